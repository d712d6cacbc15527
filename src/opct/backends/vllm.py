"""`--sampler vllm` / `vllm-server`: the student's rollouts come from vLLM, everything else from the training backend.

`VLLMPolicy` wraps an in-process policy (hf or cpu): `sample` goes to a `vllm_sampler` (a colocated engine or a
`vllm serve`), `score`, `teacher` and every gradient stay with the wrapped policy, so the loss always uses the
trainer's own log-probs of the sampled tokens at temperature 1, never the sampler's. `after_step` syncs the new
weights into vLLM (a fresh LoRA adapter id every step, or a reload for full fine-tuning), so sampling is never a
step stale. The sampler's raw log-probs travel in `Rollout.sampler_logp`; the OPCT step logs their gap to the
trainer's (`sampler_logp_gap`, mean |delta| per token), the precision mismatch a user should see.

That the sync took effect is checked, not assumed (`SyncCheck`, docs/vllm.md "Does the sampler serve the trained
weights?"): a sampler that silently keeps serving the initial weights while the trainer learns looks healthy in
every loss curve, so after every `sampler_check_every`-th sync the engine's log-probs of a fixed probe (two of the
run's own first samples) are compared with the trainer's and with the initial model's; a sampler closer to the
initial model than to the trainer on two checks in a row stops the run (`SamplerStaleError`, exit 1).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from opct.backends import select, vllm_sampler
from opct.backends.base import BackendError, Policy, Rollout
from opct.backends.vllm_sampler import (DEFAULT_MAX_MODEL_LEN, loads_adapters, max_lora_rank, unauthorized,
                                        unreachable)
from opct import extras
from opct.errors import MachineError
from opct.models import resolve as resolve_model
from opct.models import adapter_rank, base_and_adapter


def needed_model_len(prompt_lengths, max_new_tokens: int) -> int:
    """The engine context a run needs: its longest prompt + max_new_tokens, at least DEFAULT_MAX_MODEL_LEN."""
    return max(DEFAULT_MAX_MODEL_LEN, max(prompt_lengths, default=0) + max_new_tokens)


class SamplerStaleError(MachineError, RuntimeError):
    """The vLLM sampler does not serve the weights being trained (a weight sync that did not take effect)."""


STALE_RATIO = 3.0  # a check strikes when the sampler is >= 3x closer to the initial model than to the trainer
STALE_MIN_GAP = 1e-3  # ... and >= this far (nats a token) from the trainer: below, staleness costs nothing
STALE_STRIKES = 2  # strikes in a row that stop the run
PROBE_SEQUENCES = 2  # the probe: the longest two (prompt, response) pairs of the first rollout checked


def mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """Mean |a - b| over every token of every sequence."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(abs(x - y) for x, y in pairs) / max(len(pairs), 1)


