"""Pool several `vs_trl.py` result files of the same workload into one step-time ratio, with the same seeded
two-level bootstrap over rounds and steps that each file's `ratio.step_time_spread` uses (`vs_trl.ratio_spread`).

  python benchmarks/pool_vs_trl.py benchmarks/results/vs_trl-A.json benchmarks/results/vs_trl-B.json [--config lora_r32]

Prints one JSON object: the pooled ratio (median of all opct steps over median of all TRL steps), its interval,
the per-round ratios and the files' configs and machines (so that mixing different workloads shows). Files that
record different CPUs are refused: a ratio pooled across machines means nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import other_cpus  # noqa: E402
from vs_trl import ratio_spread  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--config", default="lora_r32", help="which compared configuration of each file")
    a = p.parse_args(argv)
    opct, trl, configs, machines = [], [], [], []
    for f in a.files:
        r = json.loads(Path(f).read_text())
        machines.append(r.get("machine") or {})
        raw = r["configs"][a.config]["raw_runs"]
        opct += raw["opct"]
        trl += raw["trl"]
        configs.append({k: r["config"].get(k) for k in ("model", "batch", "max_new_tokens", "prompt_tokens",
                                                          "steps", "warmup", "huge_pages", "trl_huge_pages",
                                                          "decode_dtype")})
    cpus = {m.get("cpu") for m in machines}
    if other_cpus(machines):
        ids = sorted({m.get("cpu_id") for m in machines} - {None})
        sys.exit(f"pool_vs_trl.py: the files ran on different CPUs ({sorted(cpus - {None})}, {ids}); not pooled")
    steps = lambda runs: [s for run in runs if "error" not in run for s in run["steps_s"]]  # noqa: E731
    print(json.dumps({"files": a.files, "configs": configs, "cpus": sorted(cpus, key=str), "rounds": len(opct),
                      "step_time": median(steps(opct)) / median(steps(trl)),
                      "spread": ratio_spread(opct, trl)}, indent=1))


if __name__ == "__main__":
    main()
