"""Time opct training steps: `python benchmarks/step.py --model M --batch B --max-new-tokens T [--lora-rank R]
[--prompt-tokens N] [--sampler vllm]`.

Runs the real `opct.algo.opct.train` loop (same code path as `opct train`) on `common.workload_prompts`: by default
`bench_prompts` (~70-token chat prompts), with `--prompt-tokens N` jailbreak-wrapped behaviours of about N tokens
with this model's tokenizer; the teacher sees the same prompt plus a short privileged context, as in the TRL
comparison. Discards `--warmup` steps and prints one JSON line: median step seconds, per-phase medians (sample /
teacher / student / optim, and decode: the part of `sample` spent decoding), tokens per second, token counts per
step and the process's peak RSS.

`--sampler vllm` samples with an in-process vLLM engine (fp32, LoRA adapter synced every step), exactly as `opct
train --sampler vllm`; run it with an interpreter that has vllm installed (the vLLM venv). Then:
  decode   = the whole `llm.generate` call of the step (prompt prefill, scheduling, sampling and the decode
             steps in vLLM's engine process, plus the request round trip), not only the decode loop;
  optim    includes the weight sync into vLLM (saving the adapter and loading it under a fresh id), which runs at
           the end of the optimizer step; `sync_s` reports it alone;
  peak_rss_mb = this process's peak + the largest peak of its child processes (vLLM's engine core runs in a child),
             an upper bound of what both held at once (`peak_rss_self_mb` / `peak_rss_children_mb` apart).
  The engine's `max_model_len` is the training loop's: the longest prompt + max_new_tokens, at least 2048
  (recorded as `vllm_max_model_len`, from run.json).

`decode_s_per_token`: seconds per decode step at batch B, the median over steps of decode seconds / decode steps
(decode steps = the longest response of the step). On the cpu backend decode seconds are the decoder build and
decode loop (the prompt prefill is excluded; `prefill_s` reports it); with vLLM see above.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import gpu_memory, machine, peak_rss_mb, prompt_summary, teacher_messages, workload_prompts  # noqa: E402


def children_peak_rss_mb() -> float:
    """Largest peak RSS among this process's finished (waited-for) child processes, in MB."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def workload_pairs(model: str, n: int, prompt_tokens: int | None, seed: int = 0):
    """`n` consistency pairs of the benchmark workload (`common.workload_prompts`) and its prompt info."""
    from opct.data.pairs import ConsistencyPair

    items, info = workload_prompts(n, seed=seed, prompt_tokens=prompt_tokens, model=model)
    return [ConsistencyPair(it["student"], teacher_messages(it)) for it in items], info


