"""`opct demo --axis all --judge llm` end to end against a real OpenAI-compatible server, at a small size.

    python dev/axes_all_llm_judge.py --out /tmp/axes-all-llm [--vllm-python .venv-vllm/bin/python] [-- EXTRA DEMO FLAGS]

Starts `vllm serve` (from a separate vLLM venv, as dev/safety_llm_judge_vllm.py does) on the cached dense
SmolLM2-135M-Instruct under the name "judge" (the smallest model here: the fastest judge on a CPU), then runs the
real CLI in a subprocess:

    opct demo --axis all --judge llm --judge-url URL --judge-model judge --out OUT --steps 4 --n-eval 2
              --n-benign 4 --attack-samples 1 --capability '' --probe-every 0 [EXTRA]

so every axis' pre-flight, the safety axis' SAGE-rubric judge and the jailbreak axis' StrongREJECT judge run through
the server, in one command. Prints and writes OUT-summary.json: the demo's exit status, wall time, its peak RSS
(`/usr/bin/time -v` where present), the judge's request count from the server log, and per axis what results.json
holds from the LLM judge (unparseable counts included). A model this small grades poorly (docs/safety.md): the point is
the path, not the grades. Then stops the server, whatever happened.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from opct.backends.vllm_sampler import start_server
from opct.experiment import methods_view, read_results

ROOT = Path(__file__).resolve().parents[1]


def judge_figures(axis: str, res: dict) -> dict:
    """Per method, what an axis' results.json says of the LLM judge: responses graded and how many it could not
    parse (safety: the SAGE rubric's verdicts; jailbreak: the StrongREJECT rubric's, per split). Sycophancy has no
    judge: {}."""
    out = {}
    for method, ev in methods_view(read_results(res)).items():
        counts, details = ev["counts"], ev["details"]
        if axis == "safety":
            out[method] = {"responses": sum(counts["n_responses"].values()),
                           "unparseable": sum(counts["n_unparsed"].values())}
        elif axis == "jailbreak" and "rubric" in details:
            rubric = details["rubric"]
            out[method] = {"judge": rubric["judge"], "unparseable": sum(rubric["unparseable"].values()),
                           "unparseable_by_split": rubric["unparseable"],
                           "parsed_by_split": {k: v["n"] for k, v in rubric["asr"].items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the demo's --out (must not exist)")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--judge-model", default=str(Path.home() / ".cache/opct/models/smollm2-135m-instruct"))
    ap.add_argument("extra", nargs="*", help="more `opct demo` flags (after --)")
    a = ap.parse_args()
    out = Path(a.out)
    work = Path(tempfile.mkdtemp(prefix="axes-all-judge-"))
    server, startup = start_server(a.vllm_python, a.judge_model, "judge", work)
    cmd = ["opct", "demo", "--axis", "all", "--judge", "llm", "--judge-url", server.url, "--judge-model", "judge",
           "--out", str(out), "--steps", "4", "--n-eval", "2", "--n-benign", "4", "--attack-samples", "1",
           "--capability", "", "--probe-every", "0", *a.extra]
    rusage = work / "time.txt"
    timed = ["/usr/bin/time", "-v", "-o", str(rusage), *cmd] if shutil.which("/usr/bin/time") else cmd
    try:
        t0 = time.time()
        proc = subprocess.run(timed)
        seconds = time.time() - t0
    finally:
        server.close()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", rusage.read_text() if rusage.exists() else "")
    log = (work / "server.log").read_text(errors="replace")
    axes = {}
    for res_path in sorted(out.glob("*/results.json")):
        axes[res_path.parent.name] = judge_figures(res_path.parent.name, json.loads(res_path.read_text()))
    summary = {
        "command": " ".join(cmd), "returncode": proc.returncode, "seconds": round(seconds, 1),
        "server_startup_seconds": round(startup, 1), "judge_model": a.judge_model,
        "demo_peak_rss_gb": round(int(rss.group(1)) / 1024 ** 2, 2) if rss else None,
        "judge_requests_in_server_log": log.count("POST /v1/chat/completions"),
        "summary_json": (out / "summary.json").exists(), "axes": axes,
    }
    print(json.dumps(summary, indent=1))
    Path(str(out) + "-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
