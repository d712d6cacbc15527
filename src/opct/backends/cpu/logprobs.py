"""Log-probs of given tokens straight from final hidden states, streaming the vocabulary (CPU backend).

`response_logprobs` is what the CPU backend scores with: for a plain bias-free float32 LM head it never builds the
N x T x V logits (`hidden_token_logprobs`), and given the response mask it skips padded positions; otherwise it
falls back to the logits. A frozen teacher and its student go through the same computation, so identical prompts
give bit-identical log-probs.
"""

from __future__ import annotations

import torch

from opct.algo.losses import token_logprobs
from opct.backends.cpu import gemm
from opct.backends.hf import head_logits, logit_quirks
from opct.models import lm_parts


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
    of `chunk` rows (memory O(N x chunk), not O(N x V)); the products go through `gemm`. Measured against full
    logits + autograd: dev/LOG.md."""
    grad = torch.is_grad_enabled()
    return _HiddenTokenLogprobs.apply(h_NH, w_VH, tokens_N, chunk, grad and h_NH.requires_grad,
                                      grad and w_VH.requires_grad)


def plain_head_weight(model) -> torch.Tensor | None:
    """The LM head's weight when logits are exactly hidden @ weight.T in float32 (no bias, no soft-capping or
    scaling, not adapted): what `hidden_token_logprobs` needs. None otherwise."""
    _, head = lm_parts(model)
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.dtype != torch.float32 \
            or logit_quirks(model):
        return None
    return head.weight


def response_logprobs(model, hidden_BTH: torch.Tensor, response_BT: torch.Tensor,
                      mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """log p(response_BT[:, t] | ...) from the hidden states that predict them: logp_BT. With `mask_BT` (1 on real
    tokens), the head runs on the real tokens only and padded positions get 0."""
    w_VH = plain_head_weight(model)
    if w_VH is None:
        return token_logprobs(head_logits(model, hidden_BTH).float(), response_BT)
    B, T, H = hidden_BTH.shape
    h_NH, tok_N = hidden_BTH.reshape(B * T, H), response_BT.reshape(B * T)
    if mask_BT is None or bool(mask_BT.all()):
        return hidden_token_logprobs(h_NH, w_VH, tok_N).view(B, T)
    real_N = mask_BT.reshape(B * T).nonzero().squeeze(1)
    logp_N = hidden_token_logprobs(h_NH.index_select(0, real_N), w_VH, tok_N.index_select(0, real_N))
    return logp_N.new_zeros(B * T).index_copy(0, real_N, logp_N).view(B, T)
