"""Time opct training steps: `python benchmarks/step.py --model M --batch B --max-new-tokens T [--lora-rank R]`.

Runs the real `opct.algo.opct.train` loop (same code path as `opct train`) on `bench_prompts` (~70-token chat prompts;
the teacher sees the same prompt plus a short privileged context, as in the TRL comparison), discards `--warmup`
steps and prints one JSON line: median step seconds, per-phase medians (sample / teacher / student / optim),
tokens per second, token counts per step and the process's peak RSS.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import bench_prompts, peak_rss_mb  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (one sample each)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=32, help="0 = full fine-tuning")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured first steps")
    p.add_argument("--threads", type=int, default=0, help="0 = opct's default policy (auto: the free cores)")
    p.add_argument("--loss", default="sampled")
    p.add_argument("--backend", default="cpu", choices=["cpu", "hf"], help="opct's execution backend")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()

    import torch

    from opct.algo.opct import train
    from opct.config import TrainConfig
    from opct.data.io import read_jsonl
    from opct.data.pairs import ConsistencyPair

    n_steps = a.warmup + a.steps
    items = bench_prompts(a.batch * n_steps)
    pairs = [ConsistencyPair(it["student"], it["student"][:-1] + [
        {"role": "user", "content": it["student"][-1]["content"] + "\n\n" + it["privileged_context"]}])
        for it in items]
    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig(model=a.model, out=os.path.join(d, "run"), steps=n_steps, prompts_per_step=a.batch,
                          micro_batch=a.batch, max_new_tokens=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                          lora_rank=a.lora_rank, lora_alpha=2.0 * a.lora_rank, lr=1e-5, save_every=0,
                          tensorboard=False, loss=a.loss, threads=a.threads, device="cpu", backend=a.backend, dtype=a.dtype)
        t0 = time.perf_counter()
        train(cfg, pairs=pairs, show_progress=False)
        wall = time.perf_counter() - t0
        rows = read_jsonl(os.path.join(d, "run", "metrics.jsonl"))[a.warmup:]

    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(json.dumps({
        "side": "opct",
        "median_step_s": med("step_seconds"),
        "steps_s": [r["step_seconds"] for r in rows],
        "threads_per_step": [r.get("threads") for r in rows],
        "others_busy_cores_per_step": [r.get("others_busy_cores") for r in rows],
        "phases_s": {"sample": med("time_sample"), "teacher": med("time_teacher"), "student": med("time_student"),
                     "optim": med("time_optim"), "decode": med("decode_seconds")},
        "tokens_per_s": med("tokens_per_s"),
        "prompt_tokens": med("prompt_tokens"), "teacher_prompt_tokens": med("teacher_prompt_tokens"),
        "response_tokens": med("response_tokens"), "decode_steps": med("decode_steps"), "batch": a.batch,
        # the cpu backend's prefill reuse (one micro-batch, LoRA): the student's prompt forward is timed in `sample`
        "student_prompt_forward_in_sample": a.lora_rank > 0 and a.backend == "cpu",
        "peak_rss_mb": peak_rss_mb(),
        "wall_s_including_load": wall,
        "config": {"model": a.model, "batch": a.batch, "max_new_tokens": a.max_new_tokens, "lora_rank": a.lora_rank,
                   "steps": a.steps, "warmup": a.warmup, "threads": a.threads, "loss": a.loss,
                   "backend": a.backend, "dtype": a.dtype},
        "versions": {"torch": torch.__version__},
    }))


if __name__ == "__main__":
    main()
