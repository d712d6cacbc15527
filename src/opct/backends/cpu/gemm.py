"""fp32 matrix products on the CPU through oneDNN rather than the BLAS behind torch.matmul.

Why: oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, which torch.compile's CPU backend uses for linears with
frozen weights) ran the model's x W^T and dy W products faster than torch.matmul (MKL) on the CPUs we measured
(`benchmarks/gemm.py`; figures in dev/LOG.md). Not for every shape: a product whose left operand is a
transposed view (dy^T xa, LoRA's dB) was slower through oneDNN, so callers use these functions only where they
measured faster and torch's ops elsewhere. Frozen weights can also be kept pre-packed in oneDNN's layout
(`packed_weight`).

These functions have no autograd formula: they are called from custom autograd Functions (`lora.LoRALinearFn`,
`logprobs._HiddenTokenLogprobs`) and no-grad code (the frozen teacher). Anything but fp32 CPU tensors, a PyTorch
built without oneDNN, or `configure(kernel="torch")` (the `cpu_gemm` setting) takes torch's own ops.

Which is faster depends on the CPU. torch's CPU matmuls are MKL's, which runs its AVX-512 code only on Intel CPUs:
on the AMD EPYC VMs with AVX-512 where this module was written oneDNN's products were the faster ones, on an Intel
Xeon with AVX-512 MKL's (dev/LOG.md, 2026-11-25 (evening)), and on an AMD EPYC with AVX2 only, where both libraries run AVX2
code, MKL's again (dev/LOG.md, 2026-11-27 (evening)).
`cpu_gemm: auto` (the default) therefore takes oneDNN only on a non-Intel CPU with AVX-512 (`auto_kernel`), torch's
kernels elsewhere. Never timed at run time, so a run and its resume on the same machine use the same kernels.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref

import torch

from opct.provenance import cpu_info

_OP = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
SETTINGS = {"kernel": "onednn", "pack": True}  # set by the CPU backend's setup (`configure`)


def cpu_vendor() -> str | None:
    """The CPU's vendor as /proc/cpuinfo gives it ("GenuineIntel", "AuthenticAMD", ...); None where unreadable."""
    return cpu_info().get("vendor_id")


def cpu_has_avx512() -> bool:
    """Whether /proc/cpuinfo lists AVX-512 Foundation (`avx512f`); False where unreadable."""
    return "avx512f" in cpu_info().get("flags", "").split()


def auto_kernel(vendor: str | None = None, avx512: bool | None = None) -> str:
    """`cpu_gemm: auto`: "onednn" on a non-Intel CPU with AVX-512 (MKL would run its AVX2 code there), where the
    vendor is unreadable, or where this PyTorch has no MKL; else "torch" (MKL)."""
    vendor = cpu_vendor() if vendor is None else vendor
    avx512 = cpu_has_avx512() if avx512 is None else avx512
    if vendor is None or not torch.backends.mkl.is_available():
        return "onednn"
    return "onednn" if vendor != "GenuineIntel" and avx512 else "torch"


def configure(kernel: str = "onednn", pack: bool = True) -> str:
    """Process-wide: which kernel runs these products ("onednn", "torch", or "auto": `auto_kernel`) and whether
    frozen weights are packed. Returns the kernel chosen."""
    if kernel not in ("auto", "onednn", "torch"):
        raise ValueError(f"cpu_gemm={kernel!r}: expected auto, onednn or torch")
    SETTINGS.update(kernel=auto_kernel() if kernel == "auto" else kernel, pack=pack)
    return SETTINGS["kernel"]


@functools.cache
def onednn_works(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear, on a weight it has packed, runs in `dtype` and agrees with torch here (checked once
    a process and dtype, on a tiny product): some builds list the op but cannot run it on this CPU, and bfloat16
    needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, which an AVX2 CPU lacks; those must take torch's ops, not fail."""
    if _OP is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.arange(6.0).view(2, 3).to(dtype), torch.arange(12.0).view(4, 3).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2) if dtype != torch.float32 else w
        return bool(torch.equal(_OP(x, packed, None, "none", [], ""), x @ w.T))
    except RuntimeError:
        return False


def onednn(*tensors: torch.Tensor) -> bool:
    """Whether products of these tensors go through oneDNN."""
    return (SETTINGS["kernel"] == "onednn" and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and onednn_works())


