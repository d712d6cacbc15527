"""Choosing where a command runs: device, dtype and backend from its execution settings, resolved once."""

from __future__ import annotations

import importlib.util

import torch

from opct.backends.base import BackendError
from opct.backends.cpu import unsupported_reason

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto: the first CUDA device, else Apple's MPS, else the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise BackendError(f"--device {name!r}: expected auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"--device {name}: no CUDA device is available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BackendError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise BackendError(f"--device {name}: MPS is not available here")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise BackendError(f"--device {name}: expected auto, cpu, cuda, cuda:N or mps")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU and MPS; bfloat16 on a CUDA device that supports it, else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: cpu where its kernels apply (float32 on the CPU), hf elsewhere."""
    why = unsupported_reason(device, dtype)
    if name == "auto":
        return "hf" if why else "cpu"
    if name == "cpu" and why:
        raise BackendError(f"--backend cpu: {why}; use --backend hf (or auto)")
    return name


def other_decode_dtype(cfg, dtype: torch.dtype) -> str | None:
    """The decode_dtype a training config (RunConfig, its sampler resolved) asks the student to sample in when it is
    not the model's `dtype` (float32, the default, means the model's own), else None; a vLLM sampler does not use
    it."""
    if cfg.sampler in ("vllm", "vllm-server") or cfg.decode_dtype in ("float32", str(dtype).removeprefix("torch.")):
        return None
    return cfg.decode_dtype


def vllm_usable(device: torch.device) -> bool:
    """What `auto` asks of a place to run vLLM: a CUDA device, and vLLM installed."""
    return device.type == "cuda" and importlib.util.find_spec("vllm") is not None


def resolve_sampler(cfg, device: torch.device, parallel: str = "none") -> str:
    """The sampler OPCT's student uses (config.StudentSampler, a TrainConfig's --sampler); train.loop.start_run
    resolves it once, and the demo's preflight asks it ahead. auto: an in-process vLLM engine ("vllm") on a CUDA
    device where vLLM is installed (and can hold the LoRA rank, and every rank holds full weights: not under FSDP2);
    the backend's own decoder ("policy") elsewhere. (SFT has no sampler setting: its `sampler` is "policy".)"""
    if cfg.sampler != "auto":
        return cfg.sampler
    return "vllm" if vllm_usable(device) and cfg.lora_rank <= 512 and parallel != "fsdp" else "policy"


def resolve_eval_engine(name: str, device: torch.device) -> str:
    """Who generates an evaluation's answers. auto: vLLM on a CUDA device where it is installed, else the policy."""
    if name != "auto":
        return name
    return "vllm" if vllm_usable(device) else "policy"


def resolve_vllm_dtype(name: str, device: torch.device, trainer: torch.dtype) -> torch.dtype:
    """A vLLM engine's dtype. auto: bfloat16 on a CUDA device that supports it (vLLM's own kernels; the trainer
    keeps its dtype for the loss), else the trainer's."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else trainer


def resolve(cfg) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype, backend) from a config's execution settings (config.ExecConfig), resolved once per command."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    return device, dtype, resolve_backend(cfg.backend, device, dtype)


def resolve_inference(cfg) -> tuple[torch.device, torch.dtype, str, str]:
    """(device, dtype, backend, engine) of an evaluation's config (config.AxisOptions: EvalConfig, DemoConfig):
    `resolve`'s three and who generates its answers, --eval-engine with auto resolved (`resolve_eval_engine`). The
    one place an evaluation decides them: `inference_model` and evaluate.capability_run read what it returns."""
    device, dtype, backend = resolve(cfg)
    return device, dtype, backend, resolve_eval_engine(cfg.eval_engine, device)


def data_parallel_backend(requested: str) -> str:
    """The backend a data-parallel (torchrun) run uses, whatever auto chose: hf, whose forward DDP / FSDP2 wrap."""
    if requested == "cpu":
        raise BackendError("--backend cpu runs in one process; use --backend hf (or auto) under torchrun")
    return "hf"
