"""Score given response tokens under a prompt, in one prefill.

Layout: prompts are left-padded so they all end at the same column, responses are right-padded after them.
Then the logits that predict response token t sit at the same column for every row, and `logits_to_keep`
asks the model for only those T+1 columns: no lm_head (B x L x V) over prompt positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opct.rollout import Prefill, left_pad


@dataclass
class Batch:
    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    response_BT: torch.Tensor  # response token ids, right-padded
    mask_BT: torch.Tensor  # 1 on real response tokens


def right_pad(responses: list[list[int]], pad_id: int):
    """Stack responses left-aligned: returns response_BT, mask_BT (T >= 1)."""
    T = max(1, max(len(r) for r in responses))
    resp_BT = torch.full((len(responses), T), pad_id, dtype=torch.long)
    rmask_BT = torch.zeros((len(responses), T), dtype=torch.long)
    for i, r in enumerate(responses):
        resp_BT[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        rmask_BT[i, :len(r)] = 1
    return resp_BT, rmask_BT


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    p_ids_BP, p_mask_BP, _ = left_pad(prompts, pad_id)
    resp_BT, rmask_BT = right_pad(responses, pad_id)
    ids_BL = torch.cat([p_ids_BP, resp_BT], dim=1)
    mask_BL = torch.cat([p_mask_BP, rmask_BT], dim=1)
    pos_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
    return Batch(ids_BL, mask_BL, pos_BL, resp_BT, rmask_BT)


def response_logits(model, batch: Batch) -> torch.Tensor:
    """Logits predicting each response token: logits_BTV (position t predicts response_BT[:, t])."""
    T = batch.response_BT.shape[1]
    out = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                position_ids=batch.position_ids_BL, logits_to_keep=T + 1, use_cache=False)
    return out.logits[:, :-1].float()


def response_logits_after_prefill(model, pre: Prefill, responses: list[list[int]], pad_id: int) -> torch.Tensor:
    """The same logits_BTV as `response_logits(model, build_batch(prompts, responses))`, computed by running only
    the response tokens on top of a prefill's KV cache. When the prefill ran under grad, gradients flow back
    through the cached keys/values into the prompt positions, exactly as in one full forward."""
    resp_BT, rmask_BT = right_pad(responses, pad_id)
    T = resp_BT.shape[1]
    first_B1V = pre.last_logits_BV[:, None].float()
    if T == 1:
        return first_B1V
    # Token t (t < T-1) predicts token t+1; its position continues each row's prompt positions.
    pos_BT = pre.last_pos_B[:, None] + 1 + torch.arange(T - 1)[None]
    mask_BL = torch.cat([pre.mask_BL, rmask_BT[:, :T - 1]], dim=1)
    out = model(input_ids=resp_BT[:, :T - 1], attention_mask=mask_BL, position_ids=pos_BT,
                past_key_values=pre.cache, use_cache=True)
    return torch.cat([first_B1V, out.logits.float()], dim=1)
