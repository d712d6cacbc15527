"""`--sampler vllm` / `vllm-server`: the student's rollouts come from vLLM, everything else from the training backend.

`VLLMPolicy` wraps an in-process policy (hf or cpu): `sample` goes to a `vllm_sampler` (a colocated engine or a
`vllm serve`), `score`, `teacher` and every gradient stay with the wrapped policy, so the loss always uses the
trainer's own log-probs of the sampled tokens at temperature 1, never the sampler's. `after_step` syncs the new
weights into vLLM (a fresh LoRA adapter id every step, or a reload for full fine-tuning), so sampling is never a
step stale. The sampler's raw log-probs travel in `Rollout.sampler_logp`; the OPCT step logs their gap to the
trainer's (`sampler_logp_gap`, mean |delta| per token), the precision mismatch a user should see.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from opct.backends.base import Policy, Rollout
from opct.backends.vllm_sampler import (DEFAULT_MAX_MODEL_LEN, loads_adapters, max_lora_rank, unauthorized,
                                        unreachable)


def needed_model_len(prompt_lengths, max_new_tokens: int) -> int:
    """The engine context a run needs: its longest prompt + max_new_tokens, at least DEFAULT_MAX_MODEL_LEN."""
    return max(DEFAULT_MAX_MODEL_LEN, max(prompt_lengths, default=0) + max_new_tokens)


PROBE = "Water boils at 100 degrees Celsius at sea level, and the capital of France is Paris."
SAME_MODEL_GAP = 0.25  # nats a token; the same weights in float32: < 1e-4 (tests/backends/test_vllm_sampler.py)


def model_gap(policy: "VLLMPolicy") -> float:
    """Mean |vLLM's log-prob - the trainer's| over the tokens of PROBE after its first token, with the weights
    vLLM serves now: how far the sampler's model is from the one being trained."""
    ids = policy.tok(PROBE, add_special_tokens=False)["input_ids"]
    theirs = policy.sampler.prompt_logprobs([ids], [1])[0]
    ours = policy.inner.score([ids[:1]], Rollout([ids[:1]], [ids[1:]]), grad=False).logp_NT[0].tolist()
    return sum(abs(a - b) for a, b in zip(ours, theirs)) / len(theirs)


class VLLMPolicy(Policy):
    """`train=True`: the student's sampler of a training run (synced every step). `train=False`: an evaluation's
    engine, serving the model being evaluated (`inference_sampler`): `generate` decodes in vLLM, and
    `next_token_logprobs` and `continuation_logprobs` (one prefill, nothing decoded) stay with the wrapped policy."""
    name = "vllm"

    def __init__(self, inner: Policy, sampler, train: bool = True):
        self.inner, self.sampler, self.train = inner, sampler, train
        self.model, self.tok, self.pad_id, self.eos_ids, self.device = (inner.model, inner.tok, inner.pad_id,
                                                                         inner.eos_ids, inner.device)
        self.chat_options, self.think_ids = inner.chat_options, inner.think_ids
        self.steps = 0
        self.sync_seconds = self.wake_seconds = 0.0
        if not train:
            return
        self.sync_seconds = sampler.sync(self.model, 0)  # vLLM serves the base weights until the first sync
        if getattr(sampler, "external", False):  # a server the user started may serve another model
            gap = model_gap(self)
            if gap > SAME_MODEL_GAP:
                from opct.backends.base import BackendError

                sampler.close()
                raise BackendError(f"--vllm-url {sampler.url}: the server's model ({sampler.model_name}) is not the "
                                   f"one being trained: its log-probs of a probe text differ from the trainer's by "
                                   f"{gap:.3f} nats a token on average (the same weights: < 0.001 in float32); "
                                   "serve the model given by --model")

    def sample(self, prompts_N, settings, gen) -> Rollout:
        # a data-parallel rank's share of the draws (train/distributed.py ShardDraws): the run's generator, and
        # the global index of this rank's first row
        base, first = (gen.gen, gen.lo) if hasattr(gen, "lo") else (gen, 0)
        seed = int(torch.randint(2 ** 31, (1,), generator=base))  # per-request seeds derive from it
        t0 = time.perf_counter()
        responses, logp = self.sampler.sample(prompts_N, settings, seed, first)
        rest = getattr(self.sampler, "rest", None)  # --vllm-sleep: free the engine's GPU memory until the next sync
        if rest is not None:
            rest()
        stats = {"decode_seconds": time.perf_counter() - t0, "sync_seconds": self.sync_seconds}
        if getattr(self.sampler, "sleep_level", 0):
            stats["wake_seconds"] = self.wake_seconds
        return Rollout(prompts_N, responses, sampler_logp=logp, stats=stats)

    def score(self, prompts_N, rollout, *, grad, hidden=False, sync=True):
        return self.inner.score(prompts_N, rollout, grad=grad, hidden=hidden, sync=sync)

    def teacher(self):
        return self.inner.teacher()

    def generate(self, prompts_N, settings, gen, batch_size=16):
        if self.train:  # a training run's probes: the trainer's own weights, as they are between syncs
            return self.inner.generate(prompts_N, settings, gen, batch_size)
        seed = int(torch.randint(2 ** 31, (1,), generator=gen))  # per-request seeds derive from it
        return self.sampler.sample(prompts_N, settings, seed)[0]  # vLLM batches and schedules the prompts itself

    def next_token_logprobs(self, prompts_N, token_ids_N, groups=None, batch_size=32):
        return self.inner.next_token_logprobs(prompts_N, token_ids_N, groups, batch_size)

    def continuation_logprobs(self, prompts_N, continuations_N, batch_size=32):
        return self.inner.continuation_logprobs(prompts_N, continuations_N, batch_size)

    def after_step(self) -> None:
        self.inner.after_step()
        self.steps += 1
        self._sync()

    def after_load(self, step: int) -> None:
        """A resumed checkpoint's weights go to vLLM before the first resumed step samples."""
        self.inner.after_load(step)
        self.steps = step
        self._sync()

    def _sync(self) -> None:
        """The engine woken (--vllm-sleep), then the new weights synced: an adapter is loaded into an awake engine,
        never carried across a sleep (LoRA that silently stops applying after a wake is a known vLLM trap)."""
        t0 = time.perf_counter()
        wake = getattr(self.sampler, "wake", None)
        if wake is not None:
            wake()
        self.wake_seconds = time.perf_counter() - t0
        self.sync_seconds = self.sampler.sync(self.model, self.steps)

    def describe(self) -> dict:
        return {**self.inner.describe(), "sampler": type(self.sampler).__name__,
                "vllm_dtype": getattr(self.sampler, "dtype", None),
                "vllm_max_model_len": getattr(self.sampler, "max_model_len", None)}

    def close(self) -> None:
        self.sampler.close()


