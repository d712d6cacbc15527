"""Prompt prefill and decoding for the CPU backend.

`prefill` runs the prompts once and keeps their KV cache: a prompt prefix every row shares runs once at batch 1
(and, for the frozen teacher, is kept across steps), and the last layer computes only keys and values except at
the last position. `decode` samples from a prefill through the lean decoder. `response_hidden_after_prefill`
scores a rollout's tokens on top of a prefill's cache: when the prefill ran under grad (the student's sampling
prefill), gradients flow back into the prompt positions exactly as in one full forward, so the student's scoring
need not run the prompts again; rows can run in groups of similar response length (`length_groups`), so that a
short response is not padded to the longest.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from opct.backends.batching import common_prefix, left_pad, right_pad
from opct.backends.cpu.decoder import LeanDecoder, unsupported_reason
from opct.backends.hf import head_logits
from opct.models import lm_parts
from opct.backends.sampling import SamplingSettings, decode_loop


@dataclass
class Prefill:
    """The prompts' forward pass: its KV cache (with the autograd graph when run under grad), the final hidden
    state that predicts the first response token, and the padding layout."""
    cache: DynamicCache
    last_hidden_BH: torch.Tensor
    mask_BL: torch.Tensor
    last_pos_B: torch.Tensor


@contextmanager
def last_layer_keys_only(model, enabled: bool = True):
    """Within this block, the body's last layer runs in full only for the last position of its input; the other
    positions compute just their keys and values, the only part of them that later tokens read. A prefill needs no
    more (it returns the last position's hidden state and the KV cache), so this drops the last layer's query and
    output projections, attention and MLP over every other prompt row. The body's last_hidden_state then holds
    that last position only. Llama-layout models only (`decoder.unsupported_reason`); others run unchanged."""
    layer = rope = None
    if enabled and unsupported_reason(model) is None:
        body, _ = lm_parts(model)
        layer = body.layers[body.config.num_hidden_layers - 1]
        rope = getattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb", None)
    if layer is None or rope is None or "forward" in vars(layer):
        yield
        return
    attn, full = layer.self_attn, type(layer).forward

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        T = hidden_states.shape[1]
        mask_ok = attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
                                              and attention_mask.shape[-2] == T)
        if T > 1 and past_key_values is not None and position_embeddings is not None and mask_ok:
            # Keys and values of positions 0..T-2, exactly as the attention module computes them, into the cache;
            # the layer then runs on position T-1, whose attention reads them back from there.
            h_BTC = layer.input_layernorm(hidden_states[:, :-1])
            shape = (*h_BTC.shape[:-1], -1, attn.head_dim)
            k_BKTD = attn.k_proj(h_BTC).view(shape).transpose(1, 2)
            v_BKTD = attn.v_proj(h_BTC).view(shape).transpose(1, 2)
            cos, sin = position_embeddings
            _, k_BKTD = rope(k_BKTD, k_BKTD, cos[:, :-1], sin[:, :-1])
            past_key_values.update(k_BKTD, v_BKTD, attn.layer_idx)
            hidden_states, position_embeddings = hidden_states[:, -1:], (cos[:, -1:], sin[:, -1:])
            position_ids = position_ids[:, -1:] if position_ids is not None else None
            attention_mask = attention_mask[:, :, -1:] if attention_mask is not None else None
        return full(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings,
                    **kwargs)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def prefill(model, prompts: list[list[int]], pad_id: int, min_shared: int = 8, prefix_cache: dict | None = None,
            keys_only: bool = True, group_cost: float | None = None) -> Prefill:
    """Run the prompts, keeping their KV cache. When every prompt starts with the same tokens (a chat template's
    system prompt, a shared instruction), that prefix runs once with batch 1 and its KV is broadcast to every row;
    each row then runs only its own suffix, left-padded *after* the prefix. Positions and the attention mask make
    this the same computation as a full left-padded prefill (up to float rounding), with gradients flowing back
    into the shared prefix when run under grad.

    `prefix_cache` (a dict owned by the caller, for a model whose weights never change, e.g. the frozen teacher):
    the shared prefix's KV is kept there and reused while the next call's prefix is the same tokens, as a chat
    template's system prompt is on every step. Used only without grad.

    `group_cost` (None: one padded batch): the suffixes run in `length_groups`, each left-padded only to its own
    longest, so that a short prompt does not pay for the longest one's length. Their caches are then laid out as
    one left-padded batch ([prefix | pads | suffix], the original row order), so the result is used exactly like
    the one-batch prefill's; every real position is the same computation (up to float rounding)."""
    with last_layer_keys_only(model, keys_only):
        return _prefill(model, prompts, pad_id, min_shared, prefix_cache, group_cost)


def _prefill(model, prompts, pad_id, min_shared, prefix_cache, group_cost=None) -> Prefill:
    B = len(prompts)
    body, _ = lm_parts(model)
    k = min(common_prefix(prompts), min(map(len, prompts)) - 1) if B > 1 else 0  # every row keeps >= 1 token
    if k < min_shared:
        k, kv = 0, None
    else:
        ids = tuple(prompts[0][:k])
        keep = prefix_cache is not None and not torch.is_grad_enabled()
        if keep and prefix_cache.get("ids") == ids:
            kv = prefix_cache["kv"]
        else:
            prefix = body(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
            kv = [(lay.keys, lay.values) for lay in prefix.layers]
            if keep:
                prefix_cache.clear()
                prefix_cache.update(ids=ids, kv=kv)
    ids_BS, smask_BS, spos_BS = left_pad([p[k:] for p in prompts], pad_id)
    mask_BL = torch.cat([torch.ones(B, k, dtype=smask_BS.dtype), smask_BS], dim=1)  # [prefix | pads | suffix]
    pos_BS = spos_BS + k
    S = ids_BS.shape[1]
    groups = [list(range(B))] if group_cost is None else length_groups([len(p) - k for p in prompts], group_cost)
    caches, sizes, last_BH = [], [], []
    for g in groups:
        # Left-padded, a group's rows hold all their tokens in the batch's last S_g columns.
        S_g = max(len(prompts[i]) - k for i in g)
        idx, cols = torch.tensor(g), torch.cat([torch.arange(k), torch.arange(k + S - S_g, k + S)])
        cache = DynamicCache() if kv is None else DynamicCache(
            ddp_cache_data=[(k_.expand(len(g), -1, -1, -1), v_.expand(len(g), -1, -1, -1)) for k_, v_ in kv])
        out = body(input_ids=ids_BS[idx, S - S_g:], attention_mask=mask_BL[idx][:, cols],
                   position_ids=pos_BS[idx, S - S_g:], past_key_values=cache, use_cache=True)
        caches.append(cache)
        sizes.append(S_g)
        last_BH.append(out.last_hidden_state[:, -1])
    if len(groups) == 1:  # rows in their order, padded to S: the cache is the batch's as it is
        return Prefill(caches[0], last_BH[0], mask_BL, pos_BS[:, -1])
    # Back to one batch in the original row order: each group's cache gets its missing pad columns (zeros, masked
    # out) between prefix and suffix, then rows are put back where they came from.
    back = torch.tensor([i for g in groups for i in g]).argsort()

    def one_batch(parts_gKLD):  # one layer's keys (or values), a tensor per group
        return torch.cat([torch.cat([t[:, :, :k], t.new_zeros(*t.shape[:2], S - S_g, t.shape[3]), t[:, :, k:]], 2)
                          for t, S_g in zip(parts_gKLD, sizes)]).index_select(0, back)

    cache = DynamicCache(ddp_cache_data=[(one_batch([lay.keys for lay in group_layers]),
                                          one_batch([lay.values for lay in group_layers]))
                                         for group_layers in zip(*[c.layers for c in caches])])
    return Prefill(cache, torch.cat(last_BH).index_select(0, back), mask_BL, pos_BS[:, -1])


@torch.inference_mode()  # as no_grad, minus autograd's per-op view/version bookkeeping
def decode(model, pre: Prefill, settings: SamplingSettings, eos_ids: set[int], pad_id: int,
           generator: torch.Generator | None = None, lean: bool = True) -> list[list[int]]:
    """Sample one response per row, continuing from a prefill. With `lean` (default), Llama-layout models decode
    through `decoder.LeanDecoder` (fused weights with LoRA merged, packed for the batch; preallocated cache);
    other models, or lean=False, through the Hugging Face forward."""
    mask_BL, P = pre.mask_BL, pre.mask_BL.shape[1]
    B = mask_BL.shape[0]
    dec = LeanDecoder.build(model, B) if lean else None
    last_BH = pre.last_hidden_BH.detach().contiguous()
    s = {"pos": pre.last_pos_B, "mask": mask_BL}
    if dec is not None:
        # Prompt KV copied into a cache with room for every new token; attention mask over all its columns.
        cache = dec.new_cache(B, P + settings.max_new_tokens)
        for (k, v), layer in zip(cache, pre.cache.layers):
            k[:, :, :P], v[:, :, :P] = layer.keys.detach(), layer.values.detach()
        att_B11L = torch.zeros(B, 1, 1, P + settings.max_new_tokens, dtype=torch.bool)
        att_B11L[:, 0, 0, :P] = mask_BL.bool()

        def step(tok_B, i):
            s["pos"] = s["pos"] + 1
            t = P + i  # cache column of the token sampled at step i
            att_B11L[:, 0, 0, t] = True
            return dec.step(tok_B, s["pos"], cache, t, att_B11L[..., :t + 1])
        return decode_loop(dec.head(last_BH), step, settings, eos_ids, pad_id, generator)

    # A detached view of the prompt KV: decoding never touches the prefill's graph or its cache object.
    hf_cache = DynamicCache(ddp_cache_data=[(lay.keys.detach(), lay.values.detach()) for lay in pre.cache.layers])

    def hf_step(tok_B, i):
        s["pos"] = s["pos"] + 1
        s["mask"] = torch.cat([s["mask"], torch.ones((B, 1), dtype=mask_BL.dtype)], dim=1)
        out = model(input_ids=tok_B[:, None], attention_mask=s["mask"], position_ids=s["pos"][:, None],
                    past_key_values=hf_cache, use_cache=True)
        return out.logits[:, -1]
    return decode_loop(head_logits(model, last_BH), hf_step, settings, eos_ids, pad_id, generator)


# A forward pass over a group of rows costs about this many token rows on top of its tokens (reading every weight
# once more forward and backward, and ~20 small ops a layer): `length_groups` splits rows only where that pays.
GROUP_COST_TOKENS = 32


def length_groups(lengths: list[int], group_cost: float = GROUP_COST_TOKENS) -> list[list[int]]:
    """Rows split into groups of similar length, each group to be run padded only to its own longest row: the
    partition of the rows sorted by length that minimises sum(rows x longest) + group_cost per group (exact, by
    dynamic programming over the B+1 split points). Returns row indices, shortest group first; a single group is
    [0..B-1] in the original order."""
    B = len(lengths)
    order = sorted(range(B), key=lambda i: lengths[i])
    L = [lengths[i] for i in order]
    best, cut = [0.0] + [float("inf")] * B, [0] * (B + 1)
    for j in range(1, B + 1):  # best[j]: the first j sorted rows, the last group ending at row j-1
        for i in range(j):
            c = best[i] + (j - i) * L[j - 1] + group_cost
            if c < best[j]:
                best[j], cut[j] = c, i
    bounds, j = [], B
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    if len(bounds) <= 1:
        return [list(range(B))]
    return [order[i:j] for i, j in reversed(bounds)]


def response_hidden_after_prefill(model, pre: Prefill, responses: list[list[int]], pad_id: int,
                                  group_cost: float | None = None) -> torch.Tensor:
    """The same hidden_BTH as `hf.response_hidden(model, build_batch(prompts, responses))`, computed by running only
    the response tokens on top of a prefill's KV cache. When the prefill ran under grad, gradients flow back
    through the cached keys/values into the prompt positions, exactly as in one full forward.

    `group_cost` (None: one padded batch): run the rows in `length_groups`, each on its rows of the prompt cache and
    padded only to its own longest response, so that short responses do not pay for the longest one's length.
    Positions past a row's response hold zeros instead of the padded computation's values; every row's real
    positions are the same computation (up to float rounding). The prefill's own cache is then left unchanged."""
    groups = None if group_cost is None else length_groups([max(len(r) - 1, 0) for r in responses], group_cost)
    if groups is None or len(groups) == 1:
        return _response_hidden(model, pre, responses, pad_id)
    T = max(1, max(len(r) for r in responses))
    parts_BTH, order = [], []
    for g in groups:
        idx = torch.tensor(g)
        cache = DynamicCache(ddp_cache_data=[(lay.keys[idx], lay.values[idx]) for lay in pre.cache.layers])
        sub = Prefill(cache, pre.last_hidden_BH[idx], pre.mask_BL[idx], pre.last_pos_B[idx])
        h_gTH = _response_hidden(model, sub, [responses[i] for i in g], pad_id)
        parts_BTH.append(torch.nn.functional.pad(h_gTH, (0, 0, 0, T - h_gTH.shape[1])))
        order += g
    # Row i of the output is the groups' row argsort(order)[i]: the inverse of the permutation `order`.
    return torch.cat(parts_BTH).index_select(0, torch.tensor(order).argsort())


def _response_hidden(model, pre: Prefill, responses: list[list[int]], pad_id: int) -> torch.Tensor:
    """hidden_BTH of the responses, right-padded to the longest, run on (and appended to) the prefill's cache."""
    resp_BT, rmask_BT = right_pad(responses, pad_id)
    T = resp_BT.shape[1]
    first_B1H = pre.last_hidden_BH[:, None]
    if T == 1:
        return first_B1H
    # Token t (t < T-1) predicts token t+1; its position continues each row's prompt positions.
    pos_BT = pre.last_pos_B[:, None] + 1 + torch.arange(T - 1)[None]
    mask_BL = torch.cat([pre.mask_BL, rmask_BT[:, :T - 1]], dim=1)
    body, _ = lm_parts(model)
    out = body(input_ids=resp_BT[:, :T - 1], attention_mask=mask_BL, position_ids=pos_BT,
               past_key_values=pre.cache, use_cache=True)
    return torch.cat([first_B1H, out.last_hidden_state], dim=1)
