"""On-policy consistency training, one step top to bottom.

Every step:
  1. sample   y ~ student(. | student prompt)                       (the perturbed prompt, no grad)
  2. teacher  log p_T(y_t | teacher prompt, y_<t) in one prefill      (frozen initial model, no grad)
  3. student  log p_S(y_t | student prompt, y_<t) with grad; loss = per-token reverse KL (losses.py), summed over
              response tokens and divided by the step's total response-token count; backward
  4. AdamW step (grad clipping, LR schedule), then repeat with fresh samples (the harness, train/loop.py).
The teacher is the initial model: with LoRA the same module with adapters disabled, otherwise a frozen copy.
The step only talks to a `Policy` (backends/base.py); how sampling and scoring run is the backend's business.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from opct.algo import losses
from opct.backends.base import Policy, Scores
from opct.backends.sampling import SamplingSettings
from opct.config import TrainConfig
from opct.data.pairs import ConsistencyPair
from opct.train import loop


def consistency_loss(cfg: TrainConfig, s: Scores, t: Scores) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, kl_sum) over one micro-batch's response tokens."""
    if cfg.loss == "sampled":
        return losses.sampled_token_loss(s.logp_NT, t.logp_NT, s.mask_NT, cfg.kl_coef, cfg.kl_discount)
    real_M = s.mask_NT.flatten().bool()
    H = s.hidden_NTH.shape[-1]
    kw = {"k": cfg.topk} if cfg.loss == "topk" else {}
    kl_M = losses.exact_kl(cfg.loss, s.logits, t.logits, s.hidden_NTH.reshape(-1, H)[real_M],
                           t.hidden_NTH.reshape(-1, H)[real_M], **kw)
    loss = kl_M.sum()
    return loss, loss.detach()


def opct_step(policy: Policy, batch: list[tuple[list[int], list[int]]], cfg: TrainConfig,
              gen: torch.Generator) -> dict:
    """One optimizer step's forward/backward work on `batch` = [(student_ids, teacher_ids), ...]."""
    G = cfg.samples_per_prompt
    prompts_s = [s for s, _ in batch for _ in range(G)]
    prompts_t = [t for _, t in batch for _ in range(G)]
    exact = cfg.loss != "sampled"  # the exact losses need hidden states, not just the sampled tokens' log-probs

    # 1. the student samples on the perturbed prompts
    t0 = time.perf_counter()
    rollout = policy.sample(prompts_s, SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k),
                            gen)
    # one normaliser for every micro-batch and every data-parallel replica: the update is one big batch's
    n_tokens = policy.replicas.sum(rollout.n_tokens)
    parts = rollout.parts(cfg.micro_batch)

    # 2. the frozen teacher scores the same tokens after the clean prompt
    t1 = time.perf_counter()
    with policy.teacher() as teacher:
        teacher_scores = [teacher.score(prompts_t[c], part, grad=False, hidden=exact) for c, part in parts]

    # 3. the student scores them after the perturbed prompt, with grad; accumulate the normalised loss
    t2 = time.perf_counter()
    sums = {"loss": 0.0, "kl": 0.0, "logp_student": 0.0, "logp_teacher": 0.0}
    gap = 0.0  # |sampler's log-prob - trainer's|, summed over tokens, when the sampler reports log-probs
    for i, ((c, part), t) in enumerate(zip(parts, teacher_scores)):
        s = policy.score(part.prompts, part, grad=True, hidden=exact, sync=i == len(parts) - 1)
        loss, kl = consistency_loss(cfg, s, t)
        (loss / n_tokens).backward()
        sums["loss"] += float(loss.detach())
        sums["kl"] += float(kl)
        sums["logp_student"] += float(s.logp_NT.detach().sum())
        sums["logp_teacher"] += float(t.logp_NT.sum())
        if part.sampler_logp is not None:
            gap += sum(abs(a - float(b)) for row_s, row_v in zip(s.logp_NT.detach().tolist(), part.sampler_logp)
                       for a, b in zip(row_s, row_v))
    t3 = time.perf_counter()

    sums["sampler_logp_gap"] = gap
    row = {k: v / n_tokens for k, v in policy.replicas.sum(sums).items()}
    if rollout.sampler_logp is None:
        del row["sampler_logp_gap"]
    responses = policy.replicas.gather(rollout.responses)  # the global batch's
    prompt_tokens = policy.replicas.sum({"s": sum(map(len, prompts_s)), "t": sum(map(len, prompts_t))})
    row.update(response_len=n_tokens / len(responses), response_tokens=n_tokens,
               prompt_tokens=int(prompt_tokens["s"]), teacher_prompt_tokens=int(prompt_tokens["t"]),
               decode_steps=max(map(len, responses)),
               distinct_responses=len(set(map(tuple, responses))) / len(responses),
               time_sample=t1 - t0, time_teacher=t2 - t1, time_student=t3 - t2, **rollout.stats)
    return row


def train(cfg: TrainConfig, pairs: list[ConsistencyPair] | None = None, probe=None, probe_every: int = 0,
          show_progress: bool = True) -> Path:
    """Run OPCT; returns the output directory. `probe(policy) -> dict` (optional) is called every
    `probe_every` steps and its numbers are logged with that step (e.g. a quick held-out eval)."""
    with loop.start_run(cfg, pairs) as run:  # on an error, the run's sampler and logs are closed at once
        bar = loop.steps(run, "opct", show_progress)
        for step in bar:
            idx = loop.data_order(len(run.rendered), cfg.seed, step * cfg.prompts_per_step, cfg.prompts_per_step)
            # this process's share of the step's pairs (all of them in one process) and its sampling generator
            batch, gen = loop.share(run, [run.rendered[i] for i in idx], cfg.samples_per_prompt)
            # 1-3: sample, teacher scores, student forward/backward
            row = opct_step(run.policy, batch, run.cfg, gen)
            # 4: optimizer step
            row.update(loop.optimizer_step(run, step, row["loss"]))
            loop.end_step(run, step, row, probe, probe_every, bar, show_progress)
        return loop.save_final(run, {})
