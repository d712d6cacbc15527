"""Time TRL 1.16's SDFTTrainer training steps: the peer that opct's step time is compared against.

    pip install -e '.[bench]'        # trl==1.16.0, changes no pinned package
    python benchmarks/trl_step.py --model /tmp/smol --batch 8 --max-new-tokens 32 --lora-rank 32 --steps 5 --warmup 1

Prints one JSON line. Configuration (the issue's peer): `distillation_mode="sampled_token"`,
`distillation_alpha=1.0`, `teacher_model_kind="base"` (LoRA: the same module with the adapter disabled;
full fine-tune, `--lora-rank 0`: a second frozen copy), LoRA r=32 on all linear layers, temperature 1.0,
top_p 1.0, top_k 0 (off), fp32 on the CPU (`--device cuda`: on the GPU), `num_generations=1`, one optimizer step per generation.

The teacher prompt is TRL's default template "{prompt}\\n\\n{privileged_context}" over the same student
prompt opct samples from, plus a short privileged context (`common.workload_prompts`: by default the ~70-token
`bench_prompts`, with `--prompt-tokens N` jailbreak-wrapped behaviours of about N tokens), so the teacher prefill
is a few tokens longer than the student's; the work per step is otherwise the same as opct's.

Step time is wall clock from `on_step_begin` to `on_step_end`: sampling, teacher forward, student forward
and backward, gradient clipping, optimizer step and zero_grad; it excludes the dataloader and logging.
Phases come from wrapping trainer methods on the instance (no TRL source is changed):
  sample  = `_prepare_inputs`: tokenise prompts, `model.generate`, build the teacher prompts
            (`generate` alone is reported as `generate`);
  teacher = `_forward_logits` calls made with grad disabled (the adapter-disabled teacher prefill);
  optim   = `optimizer.step()`, between the on_pre_optimizer_step / on_optimizer_step callbacks;
  student = the rest of the step: student forward (`student_forward` alone), loss, backward, gradient
            clipping, scheduler and zero_grad.
The keys sample / teacher / student / optim match benchmarks/step.py (opct).

TRL 1.16 defaults that would change the measurement and are overridden here: `bf16=True` (TRL's base
config turns bf16 autocast on, even on CPU) -> False; `gradient_checkpointing=True` -> False unless
`--gradient-checkpointing` (it recomputes the student forward, which opct does not); logging every 10 steps,
checkpoint saving and reporting are switched off; `max_prompt_length=512` (left truncation of longer prompts)
-> None, so long prompts are trained on whole, as opct does (no effect on the default ~70-token prompts).

`decode_s_per_token`: the median over steps of `generate` seconds / decode steps (the padded completion length,
i.e. the longest response of the step): transformers' `generate` at batch B, prompt prefill included.

`--vllm` (side `trl_vllm`): TRL's own vLLM generation, `use_vllm=True` with `vllm_mode="colocate"` (an in-process
vllm.LLM on the training GPU) and TRL's other vLLM defaults: 0.3 of the GPU's memory, CUDA graphs, and the dtype
vLLM picks for the checkpoint ("auto": a float32 checkpoint is sampled in bfloat16; training stays float32). Its
`generate` includes TRL's weight sync into vLLM (the LoRA merged into the base weights, then loaded), as TRL runs it
before sampling each step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpu_memory, machine, median, peak_rss_mb, prompt_summary, workload_prompts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, dir or Hub id (resolved by opct.models.resolve)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=32, help="0 = full fine-tune")
    p.add_argument("--steps", type=int, default=5, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    p.add_argument("--gradient-checkpointing", action="store_true", help="TRL's own default; off for a like-for-like step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="jailbreak-wrapped prompts of about N tokens (default: the ~70-token bench_prompts)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (use_cpu=True), or cuda: the trainer's accelerator places the model on the GPU")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's weights (training math follows them; bf16 autocast stays off)")
    p.add_argument("--vllm", action="store_true",
                   help="sample with TRL's colocated vLLM engine (use_vllm=True, vllm_mode='colocate'; needs vllm)")
    return p.parse_args(argv)


class PhaseTimer:
    """Accumulates seconds per phase within the current step; the callback snapshots it per step."""

    def __init__(self):
        self.current = defaultdict(float)
        self.tokens = {}

    def wrap(self, obj, name, phase_of):
        """Replace obj.name (on the instance) by a timed version; phase_of() names the phase at call time."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            phase = phase_of()
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.current[phase] += time.perf_counter() - t0
            return out

        setattr(obj, name, timed)
        return inner


