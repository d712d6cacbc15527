"""A lean decode step for Llama-layout models (Llama, SmolLM2, Qwen2, Mistral without sliding window).

Why: decoding a small batch through the Hugging Face modules plus PEFT's LoRA wrappers is dominated by skinny
(rows x hidden) matmuls that F.linear runs far below the memory bandwidth, and by ~100 small ops a layer. Here a
layer is four matmuls (q/k/v and gate/up stacked) on weights packed for the batch size by oneDNN (default) or MKL
with the LoRA update merged in, and the KV cache is preallocated. Which packing wins depends on the CPU; the
`decode_matmul` setting picks one (figures: dev/LOG.md, 2026-11-25 (evening)).

With LoRA, a decoder merges the adapters into the body's weights when it is built, so it always decodes with the
current weights. Where oneDNN's packed layout is blocks of whole rows (`gemm.block_rows`), it writes W + s B A
block by block straight into packed buffers kept across rollouts (`_merge_packed`, from the packed base copy the
training forward keeps); elsewhere it merges densely and packs afresh (freed after the rollout). The kept buffers
cost their size for the whole run and are held only within `gemm.kept`'s memory budget, so a large model does not
carry them through the backward pass; applying the adapters unmerged on the base weights measured slower. Weights
that cannot change between rollouts (the LM head; the whole body when no adapter is active) keep their packed
copy while it is small (`gemm.kept`). The Hugging Face model stays the reference for every log-prob that enters a
loss, and tests pin this path's logits against it.

`decode_dtype` bfloat16 (off by default) keeps those packed weights as bfloat16 copies (merged in fp32, then
rounded): decode products read half the bytes and run on the CPU's bf16 dot products, while norms, attention, the
residual stream and the logits stay fp32. It samples from a rounded copy of the model, the one setting here that
changes what is computed beyond float rounding order.

Anything outside the supported layout (not on the CPU, other attention variants, q/k norms, sliding windows,
adapted embeddings, DoRA and other LoRA variants) makes `LeanDecoder.build` return None, and the caller falls back
to the Hugging Face forward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from opct.backends.cpu import gemm, process
from opct.models import unwrap

SUPPORTED = {"llama", "qwen2", "mistral"}
SETTINGS = {"matmul": "onednn", "dtype": torch.float32, "huge_pages": True}  # set by the CPU backend (`configure`)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def configure(matmul: str = "onednn", dtype: str = "float32", huge_pages: bool = True) -> None:
    """Process-wide: how decode steps pack their weights ("onednn", "mkl" or "dense" = plain F.linear), in
    which dtype their matmuls read the weights ("float32" or "bfloat16"), and whether kept packed weights are
    moved onto 2 MB pages (`_on_huge_pages`)."""
    if matmul not in ("onednn", "mkl", "dense"):
        raise ValueError(f"decode_matmul={matmul!r}: expected onednn, mkl or dense")
    if dtype not in DTYPES:
        raise ValueError(f"decode_dtype={dtype!r}: expected float32 or bfloat16")
    SETTINGS.update(matmul=matmul, dtype=DTYPES[dtype], huge_pages=bool(huge_pages))
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
    m = unwrap(model)
    return m.model, m.lm_head, m.config


def unsupported_reason(model) -> str | None:
    try:
        body, head, arch = _inner(model)  # arch: the model's transformers config
    except AttributeError:
        return "not a *ForCausalLM with .model and .lm_head"
    w = next(model.parameters())
    if w.device.type != "cpu":
        return f"not on the CPU ({w.device})"
    if arch.model_type not in SUPPORTED:
        return f"model_type {arch.model_type!r}"
    if getattr(arch, "sliding_window", None) and getattr(arch, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(arch, "hidden_act", "silu") != "silu":
        return f"hidden_act {arch.hidden_act!r}"
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
    never timed at run time, so a resumed run samples with the same kernels as the original. MKL's packing is
    fp32 only: bfloat16 decode products take oneDNN or plain F.linear."""
    want = SETTINGS["matmul"]
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return "dense"
    if want == "onednn" and gemm.onednn_works(SETTINGS["dtype"]):
        return "onednn"
    if want in ("onednn", "mkl") and SETTINGS["dtype"] == torch.float32 and torch.backends.mkl.is_available() \
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        return "mkl"
    return "dense"


