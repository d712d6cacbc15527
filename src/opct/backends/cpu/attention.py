"""Attention on the CPU: two batched matmuls over the key/value heads at short lengths, the flash kernel beyond
(without repeating key/value heads, and in causal query chunks).

Why: Hugging Face's `sdpa` path repeats every key/value head for its query-head group (it does not pass a mask
together with `enable_gqa`), and PyTorch's CPU flash kernel is tuned for long sequences. At the sizes consistency
training runs (prompts of tens to hundreds of tokens, short responses) the plain computation is faster; past about
2^15 query x key positions the flash kernel wins. Memory: under grad the softmax output (batch x heads x queries x
keys floats a layer) is kept for the backward pass, where the flash kernel keeps one float per query; the 2^15 cap
bounds that.

Past the cap (`flash_attention`): the flash kernel reads the key/value heads as they are (`enable_gqa`), and a
causal mask is run in chunks of up to `CHUNK_QUERIES` queries, each chunk reading only the keys up to its own last
position. The kernel computes every query x key block of a masked attention, including those above the diagonal
that the mask zeroes (its key blocks are 512 long, so a prompt of a few hundred tokens gets no skipping at all);
two chunks compute a quarter fewer blocks, many nearly half. The dropped keys are checked to be masked for every
query of the chunk, so the result is the full computation's up to float rounding, forward and backward. Anything
neither form covers (dropout, soft-capping, attention sinks, float masks, other devices) takes Hugging Face's
`sdpa`. Figures: dev/LOG.md, 2026-11-26 (evening).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "opct"
MAX_SCORES = 1 << 15  # query x key positions per head up to which the matmul form is used
CHUNK_QUERIES = 256  # queries per flash-kernel call in long causal attention (chunks of equal size up to this)


def short_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    is_causal=None, **kwargs):
    """Same contract as transformers' sdpa_attention_forward: query_BHTD, key/value_BKSD, a boolean mask_B1TS
    (True = attend). Returns (output_BTHD, None)."""
    B, H, T, D = query.shape
    K, S = key.shape[1], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask_B1TS = attention_mask
    if mask_B1TS is None and causal and S >= T:
        # No mask: the sdpa mask builder left it out because it is plain causal attention (no padding).
        mask_B1TS = torch.ones(T, S, dtype=torch.bool).tril_(S - T)[None, None]
    covered = (query.device.type == "cpu" and (dropout == 0.0 or not module.training) and H % K == 0
               and value.shape[-1] == D and isinstance(mask_B1TS, torch.Tensor) and mask_B1TS.dtype == torch.bool
               and mask_B1TS.dim() == 4 and mask_B1TS.shape[1] == 1
               and not any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias")))
    if not covered:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = D ** -0.5 if scaling is None else scaling
    if T * S > MAX_SCORES:
        return flash_attention(query, key, value, mask_B1TS, scale).transpose(1, 2).contiguous(), None
    G = H // K  # query heads per key/value head: head h reads key/value head h // G, as HF's repeat_kv
    # Masked scores get the dtype's most negative value, not -inf: a row with nothing to attend to (a padding
    # query) gets a uniform softmax instead of NaNs that would reach the backward pass.
    bias_B11TS = torch.zeros(mask_B1TS.shape, dtype=query.dtype).masked_fill_(
        ~mask_B1TS, torch.finfo(query.dtype).min)[:, :, None]
    scores_BKGTS = torch.matmul(query.reshape(B, K, G * T, D), key.transpose(-1, -2)).view(B, K, G, T, S)
    p_BKGTS = torch.add(bias_B11TS, scores_BKGTS, alpha=scale).softmax(-1)
    out_BKGTD = torch.matmul(p_BKGTS.view(B, K, G * T, S), value)
    return out_BKGTD.view(B, H, T, D).transpose(1, 2).contiguous(), None


def flash_attention(query_BHTD, key_BKSD, value_BKSD, mask_B1TS, scale: float) -> torch.Tensor:
    """scaled_dot_product_attention (the CPU flash kernel) with grouped key/value heads read in place; when the mask
    is causal for queries that are the last T of the S key positions, in query chunks [a, e) that each attend to
    keys [0, S - T + e) only. Returns out_BHTD."""
    T, S = query_BHTD.shape[2], key_BKSD.shape[2]
    n = -(-T // CHUNK_QUERIES)
    if n > 1 and (S < T or mask_B1TS.shape[-2] != T or mask_B1TS.triu(S - T + 1).any()):
        n = 1  # some query sees a key after its own position (or one mask row serves all): one call, all keys
    bounds = [T * i // n for i in range(n + 1)]
    outs = []
    for a, e in zip(bounds[:-1], bounds[1:]):
        end = S - T + e  # one past the last key a query of this chunk sees (S for a single chunk)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query_BHTD[:, :, a:e], key_BKSD[:, :, :end], value_BKSD[:, :, :end], attn_mask=mask_B1TS[:, :, a:e, :end],
            scale=scale, enable_gqa=True))
    return outs[0] if n == 1 else torch.cat(outs, dim=2)


def use(model) -> None:
    """Switch a transformers model (and any PEFT wrapper's base) to `short_attention`."""
    AttentionInterface.register(NAME, short_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
