"""On-policy consistency training, one file, top to bottom.

Every step:
  1. sample   y ~ student(. | student prompt)                       (the perturbed prompt, no grad)
  2. teacher  log p_T(y_t | teacher prompt, y_<t) in one prefill      (frozen initial model, no grad)
  3. student  log p_S(y_t | student prompt, y_<t) with grad, loss = per-token reverse KL (losses.py),
              summed over response tokens and divided by the step's total response-token count
              (when the step is one micro-batch, the prompt part of this forward is the one step 1 already
              ran with grad for sampling: only the response tokens are run again, on its KV cache)
  4. AdamW step (grad clipping, LR schedule), then repeat with fresh samples.
The teacher is the initial model: with LoRA the same module with adapters disabled, otherwise a frozen copy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from opct import checkpoint, losses, malloc
from opct.config import TrainConfig, to_yaml
from opct.metrics import MetricsLog, peak_rss_mb
from opct.models import Teacher, add_lora, load_model
from opct.pairs import ConsistencyPair, PairsError, load_pairs, render_prompt
from opct.rollout import SamplingSettings, decode, prefill, sample
from opct.rollout import head_logits
from opct.scoring import build_batch, response_hidden, response_hidden_after_prefill, response_logprobs


class RunError(RuntimeError):
    """The run cannot start (bad output directory, config, ...)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_out_dir(cfg: TrainConfig) -> Path:
    """Fail before any work if the output directory is unusable or would be silently overwritten."""
    out = Path(cfg.out)
    existing = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not existing.is_dir():
        raise RunError(f"{out}: cannot create the output directory: {existing} is not a directory")
    if not os.access(existing, os.W_OK):
        raise RunError(f"{out}: output directory is not writable ({existing})")
    if cfg.resume:
        if not checkpoint.list_checkpoints(out):
            raise RunError(f"{out}: --resume given but there is no checkpoint to resume from")
    elif out.exists() and any(out.iterdir()):
        raise RunError(f"{out}: already holds a run; pass --resume to continue it or choose another --out")
    return out


