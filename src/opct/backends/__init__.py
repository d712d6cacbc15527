"""Execution backends behind the `Policy` seam (base.py), and choosing one: device, dtype, backend.

  hf    plain transformers + PEFT on any device and dtype: the reference (hf.py)
  cpu   opct's CPU kernels for float32 models on the CPU (cpu/)
"""

from __future__ import annotations

import torch

from opct.backends.base import DECODE_DTYPE_NEEDS_MERGED, BackendError, Policy, Rollout, Scores
from opct.backends.sampling import SamplingSettings
from opct.backends.select import (DTYPES, data_parallel_backend, other_decode_dtype, resolve, resolve_backend,
                                  resolve_device, resolve_dtype, resolve_eval_engine, resolve_inference,
                                  resolve_sampler)
from opct.backends.cpu import CPUPolicy
from opct.backends.hf import HFPolicy
from opct.backends import vllm
from opct.config import CPUSettings
from opct.data.chat import ChatFormat
from opct import models


def check_training(cfg, dtype: torch.dtype, backend: str, sampler: vllm.SamplerSpec | None) -> None:
    """What a training config (RunConfig) and its sampler (`vllm.sampler_spec` of the resolved --sampler, decided by
    start_run; None: the backend samples) ask of the backend: a decode_dtype other than the model's needs, on the hf
    backend, a merged copy of a LoRA model to sample from; a vLLM sampler needs vllm (and a given server that
    answers); --vllm-sleep an in-process engine on a GPU. Checked before a model loads."""
    decode_dtype = other_decode_dtype(cfg, dtype)
    if backend == "hf" and decode_dtype and not (cfg.merged_decode and cfg.lora_rank > 0):
        raise BackendError(DECODE_DTYPE_NEEDS_MERGED.format(decode_dtype))
    if sampler is not None:
        vllm.check(sampler)
    if cfg.vllm_sleep:
        vllm.check_sleep(cfg.vllm_sleep, sampler.kind if sampler else "policy", resolve_device(cfg.device))


def make_policy(backend: str, model, tok, eos_ids: set[int], cfg, micro_batch: int = 1 << 30,
                lora_dropout: float = 0.0, prompt_lengths=(), train: bool = True,
                sampler: vllm.SamplerSpec | None = None) -> Policy:
    """The Policy of `backend` around a loaded (and, for training, LoRA-wrapped) model; with a vLLM `sampler`
    (vllm.SamplerSpec, which train.loop.start_run decides once), wrapped so that vLLM samples (backends/vllm.py), its
    engine sized for the longest of `prompt_lengths` (the student prompts, in tokens) plus max_new_tokens; without
    one the backend samples the student itself. `cfg`: the execution settings (config.ExecConfig: where and how fast
    it runs, a training run's decode dtype); with `train=False` a policy for inference only (evaluation): no frozen
    teacher copy, the model's own weights and dtype for decoding."""
    if backend == "cpu":
        # evaluations decode in the model's own dtype (decode_dtype is the student's sampling)
        policy = CPUPolicy(model, tok, eos_ids, CPUSettings.of(cfg),
                           decode_dtype=cfg.decode_dtype if train else "float32", micro_batch=micro_batch,
                           lora_dropout=lora_dropout, train=train)
    else:
        own_decode = train and sampler is None  # the student samples itself (a training run without vLLM)
        policy = HFPolicy(model, tok, eos_ids, cuda_graphs=cfg.cuda_graphs,
                          merged_decode=own_decode and cfg.merged_decode,
                          decode_dtype=cfg.decode_dtype if own_decode else "float32", train=train)
    if train and sampler is not None:
        dtype = next(model.parameters()).dtype
        engine = vllm.make_sampler(sampler, eos_ids, prompt_lengths, device=policy.device, dtype=dtype)
        policy = vllm.VLLMPolicy(policy, engine, check_every=sampler.check_every)
    return policy


def inference_model(name: str, cfg, resolved: tuple | None = None) -> tuple[Policy, ChatFormat]:
    """The model `name` (alias, file, directory, Hub id) on the configured device and dtype, in an inference policy
    of the configured backend (`make_policy(..., train=False)`), and its chat format (opct.data.chat.ChatFormat of its
    tokenizer under the config's chat settings, the student's side): what `opct eval` and the demo's evaluations run.
    `cfg`: an evaluation's config (config.AxisOptions). Where its `eval_engine` resolves to vllm, a vLLM engine
    serving the same model generates (backends/vllm.py). The format is built from the tokenizer before any policy or
    engine is made, so --think-tags that are not tokens of the model (data.reasoning.ReasoningError) stop here, with
    nothing to close. `resolved`: `resolve_inference(cfg)` where the caller has it already
    (evaluate.capability_run), else resolved here."""
    device, dtype, backend, engine = resolved or resolve_inference(cfg)
    model, tok = models.load_model(name, device=device, dtype=dtype)
    fmt = ChatFormat.of(tok, cfg)  # its prompts (--chat-template-kwargs) and reasoning (--think-tags)
    eos = models.eos_ids(model, tok)
    policy = make_policy(backend, model, tok, eos, cfg, train=False)
    if engine == "vllm":
        policy = vllm.VLLMPolicy(policy, vllm.inference_sampler(name, cfg, eos, device, dtype), train=False)
    return policy, fmt


def inference_policy(name: str, cfg, resolved: tuple | None = None) -> Policy:
    """`inference_model`'s policy alone (its format checked all the same), for a caller that renders nothing."""
    return inference_model(name, cfg, resolved)[0]


__all__ = ["DTYPES", "BackendError", "Policy", "Rollout", "SamplingSettings", "Scores", "check_training",
           "data_parallel_backend", "inference_model", "inference_policy", "make_policy", "other_decode_dtype", "resolve",
           "resolve_backend", "resolve_device", "resolve_dtype", "resolve_eval_engine", "resolve_inference",
           "resolve_sampler"]
