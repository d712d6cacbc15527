"""KL losses between the student (perturbed prompt) and the frozen teacher (clean prompt).

Every loss returns a *sum over response tokens*; the training loop divides by the global number of response
tokens in the optimizer step, so gradient accumulation over micro-batches gives the same gradient as one big
batch (TRL #4719 is the bug this avoids). Shapes: B batch, T response positions, V vocabulary.

  sampled_token_loss  default. Per-token reverse-KL estimate on the token the student sampled,
                      k_t = log p_s(y_t) - log p_t(y_t), used as a per-token advantage A_t = -coef * k_t
                      (optionally discounted over future tokens) in a policy-gradient loss.
  reverse_kl          exact KL(p_s || p_t) over the full vocabulary at each response position.
  topk_reverse_kl     the same sum restricted to the student's top-k tokens at each position.
  forward_kl          exact KL(p_t || p_s) over the full vocabulary.
  fixed_advantage_loss  a control, no teacher: every sampled token gets the same advantage.

`clip` (> 0) caps one token's term: the sampled estimate |k_t| at most clip, an exact KL at most clip (above it the
token gives no gradient), as OPSD's per-token KL clipping, which found style tokens carrying 6-15x the KL of
content tokens. `position_kl` splits the sampled estimate into each response's first tokens and the rest.

When another engine (vLLM) sampled the tokens, `truncated_is_weights` gives each token's importance weight between
that sampler and the trainer; every loss above scales a token's term by it. `importance_weights` gives the weights
with the statistics a step logs.

The losses are device-agnostic math on what a policy returns (`opct.backends.base.Scores`): log-probs of the
sampled tokens for the default loss; for the exact ones, hidden states and a logits function, streamed over
positions (`exact_kl`) so N x T x V logits never exist at once. Everything here runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the full log-softmax tensor."""
    picked_BT = logits_BTV.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)


