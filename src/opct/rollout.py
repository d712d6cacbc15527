"""Batched sampling from the student.

A short decode loop of our own instead of `model.generate`: every sampling setting is explicit (nothing is
inherited from the model's generation_config, TRL #6337), the token ids are kept as sampled (never
re-tokenised), and rows that hit EOS stop contributing to the batch.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from opct.decoder import LeanDecoder, unsupported_reason


@dataclass
class SamplingSettings:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off


def left_pad(seqs: list[list[int]], pad_id: int):
    """Stack variable-length prompts right-aligned: returns ids_BL, attention_mask_BL, position_ids_BL."""
    L = max(len(s) for s in seqs)
    ids_BL = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask_BL = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BL[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask_BL[i, L - len(s):] = 1
    return ids_BL, mask_BL, (mask_BL.cumsum(-1) - 1).clamp(min=0)


def next_token(logits_BV: torch.Tensor, s: SamplingSettings, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row under explicit settings. Returns tokens_B."""
    if s.temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / s.temperature
    if s.top_k and s.top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(s.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if s.top_p < 1.0:
        sorted_BV, idx_BV = logits_BV.sort(dim=-1, descending=True)
        cum_BV = sorted_BV.softmax(-1).cumsum(-1)
        drop_BV = cum_BV - sorted_BV.softmax(-1) >= s.top_p  # keep the smallest prefix with mass >= top_p
        logits_BV = logits_BV.scatter(-1, idx_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    # Inverse-CDF sampling: one uniform per row against the cumulative probabilities (float64, so the rounding of
    # a 50k-term sum stays far below any token's mass). torch.multinomial draws an exponential variate per vocabulary
    # entry instead: ~9 ms a step for 8 x 49k on 2 cores, a tenth of a whole SmolLM2 decode step; this is ~0.3 ms.
    cdf_BV = logits_BV.softmax(-1).double().cumsum(-1)
    u_B1 = torch.rand(cdf_BV.shape[0], 1, dtype=torch.float64, generator=generator) * cdf_BV[:, -1:]
    # right=True: the first entry whose cdf exceeds u, so zero-probability tokens (flat cdf) are never picked.
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(-1).clamp_(max=cdf_BV.shape[-1] - 1)


def lm_parts(model):
    """(body, head) of a (PEFT-wrapped) causal LM: the transformer body, whose output is last_hidden_state, and
    the output layer. Running them separately lets callers choose which positions reach the LM head."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    return m.base_model, m.get_output_embeddings()


def head_logits(model, hidden_H: torch.Tensor) -> torch.Tensor:
    """The LM head on final hidden states, with the logit soft-capping or scaling some models apply after it."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    logits = m.get_output_embeddings()(hidden_H)
    cfg = m.config
    if getattr(cfg, "logit_scale", None) not in (None, 1.0):  # Cohere
        logits = logits * cfg.logit_scale
    if getattr(cfg, "logits_scaling", None) not in (None, 1.0):  # Granite
        logits = logits / cfg.logits_scaling
    if getattr(cfg, "final_logit_softcapping", None):  # Gemma 2
        cap = cfg.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass
class Prefill:
    """The prompts' forward pass: its KV cache (with the autograd graph when run under grad), the final hidden
    state that predicts the first response token, and the padding layout."""
    cache: DynamicCache
    last_hidden_BH: torch.Tensor
    mask_BL: torch.Tensor
    last_pos_B: torch.Tensor


def common_prefix(rows: list[list[int]]) -> int:
    n = min(map(len, rows))
    for j in range(n):
        if any(r[j] != rows[0][j] for r in rows[1:]):
            return j
    return n


@contextmanager
def last_layer_keys_only(model):
    """Within this block, the body's last layer runs in full only for the last position of its input; the other
    positions compute just their keys and values, the only part of them that later tokens read. A prefill needs no
    more (it returns the last position's hidden state and the KV cache), so this drops the last layer's query and
    output projections, attention and MLP over every other prompt row: for SmolLM2 (30 layers, keys and values
    6% of a layer's products) ~3% of each prefill, forward and backward. The body's last_hidden_state then holds
    that last position only. Llama-layout models only (`decoder.unsupported_reason`); others run unchanged."""
    layer = None
    if unsupported_reason(model) is None:
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


def prefill(model, prompts: list[list[int]], pad_id: int, min_shared: int = 8,
            prefix_cache: dict | None = None) -> Prefill:
    """Run the prompts, keeping their KV cache. When every prompt starts with the same tokens (a chat template's
    system prompt, a shared instruction: ~1/3 of a typical SmolLM2 prompt), that prefix runs once with batch 1
    and its KV is broadcast to every row; each row then runs only its own suffix, left-padded *after* the
    prefix. Positions and the attention mask make this the same computation as a full left-padded prefill (up to
    float rounding), with gradients flowing back into the shared prefix when run under grad.

    `prefix_cache` (a dict owned by the caller, for a model whose weights never change, e.g. the frozen teacher):
    the shared prefix's KV is kept there and reused while the next call's prefix is the same tokens, as a chat
    template's system prompt is on every step. Used only without grad."""
    with last_layer_keys_only(model):
        return _prefill(model, prompts, pad_id, min_shared, prefix_cache)


def _prefill(model, prompts, pad_id, min_shared, prefix_cache) -> Prefill:
    B = len(prompts)
    body, _ = lm_parts(model)
    k = min(common_prefix(prompts), min(map(len, prompts)) - 1) if B > 1 else 0  # every row keeps >= 1 token
    if k < min_shared:
        ids_BL, mask_BL, pos_BL = left_pad(prompts, pad_id)
        cache = DynamicCache()
        out = body(input_ids=ids_BL, attention_mask=mask_BL, position_ids=pos_BL, past_key_values=cache,
                   use_cache=True)
        return Prefill(cache, out.last_hidden_state[:, -1], mask_BL, pos_BL[:, -1])
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
    cache = DynamicCache(ddp_cache_data=[(k_.expand(B, -1, -1, -1), v_.expand(B, -1, -1, -1)) for k_, v_ in kv])
    ids_BS, smask_BS, spos_BS = left_pad([p[k:] for p in prompts], pad_id)
    mask_BL = torch.cat([torch.ones(B, k, dtype=smask_BS.dtype), smask_BS], dim=1)  # [prefix | pads | suffix]
    pos_BS = spos_BS + k
    out = body(input_ids=ids_BS, attention_mask=mask_BL, position_ids=pos_BS, past_key_values=cache, use_cache=True)
    return Prefill(cache, out.last_hidden_state[:, -1], mask_BL, pos_BS[:, -1])


@torch.inference_mode()  # as no_grad, minus autograd's per-op view/version bookkeeping: ~1.5 ms a SmolLM2 step
def decode(model, pre: Prefill, settings: SamplingSettings, eos_ids: set[int], pad_id: int,
           generator: torch.Generator | None = None, lean: bool = True) -> list[list[int]]:
    """Sample one response per row, continuing from a prefill. Each response ends with its EOS token when one
    was produced within max_new_tokens (the EOS is part of the response and of the loss).

    With `lean` (default), Llama-layout models decode through `decoder.LeanDecoder` (fused weights with LoRA merged,
    packed for the batch; preallocated cache); other models, or lean=False, through the Hugging Face forward."""
    mask_BL, pos_B = pre.mask_BL, pre.last_pos_B
    B, P = mask_BL.shape
    dec = LeanDecoder.build(model, B) if lean else None
    last_BH = pre.last_hidden_BH.detach().contiguous()
    logits_BV = dec.head(last_BH) if dec is not None else head_logits(model, last_BH)
    if dec is not None:
        # Prompt KV copied into a cache with room for every new token; attention mask over all its columns.
        cache = dec.new_cache(B, P + settings.max_new_tokens)
        for (k, v), layer in zip(cache, pre.cache.layers):
            k[:, :, :P], v[:, :, :P] = layer.keys.detach(), layer.values.detach()
        att_B11L = torch.zeros(B, 1, 1, P + settings.max_new_tokens, dtype=torch.bool)
        att_B11L[:, 0, 0, :P] = mask_BL.bool()
    else:
        # A detached view of the prompt KV: decoding never touches the prefill's graph or its cache object.
        cache = DynamicCache(ddp_cache_data=[(lay.keys.detach(), lay.values.detach()) for lay in pre.cache.layers])
    eos_V = torch.tensor(sorted(eos_ids), dtype=torch.long)
    done_B = torch.zeros(B, dtype=torch.bool)
    responses: list[list[int]] = [[] for _ in range(B)]
    for step in range(settings.max_new_tokens):
        tok_B = next_token(logits_BV.float(), settings, generator)
        tok_B = torch.where(done_B, torch.full_like(tok_B, pad_id), tok_B)
        for i in (~done_B).nonzero().flatten().tolist():
            responses[i].append(int(tok_B[i]))
        done_B |= torch.isin(tok_B, eos_V)
        if step + 1 == settings.max_new_tokens or bool(done_B.all()):
            break  # the last token needs no forward pass: its logits would never be sampled from
        # Finished rows keep decoding a pad token (their outputs are discarded), which keeps the batch rectangular.
        pos_B = pos_B + 1
        if dec is not None:
            t = P + step  # cache column of the token sampled at this step
            att_B11L[:, 0, 0, t] = True
            logits_BV = dec.step(tok_B, pos_B, cache, t, att_B11L[..., :t + 1])
        else:
            mask_BL = torch.cat([mask_BL, torch.ones((B, 1), dtype=mask_BL.dtype)], dim=1)
            out = model(input_ids=tok_B[:, None], attention_mask=mask_BL, position_ids=pos_B[:, None],
                        past_key_values=cache, use_cache=True)
            logits_BV = out.logits[:, -1]
    return responses


def sample(model, prompts: list[list[int]], settings: SamplingSettings, eos_ids: set[int], pad_id: int,
           generator: torch.Generator | None = None) -> list[list[int]]:
    """Prefill (no grad, eval mode) + decode: one response per prompt (repeat a prompt to get several)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        responses = decode(model, prefill(model, prompts, pad_id), settings, eos_ids, pad_id, generator)
    model.train(was_training)
    return responses
