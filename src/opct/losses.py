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

The sampled-token loss needs only log p(y_t) of the sampled tokens: `hidden_token_logprobs` computes them from
the final hidden states and the LM head weight, streaming the vocabulary, without ever building B x T x V logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from opct import gemm


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the full log-softmax tensor."""
    picked_BT = logits_BTV.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)


class _HiddenTokenLogprobs(torch.autograd.Function):
    """log softmax(h W^T)[token] for rows of final hidden states, streaming the vocabulary in chunks.

    Like flash attention over the vocabulary: for each chunk of V_c output rows of W, the N x V_c logits are made,
    exponentiated against a running max, summed into a running denominator and (when only h needs a gradient)
    multiplied back into an N x H accumulator, then dropped. That gradient comes out of the same pass:
        d logp_n / d h_n = W[token_n] - softmax(h_n W^T) @ W,
    one H-vector per row, so backward only scales it. Same FLOPs as autograd through full logits (the logits
    matmul and the one back to H), but never an N x V tensor: on a CPU those cost more than the matmuls (each
    fresh 50 MB tensor page-faults in, and log-softmax + gather + their backward sweep it ~6 times).
    When W needs a gradient too (full fine-tuning), backward recomputes each chunk's logits instead. The forward
    value is computed the same way in every case, so a frozen teacher and its student agree bit for bit.
    """

    @staticmethod
    def forward(ctx, h_NH, w_VH, tokens_N, chunk, want_h, want_w):
        N, H = h_NH.shape
        max_N = h_NH.new_full((N,), float("-inf"))
        sum_N = h_NH.new_zeros(N)
        acc_NH = h_NH.new_zeros(N, H) if want_h and not want_w else None
        for v0 in range(0, w_VH.shape[0], chunk):
            w_cH = w_VH[v0:v0 + chunk]
            e_Nc = gemm.linear(h_NH, w_cH)  # logits of this chunk, exponentiated in place below
            new_max_N = torch.maximum(max_N, e_Nc.amax(-1))
            rescale_N = (max_N - new_max_N).exp_()  # earlier terms were relative to the old max
            e_Nc.sub_(new_max_N[:, None]).exp_()
            sum_N = sum_N * rescale_N + e_Nc.sum(-1)
            if acc_NH is not None:
                acc_NH.mul_(rescale_N[:, None]).add_(gemm.mm(e_Nc, w_cH))
            max_N = new_max_N
        w_tok_NH = w_VH[tokens_N]
        lse_N = max_N + sum_N.log()
        ctx.chunk, ctx.want_w = chunk, want_w
        if want_w:
            ctx.save_for_backward(h_NH, w_VH, tokens_N, lse_N)
        else:
            ctx.save_for_backward(None if acc_NH is None else w_tok_NH - acc_NH / sum_N[:, None])
        return (h_NH * w_tok_NH).sum(-1) - lse_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_N):
        if not ctx.want_w:
            grad_NH, = ctx.saved_tensors
            return g_N[:, None] * grad_NH, None, None, None, None, None
        h_NH, w_VH, tokens_N, lse_N = ctx.saved_tensors
        # d logp_n / d logits_n = onehot(token_n) - p_n; the one-hot part is added row-wise below.
        dh_NH = g_N[:, None] * w_VH[tokens_N]
        dw_VH = torch.zeros_like(w_VH).index_add_(0, tokens_N, g_N[:, None] * h_NH)
        for v0 in range(0, w_VH.shape[0], ctx.chunk):
            w_cH = w_VH[v0:v0 + ctx.chunk]
            d_Nc = gemm.linear(h_NH, w_cH).sub_(lse_N[:, None]).exp_().mul_(-g_N[:, None])
            dh_NH.add_(gemm.mm(d_Nc, w_cH))
            dw_VH[v0:v0 + ctx.chunk] += d_Nc.T @ h_NH
        return dh_NH, dw_VH, None, None, None, None


def hidden_token_logprobs(h_NH: torch.Tensor, w_VH: torch.Tensor, tokens_N: torch.Tensor,
                          chunk: int = 4096) -> torch.Tensor:
    """token_logprobs(h_NH @ w_VH.T, tokens_N) for a bias-free output layer w_VH, streaming the vocabulary in chunks
    of `chunk` rows (memory O(N x chunk), not O(N x V)). For SmolLM2's 256 response rows x 49k vocabulary on 2 cores:
    ~0.18 s with the gradient and ~0.09 s without (near the matmul peak), against 0.30 s through full logits and
    autograd measured alone, and more inside a training step, where each fresh 50 MB logits tensor page-faults.
    The products go through `gemm` (oneDNN): the chunked logits took 101 ms there against 140 ms through
    torch.matmul, the product back to H 76 ms against 93 ms (chunks of 2048; 4096 gave 90 and 77 ms)."""
    grad = torch.is_grad_enabled()
    return _HiddenTokenLogprobs.apply(h_NH, w_VH, tokens_N, chunk, grad and h_NH.requires_grad,
                                      grad and w_VH.requires_grad)


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


def sampled_token_loss(logp_student_BT, logp_teacher_BT, mask_BT, coef: float = 1.0, discount: float = 0.0):
    """Policy-gradient loss with the sampled-token reverse-KL estimate as a per-token advantage.

    Written in importance-sampling form, L = -sum_t ratio_t * A_t with ratio_t = exp(logp - logp.detach()) = 1
    on-policy, so the loss *value* is the summed KL estimate while its gradient is -sum_t A_t * grad logp_t:
    the REINFORCE gradient of KL(student || teacher) on the student's own samples (the score-function term
    has zero mean, so no baseline is needed). Returns (loss_sum, kl_sum).
    """
    m_BT = mask_BT.to(logp_student_BT.dtype)
    k_BT = (logp_student_BT.detach() - logp_teacher_BT) * m_BT
    adv_BT = -coef * discounted_future_sum(k_BT, discount) * m_BT
    ratio_BT = torch.exp(logp_student_BT - logp_student_BT.detach())
    loss = -(ratio_BT * adv_BT).sum()
    return loss, k_BT.sum()


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


def chunked_kl(kl_fn, hidden_student_NH, hidden_teacher_NH, lm_head_VH, chunk: int = 256, **kw):
    """kl_fn over positions in chunks, recomputing each chunk's logits in backward (activation checkpointing),
    so only the hidden states are kept alive: peak memory O(chunk * V) instead of O(N * V). Returns kl_N."""
    def one(h_s, h_t):
        return kl_fn(h_s @ lm_head_VH.T, h_t @ lm_head_VH.T, **kw)

    parts = [checkpoint(one, hidden_student_NH[i:i + chunk], hidden_teacher_NH[i:i + chunk], use_reentrant=False)
             for i in range(0, hidden_student_NH.shape[0], chunk)]
    return torch.cat(parts)


EXACT = {"full": reverse_kl, "topk": topk_reverse_kl, "forward": forward_kl}
LOSSES = ("sampled", *EXACT)
