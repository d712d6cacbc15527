"""On-policy consistency training, one step top to bottom.

Every step:
  1. sample   y ~ student(. | student prompt)                       (the perturbed prompt, no grad)
  2. teacher  log p_T(y_t | teacher prompt, y_<t) in one prefill      (frozen initial model, no grad)
  3. student  log p_S(y_t | student prompt, y_<t) with grad; loss = per-token reverse KL (losses.py), summed over
              response tokens and divided by the step's total response-token count; backward. When vLLM sampled
              the tokens, each token's term is weighted by min(p_S / p_vLLM, sampler_is_cap) (truncated
              importance sampling: vLLM's numbers differ from the trainer's)
  4. AdamW step (grad clipping, LR schedule), then repeat with fresh samples (the harness, train/loop.py).
The teacher is the initial model: with LoRA the same module with adapters disabled, otherwise a frozen copy.
Controls (config, docs/controls.md): teacher_context=shuffled gives step 2 another pair's teacher prompt
(`other_contexts`); fixed_advantage replaces step 3's KL advantage by a constant; kl_clip caps each token's term.
Each step also logs the KL estimate over each response's first KL_HEAD tokens and over the rest (kl_head, kl_tail).
The step only talks to a `Policy` (backends/base.py); how sampling and scoring run is the backend's business.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import torch

from opct.algo import losses
from opct.backends.base import Policy, Scores
from opct.backends.sampling import SamplingSettings
from opct.config import TrainConfig
from opct.data.chat import ChatFormat
from opct.data.pairs import ConsistencyPair
from opct.lens.tokens import StepTokens, due
from opct.train import loop
from opct.train.distributed import Replicas


KL_HEAD = 8  # kl_head / kl_tail: a response's first 8 loss tokens against the rest


def consistency_loss(cfg: TrainConfig, s: Scores, t: Scores,
                     w_NT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss_sum, kl_sum, tokens clipped) over one micro-batch's response tokens; `w_NT`: per-token importance
    weights (tokens sampled by vLLM), which scale each token's loss term but not the logged KL."""
    if cfg.loss == "sampled":
        k_NT = (s.logp_NT.detach() - t.logp_NT) * s.mask_NT
        clipped = int((k_NT.abs() > cfg.kl_clip).sum()) if cfg.kl_clip > 0 else 0
        if cfg.fixed_advantage:
            return (losses.fixed_advantage_loss(s.logp_NT, s.mask_NT, cfg.fixed_advantage, w_NT),
                    k_NT.sum(), clipped)
        return (*losses.sampled_token_loss(s.logp_NT, t.logp_NT, s.mask_NT, cfg.kl_coef, cfg.kl_discount, w_NT,
                                           cfg.kl_clip), clipped)
    real_M = s.mask_NT.flatten().bool()
    H = s.hidden_NTH.shape[-1]
    kw = {"k": cfg.topk} if cfg.loss == "topk" else {}
    kl_M = losses.exact_kl(cfg.loss, s.logits, t.logits, s.hidden_NTH.reshape(-1, H)[real_M],
                           t.hidden_NTH.reshape(-1, H)[real_M], **kw)
    kl = kl_M.sum().detach()
    clipped = 0
    if cfg.kl_clip > 0:
        clipped = int((kl_M.detach() > cfg.kl_clip).sum())
        kl_M = kl_M.clamp(max=cfg.kl_clip)
    if w_NT is not None:
        kl_M = kl_M * w_NT.flatten()[real_M]
    return kl_M.sum(), kl, clipped


def other_contexts(rendered: list[tuple[list[int], list[int]]], idx: list[int], seed: int,
                   step: int) -> list[list[int]]:
    """The shuffled-context control's teacher prompts for the step's pairs `idx`: for each, the teacher prompt of
    another pair of the run's data, drawn uniformly among those whose teacher prompt differs from its own (another
    example's context, OP²SD's control, arXiv 2608.09228). Drawn from (seed, step), so a resumed run draws the same."""
    rng = random.Random(f"shuffled:{seed}:{step}")
    out = []
    for i in idx:
        others = [j for j, (_, t) in enumerate(rendered) if t != rendered[i][1]]
        if not others:
            raise loop.RunError("--teacher-context shuffled needs pairs with at least two different teacher prompts")
        out.append(rendered[rng.choice(others)][1])
    return out