def render_pairs(tok, pairs: list[ConsistencyPair], max_length: int, max_new_tokens: int):
    """Token ids of both sides of every pair; a pair that cannot fit its response is an error."""
    rendered = []
    for i, p in enumerate(pairs):
        s_ids, t_ids = render_prompt(tok, p.student), render_prompt(tok, p.teacher)
        longest = max(len(s_ids), len(t_ids))
        if longest + max_new_tokens > max_length:
            where = p.meta.get("_where", f"pair {i}")
            raise PairsError(f"{where}: prompt is {longest} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                             f"max_length={max_length} (shorten the pair, lower --max-new-tokens, or raise --max-length)")
        rendered.append((s_ids, t_ids))
    return rendered


def data_order(n_pairs: int, seed: int, start: int, count: int) -> list[int]:
    """Pair indices for global positions start..start+count: a fresh seeded permutation every epoch, so the
    data position is a pure function of (step, seed) and resumes exactly."""
    idx = []
    for pos in range(start, start + count):
        epoch, k = divmod(pos, n_pairs)
        perm = torch.randperm(n_pairs, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        idx.append(int(perm[k]))
    return idx


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if cfg.schedule == "linear":
            return max(0.0, 1.0 - frac)
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + float(np.cos(np.pi * min(1.0, frac))))
        return 1.0
    return f


def opct_step(model, teacher: Teacher, pad_id: int, eos_ids: set[int], batch, cfg: TrainConfig,
              gen: torch.Generator) -> dict:
    """One optimizer step's forward/backward work on `batch` = [(student_ids, teacher_ids), ...]."""
    G, mb = cfg.samples_per_prompt, cfg.micro_batch
    prompts_s = [s for s, _ in batch for _ in range(G)]
    prompts_t = [t for _, t in batch for _ in range(G)]
    settings = SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    chunks = [slice(i, i + mb) for i in range(0, len(prompts_s), mb)]

    # One micro-batch, LoRA, no dropout: the student's prompt forward (with grad) doubles as the sampler's prefill,
    # and step 3 runs only the response tokens on top of its KV cache. This saves one prompt prefill per step.
    # (Full fine-tuning keeps the separate path: with grad-carrying weights the cached forward rounds differently
    # from the frozen copy's, and identical prompts must give exactly zero KL.)
    fused = len(chunks) == 1 and cfg.lora_dropout == 0 and teacher.shared

    # 1. sample from the student on the perturbed prompts
    t0 = time.perf_counter()
    if fused:
        model.eval()  # no dropout either way; eval mode only makes that explicit
        pre = prefill(model, prompts_s, pad_id)
        t_decode = time.perf_counter()
        responses = decode(model, pre, settings, eos_ids, pad_id, gen)
    else:
        t_decode = t0
        responses = sample(model, prompts_s, settings, eos_ids, pad_id, gen)
    n_tokens = sum(len(r) for r in responses)  # global normaliser for every micro-batch

    # 2. the frozen teacher scores the same tokens after the clean prompt (one prefill per micro-batch)
    t1 = time.perf_counter()
    teacher_out = []
    with teacher() as tm:
        for c in chunks:
            b = build_batch(prompts_t[c], responses[c], pad_id)
            # Same computation as the student's (below), so identical prompts give bit-identical log-probs.
            h_t_BTH = (response_hidden_after_prefill(tm, prefill(tm, prompts_t, pad_id,
                                                                 prefix_cache=teacher.prefix_cache), responses, pad_id)
                       if fused else response_hidden(tm, b))
            teacher_out.append(head_logits(tm, h_t_BTH).float() if cfg.loss in losses.EXACT
                               else response_logprobs(tm, h_t_BTH, b.response_BT))

    # 3. the student scores them after the perturbed prompt, with grad; accumulate the normalised loss
    t2 = time.perf_counter()
    if not fused:
        model.train()
    sums = {"loss": 0.0, "kl": 0.0, "logp_student": 0.0, "logp_teacher": 0.0}
    for c, t_out in zip(chunks, teacher_out):
        b = build_batch(prompts_s[c], responses[c], pad_id)
        h_s_BTH = response_hidden_after_prefill(model, pre, responses, pad_id) if fused else response_hidden(model, b)
        m_BT = b.mask_BT.float()
        if cfg.loss == "sampled":
            logp_s_BT, logp_t_BT = response_logprobs(model, h_s_BTH, b.response_BT), t_out
            loss, kl = losses.sampled_token_loss(logp_s_BT, logp_t_BT, b.mask_BT, cfg.kl_coef, cfg.kl_discount)
        else:
            logits_s_BTV = head_logits(model, h_s_BTH).float()
            logp_s_BT = losses.token_logprobs(logits_s_BTV, b.response_BT)
            logp_t_BT = losses.token_logprobs(t_out, b.response_BT)
            kw = {"k": cfg.topk} if cfg.loss == "topk" else {}
            kl_BT = losses.EXACT[cfg.loss](logits_s_BTV, t_out, **kw)
            loss = (kl_BT * m_BT).sum()
            kl = loss.detach()
        (loss / n_tokens).backward()
        sums["loss"] += float(loss.detach())
        sums["kl"] += float(kl)
        sums["logp_student"] += float((logp_s_BT.detach() * m_BT).sum())
        sums["logp_teacher"] += float((logp_t_BT * m_BT).sum())
    t3 = time.perf_counter()
    row = {k: v / n_tokens for k, v in sums.items()}
    row.update(response_len=n_tokens / len(responses), response_tokens=n_tokens,
               prompt_tokens=sum(map(len, prompts_s)), teacher_prompt_tokens=sum(map(len, prompts_t)),
               decode_steps=max(map(len, responses)),
               time_sample=t1 - t0, time_teacher=t2 - t1, time_student=t3 - t2,
               decode_seconds=t1 - t_decode)  # within time_sample: decoder build + decode loop (+ prefill unless fused)
    return row


@dataclass
class Run:
    """Everything a training loop needs, set up identically for OPCT and the SFT baseline."""
    out: Path
    model: torch.nn.Module
    tok: object
    teacher: Teacher
    rendered: list  # [(student_ids, teacher_ids)] per pair
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    gen: torch.Generator  # the sampling RNG, checkpointed with the rest
    start: int  # first step to run (> 0 when resuming)
    log: MetricsLog
    pad_id: int
    eos_ids: set


def start_run(cfg: TrainConfig, pairs: list[ConsistencyPair] | None) -> Run:
    """Validate everything before writing anything, then load, add LoRA, build the optimizer, maybe resume."""
    if cfg.steps < 1 or cfg.prompts_per_step < 1 or cfg.samples_per_prompt < 1 or cfg.micro_batch < 1:
        raise RunError("steps, prompts_per_step, samples_per_prompt and micro_batch must be >= 1")
    if cfg.max_new_tokens < 1:
        raise RunError("max_new_tokens must be >= 1")
    out = check_out_dir(cfg)
    if pairs is None:
        if not cfg.pairs:
            raise RunError("no pairs: pass --pairs FILE.jsonl")
        pairs = load_pairs(cfg.pairs)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    malloc.keep_freed_memory()  # each step re-allocates the same large buffers: keep their pages (malloc.py)
    seed_everything(cfg.seed)
    model, tok = load_model(cfg.model)
    max_length = cfg.max_length or getattr(model.config, "max_position_embeddings", 2048)
    rendered = render_pairs(tok, pairs, max_length, cfg.max_new_tokens)
    eos_ids = {tok.eos_token_id} | set(np.atleast_1d(model.generation_config.eos_token_id or []).tolist())

    if cfg.lora_rank > 0:
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    else:
        model.requires_grad_(True)
    teacher = Teacher(model)  # before any update: the frozen initial model
    params = [p for p in model.parameters() if p.requires_grad]
    betas = tuple(float(x) for x in cfg.betas.split(","))
    # PyTorch's fused AdamW kernel where it has one: SmolLM2's 420 LoRA tensors, clipping included, 13 ms a step
    # on 2 cores against 36 ms for the default multi-tensor (foreach) implementation.
    fused_kernel = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                       for p in params)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, fused=fused_kernel)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    gen = torch.Generator().manual_seed(cfg.seed)

    start = 0
    out.mkdir(parents=True, exist_ok=True)
    if cfg.resume:
        start = checkpoint.load(checkpoint.list_checkpoints(out)[-1], model, optimizer, scheduler, gen)
    (out / "config.yaml").write_text(to_yaml(cfg))
    log = MetricsLog(out, resume_step=start, tensorboard=cfg.tensorboard)
    return Run(out, model, tok, teacher, rendered, params, optimizer, scheduler, gen, start, log, tok.pad_token_id,
               eos_ids)