class SyncCheck:
    """Whether the sampler serves the trainer's weights (module docstring). After a sync, on a fixed probe (the
    longest PROBE_SEQUENCES prompt + response pairs of the first rollout it sees), three mean per-token gaps of
    log-probs: the sampler's to the trainer's (g_trainer), the sampler's to the initial model's (g_initial, the
    initial model's read once) and the trainer's to the initial model's (drift). A check strikes when g_trainer >=
    STALE_MIN_GAP and g_trainer >= STALE_RATIO * g_initial: by the triangle inequality that needs drift >=
    g_trainer * (1 - 1/STALE_RATIO), so a sampler that follows the trainer within its precision gap e (~1e-5 in
    float32, ~1e-2 in bfloat16) strikes only if its rounding undid two thirds of the trainer's update on every probe
    token; a stale one strikes once the trainer has moved about (1 + STALE_RATIO) * e from the initial weights.
    STALE_STRIKES in a row (on any data-parallel rank) raise SamplerStaleError. A check runs before a step samples,
    on the weights of the sync after step `step` (every `every` steps), and its numbers are logged with that step."""

    def __init__(self, every: int):
        self.every, self.strikes = every, 0
        self.probe = None  # (Rollout of the probe, the initial model's log-probs of its responses)
        self.stats: dict = {}

    def maybe_fix_probe(self, policy: "VLLMPolicy", rollout: Rollout) -> None:
        if self.probe is not None or not self.every:
            return
        order = sorted(range(len(rollout.responses)), key=lambda i: -len(rollout.responses[i]))[:PROBE_SEQUENCES]
        probe = Rollout([rollout.prompts[i] for i in order], [rollout.responses[i] for i in order])
        with policy.inner.teacher() as teacher:
            initial = self._logps(teacher, probe)
        self.probe = (probe, initial)

    @staticmethod
    def _logps(policy: Policy, probe: Rollout) -> list[list[float]]:
        model = policy.model
        was = model.training
        model.eval()  # no dropout in a reading
        try:
            s = policy.score(probe.prompts, probe, grad=False)
        finally:
            model.train(was)
        return [s.logp_NT[i, :len(r)].tolist() for i, r in enumerate(probe.responses)]

    def check(self, policy: "VLLMPolicy", step: int) -> None:
        self.stats = {}
        if not self.every or self.probe is None or step % self.every:
            return
        t0 = time.perf_counter()
        probe, initial = self.probe
        trainer = self._logps(policy.inner, probe)
        served = policy.sampler.prompt_logprobs([p + r for p, r in zip(probe.prompts, probe.responses)],
                                                [len(p) for p in probe.prompts])
        g_trainer, g_initial, drift = mean_gap(served, trainer), mean_gap(served, initial), mean_gap(trainer, initial)
        strike = g_trainer >= STALE_MIN_GAP and g_trainer >= STALE_RATIO * g_initial
        self.strikes = self.strikes + 1 if policy.replicas.max(int(strike)) else 0
        self.stats = {"sync_gap_trainer": g_trainer, "sync_gap_initial": g_initial, "sync_drift": drift,
                      "check_seconds": time.perf_counter() - t0}
        if self.strikes >= STALE_STRIKES:
            raise SamplerStaleError(
                f"after step {step}: the vLLM sampler does not serve the trained weights: on {sum(map(len, initial))} "
                f"probe tokens its log-probs are {g_trainer:.4f} nats a token from the trainer's and {g_initial:.4f} "
                f"from the initial model's, which the trainer has moved {drift:.4f} from ({self.strikes} checks in "
                "a row); its weight sync is not taking effect, so the run stopped (docs/vllm.md, \"Does the sampler "
                "serve the trained weights?\")")


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

    def __init__(self, inner: Policy, sampler, train: bool = True, check_every: int = 0):
        self.inner, self.sampler, self.train = inner, sampler, train
        self.sync_check = SyncCheck(check_every if train else 0)
        self.model, self.tok, self.pad_id, self.eos_ids, self.device = (inner.model, inner.tok, inner.pad_id,
                                                                         inner.eos_ids, inner.device)
        self.steps = 0
        self.sync_seconds = self.wake_seconds = 0.0
        if not train:
            return
        self.sync_seconds = sampler.sync(self.model, 0)  # vLLM serves the base weights until the first sync
        if getattr(sampler, "external", False):  # a server the user started may serve another model
            gap = model_gap(self)
            if gap > SAME_MODEL_GAP:
                sampler.close()
                raise BackendError(f"--vllm-url {sampler.url}: the server's model ({sampler.model_name}) is not the "
                                   f"one being trained: its log-probs of a probe text differ from the trainer's by "
                                   f"{gap:.3f} nats a token on average (the same weights: < 0.001 in float32); "
                                   "serve the model given by --model")

    def sample(self, prompts_N, settings, gen) -> Rollout:
        # a data-parallel rank's share of the draws (train/distributed.py ShardDraws): the run's generator, and
        # the global index of this rank's first row
        self.sync_check.check(self, self.steps)  # the weights about to sample are the trainer's
        base, first = (gen.gen, gen.lo) if hasattr(gen, "lo") else (gen, 0)
        seed = int(torch.randint(2 ** 31, (1,), generator=base))  # per-request seeds derive from it
        t0 = time.perf_counter()
        responses, logp = self.sampler.sample(prompts_N, settings, seed, first)
        rest = getattr(self.sampler, "rest", None)  # --vllm-sleep: free the engine's GPU memory until the next sync
        if rest is not None:
            rest()
        stats = {"decode_seconds": time.perf_counter() - t0, "sync_seconds": self.sync_seconds,
                 **self.sync_check.stats}  # this step's check, where one ran
        if getattr(self.sampler, "sleep_level", 0):
            stats["wake_seconds"] = self.wake_seconds
        rollout = Rollout(prompts_N, responses, sampler_logp=logp, stats=stats)
        self.sync_check.maybe_fix_probe(self, rollout)
        return rollout

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


@dataclass(frozen=True)
class SamplerSpec:
    """A training run's vLLM sampler, decided once (train.loop.start_run: `sampler_spec` of the config whose --sampler
    it resolved) and handed to everything that checks or makes it (check_training, make_policy, `check`,
    `make_sampler`), none of which reads a command's config: `kind` "vllm" (an in-process engine) or "vllm-server"
    (`url`, or a server opct starts), the model it serves and how its engine is sized, and how often the weight sync is
    checked. Each field is the run's own setting of that name (config.StudentSampler, config.VLLMSettings, the
    model, LoRA and sampling settings), copied, never re-derived."""
    kind: str  # --sampler, resolved: vllm | vllm-server
    model: str  # --model: the base model the engine serves (its dense local copy, models.resolve)
    lora_rank: int
    seed: int
    max_new_tokens: int
    url: str  # --vllm-url ("" = start a server, for vllm-server)
    check_every: int  # --sampler-check-every
    dtype: str  # --vllm-dtype
    kv_cache_gib: float  # --vllm-kv-cache-gib
    gpu_memory: float  # --vllm-gpu-memory
    sleep: int  # --vllm-sleep
    cuda_graphs: bool  # --cuda-graphs


