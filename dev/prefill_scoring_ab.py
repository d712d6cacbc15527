"""A/B of `prefill_scoring`: opct steps whose rollouts carry no kept sampling prefill (`prefill_reuse` off, so every
rollout is scored as vLLM's are), scored on a prefill run at scoring time (on) or by one padded forward (off).

    python dev/prefill_scoring_ab.py MODEL PROMPT_TOKENS NEW_TOKENS STEPS on|off
    python dev/prefill_scoring_ab.py smollm2-135m-instruct 0 32 4 on        # 0: the original ~70-token workload

Runs 1 + STEPS steps (batch 8, LoRA r=32, benchmarks/step.py's config and workload at seed 0) and prints one JSON
line: the measured steps' median phases (s), their losses and response tokens, and the process's peak RSS (MB).
Used for docs/speed.md (2026-11-26, late night); run the two settings alternately, alone on the machine.
"""
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from step import step_config, workload_pairs  # noqa: E402

from opct.algo.opct import train  # noqa: E402
from opct.data.io import read_jsonl  # noqa: E402

model, ptok, new, steps, on = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "on"
pairs, _ = workload_pairs(model, 8 * (steps + 1), ptok or None, 0)
with tempfile.TemporaryDirectory() as d:
    cfg = step_config(os.path.join(d, "run"), model, 8, steps + 1, new, 32, prefill_reuse=False, prefill_scoring=on)
    train(cfg, pairs=pairs, show_progress=False)
    rows = read_jsonl(os.path.join(d, "run", "metrics.jsonl"))[1:]

def med(rows, key):
    return round(statistics.median(r[key] for r in rows), 3)


print(json.dumps({"prefill_scoring": on, "teacher": med(rows, "time_teacher"), "student": med(rows, "time_student"),
                  "sample": med(rows, "time_sample"),
                  "step": round(statistics.median(sum(v for k, v in r.items() if k.startswith("time_")) for r in rows), 3),
                  "loss": [round(r["loss"], 6) for r in rows], "tokens": [r["response_tokens"] for r in rows],
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
