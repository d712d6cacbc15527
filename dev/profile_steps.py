"""Per-step resource counts and an optional torch.profiler table for opct steps on the benchmark workload.

    python dev/profile_steps.py --model smollm2-135m-instruct --prompt-tokens 400 --new-tokens 32 --batch 8 --steps 4
    python dev/profile_steps.py ... --profile --skip 2     # op table over the steps after the first two

Each step prints its wall time, minor/major page faults, context switches and user/system CPU seconds (getrusage,
counted at the end of each optimizer step; step 1's counts include loading the model), so the cold steps that fault
in fresh memory show next to the warm ones.
With --profile, torch.profiler records the steps after --skip and prints the ops by self time, then grouped by input
shape. Used for the long-prompt profile in dev/LOG.md (2026-11-24 evening).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from step import step_config, workload_pairs  # noqa: E402

import opct.train.loop as loop  # noqa: E402
from opct.algo.opct import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-tokens", type=int, default=0, help="target prompt length (0: the original workload)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--skip", type=int, default=1, help="steps left out of the profile")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=40, help="rows of each profiler table")
    args = p.parse_args()
    if args.profile and args.skip >= args.steps:
        p.error("--skip must leave at least one step to profile")

    pairs, _ = workload_pairs(args.model, args.batch * args.steps, args.prompt_tokens or None)
    prof = None
    if args.profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                      schedule=torch.profiler.schedule(wait=args.skip, warmup=0,
                                                                       active=args.steps - args.skip))
    last = [resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()]
    optimizer_step = loop.optimizer_step

    def counted_step(*a, **kw):
        row = optimizer_step(*a, **kw)
        u, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        u0, t0 = last
        print(f"step {a[1] + 1}: {t - t0:.2f} s, minor faults {u.ru_minflt - u0.ru_minflt}, major "
              f"{u.ru_majflt - u0.ru_majflt}, voluntary/involuntary switches {u.ru_nvcsw - u0.ru_nvcsw}/"
              f"{u.ru_nivcsw - u0.ru_nivcsw}, user {u.ru_utime - u0.ru_utime:.2f} s, system "
              f"{u.ru_stime - u0.ru_stime:.2f} s", flush=True)
        last[:] = [u, t]
        if prof is not None:
            prof.step()
        return row

    loop.optimizer_step = counted_step  # opct_step calls loop.optimizer_step once a step
    with tempfile.TemporaryDirectory() as d:
        cfg = step_config(os.path.join(d, "run"), args.model, args.batch, args.steps, args.new_tokens, lora_rank=32)
        if prof is not None:
            prof.start()
        last[1] = time.perf_counter()
        try:
            train(cfg, pairs=pairs, show_progress=False)
        finally:
            loop.optimizer_step = optimizer_step
            if prof is not None:
                prof.stop()
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