def sampler_spec(cfg) -> SamplerSpec | None:
    """The vLLM sampler a training config's resolved --sampler asks for; None where the training backend samples
    the student itself (--sampler policy, and SFT, which has no sampler setting)."""
    if cfg.sampler == "auto":
        raise ValueError("sampler_spec needs a resolved --sampler (policy, vllm or vllm-server), got auto: "
                         "train.loop.start_run resolves it (backends.resolve_sampler)")
    if cfg.sampler == "policy":
        return None
    return SamplerSpec(kind=cfg.sampler, model=cfg.model, lora_rank=cfg.lora_rank, seed=cfg.seed,
                       max_new_tokens=cfg.max_new_tokens, url=cfg.vllm_url, check_every=cfg.sampler_check_every,
                       dtype=cfg.vllm_dtype, kv_cache_gib=cfg.vllm_kv_cache_gib, gpu_memory=cfg.vllm_gpu_memory,
                       sleep=cfg.vllm_sleep, cuda_graphs=cfg.cuda_graphs)


def make_sampler(spec: SamplerSpec, eos_ids, prompt_lengths=(), *, device: torch.device, dtype: torch.dtype):
    """The vLLM sampler `spec` asks for, on the base model's dense local copy (vLLM cannot read GGUF on a CPU).
    An engine or server started here gets a context of `needed_model_len` of the run's student prompt lengths (in
    tokens); a server given by --vllm-url has its own, which must hold the longest prompt + max_new_tokens.
    On a GPU, vLLM takes `vllm_gpu_memory` of the training device's memory (weights + KV cache) and runs on that
    device (under torchrun each rank has its own engine on its own GPU); an in-process engine there captures CUDA
    graphs for LoRA runs unless `cuda_graphs` is off (a full fine-tune's engine, and a server started here, run
    eagerly, as on the CPU). `device` and `dtype`: the trainer's model's (make_policy passes them); the engine runs
    in `spec.dtype` (auto: bfloat16 on a GPU, else the trainer's)."""
    check(spec)
    check_sleep(spec.sleep, spec.kind, device)
    engine_dtype = select.resolve_vllm_dtype(spec.dtype, device, dtype)
    kw = dict(dtype=str(engine_dtype).removeprefix("torch."), lora_rank=spec.lora_rank, seed=spec.seed,
              kv_cache_gib=spec.kv_cache_gib, max_model_len=needed_model_len(prompt_lengths, spec.max_new_tokens))
    on_gpu = device.type == "cuda"
    gpu = str(torch.cuda.current_device()) if on_gpu else None
    if spec.kind == "vllm":
        # On a GPU a LoRA run's engine compiles and captures its decode as CUDA graphs unless cuda_graphs is off (a
        # slower start, then no per-kernel launches): a synced adapter is copied into vLLM's LoRA buffers, which the
        # graphs read. A full fine-tune's sync reloads the weights (vllm_worker.WeightSync re-points tied ones), not
        # known to keep the addresses a graph reads, so that engine stays eager, as every engine on the CPU.
        graphs = spec.cuda_graphs and spec.lora_rank > 0
        extra = {"gpu_memory_utilization": spec.gpu_memory, "enforce_eager": not graphs,
                 **({"sleep_level": spec.sleep} if spec.sleep else {})} if on_gpu else {}
        with visible_device(gpu):  # the engine's worker process starts with only this rank's GPU visible
            return colocated().VLLMSampler(resolve_model(spec.model), eos_ids, **kw, **extra)
    if spec.url:
        sampler = vllm_sampler.VLLMServerSampler(eos_ids, url=spec.url, lora_rank=spec.lora_rank)
        need = max(prompt_lengths, default=0) + spec.max_new_tokens
        if sampler.max_model_len is not None and sampler.max_model_len < need:
            sampler.close()
            raise BackendError(f"--vllm-url {spec.url}: the server's context is {sampler.max_model_len} tokens "
                               f"(its --max-model-len); this run needs {need} (its longest prompt, "
                               f"{need - spec.max_new_tokens}, + --max-new-tokens {spec.max_new_tokens})")
        return sampler
    extra_args = ("--gpu-memory-utilization", str(spec.gpu_memory)) if on_gpu else ()
    with visible_device(gpu):
        return vllm_sampler.VLLMServerSampler(eos_ids, model_dir=resolve_model(spec.model), extra_args=extra_args, **kw)


