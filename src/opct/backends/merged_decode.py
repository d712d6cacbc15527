"""A LoRA model's decoding copy: the base model with the adapters merged into its weights, refreshed in place.

PEFT computes each adapted linear as base(x) + lora_B(lora_A(x)) * scaling, four more kernels a linear in every
decode step (about 670 a token for a 24-layer model with all seven linears adapted). On a GPU, where a decode step's
small kernels, launched or replayed one by one, set the pace, decoding from W + scaling * B A removes them. The copy
shares every parameter the adapters do not touch (embeddings, norms, an untied head) with the PEFT model and holds
its own tensor for each adapted linear's weight: one more copy of those weights in memory. `refresh` writes
W + delta into those tensors in place (the same storage each time), called before each sampling so that the copy
follows every optimizer step.

Only sampling reads the copy: the scores and the frozen teacher (the adapters switched off) use the PEFT model.
Merged and unmerged products round differently, so the sampled tokens can differ from the unmerged model's by float
rounding, as with the CPU backend's merged decoder; the log-probs the loss uses come from the PEFT model either way.

With a `dtype` other than the model's (`decode_dtype: bfloat16` for a float32 run, as TRL's colocated vLLM samples
by default), the copy holds every parameter in that dtype (buffers, such as rotary frequencies, as they are), none
shared (a copy of the whole model in that dtype), and `refresh` rounds W + delta (summed in float32) to it: the
student samples from a rounded copy of itself, as with the CPU backend's bfloat16 decoder (docs/design.md), and the
loss's log-probs stay the float32 model's. The frozen teacher never samples from the copy.
"""

from __future__ import annotations

import copy

import torch


def unsupported_reason(model, dtype: torch.dtype | None = None) -> str | None:
    """Why `model` cannot decode from a merged copy (in `dtype`, default its own) here, or None: it must be a PEFT LoRA
    model whose adapted layers PEFT can express as one weight delta (no DoRA); a copy in another dtype shares no
    tensor, so nothing but the LoRA weights may be trained (refresh copies only those)."""
    if not hasattr(model, "peft_config"):
        return "not a PEFT model"
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    if not layers:
        return "no LoRA layers"
    if any(any(getattr(m, "use_dora", {}).get(n, False) for n in m.lora_A) for m in layers):
        return "DoRA adapters"
    if dtype not in (None, next(model.parameters()).dtype):
        trained = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
        if trained:
            return f"parameters other than LoRA's are trained ({trained[0]}, ...)"
    return None


class MergedCopy:
    """`model` (a PEFT LoRA model) as a plain transformers model with its active adapters merged in, in `dtype`
    (default: the model's); `.model` is the copy, to be refreshed before use after any change to the adapter
    weights."""

    def __init__(self, model, dtype: torch.dtype | None = None):
        base = model.get_base_model()
        lora = {name: m for name, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
        model_dtype = next(base.parameters()).dtype
        self.dtype = model_dtype if dtype is None else dtype
        if self.dtype == model_dtype:
            # Shared, not copied: every tensor except the adapted linears' weights (those the copy merges into).
            own = {id(m.base_layer.weight) for m in lora.values()}
            memo = {id(t): t for t in [*base.parameters(), *base.buffers()] if id(t) not in own}
        else:
            # Every parameter as a new one in `dtype`, made tensor by tensor (no float32 copy of the whole model on
            # the way; tied weights stay tied: one entry a tensor); the LoRA weights, dropped below, are not
            # copied. Buffers, such as rotary inverse frequencies, are copied as they are.
            memo = {id(p): (p if "lora_" in n else torch.nn.Parameter(p.detach().to(self.dtype), requires_grad=False))
                    for n, p in base.named_parameters()}
        self.model = copy.deepcopy(base, memo)
        self.pairs = []  # (the PEFT LoRA layer, the copy's plain linear in its place)
        for name, mod in lora.items():
            parent_name, _, attr = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            plain = getattr(parent, attr).base_layer
            plain.weight.requires_grad_(False)
            setattr(parent, attr, plain)
            self.pairs.append((mod, plain))
        self.model.eval()

    @torch.no_grad()
    def refresh(self) -> "MergedCopy":
        """Write each adapted weight + the active adapters' deltas into the copy, in place."""
        for mod, plain in self.pairs:
            merged = mod.base_layer.weight.detach().float()  # summed in float32, rounded once to the weight's dtype
            for n in mod.active_adapters:
                if n in mod.lora_A:
                    merged = merged + mod.get_delta_weight(n).float()
            plain.weight.copy_(merged)
        return self
