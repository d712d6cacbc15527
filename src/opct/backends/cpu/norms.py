"""RMSNorm and the SwiGLU product with hand-written backward passes that keep fewer activations.

Why: a training step's peak memory is the activations autograd keeps for the backward pass. For
`w * (x * rsqrt(mean(x^2) + eps))` (Hugging Face's Llama RMSNorm) autograd keeps x, the rsqrt and the normalised
x; for `silu(g) * u` it keeps g, silu(g) and u. Both backward passes can be computed from less: x and the rsqrt
(one float a row) for the norm, g and u for the product (silu(g) is recomputed).

The forward passes run the same operations in the same order as the modules they replace, so outputs are bit for
bit unchanged (tests pin this), and the gradients agree to rounding. Without autograd (the teacher, sampling) the
modules' own forward runs. `use(model)` patches the modules whose code is known to compute exactly this: the
RMSNorm and MLP classes of Llama, Qwen2 and Mistral with the SiLU activation.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
MLPS = {"LlamaMLP", "Qwen2MLP", "MistralMLP"}


class RMSNormFn(torch.autograd.Function):
    """y = w * (x * r), r = rsqrt(mean(x^2) + eps) over the last dimension, for fp32 x_NC and w_C."""

    @staticmethod
    def forward(ctx, x_NC, w_C, eps):
        r_N1 = torch.rsqrt(x_NC.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x_NC, w_C, r_N1)
        return (x_NC * r_N1).mul_(w_C)  # = w * (x r) bit for bit (products commute), in one buffer

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_NC):
        x_NC, w_C, r_N1 = ctx.saved_tensors
        h_NC = x_NC * r_N1  # recomputed: the normalised x is not kept
        dh_NC = dy_NC * w_C
        # d/dx of h = x r: r (dh - h mean(dh * h)), r's own dependence on x giving the second term.
        dx_NC = (dh_NC - h_NC * (dh_NC * h_NC).mean(-1, keepdim=True)).mul_(r_N1) if ctx.needs_input_grad[0] else None
        dw_C = (dy_NC * h_NC).reshape(-1, h_NC.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx_NC, dw_C, None


class SiLUMulFn(torch.autograd.Function):
    """p = silu(g) * u."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        # In place on silu(g): one activation-sized buffer instead of two (g and u stay kept for the backward).
        return F.silu(g).mul_(u)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dp):
        g, u = ctx.saved_tensors
        dg = torch.ops.aten.silu_backward(dp * u, g) if ctx.needs_input_grad[0] else None
        du = dp * F.silu(g) if ctx.needs_input_grad[1] else None
        return dg, du


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rms_forward(self, hidden_states):
    w = self.weight
    if hidden_states.dtype != torch.float32 or w.dtype != torch.float32 or not _wants_grad(hidden_states, w):
        return type(self).forward(self, hidden_states)
    return RMSNormFn.apply(hidden_states, w, self.variance_epsilon)


def _mlp_forward(self, x):
    g = self.gate_proj(x)
    u = self.up_proj(x)
    p = SiLUMulFn.apply(g, u) if _wants_grad(g, u) else self.act_fn(g) * u
    return self.down_proj(p)


def use(model) -> int:
    """Give the known RMSNorm and SiLU MLP modules of `model` these backward passes. Returns how many."""
    count = 0
    for mod in model.modules():
        name = type(mod).__name__
        if name in RMS_NORMS and isinstance(getattr(mod, "weight", None), torch.Tensor):
            mod.forward = types.MethodType(_rms_forward, mod)
            count += 1
        elif (name in MLPS and getattr(getattr(mod, "config", None), "hidden_act", None) == "silu"
              and all(hasattr(mod, n) for n in ("gate_proj", "up_proj", "down_proj"))):
            mod.forward = types.MethodType(_mlp_forward, mod)
            count += 1
    return count