def linear(x_NI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for 2-D x, as torch.nn.functional.linear. `packed`: W as `packed_weight` returned it."""
    if onednn(x_NI, w_OI):
        return _OP(x_NI, packed if packed is not None else w_OI, b_O, "none", [], "")
    return torch.nn.functional.linear(x_NI, w_OI, b_O)


def mm(a_NK: torch.Tensor, b_KM: torch.Tensor) -> torch.Tensor:
    """a @ b; oneDNN reads b through a transposed view, no copy."""
    return linear(a_NK, b_KM.t())


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 where the OS does not say): what kept weight copies are budgeted against."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# Copies derived from frozen tensors, kept while those are unchanged: {owner: {tag: (key, copy, nbytes)}}.
# All kept copies together stay within this share of physical memory (an eighth left the 0.5B LoRA run's decode
# head out, repacked every rollout: dev/LOG.md 2026-11-26 (later)).
KEEP_FRACTION = 1 / 4
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept(owner, tag: str, tensors: list[torch.Tensor], make, extra=(), nbytes: int | None = None):
    """make(), kept for `owner` under `tag` and returned again while `tensors` are unchanged (an in-place update
    bumps a tensor's _version, replacing it changes its storage) and `extra` is the same; one copy per (owner, tag).
    None, and nothing kept, when a tensor can change (requires grad) or all kept copies would take more than
    `KEEP_FRACTION` of physical memory: the caller then works without a kept copy, so a large model or a full
    fine-tune does not carry a second copy of its weights through the backward pass, where a training step peaks.
    `nbytes`: the copy's size when it is not that of `tensors` (a buffer keyed by `extra` alone). With `make` None,
    only a copy already kept is returned (None otherwise)."""
    if any(t.requires_grad for t in tensors):
        return None
    key = (tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors), extra)
    copies = _KEPT.setdefault(owner, {})
    hit = copies.pop(tag, None)  # a stale copy is freed before a new one is made
    if hit is not None and hit[0] == key:
        copies[tag] = hit
        return hit[1]
    if make is None:
        return None
    if nbytes is None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    in_use = sum(c[2] for cs in _KEPT.values() for c in cs.values())
    if in_use + nbytes > physical_memory() * KEEP_FRACTION:
        return None
    copies[tag] = (key, make(), nbytes)
    return copies[tag][1]


PACK_ROWS = 256  # the row count oneDNN lays a packed weight out for; any row count may use it


def packed_weight(lin: torch.nn.Linear, make: bool = True) -> torch.Tensor | None:
    """A copy of a frozen linear's weight laid out in advance for oneDNN's forward product (x W^T), `kept` while
    the weight is unchanged; None where products do not go through oneDNN or no copy may be kept. Forward products
    with it are bit for bit those with the weight itself from 2 rows on (a single row takes a matrix-vector kernel
    unpacked: equal to rounding), only faster. The backward's dy W gained nothing from packing W^T, so backward
    products read the weight itself. `configure(pack=False)` turns packing off. With `make` False, only a copy
    already kept is returned."""
    w_OI = lin.weight
    if not SETTINGS["pack"] or not onednn(w_OI):
        return None
    make_packed = lambda: torch.ops.mkldnn._reorder_linear_weight(w_OI.detach(), PACK_ROWS)  # noqa: E731
    return kept(lin, "packed", [w_OI], make_packed if make else None)


@functools.cache
def block_rows(out_features: int, in_features: int, rows: int, dtype: torch.dtype = torch.float32) -> int | None:
    """How oneDNN lays out a weight W_OI packed for `rows` rows (`torch.ops.mkldnn._reorder_linear_weight`), when
    that layout is blocks of `ob` output rows with no padding: fp32 as [O/ob][I][ob] (column by column), bfloat16 as
    [O/ob][I/2][ob][2] (pairs of columns, the layout of AVX-512 bf16 dot products). ob (64 on the AVX-512 CPUs we
    measured, for every row count from 2 to 256). None for any other layout, or where a packed tensor's memory
    cannot be reached. Found once per shape by packing matrices of row and column numbers (taken modulo 251 and
    divided by 251, so that both parts are integers the dtype holds exactly) and reading their memory back
    (`packed_blocks`)."""
    O, I = out_features, in_features
    exact = round(2 / torch.finfo(dtype).eps)  # integers up to this are exact: 256 in bfloat16, 2^24 in fp32
    if not onednn_works(dtype) or not hasattr(torch.ops.mkldnn, "data_ptr") or max(O, I) > 251 * exact \
            or (dtype == torch.bfloat16 and I % 2):
        return None
    r_OI = torch.arange(O, dtype=torch.float32)[:, None].expand(O, I)
    c_OI = torch.arange(I, dtype=torch.float32)[None, :].expand(O, I)
    probes = [w.contiguous().to(dtype) for v in (r_OI, c_OI) for w in (v.remainder(251), v.div(251).floor())]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in probes]
    if torch.ops.mkldnn._nbytes(packed[0]) != O * I * dtype.itemsize:
        return None
    for ob in (64, 32, 16, 8):
        if O % ob == 0 and all(torch.equal(packed_blocks(p, O, I, ob, dtype), blocked(w, ob))
                               for p, w in zip(packed, probes)):
            return ob
    return None


def blocked(w_OI: torch.Tensor, ob: int) -> torch.Tensor:
    """W_OI as a view in `block_rows`' layout for its dtype: fp32 [O/ob][I][ob], bfloat16 [O/ob][I/2][ob][2]."""
    O, I = w_OI.shape
    if w_OI.dtype == torch.bfloat16:
        return w_OI.view(O // ob, ob, I // 2, 2).permute(0, 2, 1, 3)
    return w_OI.view(O // ob, ob, I).transpose(1, 2)


def packed_blocks(packed: torch.Tensor, out_features: int, in_features: int, ob: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The memory of a oneDNN-packed weight as a plain tensor in `block_rows`' layout, readable and writable in
    place. It does not keep `packed` alive: the caller holds both together."""
    n = out_features * in_features
    assert torch.ops.mkldnn._nbytes(packed) == n * dtype.itemsize
    buf = (ctypes.c_uint8 * (n * dtype.itemsize)).from_address(torch.ops.mkldnn.data_ptr(packed))
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
    if dtype == torch.bfloat16:
        return t.view(out_features // ob, in_features // 2, ob, 2)
    return t.view(out_features // ob, in_features, ob)
