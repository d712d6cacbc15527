"""Execution backends behind the `Policy` seam (base.py), and choosing one: device, dtype, backend.

  hf    plain transformers + PEFT on any device and dtype: the reference (hf.py)
  cpu   opct's CPU kernels for float32 models on the CPU (cpu/)
"""

from __future__ import annotations

import torch

from opct.backends.base import Policy, Rollout, Scores
from opct.backends.sampling import SamplingSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BackendError(ValueError):
    """The device, dtype or backend asked for cannot be used here; the message says why."""


DECODE_DTYPE_NEEDS_MERGED = ("--decode-dtype {} on the hf backend samples from a merged copy of a LoRA model: add "
                             "--merged-decode (with --lora-rank > 0), or leave --decode-dtype at float32")


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
    from opct.backends import cpu

    why = cpu.unsupported_reason(device, dtype)
    if name == "auto":
        return "hf" if why else "cpu"
    if name == "cpu" and why:
        raise BackendError(f"--backend cpu: {why}; use --backend hf (or auto)")
    return name


def other_decode_dtype(cfg, dtype: torch.dtype) -> str | None:
    """The decode_dtype a config asks the policy to sample in when it is not the model's `dtype` (float32, the
    default, means the model's own), else None; a vLLM sampler does not use it."""
    decode_dtype = getattr(cfg, "decode_dtype", "float32")
    if getattr(cfg, "sampler", "policy") != "policy" or decode_dtype in ("float32", str(dtype).removeprefix("torch.")):
        return None
    return decode_dtype


def resolve(cfg) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype, backend) from a config's device / dtype / backend settings; a training config's decode_dtype
    other than the model's needs, on the hf backend, a merged copy of a LoRA model to sample from."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    backend = resolve_backend(cfg.backend, device, dtype)
    decode_dtype = other_decode_dtype(cfg, dtype)
    if (backend == "hf" and hasattr(cfg, "lora_rank") and decode_dtype
            and not (cfg.merged_decode and cfg.lora_rank > 0)):
        raise BackendError(DECODE_DTYPE_NEEDS_MERGED.format(decode_dtype))
    return device, dtype, backend


def data_parallel_backend(requested: str) -> str:
    """The backend a data-parallel (torchrun) run uses, whatever auto chose: hf, whose forward DDP / FSDP2 wrap."""
    if requested == "cpu":
        raise BackendError("--backend cpu runs in one process; use --backend hf (or auto) under torchrun")
    return "hf"


def check_sampler(cfg) -> None:
    """What a vLLM sampler setting needs (vllm installed, a given server answering), checked before a model loads."""
    if getattr(cfg, "sampler", "policy") != "policy":
        from opct.backends.vllm import check

        check(cfg)


def make_policy(backend: str, model, tok, eos_ids: set[int], cfg, micro_batch: int = 1 << 30,
                lora_dropout: float = 0.0, prompt_lengths=(), train: bool = True) -> Policy:
    """The Policy of `backend` around a loaded (and, for training, LoRA-wrapped) model; with a vLLM `sampler`
    setting, wrapped so that vLLM samples (backends/vllm.py), its engine sized for the longest of `prompt_lengths`
    (the student prompts, in tokens) plus max_new_tokens. `train=False`: a policy for inference only (evaluation):
    no frozen teacher copy, the model's own weights and dtype for decoding."""
    if backend == "cpu":
        from opct.backends.cpu import CPUPolicy

        policy = CPUPolicy(model, tok, eos_ids, cfg, micro_batch=micro_batch, lora_dropout=lora_dropout, train=train)
    else:
        from opct.backends.hf import HFPolicy

        training_decode = train and getattr(cfg, "sampler", "policy") == "policy"
        policy = HFPolicy(model, tok, eos_ids, cuda_graphs=getattr(cfg, "cuda_graphs", False),
                          merged_decode=training_decode and getattr(cfg, "merged_decode", False),
                          decode_dtype=getattr(cfg, "decode_dtype", "float32") if training_decode else "float32",
                          train=train)
    if train and getattr(cfg, "sampler", "policy") != "policy":
        from opct.backends.vllm import VLLMPolicy, make_sampler

        policy = VLLMPolicy(policy, make_sampler(cfg, eos_ids, prompt_lengths))
    return policy


def inference_policy(name: str, cfg) -> Policy:
    """The model `name` (alias, file, directory, Hub id) on the configured device and dtype, in an inference policy
    of the configured backend (`make_policy(..., train=False)`): what `opct eval` and the demo's evaluations run."""
    from opct.models import eos_ids, load_model

    device, dtype, backend = resolve(cfg)
    model, tok = load_model(name, device=device, dtype=dtype)
    return make_policy(backend, model, tok, eos_ids(model, tok), cfg, train=False)


__all__ = ["BackendError", "Policy", "Rollout", "SamplingSettings", "Scores", "check_sampler", "inference_policy",
           "make_policy", "resolve"]