def sampler_logprobs(rows: list[list[float]], like_NT: torch.Tensor) -> torch.Tensor:
    """The sampler's log-probs of a micro-batch's response tokens, laid out as the trainer's logp_NT (0 after each
    response's end)."""
    out_NT = torch.zeros_like(like_NT, dtype=torch.float32)
    for i, row in enumerate(rows):
        out_NT[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out_NT


@dataclasses.dataclass
class StepStats:
    """One step's metrics: summed over its micro-batches (`add`, of `backward_micro_batch`'s dicts), then over the
    data-parallel replicas and per token (`row`). A field left None is a number this step does not log."""
    sums: dict[str, float]  # per loss token: loss, kl, logp_student, logp_teacher [, the sampler's statistics]
    position: dict[str, float] = dataclasses.field(  # kl_head / kl_tail and their own token counts
        default_factory=lambda: dict.fromkeys(("kl_head", "head_tokens", "kl_tail", "tail_tokens"), 0.0))
    clipped: int | None = None  # with kl_clip: the tokens whose term was clipped
    ratio_max: float | None = None  # with importance weights: the largest ratio before truncation
    unclosed: int | None = None  # with a thinking model: the responses whose reasoning never closed

    @classmethod
    def start(cls, cfg: TrainConfig, sampled_elsewhere: bool, unclosed: int | None) -> StepStats:
        """`sampled_elsewhere`: the sampler reported its own log-probs (vLLM; every replica's sampler is the same
        kind): their gap to the trainer's is logged and, with sampler_is_cap > 0, the importance weights'."""
        weighted = sampled_elsewhere and cfg.sampler_is_cap > 0
        keys = (["loss", "kl", "logp_student", "logp_teacher"] + ["sampler_logp_gap"] * sampled_elsewhere
                + ["is_weight_mean", "is_truncated"] * weighted)
        return cls(dict.fromkeys(keys, 0.0), clipped=0 if cfg.kl_clip > 0 else None,
                   ratio_max=0.0 if weighted else None, unclosed=unclosed)

    def add(self, metrics: dict) -> None:
        """One micro-batch's metrics: sums, but is_ratio_max a running max."""
        for k, v in metrics.items():
            if k == "kl_clipped":
                self.clipped += v
            elif k == "is_ratio_max":
                self.ratio_max = max(self.ratio_max, v)
            elif k in self.position:
                self.position[k] += v
            else:
                self.sums[k] += v

    def row(self, replicas: Replicas, n_tokens: int, n_responses: int) -> dict:
        """The logged numbers, over every replica: `sums` and kl_clipped per loss token (`n_tokens`, the step's),
        kl_head / kl_tail per token of their own positions (absent without any), unclosed_reasoning per response."""
        row = {k: v / max(n_tokens, 1) for k, v in replicas.sum(self.sums).items()}
        position = replicas.sum(self.position)
        row |= {k: position[k] / position[n] for k, n in (("kl_head", "head_tokens"), ("kl_tail", "tail_tokens"))
                if position[n]}
        if self.clipped is not None:
            row["kl_clipped"] = replicas.sum(self.clipped) / max(n_tokens, 1)
        if self.ratio_max is not None:
            row["is_ratio_max"] = replicas.max(self.ratio_max)
        if self.unclosed is not None:
            row["unclosed_reasoning"] = replicas.sum(self.unclosed) / n_responses
        return row


def backward_micro_batch(cfg: TrainConfig, s: Scores, t: Scores, sampler_logp: list[list[float]] | None,
                         n_tokens: int) -> dict:
    """One micro-batch's loss (`consistency_loss`), divided by the step's loss-token count `n_tokens`, backward;
    returns its metrics as sums over its tokens (`StepStats.add`): the importance weights' statistics when the sampler
    reported log-probs (`losses.importance_weights`), the position split (`losses.position_kl`), loss, kl,
    logp_student and logp_teacher over the tokens the loss covers, and with kl_clip the clipped tokens."""
    w_NT, metrics = None, {}
    if sampler_logp is not None:
        w_NT, metrics = losses.importance_weights(s.logp_NT, sampler_logprobs(sampler_logp, s.logp_NT), s.mask_NT,
                                                  cfg.sampler_is_cap)
    loss, kl, clipped = consistency_loss(cfg, s, t, w_NT)
    (loss / max(n_tokens, 1)).backward()
    metrics |= losses.position_kl(s.logp_NT, t.logp_NT, s.mask_NT, KL_HEAD)
    metrics |= {"loss": float(loss.detach()), "kl": float(kl),
                "logp_student": float((s.logp_NT.detach() * s.mask_NT).sum()),
                "logp_teacher": float((t.logp_NT * s.mask_NT).sum())}
    if cfg.kl_clip > 0:
        metrics["kl_clipped"] = clipped
    return metrics


def opct_step(policy: Policy, fmt: ChatFormat, batch: list[tuple[list[int], list[int]]], cfg: TrainConfig,
              gen: torch.Generator, tokens: StepTokens | None = None) -> dict:
    """One optimizer step's forward/backward work on `batch` = [(student_ids, teacher_ids), ...], each student prompt
    sampled samples_per_prompt times: phases 1-3 of the module's docstring, step 3 a backward per micro-batch
    (`backward_micro_batch`) over one normaliser, the loss's tokens in the step on every data-parallel replica (no
    reasoning under train_on_thinking off): the gradient is one big batch's. `fmt`: the student's chat format, which
    says where each response's answer starts after a thinking model's reasoning (`ChatFormat.answer_tokens`,
    `answer_mask`). With `tokens` (a step whose token log is due), each micro-batch's two log-probs per token go
    there too (opct.lens.tokens). Returns its metrics (`StepStats`)."""
    prompts_s = [s for s, _ in batch for _ in range(cfg.samples_per_prompt)]
    prompts_t = [t for _, t in batch for _ in range(cfg.samples_per_prompt)]
    exact = cfg.loss != "sampled"  # the exact losses need hidden states, not just the sampled tokens' log-probs
    answer_only = fmt.thinks and not cfg.train_on_thinking

    # 1. the student samples on the perturbed prompts
    t0 = time.perf_counter()
    rollout = policy.sample(prompts_s, SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k),
                            gen)
    n_answer, unclosed = fmt.answer_tokens(prompts_s, rollout.responses)
    n_sampled = policy.replicas.sum(rollout.n_tokens)
    n_tokens = policy.replicas.sum(n_answer if answer_only else rollout.n_tokens)
    parts = rollout.parts(cfg.micro_batch)

    # 2. the frozen teacher scores the same tokens after the clean prompt
    t1 = time.perf_counter()
    with policy.teacher() as teacher:
        teacher_scores = [teacher.score(prompts_t[c], part, grad=False, hidden=exact) for c, part in parts]

    # 3. the student scores them after the perturbed prompt, with grad; each micro-batch's normalised loss backward
    t2 = time.perf_counter()
    stats = StepStats.start(cfg, rollout.sampler_logp is not None, unclosed if fmt.thinks else None)
    for i, ((c, part), t) in enumerate(zip(parts, teacher_scores)):
        s = policy.score(part.prompts, part, grad=True, hidden=exact, sync=i == len(parts) - 1)
        if answer_only:  # the reasoning tokens leave the loss (and the importance weights' counts)
            keep_NT, _ = fmt.answer_mask(part.prompts, part.responses, s.mask_NT.shape[1])
            s = dataclasses.replace(s, mask_NT=s.mask_NT * keep_NT)
        stats.add(backward_micro_batch(cfg, s, t, part.sampler_logp, n_tokens))
        if tokens is not None:
            tokens.add(part.prompts, prompts_t[c], part.responses, s.logp_NT, t.logp_NT, s.mask_NT)
    t3 = time.perf_counter()

    responses = policy.replicas.gather(rollout.responses)  # the global batch's
    prompt_tokens = policy.replicas.sum({"s": sum(map(len, prompts_s)), "t": sum(map(len, prompts_t))})
    row = stats.row(policy.replicas, n_tokens, len(responses)) | ({"loss_tokens": n_tokens} if answer_only else {})
    return row | dict(response_len=n_sampled / len(responses), response_tokens=n_sampled,
                      prompt_tokens=int(prompt_tokens["s"]), teacher_prompt_tokens=int(prompt_tokens["t"]),
                      decode_steps=max(map(len, responses)),
                      distinct_responses=len(set(map(tuple, responses))) / len(responses),
                      time_sample=t1 - t0, time_teacher=t2 - t1, time_student=t3 - t2, **rollout.stats)