def colocated():
    """opct.backends.vllm_engine, the in-process engine's module. It imports vllm, an optional extra, so it is
    imported here, when an engine is built (after `check` or extras.require named the extra if vllm is missing);
    tests replace this function with a stand-in engine."""
    from opct.backends import vllm_engine

    return vllm_engine


def check_sleep(level: int, sampler: str, device: torch.device) -> None:
    """--vllm-sleep is for an in-process engine on a CUDA device (`sampler`: the resolved one); a BackendError
    otherwise, before any model loads, rather than a setting silently ignored."""
    if level and (sampler != "vllm" or device.type != "cuda"):
        raise BackendError(f"--vllm-sleep {level}: vLLM's sleep mode needs --sampler vllm (an in-process engine) on a "
                           f"CUDA device (here: the {sampler} sampler on {device.type}); leave it at 0")


INFERENCE_MAX_MODEL_LEN = 8192  # an evaluation engine's context: the model's own, up to this


class Deferred:
    """A sampler started when it is first used, not when it is made: an evaluation that never generates (the
    sycophancy axis reads its answers in one prefill through the backend) starts no engine. `close` closes it only
    if it started."""

    def __init__(self, start):
        self._start, self._sampler = start, None

    def __getattr__(self, name):  # sample, prompt_logprobs, dtype, ...: the started sampler's
        if name.startswith("_"):
            raise AttributeError(name)
        if self._sampler is None:
            self._sampler = self._start()
        return getattr(self._sampler, name)

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()


def inference_sampler(name: str, cfg, eos_ids, device: torch.device, dtype: torch.dtype) -> Deferred:
    """An in-process vLLM engine serving the model `name` for evaluation, started on first use (`Deferred`; what
    can be refused is refused now): a dense model directory (an alias, a directory, a Hub id) as it is, or an opct
    LoRA adapter directory as its base model plus the adapter. Its dtype is `vllm_dtype`'s (auto: bfloat16 on a GPU,
    else the model's), its context the model's up to INFERENCE_MAX_MODEL_LEN; on a GPU it takes `vllm_gpu_memory`
    of the device."""
    extras.require("vllm", "--eval-engine vllm", "")
    base, adapter = base_and_adapter(name)
    if base.endswith(".gguf"):
        raise BackendError(f"--eval-engine vllm: vLLM cannot load the GGUF file {base}; pass a model directory or "
                           "a Hub id, or --eval-engine policy")
    rank = adapter_rank(adapter) if adapter else 0
    try:
        ctx = getattr(AutoConfig.from_pretrained(base), "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    except (OSError, ValueError):
        ctx = DEFAULT_MAX_MODEL_LEN
    on_gpu = device.type == "cuda"
    extra = {"gpu_memory_utilization": cfg.vllm_gpu_memory, "enforce_eager": not cfg.cuda_graphs} if on_gpu else {}

    def start():
        with visible_device(str(torch.cuda.current_device()) if on_gpu else None):
            engine_dtype = str(select.resolve_vllm_dtype(cfg.vllm_dtype, device, dtype)).removeprefix("torch.")
            sampler = colocated().VLLMSampler(base, eos_ids, dtype=engine_dtype, lora_rank=rank, seed=cfg.seed,
                                              max_model_len=min(ctx, INFERENCE_MAX_MODEL_LEN),
                                              kv_cache_gib=cfg.vllm_kv_cache_gib, **extra)
        if adapter:
            sampler.serve_adapter(adapter)
        return sampler
    return Deferred(start)


def check(spec: SamplerSpec) -> None:
    """What the vLLM sampler `spec` needs, checked before any model loads (start_run) and again when the
    sampler is made: vllm importable (unless the server is someone else's), and a server given by --vllm-url
    answering, taking this client (an API key from $OPCT_VLLM_API_KEY) and with its run-time LoRA routes when the run
    trains a LoRA adapter."""
    if spec.kind == "vllm" or not spec.url:
        extras.require("vllm", f"--sampler {spec.kind}",
                "or pass --vllm-url of a running server" if spec.kind != "vllm" else "")
    if spec.kind != "vllm-server" or not spec.url:
        return
    why = unreachable(spec.url)
    if why:
        raise BackendError(f"--vllm-url {spec.url}: no vLLM server answers there ({why}); start one, or leave "
                           "--vllm-url out and opct starts one")
    why = unauthorized(spec.url)
    if why:
        raise BackendError(f"--vllm-url {spec.url}: {why}")
    if spec.lora_rank > 0 and not loads_adapters(spec.url):
        raise BackendError(f"--vllm-url {spec.url}: the server cannot load LoRA adapters at run time "
                           "(/v1/load_lora_adapter answered 404); start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                           f"and --enable-lora --max-lora-rank {max_lora_rank(spec.lora_rank)}")


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
