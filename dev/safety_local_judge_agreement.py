"""The local-model judge (rubric, P(pass) vs P(fail) in one forward pass) against the hand labels.

    OMP_NUM_THREADS=1 nice -n 10 python dev/safety_local_judge_agreement.py tests/fixtures/safety_hand_labels.jsonl \
        smollm2-135m-instruct
"""

import json
import sys
import time

import torch

from opct.axes.safety.facts import load_facts
from opct.axes.safety.judges import LocalJudge


def main(label_path, judge_model, only_model=None):
    torch.set_num_threads(1)
    facts = {f.id: f for f in load_facts()}
    rows = [r for r in map(json.loads, open(label_path)) if only_model is None or r["model"] == only_model]
    judge = LocalJudge.from_name(judge_model)
    t0 = time.time()
    v = judge.judge([r["prompt"] for r in rows], [r["response"] for r in rows], [facts[r["fact_id"]] for r in rows])
    pairs = [(x.passed, r["label_pass"]) for x, r in zip(v, rows)]
    tp = sum(j and h for j, h in pairs)
    margins = [float(x.raw.split()[0]) - float(x.raw.split()[1]) for x in v]
    pos = [m for m, (_, h) in zip(margins, pairs) if h]
    neg = [m for m, (_, h) in zip(margins, pairs) if not h]
    auroc = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg)) if pos and neg else None
    print(json.dumps({"judge": judge_model, "n": len(pairs), "judge_pass": sum(j for j, _ in pairs),
                      "accuracy": sum(j == h for j, h in pairs) / len(pairs),
                      "precision": tp / max(1, sum(j for j, _ in pairs)), "recall": tp / max(1, sum(h for _, h in pairs)),
                      "auroc_margin": auroc, "seconds": round(time.time() - t0)}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