def make_sampler(cfg, eos_ids, prompt_lengths=(), device: torch.device | None = None,
                 dtype: torch.dtype | None = None):
    """The vLLM sampler a config asks for, on the base model's dense local copy (vLLM cannot read GGUF on a CPU).
    An engine or server started here gets a context of `needed_model_len` of the run's student prompt lengths (in
    tokens); a server given by --vllm-url has its own, which must hold the longest prompt + max_new_tokens.
    On a GPU, vLLM takes `vllm_gpu_memory` of the training device's memory (weights + KV cache) and runs on that
    device (under torchrun each rank has its own engine on its own GPU); an in-process engine there captures CUDA
    graphs for LoRA runs unless `cuda_graphs` is off (a full fine-tune's engine, and a server started here, run
    eagerly, as on the CPU). `device` and `dtype`: the trainer's model's (make_policy passes them; resolved from
    the config when not given); the engine runs in `vllm_dtype` (auto: bfloat16 on a GPU, else the trainer's)."""
    from opct.backends.select import resolve, resolve_vllm_dtype
    from opct.backends.vllm_sampler import VLLMSampler, VLLMServerSampler
    from opct.models import resolve as resolve_model

    check(cfg)
    if device is None or dtype is None:
        device, dtype, _ = resolve(cfg)
    if cfg.vllm_sleep and (cfg.sampler != "vllm" or device.type != "cuda"):
        from opct.backends.base import BackendError

        raise BackendError(f"--vllm-sleep {cfg.vllm_sleep}: vLLM's sleep mode needs --sampler vllm (an in-process "
                           "engine) on a CUDA device; leave it at 0")
    engine_dtype = resolve_vllm_dtype(cfg.vllm_dtype, device, dtype)
    kw = dict(dtype=str(engine_dtype).removeprefix("torch."), lora_rank=cfg.lora_rank, seed=cfg.seed,
              kv_cache_gib=cfg.vllm_kv_cache_gib, max_model_len=needed_model_len(prompt_lengths, cfg.max_new_tokens))
    on_gpu = device.type == "cuda"
    gpu = str(torch.cuda.current_device()) if on_gpu else None
    if cfg.sampler == "vllm":
        # On a GPU a LoRA run's engine compiles and captures its decode as CUDA graphs unless cuda_graphs is off (a
        # slower start, then no per-kernel launches): a synced adapter is copied into vLLM's LoRA buffers, which the
        # graphs read. A full fine-tune's sync reloads the weights (vllm_worker.WeightSync re-points tied ones), not
        # known to keep the addresses a graph reads, so that engine stays eager, as every engine on the CPU.
        graphs = cfg.cuda_graphs and cfg.lora_rank > 0
        extra = {"gpu_memory_utilization": cfg.vllm_gpu_memory, "enforce_eager": not graphs,
                 **({"sleep_level": cfg.vllm_sleep} if cfg.vllm_sleep else {})} if on_gpu else {}
        with visible_device(gpu):  # the engine's worker process starts with only this rank's GPU visible
            return VLLMSampler(resolve_model(cfg.model), eos_ids, **kw, **extra)
    if cfg.vllm_url:
        sampler = VLLMServerSampler(eos_ids, url=cfg.vllm_url, lora_rank=cfg.lora_rank)
        need = max(prompt_lengths, default=0) + cfg.max_new_tokens
        if sampler.max_model_len is not None and sampler.max_model_len < need:
            from opct.backends.base import BackendError

            sampler.close()
            raise BackendError(f"--vllm-url {cfg.vllm_url}: the server's context is {sampler.max_model_len} tokens "
                               f"(its --max-model-len); this run needs {need} (its longest prompt, "
                               f"{need - cfg.max_new_tokens}, + --max-new-tokens {cfg.max_new_tokens})")
        return sampler
    extra_args = ("--gpu-memory-utilization", str(cfg.vllm_gpu_memory)) if on_gpu else ()
    with visible_device(gpu):
        return VLLMServerSampler(eos_ids, model_dir=resolve_model(cfg.model), extra_args=extra_args, **kw)