class _Packed:
    """y = x W^T + b for a fixed weight, packed for one batch size (see `packing`). With `SETTINGS["dtype"]`
    bfloat16, the fp32 weight (LoRA merged) is rounded to bfloat16 once, here; each call rounds x to bfloat16,
    the product accumulates in fp32 inside the kernel, and the result comes back as fp32."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, batch: int):
        self.kind, self.batch = packing(w), batch
        self.dtype = SETTINGS["dtype"] if w.dtype == torch.float32 else w.dtype
        w = w.to(self.dtype)
        self.b = None if b is None else b.to(self.dtype)
        if self.kind == "onednn":
            self.packed, self.w = torch.ops.mkldnn._reorder_linear_weight(w, batch), None
        elif self.kind == "mkl":
            # Only the packed copy is kept. MKL reads the second weight argument only when the batch size
            # differs from the packed one, which __call__ rules out; a zero-stride view stands in for it.
            self.packed, self.w = torch.ops.mkl._mkl_reorder_linear_weight(w, batch), w.new_zeros(()).expand(w.shape)
        else:
            self.packed, self.w = None, w

    @classmethod
    def onednn(cls, packed: torch.Tensor, b: torch.Tensor | None, batch: int, dtype: torch.dtype) -> _Packed:
        """Wrap a weight oneDNN has packed already, in `dtype`."""
        self = cls.__new__(cls)
        self.kind, self.batch, self.packed, self.w, self.dtype = "onednn", batch, packed, None, dtype
        self.b = None if b is None else b.to(dtype)
        return self

    def __call__(self, x_BI: torch.Tensor) -> torch.Tensor:
        if self.dtype != x_BI.dtype:
            return self._call(x_BI.to(self.dtype)).to(x_BI.dtype)
        return self._call(x_BI)

    def _call(self, x_BI: torch.Tensor) -> torch.Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x_BI, self.packed, self.b, "none", [], "")
        if self.packed is None:
            return F.linear(x_BI, self.w, self.b)
        assert x_BI.shape[0] == self.batch, (x_BI.shape, self.batch)
        return torch.ops.mkl._mkl_linear(x_BI, self.packed, self.w, self.b, self.batch)


def _group_weight(mods: list[torch.nn.Module], scales: list[float], lora: bool):
    """The weight and bias of linears that read the same input, stacked into a fresh tensor (never a view of the
    model's own weight): with `lora`, each member's enabled adapters merged in (W_i + s_i B_i A_i, once a rollout rather
    than x A^T B^T at every token), then each member's rows times its scale."""
    bases = [_base(m) for m in mods]
    w = torch.empty(sum(b.out_features for b in bases), bases[0].in_features, dtype=bases[0].weight.dtype)
    start = 0
    for m, base, sc in zip(mods, bases, scales):
        rows = slice(start, start + base.out_features)
        factors = _lora_factors(m) if lora else []
        # One pass writes sc (W + s B A) into the stack: sc W + (sc s) B A.
        if factors:
            A, Bm, s = factors[0]
            torch.addmm(base.weight.detach(), Bm, A, beta=sc, alpha=s * sc, out=w[rows])
        else:
            torch.mul(base.weight.detach(), sc, out=w[rows])
        for A, Bm, s in factors[1:]:
            w[rows].addmm_(Bm, A, alpha=s * sc)
        start += base.out_features
    return w, _group_bias(bases, scales)


def _group_bias(bases: list[torch.nn.Linear], scales: list[float]) -> torch.Tensor | None:
    """The stacked bias of a group (zeros for members without one), each member's part times its scale."""
    if all(b.bias is None for b in bases):
        return None
    return torch.cat([(b.bias.detach() if b.bias is not None else b.weight.new_zeros(b.out_features)) * sc
                      for b, sc in zip(bases, scales)])


def _on_huge_pages(packed: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A kept copy's packed weights (oneDNN's, or MKL's plain buffers; None: unpacked) moved onto 2 MB pages, once,
    when it is made (`process.collapse_to_huge_pages`; the `decode_huge_pages` setting): every decode token streams
    all of them, and with 4 kB pages that stream takes a TLB miss every 4 kB. Contents unchanged. Only kept copies:
    a throwaway one would pay the copy every rollout."""
    for t in packed if SETTINGS["huge_pages"] else []:
        if t is not None:
            addr, n = ((torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)) if t.is_mkldnn
                       else (t.data_ptr(), t.numel() * t.element_size()))
            process.collapse_to_huge_pages(addr, n)
    return packed


class _MergedBody:
    """oneDNN-packed tensors for a LoRA model's merged body, kept across rollouts (`gemm.kept`) and rewritten in
    place by each decoder built on them; `owner` is the decoder now reading them."""

    def __init__(self, shapes: list[tuple[int, int]], batch: int, dtype: torch.dtype):
        self.packed = _on_huge_pages([torch.ops.mkldnn._reorder_linear_weight(torch.zeros(O, I, dtype=dtype), batch)
                                      for O, I in shapes])
        self.owner = None


def _merge_packed(body, groups, batch: int, owner) -> list[dict] | None:
    """The merged body's groups as oneDNN-packed weights, written straight into packed memory: each member's
    sc (W + s B A) computed block by block in oneDNN's fp32 [O/ob][I][ob] layout (`gemm.block_rows`), from the
    frozen W's packed copy that the training forward keeps (`gemm.packed_weight`) or from W itself. No dense merged
    copy and no repacking (`_group_weight`, `_Packed`). With decode_dtype bfloat16 each member's fp32 blocks are
    rounded into bfloat16 buffers in their [O/ob][I/2][ob][2] layout in the same pass. The packed tensors are kept
    across rollouts and owned by one decoder at a time (`owner`). None where this does not apply: decode products
    not through oneDNN, another packed layout, a member whose rows do not fill whole blocks, the buffers still read
    by a live decoder, or no room within `gemm.kept`'s memory budget; the caller then merges and packs afresh."""
    flat = [(mods, scales) for g in groups for mods, scales in g.values()]
    bases = [[_base(m) for m in mods] for mods, _ in flat]
    shapes = [(sum(b.out_features for b in bs), bs[0].in_features) for bs in bases]
    dtype = SETTINGS["dtype"]
    if packing(bases[0][0].weight) != "onednn":
        return None
    obs = [gemm.block_rows(O, I, batch, dtype) for O, I in shapes]
    if any(ob is None or any(b.out_features % ob for b in bs) for ob, bs in zip(obs, bases)):
        return None
    merged = gemm.kept(body, "decode_merged", [], lambda: _MergedBody(shapes, batch, dtype),
                       extra=(batch, tuple(shapes), dtype), nbytes=dtype.itemsize * sum(O * I for O, I in shapes))
    if merged is None or (merged.owner is not None and merged.owner() is not None):
        return None
    merged.owner = weakref.ref(owner)
    with torch.no_grad():
        for packed, ob, (mods, scales), bs, (O, I) in zip(merged.packed, obs, flat, bases, shapes):
            dst_XIo = gemm.packed_blocks(packed, O, I, ob, dtype)
            start = 0
            for m, base, sc in zip(mods, bs, scales):
                n = base.out_features // ob
                kept_w = gemm.packed_weight(base, make=False)
                if kept_w is not None and gemm.block_rows(base.out_features, I, gemm.PACK_ROWS) == ob:
                    w_XIo = gemm.packed_blocks(kept_w, base.out_features, I, ob)
                else:
                    w_XIo = base.weight.detach().view(n, ob, I).transpose(1, 2)
                # bfloat16: merged in fp32 (a block of rows at a time), then rounded into the buffer's pairs.
                out_XIo = dst_XIo[start:start + n] if dtype == torch.float32 else torch.empty(n, I, ob)
                factors = _lora_factors(m)
                # Block j of (B A) in this layout is A^T B_j^T, B_j the j-th ob rows of B: a batched product.
                blocks = [(A.T.expand(n, -1, -1), Bm.view(n, ob, -1).transpose(1, 2), s) for A, Bm, s in factors]
                if blocks:
                    a, b, s = blocks[0]
                    torch.baddbmm(w_XIo, a, b, beta=sc, alpha=s * sc, out=out_XIo)
                else:
                    torch.mul(w_XIo, sc, out=out_XIo)
                for a, b, s in blocks[1:]:
                    out_XIo.baddbmm_(a, b, alpha=s * sc)
                if dtype != torch.float32:
                    dst_XIo[start:start + n].copy_(out_XIo.view(n, I // 2, 2, ob).transpose(2, 3))
                start += n
    bias = [_group_bias(bs, scales) for bs, (_, scales) in zip(bases, flat)]
    wrapped = iter(_Packed.onednn(p, b, batch, dtype) for p, b in zip(merged.packed, bias))
    return [{name: next(wrapped) for name in g} for g in groups]


def _groups(body, scaling: float):
    """Per layer, the linear groups a decode step runs: {name: (modules, output scales)}."""
    for layer in body.layers:
        a, m = layer.self_attn, layer.mlp
        yield {"qkv": ([a.q_proj, a.k_proj, a.v_proj], [scaling, 1.0, 1.0]), "o": ([a.o_proj], [1.0]),
               "gate_up": ([m.gate_proj, m.up_proj], [1.0, 1.0]), "down": ([m.down_proj], [1.0])}


def _kept(body, part: str, linears: list[torch.nn.Linear], batch: int, pack):
    """The copy of these weights an earlier rollout packed for `batch`, while they are unchanged (`gemm.kept`:
    frozen, and the kept copies small); otherwise pack() anew, to be freed with this decoder."""
    tensors = [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
    nbytes = sum(t.numel() for t in tensors) * SETTINGS["dtype"].itemsize
    def keep():  # a copy that will be kept: onto huge pages
        packed = pack()
        parts = [packed] if isinstance(packed, _Packed) else [p for layer in packed for p in layer.values()]
        _on_huge_pages([p.packed for p in parts])
        return packed

    packed = gemm.kept(body, "decode_" + part, tensors, keep, extra=(batch, SETTINGS["dtype"]), nbytes=nbytes)
    return pack() if packed is None else packed


class LeanDecoder:
    """Decode steps for one model's current weights and a fixed batch size, over a preallocated KV cache.
    Build one per rollout: it reads the weights as they are when built and does not follow later updates.

    The LM head, and the body too when no adapter is active (a frozen teacher answering, say), are packed once
    and kept while unchanged (`gemm.kept`). With LoRA the body is merged anew each rollout (into kept packed
    buffers where `_merge_packed` applies), since applying the adapters unmerged measured slower."""

    def __init__(self, model, batch: int):
        body, head, cfg = _inner(model)
        self.body, self.batch = body, batch
        a0 = body.layers[0].self_attn
        self.head_dim, self.scaling = a0.head_dim, a0.scaling
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        groups = list(_groups(body, self.scaling))
        lora = any(_lora_factors(m) for g in groups for mods, _ in g.values() for m in mods)

        def pack_body():
            with torch.no_grad():
                return [{name: _Packed(*_group_weight(mods, scales, lora), batch) for name, (mods, scales) in g.items()}
                        for g in groups]

        def pack_head():
            return _Packed(head.weight.detach(), None if head.bias is None else head.bias.detach(), batch)

        linears = [_base(m) for g in groups for mods, _ in g.values() for m in mods]
        if lora:
            packed = _merge_packed(body, groups, batch, self) or pack_body()
        else:
            packed = _kept(body, "body", linears, batch, pack_body)
        self.head = _kept(body, "head", [head], batch, pack_head)
        self.layers = [{"ln1": layer.input_layernorm, "ln2": layer.post_attention_layernorm, **p}
                       for layer, p in zip(body.layers, packed)]
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
