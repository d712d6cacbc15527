"""Sampling tokens under explicit settings, shared by every in-process backend.

Every setting is explicit (nothing is inherited from the model's generation_config, TRL #6337), token ids are
kept as sampled (never re-tokenised), and rows that hit EOS stop contributing. A backend supplies the logits:
`decode_loop` asks it for the next logits after each sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class SamplingSettings:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off


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
    # a vocabulary-long sum stays far below any token's mass). torch.multinomial draws an exponential variate per
    # vocabulary entry instead, a far larger cost per step on a CPU. The uniforms come from the (CPU) generator
    # whatever the logits' device, so a seed gives the same draws everywhere.
    cdf_BV = logits_BV.softmax(-1).double().cumsum(-1)
    u_B1 = uniforms(generator, cdf_BV.shape[0]).to(cdf_BV.device)
    u_B1 = u_B1 * cdf_BV[:, -1:]
    # right=True: the first entry whose cdf exceeds u, so zero-probability tokens (flat cdf) are never picked.
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(-1).clamp_(max=cdf_BV.shape[-1] - 1)


def uniforms(generator, B: int) -> torch.Tensor:
    """B uniforms in float64, shape (B, 1): from a torch.Generator, or from a rank's share of a distributed batch's
    draws (train/distributed.py ShardDraws)."""
    if hasattr(generator, "uniforms"):
        return generator.uniforms(B)
    return torch.rand(B, 1, dtype=torch.float64, generator=generator)


def all_done(generator, done: bool) -> bool:
    """Whether decoding may stop: this batch is done and, in a distributed step, so is every other rank's."""
    return generator.all_done(done) if hasattr(generator, "all_done") else done


def decode_loop(first_logits_BV: torch.Tensor, step: Callable[[torch.Tensor, int], torch.Tensor],
                settings: SamplingSettings, eos_ids: set[int], pad_id: int,
                generator: torch.Generator | None) -> list[list[int]]:
    """Sample up to max_new_tokens per row. `step(tok_B, i)` feeds the tokens sampled at step i (pad for finished
    rows, whose outputs are discarded, which keeps the batch rectangular) and returns the next logits_BV. Each
    response ends with its EOS token when one was produced (the EOS is part of the response and of the loss)."""
    logits_BV = first_logits_BV
    B = logits_BV.shape[0]
    eos_V = torch.tensor(sorted(eos_ids), dtype=torch.long, device=logits_BV.device)
    done_B = torch.zeros(B, dtype=torch.bool, device=logits_BV.device)
    responses: list[list[int]] = [[] for _ in range(B)]
    for i in range(settings.max_new_tokens):
        tok_B = next_token(logits_BV.float(), settings, generator)
        tok_B = torch.where(done_B, torch.full_like(tok_B, pad_id), tok_B)
        toks = tok_B.tolist()
        for r in (~done_B).nonzero().flatten().tolist():
            responses[r].append(toks[r])
        done_B |= torch.isin(tok_B, eos_V)
        if i + 1 == settings.max_new_tokens or all_done(generator, bool(done_B.all())):
            break  # the last token needs no forward pass: its logits would never be sampled from
        logits_BV = step(tok_B, i)
    return responses
