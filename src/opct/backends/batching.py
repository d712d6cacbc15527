"""Token-id lists -> padded tensors, in the one layout every backend scores with.

Prompts are left-padded so they all end at the same column and responses are right-padded after them; the
hidden state that predicts response token t then sits at the same column in every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opct import threads


def left_pad(seqs: list[list[int]], pad_id: int, device=None):
    """Stack variable-length rows right-aligned: returns ids_BL, attention_mask_BL, position_ids_BL."""
    L = max(len(s) for s in seqs)
    ids_BL = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask_BL = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BL[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask_BL[i, L - len(s):] = 1
    pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
    return ids_BL.to(device), mask_BL.to(device), pos_BL.to(device)


def right_pad(rows: list[list[int]], pad_id: int, device=None):
    """Stack rows left-aligned: returns ids_BT, mask_BT (T >= 1)."""
    T = max(1, max(len(r) for r in rows))
    ids_BT = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids_BT[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask_BT[i, :len(r)] = 1
    return ids_BT.to(device), mask_BT.to(device)


def common_prefix(rows: list[list[int]]) -> int:
    """Length of the longest prefix every row shares."""
    n = min(map(len, rows))
    for j in range(n):
        if any(r[j] != rows[0][j] for r in rows[1:]):
            return j
    return n


@dataclass
class Batch:
    input_ids_BL: torch.Tensor  # [left-padded prompt | right-padded response]
    attention_mask_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    response_BT: torch.Tensor  # response token ids, right-padded
    mask_BT: torch.Tensor  # 1 on real response tokens


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None) -> Batch:
    p_ids_BP, p_mask_BP, _ = left_pad(prompts, pad_id, device)
    resp_BT, rmask_BT = right_pad(responses, pad_id, device)
    ids_BL = torch.cat([p_ids_BP, resp_BT], dim=1)
    mask_BL = torch.cat([p_mask_BP, rmask_BT], dim=1)
    pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
    return Batch(ids_BL, mask_BL, pos_BL, resp_BT, rmask_BT)


def by_length(prompts_N: list[list[int]], batch_size: int, run) -> list:
    """`run(prompts_B)` -> one result per prompt, over batches of at most `batch_size` prompts of similar length
    (shortest first: less padding); the results come back in input order. Before each batch the CPU thread count
    is adjusted to what other processes leave free (opct/threads.py)."""
    order = sorted(range(len(prompts_N)), key=lambda i: len(prompts_N[i]))
    out: list = [None] * len(prompts_N)
    for start in range(0, len(order), batch_size):
        threads.adjust()
        rows = order[start:start + batch_size]
        for i, r in zip(rows, run([prompts_N[i] for i in rows])):
            out[i] = r
    return out
