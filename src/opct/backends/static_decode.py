"""Decoding over a fixed-size KV cache, each decode step replayed as one CUDA graph on a GPU.

On a GPU, one decode step of a small model at batch 8 is several hundred small kernels (with LoRA, five more per
adapted linear), each launched from Python: the launches, not the GPU, set the pace. A CUDA graph records the
step's kernels once and replays them with a single launch. A graph replays fixed addresses, so everything a step
reads or writes is allocated before capture and updated in place between replays:

  cache     transformers' StaticCache, keys and values for all prompt + max_new_tokens positions
  tok_N1    the tokens just sampled (the step's input)
  pos_N1    their position ids (each row's own count: rows are left-padded)
  mask_N11S an additive attention mask over the S cache positions: 0 where a row may attend, the dtype's minimum
            elsewhere (its pads and the positions not yet written); position L + i opens before step i

The first decode step runs twice eagerly on a side stream (CUDA graphs' warm-up: lazy initialisations happen
outside capture), then is captured and replayed for every step. The warm-up writes step 0's keys and values at
their own position, which the first replay writes again; StaticCache's position counter, which every forward
advances, is put back after the warm-up. A graph lives for one `generate` call (one batch of prompts), so weight
updates between training steps need no recapture.

Without CUDA (or `graphs=False`) the same static step runs eagerly: tests compare it with the dynamic-cache decode
of backends/hf.py on the CPU, and the graph with the eager static step on a GPU. Models with sliding-window layers
and attention implementations that take no additive mask (flash-attention) use the dynamic path
(`unsupported_reason`).
"""

from __future__ import annotations

import warnings

import torch
from transformers import StaticCache


def unsupported_reason(model) -> str | None:
    """Why `model` (a transformers model, PEFT-wrapped or not) cannot decode here, or None."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no additive mask"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window layers"
    return None


def prefill(lm, config, ids_NL, mask_NL, pos_NL, max_new_tokens: int, dtype: torch.dtype, graphs: bool):
    """Run the prompts into a StaticCache; returns (the last prompt position's logits_NV, step) where
    `step(tok_N, i)` feeds the token sampled at decode step i and returns the next logits_NV (`decode_loop`'s step)."""
    N, L = ids_NL.shape
    S = L + max_new_tokens
    dev = ids_NL.device
    neg = torch.finfo(dtype).min
    cache = StaticCache(config=config, max_cache_len=S)
    keys_NS = torch.zeros(N, S, dtype=torch.bool, device=dev)
    keys_NS[:, :L] = mask_NL.bool()
    q_L1, k_1S = torch.arange(L, device=dev)[:, None], torch.arange(S, device=dev)[None, :]
    # A pad position attends to itself: a fully masked row's softmax can be NaN (in float16 the additive minimum
    # plus a score overflows to -inf), and NaN keys or values at pad positions reach real rows (NaN plus a mask is NaN).
    allowed_N1LS = (((k_1S <= q_L1)[None] & keys_NS[:, None, :]) | (k_1S == q_L1)[None])[:, None]
    mask_N1LS = torch.zeros(allowed_N1LS.shape, dtype=dtype, device=dev).masked_fill_(~allowed_N1LS, neg)
    out = lm(input_ids=ids_NL, attention_mask=mask_N1LS, position_ids=pos_NL, past_key_values=cache,
             use_cache=True, logits_to_keep=1)
    del mask_N1LS, allowed_N1LS

    tok_N1 = torch.zeros(N, 1, dtype=torch.long, device=dev)
    pos_N1 = pos_NL[:, -1:].clone()
    mask_N11S = torch.zeros(N, 1, 1, S, dtype=dtype, device=dev).masked_fill_(~keys_NS[:, None, None, :], neg)

    def forward():
        return lm(input_ids=tok_N1, attention_mask=mask_N11S, position_ids=pos_N1, past_key_values=cache,
                  use_cache=True).logits[:, -1]

    replay = None

    def step(tok_N, i):
        nonlocal replay
        tok_N1.copy_(tok_N[:, None])
        pos_N1.add_(1)
        mask_N11S[..., L + i] = 0
        if replay is None:
            replay = forward
            if graphs and dev.type == "cuda":
                try:
                    replay = capture(forward, cache)
                except RuntimeError as e:  # something in the forward cannot be captured: decode eagerly
                    warnings.warn(f"decode: CUDA graph capture failed, decoding without graphs ({e})", stacklevel=2)
        return replay()

    return out.logits[:, -1], step


def capture(forward, cache):
    """`forward` recorded as a CUDA graph; returns a function that replays it and returns its (static) output."""
    counters = [layer.cumulative_length.clone() for layer in cache.layers]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    for layer, count in zip(cache.layers, counters):
        layer.cumulative_length.copy_(count)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()

    def replay():
        graph.replay()
        return out
    return replay
