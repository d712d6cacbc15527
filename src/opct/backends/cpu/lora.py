"""One autograd node per LoRA linear instead of PEFT's five.

PEFT computes a LoRA linear as base(x) + lora_B(lora_A(dropout(x))) * scaling: five autograd nodes forward and as
many backward, each a separate pass over an activation-sized tensor. `LoRALinearFn` does the same arithmetic as
three matmuls forward (x W^T, x A^T, then y += s (x A^T) B^T in place) and five backward (dy B, dx = dy W + s (dy B) A,
dA, dB), with no elementwise passes. The big products go through `gemm` (oneDNN on the CPU).

`speed_up(model)` swaps the forward of every plain PEFT `lora.Linear` (one active adapter, no dropout, no DoRA, frozen
base weight); each call still checks those conditions and falls back to PEFT's own forward otherwise, so merged weights
and anything unusual keep PEFT's behaviour. With the adapters disabled and no gradient wanted (the teacher) it runs
the base linear through the same `gemm` product as the student's, so a fresh adapter's student and its teacher
agree bit for bit. The saved adapter is unchanged.
"""

from __future__ import annotations

import types

import torch
from peft.tuners.lora.layer import Linear

from opct.backends.cpu import gemm


class LoRALinearFn(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T for x_NI, W_OI (frozen), b_O (frozen or None), A_rI, B_Or.

    The products with W (x W^T, dy W) and dy B go through `gemm` (oneDNN on fp32 CPU tensors); the rank-r rest
    stays on torch's matmul, which measured as fast or faster for those shapes."""

    @staticmethod
    def forward(ctx, x_NI, w_OI, b_O, a_rI, b_Or, scale, w_packed=None):
        xa_Nr = x_NI @ a_rI.T
        # With B = 0 (a fresh adapter) the LoRA term adds exact zeros, so y is bit for bit the frozen base
        # linear's `gemm.linear(x, W, b)`: the teacher's value.
        y_NO = gemm.linear(x_NI, w_OI, b_O, w_packed).addmm_(xa_Nr, b_Or.T, alpha=scale)
        ctx.save_for_backward(x_NI, w_OI, a_rI, b_Or, xa_Nr)
        ctx.scale = scale
        return y_NO

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_NO):
        x_NI, w_OI, a_rI, b_Or, xa_Nr = ctx.saved_tensors
        s = ctx.scale
        dyb_Nr = gemm.mm(dy_NO, b_Or)
        dx_NI = gemm.mm(dy_NO, w_OI).addmm_(dyb_Nr, a_rI, alpha=s) if ctx.needs_input_grad[0] else None
        # dA as (x^T dyB)^T rather than dyB^T x: torch's matmul is slow with a transposed left operand and long N
        # (dev/LOG.md, 2026-11-26 (later)); the two gave bit-identical results wherever compared
        da_rI = (x_NI.T @ dyb_Nr).T.mul_(s) if ctx.needs_input_grad[3] else None
        db_Or = (dy_NO.T @ xa_Nr).mul_(s) if ctx.needs_input_grad[4] else None
        return dx_NI, None, None, da_rI, db_Or, None, None


def _fast_forward(self, x, *args, **kwargs):
    """Replaces a PEFT lora.Linear's forward; PEFT's own forward whenever this layer is not in the plain state."""
    names = self.active_adapters
    base = self.base_layer
    if (self.disable_adapters and not self.merged and not args and not kwargs and x.dtype == base.weight.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or base.weight.requires_grad))):
        # The frozen teacher (adapters disabled, no grad): the base linear through the same product as the student.
        y_NO = gemm.linear(x.reshape(-1, x.shape[-1]), base.weight, base.bias, gemm.packed_weight(base))
        return y_NO.view(*x.shape[:-1], y_NO.shape[-1])
    if (args or kwargs or self.disable_adapters or self.merged or len(names) != 1 or names[0] not in self.lora_A
            or not isinstance(self.lora_dropout[names[0]], torch.nn.Identity) or names[0] in self.lora_variant
            or base.weight.requires_grad or x.dtype != base.weight.dtype
            or x.dtype != self.lora_A[names[0]].weight.dtype):
        return type(self).forward(self, x, *args, **kwargs)
    n = names[0]
    x_NI = x.reshape(-1, x.shape[-1])
    y_NO = LoRALinearFn.apply(x_NI, base.weight, base.bias, self.lora_A[n].weight, self.lora_B[n].weight,
                              float(self.scaling[n]), gemm.packed_weight(base))
    return y_NO.view(*x.shape[:-1], y_NO.shape[-1])


def speed_up(model) -> int:
    """Give every plain PEFT LoRA linear of `model` the fused forward. Returns how many layers got it."""
    count = 0
    for mod in model.modules():
        if type(mod) is Linear and type(mod.base_layer) is torch.nn.Linear and not mod.fan_in_fan_out:
            mod.forward = types.MethodType(_fast_forward, mod)
            count += 1
    return count