def parse_sets(items: list[str]) -> dict:
    """`--set KEY=VALUE` pairs as config overrides, each value read as YAML (true, 3, 0.5, bfloat16)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = yaml.safe_load(value)
    return out


def step_config(out: str, model: str, batch: int, steps: int, max_new_tokens: int, lora_rank: int, **overrides):
    """The benchmark's TrainConfig: one micro-batch of `batch` prompts a step, plain sampling at temperature 1,
    LoRA alpha = 2 x rank, no checkpoints; `overrides` set any other key, type-checked as a config file's are
    (`opct.options.from_dict`: an unknown key or a wrong type is a ConfigError)."""
    from opct.config import TrainConfig
    from opct.options import from_dict

    values = {"model": model, "out": out, "steps": steps, "prompts_per_step": batch, "micro_batch": batch,
              "max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "lora_rank": lora_rank,
              "lora_alpha": 2.0 * lora_rank, "lr": 1e-5, "save_every": 0, "report_to": "none", "device": "cpu"}
    return from_dict(TrainConfig, {**values, **overrides}, where="benchmarks/step.py")


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
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the cpu backend runs on the CPU only)")
    p.add_argument("--backend", default=None, choices=["cpu", "hf"],
                   help="opct's execution backend (default: cpu on the CPU, hf on a GPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="jailbreak-wrapped prompts of about N tokens (default: the ~70-token bench_prompts)")
    p.add_argument("--decode-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="decode_dtype (bfloat16: sampling on bfloat16 weight copies; the cpu backend, or the hf "
                        "backend with --set merged_decode=true)")
    p.add_argument("--sampler", default="policy", choices=["policy", "vllm"],
                   help="who samples: the training backend, or an in-process vLLM engine (needs vllm installed)")
    p.add_argument("--seed", type=int, default=0,
                   help="picks the workload's prompts and seeds the run (as trl_step.py's --seed does TRL's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key, e.g. --set prefill_reuse=false (repeatable; recorded in config)")
    a = p.parse_args()
    a.backend = a.backend or ("cpu" if a.device == "cpu" else "hf")
    n_steps = a.warmup + a.steps
    try:  # before any model loads: a bad --set stops here (ConfigError is a ValueError)
        sets = parse_sets(a.set)
        named = dict(loss=a.loss, threads=a.threads, backend=a.backend, dtype=a.dtype, sampler=a.sampler,
                     decode_dtype=a.decode_dtype, seed=a.seed, device=a.device)
        cfg = step_config("", a.model, a.batch, n_steps, a.max_new_tokens, a.lora_rank, **{**named, **sets})
    except ValueError as e:
        p.error(str(e))

    import torch

    from opct.algo.opct import train
    from opct.data.io import read_jsonl

    pairs, prompt_info = workload_pairs(a.model, a.batch * n_steps, a.prompt_tokens, a.seed)
    with tempfile.TemporaryDirectory() as d:
        cfg = dataclasses.replace(cfg, out=os.path.join(d, "run"))
        t0 = time.perf_counter()
        train(cfg, pairs=pairs, show_progress=False)
        wall = time.perf_counter() - t0
        rows = read_jsonl(os.path.join(d, "run", "metrics.jsonl"))[a.warmup:]
        with open(os.path.join(d, "run", "run.json")) as f:
            execution = json.load(f)["execution"]

    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    vllm = a.sampler == "vllm"
    self_rss, child_rss = peak_rss_mb(), children_peak_rss_mb()
    result = {
        "side": "opct_vllm" if vllm else "opct",
        "median_step_s": med("step_seconds"),
        "steps_s": [r["step_seconds"] for r in rows],
        "threads_per_step": [r.get("threads") for r in rows],
        "others_busy_cores_per_step": [r.get("others_busy_cores") for r in rows],
        "phases_s": {"sample": med("time_sample"), "teacher": med("time_teacher"), "student": med("time_student"),
                     "optim": med("time_optim"), "decode": med("decode_seconds")},
        "tokens_per_s": med("tokens_per_s"),
        "prompt_tokens": med("prompt_tokens"), "teacher_prompt_tokens": med("teacher_prompt_tokens"),
        "response_tokens": med("response_tokens"), "decode_steps": med("decode_steps"), "batch": a.batch,
        "decode_s_per_token": statistics.median(r["decode_seconds"] / max(r["decode_steps"], 1) for r in rows),
        "decode_s_per_token_includes": ("vLLM's whole generate call: prefill, scheduling, sampling, decode steps"
                                        if vllm else "the decoder build and decode loop; prompt prefill excluded"),
        # the cpu backend's prefill reuse (one micro-batch, LoRA): the student's prompt forward is timed in `sample`
        # (never under vLLM: the student's prompt forward then runs in `student`)
        "student_prompt_forward_in_sample": a.lora_rank > 0 and a.backend == "cpu" and not vllm,
        "peak_rss_mb": self_rss + child_rss if vllm else self_rss,
        **gpu_memory(a.device),
        "peak_rss_self_mb": self_rss, "peak_rss_children_mb": child_rss,
        "wall_s_including_load": wall,
        "prompts": prompt_summary(prompt_info),
        "config": {"model": a.model, "batch": a.batch, "max_new_tokens": a.max_new_tokens, "lora_rank": a.lora_rank,
                   "steps": a.steps, "warmup": a.warmup, "threads": a.threads, "loss": a.loss,
                   "backend": a.backend, "dtype": a.dtype, "prompt_tokens": a.prompt_tokens, "sampler": a.sampler,
                   "decode_dtype": cfg.decode_dtype, "seed": a.seed, "device": a.device, "set": sets},
        "versions": {"torch": torch.__version__},
        "machine": machine(),
    }
    if all("prefill_seconds" in r for r in rows):
        result["prefill_s"] = med("prefill_seconds")
    if vllm:
        import vllm as vllm_mod

        result["sync_s"] = med("sync_seconds")
        result["vllm_max_model_len"] = execution.get("vllm_max_model_len")
        result["versions"]["vllm"] = vllm_mod.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
