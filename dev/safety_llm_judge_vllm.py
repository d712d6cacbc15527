"""The safety axis' LLM-judge path against a real OpenAI-compatible server: `vllm serve` (started here from a
separate vLLM venv, settings of shared/research/vllm-cpu.md) answers the SAGE rubric, through exactly what
`opct eval --axis safety --judge llm --judge-url URL --judge-model NAME` runs (opct.demo.run_eval). The keyword
judge then grades the same responses, and the script prints both pass rates and their agreement.

    flock /work/notes/cpu.lock nice -n 10 python dev/safety_llm_judge_vllm.py \
        --model /tmp/axes/safety_full/opct/model --n-eval 2 --out dev/safety_llm_judge_vllm.json

Judge model: the cached dense Qwen2.5-Coder-0.5B-Instruct (the largest instruct model here); a weak grader, so the
point is the path (server, rubric, parsing, unparseable count), not the grades. `--url` uses a running server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from opct.config import EvalConfig
from opct.data.safety import load_facts
from opct.demo import run_eval
from opct.judges.safety import KeywordJudge


def start_server(python: str, model_dir: str, name: str, port: int, workdir: Path):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_RPC_BASE_PATH=tempfile.mkdtemp(prefix="sj-rpc-"),
               VLLM_CACHE_ROOT=str(workdir / "vllm-cache"), TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"))
    # `vllm serve`'s console script fails in vllm-cpu 0.32.0 (no distribution named "vllm"): run its module
    cmd = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", name, "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "4096", "--generation-config", "vllm", "--seed", "0"]
    log = (workdir / "server.log").open("wb")
    proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {workdir / 'server.log'}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url, " ".join(cmd), time.time() - t0
        except OSError:
            pass
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit("server did not come up in 900 s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the model whose responses are judged (alias, dir, adapter dir)")
    ap.add_argument("--vllm-python", default="/work/wt-vllm/.venv-vllm/bin/python")
    ap.add_argument("--judge-model", default=str(Path.home() / ".cache/opct/models/qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--url", default="")
    ap.add_argument("--port", type=int, default=8741)
    ap.add_argument("--n-eval", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="safety-judge-"))
    proc, url, cmd, startup = (None, a.url, "", 0.0) if a.url else start_server(
        a.vllm_python, a.judge_model, "judge", a.port, work)
    try:
        t0 = time.time()
        out = Path(a.out)
        cfg = EvalConfig(axis="safety", model=a.model, source="facts", n_eval=a.n_eval, max_new_tokens=64,
                         batch_size=16, judge="llm", judge_url=url, judge_model="judge", out=str(out), threads=1)
        res = run_eval(cfg)
        seconds = time.time() - t0
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    rows = [json.loads(x) for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    facts = {f.id: f for f in load_facts()}
    kw = KeywordJudge().judge([r["prompt"] for r in rows], [r["response"] for r in rows],
                              [facts[r["fact_id"]] for r in rows])
    both = [(r["passed"], v.passed) for r, v in zip(rows, kw)]
    parsed = [(l, k) for l, k in both if l is not None]
    summary = {
        "command": "opct eval --axis safety --judge llm (opct.demo.run_eval) via " + __file__,
        "server": cmd, "server_startup_seconds": round(startup, 1), "eval_seconds": round(seconds, 1),
        "model": a.model, "judge_model": a.judge_model, "n_responses": len(rows),
        "llm_unparseable": sum(l is None for l, _ in both),
        "llm_pass": sum(l is True for l, _ in both), "keyword_pass": sum(k for _, k in both),
        "agreement_on_parsed": sum(l == k for l, k in parsed) / max(1, len(parsed)),
        "both_pass": sum(l and k for l, k in parsed), "llm_only": sum(l and not k for l, k in parsed),
        "keyword_only": sum(k and not l for l, k in parsed),
        "llm_pass_rate": {s: res["pass_rate"][s]["value"] for s in res["pass_rate"]},
        "llm_over_warning": res.get("over_warning", {}).get("contrast", {}).get("value"),
    }
    print(json.dumps(summary, indent=1))
    out.with_name(out.stem + "-summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
