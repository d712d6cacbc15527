"""A lean decode step for Llama-layout models (Llama, SmolLM2, Qwen2, Mistral without sliding window).

Why: decoding a batch of 8 through the Hugging Face modules plus PEFT's LoRA wrappers costs ~200 ms per token for
SmolLM2-135M on 2 CPU cores: F.linear runs the skinny (8 x hidden) matmuls at about a third of the memory
bandwidth, and each layer is ~100 small ops. Here a layer is four matmuls (q/k/v and gate/up fused) on weights
packed for the batch size by oneDNN (default) or MKL with the LoRA update merged in, and the KV cache is
preallocated. Which packing wins depends on the CPU: on an AMD EPYC, 2 threads,
all of SmolLM2's weights at batch 8 took 35 ms with oneDNN, 77 ms MKL-packed, 70 ms F.linear; an earlier
machine gave MKL-packed ~1.8x F.linear. `OPCT_DECODE_MATMUL=onednn|mkl|dense` picks one.

A decoder merges and packs the weights when it is built (~0.35 s for SmolLM2 with LoRA) and the packed copy is freed with it at the
end of the rollout: keeping it across steps would save that time but double the weights' memory through the
backward pass, where a training step peaks (for a 1.7B model, 7 GB more). Building one per rollout also means it
always decodes with the current weights, base and LoRA alike. The Hugging Face model stays the reference for every
log-prob that enters a loss, and tests pin this path's logits against it.

Anything outside the supported layout (other attention variants, q/k norms, sliding windows, adapted embeddings,
DoRA and other LoRA variants) makes `LeanDecoder.build` return None, and the caller falls back to the Hugging Face
forward.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SUPPORTED = {"llama", "qwen2", "mistral"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _base(mod) -> torch.nn.Linear:
    return getattr(mod, "base_layer", mod)


def _is_linear(mod) -> bool:
    return type(_base(mod)) is torch.nn.Linear


def _lora_factors(mod) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """[(A_rI, B_Or, scale)] of the enabled, active, unmerged LoRA adapters of a PEFT layer ([] otherwise)."""
    if not hasattr(mod, "lora_A") or getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False):
        return []
    return [(mod.lora_A[n].weight.detach(), mod.lora_B[n].weight.detach(), float(mod.scaling[n]))
            for n in mod.active_adapters if n in mod.lora_A]


def _plain_lora(mod) -> bool:
    """False for LoRA variants this decoder does not reproduce (DoRA, fan_in_fan_out, ...)."""
    if not hasattr(mod, "lora_A"):
        return True
    dora = getattr(mod, "use_dora", {})
    return not any(dora.get(n, False) for n in mod.lora_A) and not getattr(mod, "fan_in_fan_out", False)


def _inner(model):
    """The transformer body (embeddings, layers, norm, rotary) and the LM head of a (PEFT-wrapped) causal LM."""
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    return m.model, m.lm_head, m.config


def unsupported_reason(model) -> str | None:
    try:
        body, head, cfg = _inner(model)
    except AttributeError:
        return "not a *ForCausalLM with .model and .lm_head"
    if cfg.model_type not in SUPPORTED:
        return f"model_type {cfg.model_type!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if type(body.embed_tokens) is not torch.nn.Embedding or not _is_linear(head) or not _plain_lora(head):
        return "adapted or non-standard embeddings / lm_head"
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if {n for n, _ in attn.named_children()} != _ATTN_CHILDREN or \
                {n for n, _ in mlp.named_children()} - _MLP_CHILDREN != set():
            return "non-standard attention or MLP modules"
        mods = [getattr(attn, n) for n in _ATTN_CHILDREN] + [getattr(mlp, n) for n in ("gate_proj", "up_proj",
                                                                                        "down_proj")]
        if not all(_is_linear(m) and _plain_lora(m) for m in mods):
            return "non-linear projections or a LoRA variant"
        if not type(layer.input_layernorm).__name__.endswith("RMSNorm"):
            return "non-RMSNorm layer norm"
    return None


def packing(w: torch.Tensor) -> str:
    """How decode packs this weight: "onednn", "mkl" or "dense" (plain F.linear). Fixed per machine and setting,
    never timed at run time, so a resumed run samples with the same kernels as the original."""
    want = os.environ.get("OPCT_DECODE_MATMUL", "onednn")
    if want not in ("onednn", "mkl", "dense"):
        raise ValueError(f"OPCT_DECODE_MATMUL={want!r}: expected onednn, mkl or dense")
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return "dense"
    if want == "onednn" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "onednn"
    if want in ("onednn", "mkl") and torch.backends.mkl.is_available() and hasattr(
            torch.ops.mkl, "_mkl_reorder_linear_weight"):
        return "mkl"
    return "dense"


class _Linear:
    """y = x [W_1; W_2; ...]^T + b + LoRA updates, for a group of linears that read the same input; `scales`
    optionally multiplies each member's output (folded into its rows of the packed weight)."""

    def __init__(self, mods: list[torch.nn.Module], batch: int, scales: list[float] | None = None):
        bases = [_base(m) for m in mods]
        self.kind, self.batch = packing(bases[0].weight), batch
        with torch.no_grad():
            w = torch.cat([b.weight.detach() for b in bases]) if len(bases) > 1 else bases[0].weight.detach()
            self.b = None if all(b.bias is None for b in bases) else torch.cat(
                [b.bias.detach() if b.bias is not None else w.new_zeros(b.out_features) for b in bases])
            # LoRA merged into the copy that gets packed: W_i + s_i B_i A_i for each module of the group. It costs
            # ~0.1 s per SmolLM2 rollout, where adding x A^T B^T at every token cost ~13 ms a token (240 small
            # matmuls), so it pays from ~8 tokens on.
            factors = [(i, f) for i, m in enumerate(mods) for f in _lora_factors(m)]
            if factors:
                w = w.clone() if len(bases) == 1 else w  # never write into the model's own weight
                offsets = [0]
                for b in bases:
                    offsets.append(offsets[-1] + b.out_features)
                for i, (A, Bm, scale) in factors:
                    w[offsets[i]:offsets[i + 1]].addmm_(Bm, A, alpha=scale)
            if scales is not None and any(sc != 1.0 for sc in scales):
                w = w.clone() if len(bases) == 1 and not factors else w
                start = 0
                for b, sc in zip(bases, scales):
                    w[start:start + b.out_features] *= sc
                    if self.b is not None:
                        self.b[start:start + b.out_features] *= sc
                    start += b.out_features
            if self.kind == "onednn":
                self.packed, self.w = torch.ops.mkldnn._reorder_linear_weight(w, batch), None
            elif self.kind == "mkl":
                # Only the packed copy is kept. MKL reads the second weight argument only when the batch size
                # differs from the packed one, which __call__ rules out; a zero-stride view stands in for it.
                self.packed, self.w = torch.ops.mkl._mkl_reorder_linear_weight(w, batch), w.new_zeros(()).expand(
                    w.shape)
            else:
                self.packed, self.w = None, w

    def __call__(self, x_BI: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            y_BO = torch.ops.mkldnn._linear_pointwise(x_BI, self.packed, self.b, "none", [], "")
        elif self.packed is None:
            y_BO = F.linear(x_BI, self.w, self.b)
        else:
            assert x_BI.shape[0] == self.batch, (x_BI.shape, self.batch)
            y_BO = torch.ops.mkl._mkl_linear(x_BI, self.packed, self.w, self.b, self.batch)
        return y_BO


class LeanDecoder:
    """Decode steps for one model's current weights and a fixed batch size, over a preallocated KV cache.
    Build one per rollout: it packs the weights as they are when built and does not follow later updates."""

    def __init__(self, model, batch: int):
        body, head, cfg = _inner(model)
        self.body, self.batch = body, batch
        a0 = body.layers[0].self_attn
        self.head_dim, self.scaling = a0.head_dim, a0.scaling
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.layers = []
        with torch.no_grad():
            for layer in body.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append({
                    "ln1": layer.input_layernorm, "ln2": layer.post_attention_layernorm,
                    "qkv": _Linear([a.q_proj, a.k_proj, a.v_proj], batch, [self.scaling, 1.0, 1.0]), "o": _Linear([a.o_proj], batch),
                    "gate_up": _Linear([m.gate_proj, m.up_proj], batch), "down": _Linear([m.down_proj], batch)})
            self.head = _Linear([head], batch)
        self.norm = body.norm
        self.embed = body.embed_tokens.weight.detach()

    @classmethod
    def build(cls, model, batch: int) -> LeanDecoder | None:
        """A decoder for the model's current weights, or None when its layout is not supported."""
        return None if unsupported_reason(model) is not None else cls(model, batch)

    def new_cache(self, B: int, L: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        z = lambda: torch.zeros(B, self.n_kv, L, self.head_dim)  # noqa: E731
        return [(z(), z()) for _ in self.layers]

    @staticmethod
    def _rms(ln, x):
        return F.rms_norm(x, ln.weight.shape, ln.weight, ln.variance_epsilon)

    @torch.no_grad()
    def step(self, tok_B: torch.Tensor, pos_B: torch.Tensor, cache, t: int, mask_B11L: torch.Tensor) -> torch.Tensor:
        """One token per row, written at cache column t (columns < t hold the prompt and earlier tokens;
        mask_B11L marks which of columns 0..t are attended). Returns logits_BV."""
        B, H, Hk, D = tok_B.shape[0], self.n_heads, self.n_kv, self.head_dim
        G = H // Hk  # query heads per KV head (head h reads KV head h // G, as in HF's repeat_kv)
        L = t + 1
        # The mask as an additive bias, built once per step for all layers; the 1/sqrt(D) scaling is already in q.
        bias_X1L = torch.zeros(B, Hk, 1, L).masked_fill_(~mask_B11L, float("-inf")).view(B * Hk, 1, L)
        x_BC = self.embed[tok_B]
        cos_B1D, sin_B1D = self.body.rotary_emb(x_BC[:, None], pos_B[:, None])  # broadcast over heads
        half = D // 2
        for d, (k_cache, v_cache) in zip(self.layers, cache):
            qkv_BX = d["qkv"](self._rms(d["ln1"], x_BC))
            qk_BhD = qkv_BX[:, :(H + Hk) * D].view(B, H + Hk, D)  # q and k heads get the same rotation
            x1, x2 = qk_BhD[..., :half], qk_BhD[..., half:]
            qk_BhD = qk_BhD * cos_B1D + torch.cat((-x2, x1), dim=-1) * sin_B1D
            k_cache[:, :, t] = qk_BhD[:, H:]
            v_cache[:, :, t] = qkv_BX[:, (H + Hk) * D:].view(B, Hk, D)
            # Attention of one query per head over columns 0..t: plain matmuls beat SDPA at this size.
            q_XGD = qk_BhD[:, :H].reshape(B * Hk, G, D)
            k_XLD, v_XLD = k_cache[:, :, :L].reshape(B * Hk, L, D), v_cache[:, :, :L].reshape(B * Hk, L, D)
            p_XGL = torch.baddbmm(bias_X1L, q_XGD, k_XLD.transpose(-1, -2)).softmax(-1)
            att_BX = torch.bmm(p_XGL, v_XLD).reshape(B, H * D)
            x_BC = x_BC + d["o"](att_BX)
            g_BI, u_BI = d["gate_up"](self._rms(d["ln2"], x_BC)).chunk(2, dim=-1)
            x_BC = x_BC + d["down"](F.silu(g_BI) * u_BI)
        return self.head(self._rms(self.norm, x_BC))