def train(cfg: TrainConfig, pairs: list[ConsistencyPair] | None = None, probe=None, probe_every: int = 0,
          show_progress: bool = True) -> Path:
    """Run OPCT; returns the output directory. `probe(policy, fmt) -> dict` (optional; `fmt`: the run's student chat
    format) is called every `probe_every` steps and its numbers are logged with that step (e.g. a quick held-out
    eval)."""
    with loop.start_run(cfg, pairs) as run:  # on an error, the run's sampler and logs are closed at once
        bar = loop.steps(run, "opct", show_progress)
        for step in bar:
            idx = loop.data_order(len(run.rendered), cfg.seed, step * cfg.prompts_per_step, cfg.prompts_per_step)
            # this process's share of the step's pairs (all of them in one process) and its sampling generator
            pairs = [run.rendered[i] for i in idx]
            if cfg.teacher_context == "shuffled":  # the control: another pair's teacher prompt for each
                pairs = [(student, t) for (student, _), t in zip(pairs, other_contexts(run.rendered, idx, cfg.seed, step))]
            batch, gen = loop.share(run, pairs, cfg.samples_per_prompt)
            tokens = (StepTokens(step + 1, [i for i in run.replicas.shard(idx) for _ in range(cfg.samples_per_prompt)])
                      if due(cfg.token_log_every, step, cfg.steps) else None)
            # 1-3: sample, teacher scores, student forward/backward
            row = opct_step(run.policy, run.fmt, batch, run.cfg, gen, tokens)
            if tokens is not None:  # the step's log-probs per token, to out/tokens (the lens)
                t0 = time.perf_counter()
                tokens.write(run.out, run.policy.tok, run.fmt, run.replicas.rank, run.replicas.world)
                row["time_tokens"] = time.perf_counter() - t0
            # 4: optimizer step
            row.update(loop.optimizer_step(run, step, row["loss"]))
            loop.end_step(run, step, row, probe, probe_every, bar, show_progress)
        return loop.save_final(run, {})