def discounted_future_sum(x_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """y_t = sum_{t' >= t} gamma^(t'-t) x_t'  (gamma = 0 gives x itself)."""
    if gamma == 0.0:
        return x_BT
    out_BT = torch.zeros_like(x_BT)
    run_B = torch.zeros_like(x_BT[:, 0])
    for t in range(x_BT.shape[1] - 1, -1, -1):
        run_B = x_BT[:, t] + gamma * run_B
        out_BT[:, t] = run_B
    return out_BT


def sampled_token_loss(logp_student_BT, logp_teacher_BT, mask_BT, coef: float = 1.0, discount: float = 0.0,
                       weight_BT: torch.Tensor | None = None, clip: float = 0.0):
    """Policy-gradient loss with the sampled-token reverse-KL estimate as a per-token advantage.

    Written in importance-sampling form, L = -sum_t ratio_t * A_t with ratio_t = exp(logp - logp.detach()) = 1
    on-policy, so the loss *value* is the summed KL estimate while its gradient is -sum_t A_t * grad logp_t:
    the REINFORCE gradient of KL(student || teacher) on the student's own samples (the score-function term
    has zero mean, so no baseline is needed). `weight_BT` (no grad): each token's importance weight when another
    engine sampled the tokens (`truncated_is_weights`); it scales the token's term. `clip` > 0: each token's
    estimate enters the advantage clamped to [-clip, clip] (before any discounting). Returns (loss_sum, kl_sum),
    the KL estimate unweighted and unclipped.
    """
    m_BT = mask_BT.to(logp_student_BT.dtype)
    k_BT = (logp_student_BT.detach() - logp_teacher_BT) * m_BT
    k_adv_BT = k_BT.clamp(-clip, clip) if clip > 0 else k_BT
    adv_BT = -coef * discounted_future_sum(k_adv_BT, discount) * m_BT
    if weight_BT is not None:
        adv_BT = adv_BT * weight_BT
    ratio_BT = torch.exp(logp_student_BT - logp_student_BT.detach())
    loss = -(ratio_BT * adv_BT).sum()
    return loss, k_BT.sum()


def fixed_advantage_loss(logp_student_BT, mask_BT, advantage: float, weight_BT: torch.Tensor | None = None):
    """The fixed-advantage control: the same policy-gradient form as `sampled_token_loss` with every sampled token's
    advantage the constant `advantage` instead of the teacher's -coef * k_t, so no teacher enters the update. The loss
    is -advantage * sum_t ratio_t (ratio_t = 1 on-policy) and its gradient -advantage * sum_t grad log p_s(y_t):
    with advantage < 0, each step lowers the probability of what the student just sampled. It asks how much of
    OPCT's update is the teacher's information rather than this generic push ("Does OPD really distill?",
    arXiv 2608.31046). Under AdamW the constant's size barely matters (the update is normalised); its sign does.
    `weight_BT`: importance weights as in `sampled_token_loss`. Returns loss_sum."""
    m_BT = mask_BT.to(logp_student_BT.dtype)
    adv_BT = advantage * m_BT
    if weight_BT is not None:
        adv_BT = adv_BT * weight_BT
    return -(torch.exp(logp_student_BT - logp_student_BT.detach()) * adv_BT).sum()


def position_kl(logp_student_BT, logp_teacher_BT, mask_BT, head: int) -> dict:
    """The sampled-token KL estimate split by where a token sits in its response: sums and token counts over each
    response's first `head` tokens the loss covers ("head") and over its later ones ("tail"), for the per-step
    diagnostics kl_head / kl_tail (early tokens often carry most of the KL: style, refusal or compliance openers)."""
    m_BT = mask_BT.to(torch.float32)
    k_BT = (logp_student_BT.detach().float() - logp_teacher_BT.float()) * m_BT
    head_BT = (m_BT.cumsum(1) <= head).float() * m_BT
    tail_BT = m_BT - head_BT
    return {"kl_head": float((k_BT * head_BT).sum()), "head_tokens": float(head_BT.sum()),
            "kl_tail": float((k_BT * tail_BT).sum()), "tail_tokens": float(tail_BT.sum())}


def truncated_is_weights(logp_trainer_BT: torch.Tensor, logp_sampler_BT: torch.Tensor, mask_BT: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (TIS) for tokens another engine sampled: w_t = min(p_trainer(y_t) /
    p_sampler(y_t), cap), 1 at padding, no grad. The loss's expectation is over the trainer's distribution; the
    tokens come from the sampler's (vLLM in bfloat16 with its own kernels), so each token's term is reweighted by
    the ratio of the two, truncated at `cap` to bound the variance (a small bias where the ratio exceeds it). The
    same weights in the same precision give exactly 1. Returns (w_BT, ratio_BT), the ratio before truncation."""
    ratio_BT = torch.exp(logp_trainer_BT.detach() - logp_sampler_BT)
    ratio_BT = torch.where(mask_BT.bool(), ratio_BT, torch.ones_like(ratio_BT))
    return ratio_BT.clamp(max=cap), ratio_BT


def importance_weights(logp_trainer_BT: torch.Tensor, logp_sampler_BT: torch.Tensor, mask_BT: torch.Tensor,
                       cap: float) -> tuple[torch.Tensor | None, dict]:
    """Tokens another engine sampled, with its log-probs: the truncated importance weights (`truncated_is_weights`),
    None when cap is 0 (no correction), and their statistics over the real tokens, as sums: sampler_logp_gap, of
    |log p_trainer - log p_sampler|; with the weights, is_weight_mean, of the weights, and is_truncated, the tokens
    whose ratio exceeds cap; and is_ratio_max, the largest ratio before truncation (absent without real tokens)."""
    real_BT = mask_BT.bool()
    stats = {"sampler_logp_gap": float((logp_trainer_BT.detach() - logp_sampler_BT)[real_BT].abs().sum())}
    w_BT = None
    if cap > 0:
        w_BT, ratio_BT = truncated_is_weights(logp_trainer_BT, logp_sampler_BT, mask_BT, cap)
        stats["is_weight_mean"] = float(w_BT[real_BT].sum())
        stats["is_truncated"] = float((ratio_BT[real_BT] > cap).sum())
        if real_BT.any():
            stats["is_ratio_max"] = float(ratio_BT[real_BT].max())
    return w_BT, stats


def reverse_kl(logits_student_NV, logits_teacher_NV):
    """Per-position exact KL(p_s || p_t) = sum_v p_s (log p_s - log p_t). Returns kl_N."""
    logp_s_NV = F.log_softmax(logits_student_NV, dim=-1)
    logp_t_NV = F.log_softmax(logits_teacher_NV, dim=-1)
    return (logp_s_NV.exp() * (logp_s_NV - logp_t_NV)).sum(-1)


def topk_reverse_kl(logits_student_NV, logits_teacher_NV, k: int):
    """sum over the student's top-k tokens of p_s (log p_s - log p_t); no renormalisation (a lower-mass KL)."""
    logp_s_NV = F.log_softmax(logits_student_NV, dim=-1)
    idx_NK = logp_s_NV.detach().topk(k, dim=-1).indices
    logp_s_NK = logp_s_NV.gather(-1, idx_NK)
    logp_t_NK = F.log_softmax(logits_teacher_NV, dim=-1).gather(-1, idx_NK)
    return (logp_s_NK.exp() * (logp_s_NK - logp_t_NK)).sum(-1)


def forward_kl(logits_student_NV, logits_teacher_NV):
    """Per-position exact KL(p_t || p_s) = sum_v p_t (log p_t - log p_s). Returns kl_N."""
    logp_s_NV = F.log_softmax(logits_student_NV, dim=-1)
    logp_t_NV = F.log_softmax(logits_teacher_NV, dim=-1)
    return (logp_t_NV.exp() * (logp_t_NV - logp_s_NV)).sum(-1)


def exact_kl(kind: str, s_logits, t_logits, h_s_MH: torch.Tensor, h_t_MH: torch.Tensor, chunk: int = 256,
             **kw) -> torch.Tensor:
    """EXACT[kind] at M positions from the student's and teacher's hidden states, `chunk` positions at a time,
    recomputing each chunk's logits in backward (activation checkpointing): peak memory O(chunk x V), not
    O(M x V). `s_logits`/`t_logits` map hidden rows to float32 logits. Returns kl_M. With M = 0 (a micro-batch none
    of whose tokens the loss covers, e.g. every reasoning unclosed under train_on_thinking off) the one chunk is
    empty: kl_M is still the KL of the logits of the (no) rows, so its sum is a zero that backward runs through to
    every parameter the logits depend on, giving them a zero gradient, as the sampled-token loss does with an
    all-zero mask (a tensor made afresh would have no graph, and backward would raise)."""
    kl_fn = EXACT[kind]

    def one(h_s, h_t):
        return kl_fn(s_logits(h_s), t_logits(h_t), **kw)

    parts = [checkpoint(one, h_s_MH[i:i + chunk], h_t_MH[i:i + chunk], use_reentrant=False)
             for i in range(0, max(h_s_MH.shape[0], 1), chunk)]
    return torch.cat(parts)


EXACT = {"full": reverse_kl, "topk": topk_reverse_kl, "forward": forward_kl}
