"""The colocated vLLM engine: `VLLMSampler`, a `vllm.LLM` in this process on the trainer's current weights (the
interface, sampling, log-probs and weight sync: opct.backends.vllm_sampler's docstring).

The one module of opct that imports vllm, an optional extra (`pip install 'opct[vllm]'`): opct.backends.vllm imports
it only when a run asks for an in-process engine, after extras.require has named the extra if vllm is missing. vLLM's
classes are looked up on its modules when used (`vllm.SamplingParams(...)`), so the contract tests' stand-ins
(tests/contract/test_vllm_contract.py) are what runs. The environment variables the engine reads
(`_set_env_defaults`) are set when one is built, before its engine core starts.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import vllm
import vllm.inputs
import vllm.lora.request

from opct.backends.vllm_sampler import (DEFAULT_MAX_MODEL_LEN, ENGINE_EXIT_S, WORKER_EXT, _Closing, _is_peft,
                                        _set_env_defaults, _Versions, max_lora_rank, request_seed)


class VLLMSampler(_Closing):
    """In-process: a colocated `vllm.LLM` on the model in `model_dir` (a dense local directory; vLLM cannot load
    GGUF on CPU). `lora_rank` > 0 enables LoRA with room for adapters up to that rank; `eos_ids` are the stop ids
    (opct's: the tokenizer's EOS plus the generation config's)."""

    def __init__(self, model_dir: str, eos_ids, *, dtype: str = "float32", lora_rank: int = 0,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, seed: int = 0, workdir: str | None = None,
                 kv_cache_gib: float = 1, enforce_eager: bool = True, sleep_level: int = 0, **llm_kwargs):
        self.own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="opct-vllm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rpc_dir = _set_env_defaults(os.environ, kv_cache_gib)
        self.eos_ids = sorted(int(e) for e in eos_ids)
        self.lora = lora_rank > 0
        self.max_model_len = max_model_len
        kw = dict(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=2) if self.lora else {}
        if sleep_level:
            kw["enable_sleep_mode"] = True
        self.model_dir, self.sleep_level, self.asleep = model_dir, sleep_level, False
        self.llm = vllm.LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                            enforce_eager=enforce_eager, generation_config="vllm", worker_extension_cls=WORKER_EXT,
                            **kw, **llm_kwargs)
        self._close_at_exit()
        self.versions = _Versions(self.workdir)
        self.lora_request = None  # the adapter served now; None = the engine's own weights
        self.dtype = dtype

    def rest(self) -> None:
        """With `sleep_level` (vLLM's sleep mode, GPU only): free the engine's GPU memory while the trainer runs. Level
        1 moves the weights to host memory and drops the KV cache; level 2 drops both."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake(self) -> None:
        """Take the GPU memory back before the next `sync` (which must follow: an adapter is always loaded after the
        wake, never carried across a sleep). After level 2 the weights are garbage until reloaded: a LoRA engine's
        base weights from `model_dir` here (a full fine-tune's come with its sync)."""
        if not self.asleep:
            return
        self.llm.wake_up(tags=["weights"])
        if self.sleep_level == 2 and self.lora:
            self.llm.collective_rpc("opct_reload_weights", args=(str(self.model_dir),))
        self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.asleep = False

    def serve_adapter(self, path) -> None:
        """Serve the saved PEFT adapter in `path` (not a version this sampler wrote: it is never deleted) from now
        on, under a fresh adapter id."""
        vid = self.versions.new_id()
        self.lora_request = vllm.lora.request.LoRARequest(f"opct-{vid}", vid, str(path))
        self.llm.llm_engine.add_lora(self.lora_request)

    def _params(self, settings, seed: int | None, **kw):
        return vllm.SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                              max_tokens=settings.max_new_tokens, seed=seed, stop_token_ids=self.eos_ids,
                              logprobs=0, detokenize=False, skip_special_tokens=False, **kw)

    def sample(self, prompts_N: list[list[int]], settings, seed: int,
               first: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt under `settings`. Returns (responses, sampler_logp): token ids (EOS included
        when produced) and vLLM's raw log-prob of each. `first`: the global index of prompts_N[0] (a data-parallel
        rank's share), so each prompt's request seed is the one a single process would give it."""
        params = [self._params(settings, request_seed(seed, first + i)) for i in range(len(prompts_N))]
        outs = self.llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompts_N], params,
                                 lora_request=self.lora_request, use_tqdm=False)
        responses, logps = [], []
        for o in outs:
            c = o.outputs[0]
            responses.append(list(c.token_ids))
            logps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        return responses, logps

    def prompt_logprobs(self, seqs_N: list[list[int]], starts_N: list[int]) -> list[list[float]]:
        """vLLM's log-probs of the given tokens seqs_N[i][starts_N[i]:], each conditioned on the tokens before it
        (prompt_logprobs: nothing is sampled that matters). starts_N[i] >= 1."""
        sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0)
        # One sequence per call on a LoRA engine: batched prompt log-probs with LoRA map adapters per request, not
        # per prompt token, and kill the engine (vllm-project/vllm#16668; on CPU an einsum shape error).
        batches = [[s] for s in seqs_N] if self.lora else [seqs_N]
        outs = [o for b in batches
                for o in self.llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(s)) for s in b], sp,
                                           lora_request=self.lora_request, use_tqdm=False)]
        return [[o.prompt_logprobs[t][s[t]].logprob for t in range(st, len(s))]
                for o, s, st in zip(outs, seqs_N, starts_N)]

    def sync(self, model, step: int) -> float:
        """Serve `model`'s current weights from now on (see the module docstring). Returns the seconds it took."""
        t0 = time.perf_counter()
        if _is_peft(model) != self.lora:
            raise ValueError(f"sync: {'a PEFT' if _is_peft(model) else 'a plain (full fine-tuning)'} model needs a "
                             f"VLLMSampler built with lora_rank {'> 0' if _is_peft(model) else '= 0'}")
        new = self.versions.save(model, step)
        if _is_peft(model):
            req = vllm.lora.request.LoRARequest(f"opct-{new[0]}", new[0], str(new[1]))
            self.llm.llm_engine.add_lora(req)
            self.lora_request = req
        else:
            self.llm.collective_rpc("opct_reload_weights", args=(str(new[1]),))
            self.llm.reset_prefix_cache()
            self.lora_request = None
        old = self.versions.retire(new)
        if old is not None:
            if (old[1] / "adapter_config.json").is_file():
                self.llm.llm_engine.remove_lora(old[0])
            shutil.rmtree(old[1], ignore_errors=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Shut the engine core down now (vLLM's own teardown at interpreter exit logs errors on closed streams),
        giving its processes `ENGINE_EXIT_S` to exit on SIGTERM: vLLM's default 5 s is too short for its worker on a busy
        2-core machine, and the SIGKILL that follows leaves the worker's shared memory behind."""
        atexit.unregister(self.close)
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=ENGINE_EXIT_S)
        self._remove_dirs()