def optimizer_step(run: Run, cfg: TrainConfig) -> dict:
    t = time.perf_counter()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(grad_norm), "lr": lr, "time_optim": time.perf_counter() - t}


def end_step(run: Run, cfg: TrainConfig, step: int, row: dict, probe, probe_every: int, bar, show: bool) -> None:
    """Probe, log, checkpoint: the bookkeeping shared by every loop."""
    if probe and probe_every and ((step + 1) % probe_every == 0 or step + 1 == cfg.steps):
        row.update(probe(run.model, run.tok) or {})
    row["peak_mem_mb"] = peak_rss_mb()
    run.log.log(row)
    bar.set_postfix({k: f"{row[k]:.3f}" for k in ("kl", "loss") if k in row} | {"s": f"{row['step_seconds']:.1f}"})
    if show:
        timing = " ".join(f"{k[5:]} {v:.2f}s" for k, v in row.items() if k.startswith("time_"))
        main = " ".join(f"{k} {row[k]:.4f}" for k in ("kl", "loss", "logp_student", "logp_teacher") if k in row)
        probes = " ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("probe_"))
        tqdm.write(f"step {step + 1:4d} | {main} | len {row['response_len']:.1f} | {timing} | "
                   f"{row['tokens_per_s']:.0f} tok/s" + (f" | {probes}" if probes else ""))
    if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
        checkpoint.save(run.out, step + 1, run.model, run.optimizer, run.scheduler, run.gen, cfg.keep_checkpoints)


def train(cfg: TrainConfig, pairs: list[ConsistencyPair] | None = None, probe=None, probe_every: int = 0,
          show_progress: bool = True) -> Path:
    """Run OPCT; returns the output directory. `probe(model, tokenizer) -> dict` (optional) is called every
    `probe_every` steps and its numbers are logged with that step (e.g. a quick held-out eval)."""
    run = start_run(cfg, pairs)
    t_run = time.perf_counter()
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps, desc="opct", disable=not show_progress)
    for step in bar:
        idx = data_order(len(run.rendered), cfg.seed, step * cfg.prompts_per_step, cfg.prompts_per_step)
        # 1-3: sample, teacher prefill, student forward/backward
        row = opct_step(run.model, run.teacher, run.pad_id, run.eos_ids, [run.rendered[i] for i in idx], cfg, run.gen)
        # 4: optimizer step
        row.update(optimizer_step(run, cfg))
        step_s = sum(v for k, v in row.items() if k.startswith("time_"))
        row = {"step": step + 1, **row, "step_seconds": step_s, "tokens_per_s": row["response_tokens"] / step_s}
        end_step(run, cfg, step, row, probe, probe_every, bar, show_progress)
    run.log.close()
    save_final(run.out, run.model, run.tok, cfg, {"wall_seconds": time.perf_counter() - t_run, "steps": cfg.steps})
    return run.out


def save_final(out: Path, model, tok, cfg, summary: dict) -> None:
    """The trained model as a standard directory (PEFT adapter, or a full safetensors model), then run.json,
    which is written last: its presence marks a finished run."""
    def write(d: Path):
        model.save_pretrained(d)
        tok.save_pretrained(d)
    checkpoint.atomic_dir(out / "model", write)
    info = {"config": dataclasses.asdict(cfg), "model_dir": str(out / "model"),
            "adapter": cfg.lora_rank > 0, **summary}
    tmp = out / ".run.json.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, out / "run.json")
