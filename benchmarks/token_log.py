"""What the token logs cost a training step (opct.lens.tokens; target: under 2 % of a step).

    python benchmarks/token_log.py --pairs PAIRS.jsonl [--model smollm2-135m-instruct --steps 24 --out OUT.json]

One OPCT run with --token-log-every 2: every second step (and the last) logs its tokens, the others do not, so
both kinds of step come from the same run, alternating, under the same load and weights. The step's own timer
(step_seconds: the sum of its time_* phases, time_tokens the write of the two Parquet files) counts everything
the log adds: the copy of the log-probs to the CPU inside the student phase and the write. Printed (and written
to --out) as one JSON object:
  ratio          mean step time of the logged steps / of the others, with a 95 % bootstrap interval over steps
                 (resampling each kind's steps), the first step left out (warm-up)
  write_share    mean time_tokens / mean step_seconds of the logged steps: the write alone
  steps          per step: step_seconds, time_tokens (absent when it did not log), response_tokens
Logged and unlogged steps also differ in what they sample (another batch of pairs), so the ratio's interval
carries that spread too; write_share does not.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

from opct import config
from opct.algo.opct import train


def bootstrap_ratio(a: list[float], b: list[float], n: int = 2000, seed: int = 47) -> tuple[float, float]:
    rng = random.Random(seed)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    r = sorted(mean([rng.choice(a) for _ in a]) / mean([rng.choice(b) for _ in b]) for _ in range(n))
    return r[int(0.025 * n)], r[int(0.975 * n) - 1]


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config.validate(config.TrainConfig(
            model=a.model, pairs=a.pairs, out=str(Path(tmp) / "run"), steps=a.steps,
            prompts_per_step=a.prompts_per_step, micro_batch=a.prompts_per_step, max_new_tokens=a.max_new_tokens,
            threads=a.threads, report_to="none", save_every=0, token_log_every=2, sampler="policy"))
        out = train(cfg, show_progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        files = sorted(p.name for p in (out / "tokens").iterdir())
        size = sum(p.stat().st_size for p in (out / "tokens").iterdir())
    rows = rows[1:]  # the first step warms up
    logged = [r["step_seconds"] for r in rows if "time_tokens" in r]
    plain = [r["step_seconds"] for r in rows if "time_tokens" not in r]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    lo, hi = bootstrap_ratio(logged, plain)
    result = {"benchmark": "token_log", "model": a.model, "pairs": a.pairs, "steps": a.steps,
              "prompts_per_step": a.prompts_per_step, "max_new_tokens": a.max_new_tokens, "threads": a.threads,
              "machine": cpu_name(),
              "ratio": {"value": mean(logged) / mean(plain), "lo": lo, "hi": hi, "logged_steps": len(logged),
                        "plain_steps": len(plain)},
              "write_share": mean([r["time_tokens"] for r in rows if "time_tokens" in r]) / mean(logged),
              "mean_step_seconds": {"logged": mean(logged), "plain": mean(plain)},
              "files": len(files), "bytes": size,
              "steps_detail": [{k: r[k] for k in ("step", "step_seconds", "time_tokens", "response_tokens") if k in r}
                               for r in rows]}
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
