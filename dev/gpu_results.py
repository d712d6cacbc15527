"""Print the benchmark results a GPU call wrote, short enough for the device tool's output tail: each vs_trl.py
summary's sides, ratios and errors, and each step.py result (one JSON object a file)."""

import glob
import json
import sys

FIELDS = ("median_step_s", "phases_s", "decode_s_per_token", "peak_gpu_mb", "peak_rss_mb", "response_tokens",
          "process_wall_s", "errors")


def short(x, n: int) -> str:
    return json.dumps(x, default=str)[:n]


def main(out: str) -> None:
    for f in sorted(glob.glob(out + "/*.json")):
        print("==", f)
        lines = [line for line in open(f) if line.startswith("{")]  # step.py prints one JSON line; skip any other
        try:
            data = json.loads(lines[-1]) if len(lines) == 1 else json.load(open(f))
        except (ValueError, IndexError) as e:  # a run that failed before writing its result
            print("unreadable:", e)
            continue
        if "configs" not in data:  # a step.py result
            print(short({k: data.get(k) for k in (*FIELDS[:5], "response_tokens", "wall_s_including_load")}
                        | {"set": data.get("config", {}).get("set"),
                           "decode_dtype": data.get("config", {}).get("decode_dtype")}, 900))
            continue
        for name, c in data["configs"].items():
            for side in ("opct", "trl", "opct_vllm", "trl_vllm"):
                if c.get(side):
                    print(name, side, short({k: c[side].get(k) for k in FIELDS}, 900))
            for key in ("ratio", "ratio_vllm", "ratio_to_trl_vllm"):
                if c.get(key):
                    print(name, key, short(c[key], 900))
            for side, runs in c.get("raw_runs", {}).items():
                for run in runs:
                    if "error" in run:
                        print(name, side, "ERROR", run["error"], str(run.get("stderr_tail"))[-2500:])


if __name__ == "__main__":
    main(sys.argv[1])
