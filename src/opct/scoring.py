"""Score given response tokens under a prompt, in one prefill.

Layout: prompts are left-padded so they all end at the same column, responses are right-padded after them.
Then the hidden states that predict response token t sit at the same column for every row. The transformer body
runs without its output layer; only those T columns go through the LM head (no B x L x V logits over prompt
positions), and for log-probs of given tokens not even that: `response_logprobs` never materialises the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opct import losses
from opct.rollout import Prefill, head_logits, left_pad, lm_parts


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


def response_hidden(model, batch: Batch) -> torch.Tensor:
    """Final hidden states predicting each response token: hidden_BTH (position t predicts response_BT[:, t])."""
    T = batch.response_BT.shape[1]
    body, _ = lm_parts(model)
    out = body(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
               position_ids=batch.position_ids_BL, use_cache=False)
    return out.last_hidden_state[:, -T - 1:-1]


def response_hidden_after_prefill(model, pre: Prefill, responses: list[list[int]], pad_id: int) -> torch.Tensor:
    """The same hidden_BTH as `response_hidden(model, build_batch(prompts, responses))`, computed by running only
    the response tokens on top of a prefill's KV cache. When the prefill ran under grad, gradients flow back
    through the cached keys/values into the prompt positions, exactly as in one full forward."""
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


def response_logits(model, batch: Batch) -> torch.Tensor:
    """Logits predicting each response token: logits_BTV (position t predicts response_BT[:, t])."""
    return head_logits(model, response_hidden(model, batch)).float()


def response_logits_after_prefill(model, pre: Prefill, responses: list[list[int]], pad_id: int) -> torch.Tensor:
    """`response_logits` on top of a prefill's KV cache (see `response_hidden_after_prefill`)."""
    return head_logits(model, response_hidden_after_prefill(model, pre, responses, pad_id)).float()


def response_logprobs(model, hidden_BTH: torch.Tensor, response_BT: torch.Tensor) -> torch.Tensor:
    """log p(response_BT[:, t] | ...) from the hidden states that predict them: logp_BT. For a plain bias-free LM
    head (most chat models) this never builds the B x T x V logits (`losses.hidden_token_logprobs`)."""
    _, head = lm_parts(model)
    w_VH = plain_head_weight(model)
    if w_VH is None:
        return losses.token_logprobs(head_logits(model, hidden_BTH).float(), response_BT)
    B, T, H = hidden_BTH.shape
    return losses.hidden_token_logprobs(hidden_BTH.reshape(B * T, H), w_VH, response_BT.reshape(B * T)).view(B, T)


def plain_head_weight(model) -> torch.Tensor | None:
    """The LM head's weight when logits are exactly hidden @ weight.T in float32 (no bias, no soft-capping or
    scaling, not adapted): what `losses.hidden_token_logprobs` needs. None otherwise."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    _, head = lm_parts(model)
    cfg = m.config
    if (type(head) is not torch.nn.Linear or head.bias is not None or head.weight.dtype != torch.float32
            or getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1.0)
            or getattr(cfg, "logits_scaling", None) not in (None, 1.0)):
        return None
    return head.weight