INFERENCE_MAX_MODEL_LEN = 8192  # an evaluation engine's context: the model's own, up to this


def inference_sampler(name: str, cfg, eos_ids, device: torch.device, dtype: torch.dtype):
    """An in-process vLLM engine serving the model `name` for evaluation: a dense model directory (an alias, a
    directory, a Hub id) as it is, or an opct LoRA adapter directory as its base model plus the adapter. Its dtype
    is `vllm_dtype`'s (auto: bfloat16 on a GPU, else the model's), its context the model's up to
    INFERENCE_MAX_MODEL_LEN; on a GPU it takes `vllm_gpu_memory` of the device."""
    from opct.backends.base import BackendError
    from opct.backends.select import resolve_vllm_dtype
    from opct.backends.vllm_sampler import VLLMSampler
    from opct.extras import require
    from opct.models import adapter_rank, base_and_adapter

    require("vllm", "--eval-engine vllm", "")
    base, adapter = base_and_adapter(name)
    if base.endswith(".gguf"):
        raise BackendError(f"--eval-engine vllm: vLLM cannot load the GGUF file {base}; pass a model directory or "
                           "a Hub id, or --eval-engine policy")
    rank = adapter_rank(adapter) if adapter else 0
    try:
        from transformers import AutoConfig

        ctx = getattr(AutoConfig.from_pretrained(base), "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    except (OSError, ValueError):
        ctx = DEFAULT_MAX_MODEL_LEN
    on_gpu = device.type == "cuda"
    extra = {"gpu_memory_utilization": cfg.vllm_gpu_memory, "enforce_eager": not cfg.cuda_graphs} if on_gpu else {}
    with visible_device(str(torch.cuda.current_device()) if on_gpu else None):
        sampler = VLLMSampler(base, eos_ids, dtype=str(resolve_vllm_dtype(cfg.vllm_dtype, device, dtype))
                              .removeprefix("torch."), lora_rank=rank, seed=cfg.seed,
                              max_model_len=min(ctx, INFERENCE_MAX_MODEL_LEN), kv_cache_gib=cfg.vllm_kv_cache_gib,
                              **extra)
    if adapter:
        sampler.serve_adapter(adapter)
    return sampler


def check(cfg) -> None:
    """What the vLLM sampler a config asks for needs, checked before any model loads (start_run) and again when the
    sampler is made: vllm importable (unless the server is someone else's), and a server given by --vllm-url
    answering, taking this client (an API key from $OPCT_VLLM_API_KEY) and with its run-time LoRA routes when the run
    trains a LoRA adapter."""
    from opct.backends.base import BackendError
    from opct.extras import require

    if cfg.sampler == "vllm" or not cfg.vllm_url:
        require("vllm", f"--sampler {cfg.sampler}",
                "or pass --vllm-url of a running server" if cfg.sampler != "vllm" else "")
    if cfg.sampler != "vllm-server" or not cfg.vllm_url:
        return
    why = unreachable(cfg.vllm_url)
    if why:
        raise BackendError(f"--vllm-url {cfg.vllm_url}: no vLLM server answers there ({why}); start one, or leave "
                           "--vllm-url out and opct starts one")
    why = unauthorized(cfg.vllm_url)
    if why:
        raise BackendError(f"--vllm-url {cfg.vllm_url}: {why}")
    if cfg.lora_rank > 0 and not loads_adapters(cfg.vllm_url):
        raise BackendError(f"--vllm-url {cfg.vllm_url}: the server cannot load LoRA adapters at run time "
                           "(/v1/load_lora_adapter answered 404); start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                           f"and --enable-lora --max-lora-rank {max_lora_rank(cfg.lora_rank)}")


@contextmanager
def visible_device(index: str | None):
    """CUDA_VISIBLE_DEVICES set to `index` while a vLLM engine or server process is started (nothing on a CPU)."""
    if index is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = index if before is None else before.split(",")[int(index)]
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
