"""The safety rubric judge (`LLMJudge`) against a real `vllm serve`: requests one at a time vs several in flight.

    python dev/judge_concurrency.py --samples RUN/safety/samples/base.jsonl \\
        --out benchmarks/results/judge_concurrency-DATE-MACHINE.json [--concurrency 1 8] [--repeats 2]

Starts `vllm serve` from a separate vLLM venv (`--vllm-python`; settings of shared/research/vllm-cpu.md, as
dev/safety_llm_judge_vllm.py does) on a cached model under the name "judge" (default SmolLM2-135M-Instruct: a poor
grader, the point is the requests), then grades the same responses (a safety demo's per-example samples: prompt,
response, fact_id) with each concurrency in turn, alternating, `--repeats` times. Writes the seconds of each pass,
responses a second, and how many verdicts each concurrency shares with the first (greedy decoding; a server's
batching may still change a few).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import machine  # noqa: E402

from opct.backends.vllm_sampler import start_server  # noqa: E402
from opct.axes.safety.facts import load_facts  # noqa: E402
from opct.axes.safety.judges import LLMJudge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", required=True, help="a safety demo's samples/<method>.jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--judge-model", default=str(Path.home() / ".cache/opct/models/smollm2-135m-instruct"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    rows = [json.loads(line) for line in Path(a.samples).read_text().splitlines()]
    facts = {f.id: f for f in load_facts()}
    prompts, responses = [r["prompt"] for r in rows], [r["response"] for r in rows]
    row_facts = [facts[r["fact_id"]] for r in rows]
    server, startup = start_server(a.vllm_python, a.judge_model, "judge", Path(tempfile.mkdtemp(prefix="judge-ab-")))
    passes, verdicts = [], {}
    try:
        LLMJudge(server.url, "judge", concurrency=1).judge(prompts[:2], responses[:2], row_facts[:2])  # warm-up
        for rep in range(a.repeats):
            for c in a.concurrency:
                t0 = time.perf_counter()
                v = LLMJudge(server.url, "judge", concurrency=c).judge(prompts, responses, row_facts)
                seconds = time.perf_counter() - t0
                passes.append({"concurrency": c, "repeat": rep, "seconds": round(seconds, 2),
                               "responses_per_s": round(len(rows) / seconds, 3)})
                print(json.dumps(passes[-1]), flush=True)
                verdicts.setdefault(c, [x.passed for x in v])
    finally:
        server.close()
    ref = verdicts[a.concurrency[0]]
    best = {c: min(p["seconds"] for p in passes if p["concurrency"] == c) for c in a.concurrency}
    out = {"command": "python dev/judge_concurrency.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                           for k, v in vars(a).items()),
           "samples": a.samples, "n_responses": len(rows), "judge_model": a.judge_model,
           "server": " ".join(server.cmd), "server_startup_seconds": round(startup, 1), "passes": passes,
           "best_seconds": best, "speedup_vs_first": {c: round(best[a.concurrency[0]] / best[c], 2) for c in best},
           "same_verdicts_as_first": {c: sum(x == y for x, y in zip(ref, verdicts[c])) for c in verdicts},
           "unparseable": {c: sum(x is None for x in verdicts[c]) for c in verdicts}, "machine": machine()}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