def main(argv=None):
    args = parse_args(argv)
    from datasets import Dataset
    from transformers import TrainerCallback

    from opct.extras import require

    require("trl", "benchmarks/trl_step.py (TRL's SDFTTrainer side)")
    import trl
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    n_steps = args.warmup + args.steps
    prompts, prompt_info = workload_prompts(args.batch * n_steps, seed=args.seed, prompt_tokens=args.prompt_tokens,
                                            model=args.model)
    dataset = Dataset.from_list([{"prompt": p["student"], "privileged_context": p["privileged_context"]} for p in prompts])

    peft_config = None
    if args.lora_rank > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")

    out_dir = tempfile.mkdtemp(prefix="trl_step_")
    config = SDFTConfig(
        output_dir=out_dir,
        use_cpu=args.device == "cpu",
        bf16=False,
        fp16=False,
        gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"dtype": getattr(torch, args.dtype)},
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_generations=1,
        max_completion_length=args.max_new_tokens,
        max_prompt_length=None,  # TRL's 512 would cut long prompts from the left; opct keeps them whole
        # Every sampling knob set, so nothing is inherited from the model's generation_config.
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        distillation_mode="sampled_token",
        distillation_alpha=1.0,
        teacher_model_kind="base",
        max_steps=n_steps,
        learning_rate=1e-5,
        seed=args.seed,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=args.vllm,
        vllm_mode="colocate",
    )

    timer = PhaseTimer()
    steps_s, cpu_s, phases, tokens = [], [], [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            timer.current.clear()
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_pre_optimizer_step(self, args_, state, control, **kw):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, args_, state, control, **kw):
            timer.current["optim"] += time.perf_counter() - self.t_opt

        def on_step_end(self, args_, state, control, **kw):
            total = time.perf_counter() - self.t0
            steps_s.append(total)
            cpu_s.append(time.process_time() - self.cpu0)
            split = dict(timer.current)
            split["student"] = total - split.get("sample", 0.0) - split.get("teacher", 0.0) - split.get("optim", 0.0)
            phases.append(split)
            tokens.append(dict(timer.tokens))

    from opct.models import resolve

    trainer = SDFTTrainer(model=resolve(args.model), args=config, train_dataset=dataset,
                          peft_config=peft_config, callbacks=[StepTimer()])

    # Phase wrappers on the instance. The teacher forward is the only _forward_logits call under no_grad
    # (old-logprob recomputation is off: gradient_accumulation_steps == steps_per_generation == 1).
    timer.wrap(trainer, "_forward_logits", lambda: "student_forward" if torch.is_grad_enabled() else "teacher")
    timer.wrap(trainer, "_generate", lambda: "generate")
    prepare_inputs = trainer._prepare_inputs

    def timed_prepare_inputs(generation_batch):
        t0 = time.perf_counter()
        batch = prepare_inputs(generation_batch)
        timer.current["sample"] += time.perf_counter() - t0
        # Tokens each phase computes on: real ones, and the padded lengths the forwards actually run.
        prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
        teacher_mask = batch["teacher_attention_mask"]
        timer.tokens = {
            "prompt_tokens": int(prompt_mask.sum()),
            "teacher_prompt_tokens": int(teacher_mask.sum() - completion_mask.sum()),
            "response_tokens": int(completion_mask.sum()),
            "decode_steps": int(completion_mask.size(1)),
            "student_seq_padded": int(prompt_mask.size(1) + completion_mask.size(1)),
            "teacher_seq_padded": int(teacher_mask.size(1)),
        }
        return batch

    trainer._prepare_inputs = timed_prepare_inputs

    load_before = os.getloadavg()
    trainer.train()

    measured = slice(args.warmup, None)
    steps_m, phases_m, tokens_m = steps_s[measured], phases[measured], tokens[measured]
    phase_names = sorted({k for p in phases_m for k in p})
    phases_s = {k: median([p.get(k, 0.0) for p in phases_m]) for k in phase_names}
    token_means = {k: sum(t[k] for t in tokens_m) / len(tokens_m) for k in (tokens_m[0] if tokens_m else {})}

    gen = trainer.generation_config
    result = {
        "side": "trl_vllm" if args.vllm else "trl",
        "median_step_s": median(steps_m),
        "steps_s": steps_m,
        "warmup_steps_s": steps_s[: args.warmup],
        "phases_s": phases_s,
        "steps_phases_s": phases_m,
        "peak_rss_mb": peak_rss_mb(),
        **gpu_memory(args.device),
        **token_means,
        "decode_s_per_token": median([p.get("generate", 0.0) / max(t["decode_steps"], 1)
                                      for p, t in zip(phases_m, tokens_m)]),
        "decode_s_per_token_includes": ("vLLM generate (TRL's colocated engine): the weight sync, prompt prefill and "
                                        "decode steps" if args.vllm
                                        else "transformers generate: prompt prefill and decode steps"),
        "prompts": prompt_summary(prompt_info),
        # Contention check: with the machine to itself, CPU seconds per wall second sit near the thread
        # count during the matmul-heavy phases; well below it (or a load average above the core count)
        # means another process was competing and the step times are inflated.
        "cpu_util": sum(cpu_s[measured]) / max(sum(steps_m), 1e-9),
        "steps_cpu_util": [c / w for c, w in zip(cpu_s[measured], steps_m)],
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "config": {
            "model": args.model,
            "batch": args.batch,
            "max_new_tokens": args.max_new_tokens,
            "lora_rank": args.lora_rank,
            "steps": args.steps,
            "warmup": args.warmup,
            "prompt_tokens": args.prompt_tokens,
            "max_prompt_length": config.max_prompt_length,
            "gradient_checkpointing": args.gradient_checkpointing,
            "distillation_mode": config.distillation_mode,
            "teacher_model_kind": config.teacher_model_kind,
            "teacher_prompt_template": config.teacher_prompt_template,
            "generation": {"do_sample": gen.do_sample, "temperature": gen.temperature, "top_p": gen.top_p,
                           "top_k": gen.top_k, "min_p": gen.min_p, "max_new_tokens": gen.max_new_tokens},
            "use_vllm": args.vllm,
            "vllm_dtype": (str(trainer.vllm_generation.llm.llm_engine.model_config.dtype) if args.vllm else None),
            "dtype": str(next(trainer.model.parameters()).dtype),
            "torch_threads": torch.get_num_threads(),
            "device": str(next(trainer.model.parameters()).device),
        },
        "versions": {"trl": trl.__version__, "torch": torch.__version__,
                     **({"vllm": __import__("vllm").__version__} if args.vllm else {}),
                     "transformers": __import__("transformers").__version__,
                     "peft": __import__("peft").__version__, "python": sys.version.split()[0]},
        "machine": machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
