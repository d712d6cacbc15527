"""The CPU backend: the reference backend's computation with opct's CPU kernels, for float32 models on the CPU.

Everything is applied here, once, each piece behind its own setting (`config.CPUSettings`, which is all this package
receives of a command's config; recorded with the run):

  gemm.py       fp32 matmuls through oneDNN or MKL (by CPU), frozen weights packed    cpu_gemm, pack_weights
  decoder.py    lean decode step: fused q/k/v and gate/up, LoRA merged, packed        lean_decoder, decode_matmul,
                (optionally on bfloat16 copies of the weights), kept packed weights   decode_dtype,
                on 2 MB pages                                                         decode_huge_pages
  attention.py  attention as two batched matmuls at short lengths; beyond, the flash    short_attention
                kernel on unrepeated key/value heads, in causal query chunks
  lora.py       one autograd node per LoRA linear                                     lora_node
  norms.py      RMSNorm / SwiGLU backward passes that keep fewer activations          low_memory_norms
  prefill.py    shared-prefix prefill, last layer keys-only, scoring on a prefill     keys_only_last_layer,
                (the student's sampling prefill reused for its scoring; other         prefill_reuse,
                rollouts scored on a prefill too; the teacher's shared prompt         prefill_scoring,
                prefix kept across steps; prompts and responses run in length         teacher_prefix_cache,
                groups)                                                               unpadded_prompts,
                                                                                      unpadded_scoring
  logprobs.py   token log-probs from hidden states, streaming the vocabulary          (unpadded_scoring:
                                                                                      real tokens only)
  process.py    glibc keeps freed pages (process-wide)                                keep_freed_memory
  (cli.py)      transparent huge pages, set before torch is imported                  huge_pages

Each kernel checks device, dtype and layout where it engages and falls back to the Hugging Face computation
otherwise; tests pin each against the `hf` backend.
"""

from __future__ import annotations

import time

import torch

from opct.backends.base import Rollout
from opct.backends.cpu import attention, decoder, gemm, lora, norms, process
from opct.backends.cpu.logprobs import response_logprobs
from opct.backends.cpu.prefill import GROUP_COST_TOKENS, decode, prefill, response_hidden_after_prefill
from opct.backends.hf import HFPolicy
from opct.config import CPUSettings


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if torch.device(device).type != "cpu":
        return f"the cpu backend runs on the CPU, not {device}"
    if dtype != torch.float32:
        return f"the cpu backend runs float32 models, not {str(dtype).removeprefix('torch.')}"
    return None


def setup_process(cfg: CPUSettings, decode_dtype: str = "float32") -> None:
    """The process-wide settings: kernel choices and memory behaviour; `decode_dtype` the lean decoder's weights."""
    gemm.configure(cfg.cpu_gemm, cfg.pack_weights)
    decoder.configure(cfg.decode_matmul, decode_dtype, cfg.decode_huge_pages)
    if cfg.keep_freed_memory:
        process.keep_freed_memory()  # each step re-allocates the same large buffers: keep their pages
    # huge_pages must precede torch's first allocation: the CLI applies it (cli.before_torch)


def patch_model(model, cfg: CPUSettings, decode_dtype: str = "float32") -> None:
    """The per-model kernels (attention, norms, LoRA linears); each leaves what it does not cover unchanged."""
    setup_process(cfg, decode_dtype)
    if cfg.short_attention and getattr(model, "_supports_attention_backend", False):
        attention.use(model)
    if cfg.low_memory_norms:
        norms.use(model)
    if cfg.lora_node:
        lora.speed_up(model)


class CPUPolicy(HFPolicy):
    """`hf`'s policy with the kernels above. Sampling prefills the prompts (sharing their common prefix) and
    decodes through the lean decoder. When a rollout is scored whole (one micro-batch) and the teacher is the same
    module with LoRA disabled, the sampling prefill runs under grad and the student's scoring runs only the
    response tokens on its KV cache. Other rollouts (sampled by vLLM, a micro-batch of a larger step, SFT's) are scored
    the same way with a prefill run at scoring time (`prefill_scoring`). The teacher always scores as the student
    does (prefill + responses, its shared prompt prefix kept across steps), so identical prompts still give
    bit-identical log-probs."""
    name = "cpu"

    def __init__(self, model, tok, eos_ids: set[int], cfg: CPUSettings, decode_dtype: str = "float32",
                 micro_batch: int = 1 << 30, lora_dropout: float = 0.0, train: bool = True):
        patch_model(model, cfg, decode_dtype)  # before the teacher copy (full fine-tuning): the copy runs the same
        super().__init__(model, tok, eos_ids, train=train)
        self.cfg = cfg
        shared = train and self.frozen.shared
        self.reuse_up_to = micro_batch if cfg.prefill_reuse and lora_dropout == 0 and shared else 0
        self.prefill_scoring = cfg.prefill_scoring and lora_dropout == 0 and shared
        self.prefix_cache: dict | None = {} if cfg.teacher_prefix_cache else None
        self._prompt_groups = GROUP_COST_TOKENS if cfg.unpadded_prompts else None  # prefill's group_cost

    def describe(self) -> dict:
        return {**super().describe(), "cpu_gemm_kernel": gemm.SETTINGS["kernel"]}  # what cpu_gemm: auto chose

    def sample(self, prompts_N, settings, gen) -> Rollout:
        reuse = not self.is_teacher and len(prompts_N) <= self.reuse_up_to
        was_training = self.model.training
        self.model.eval()  # no dropout either way; eval mode only makes that explicit
        t0 = time.perf_counter()
        with torch.set_grad_enabled(reuse and torch.is_grad_enabled()):
            pre = prefill(self.model, prompts_N, self.pad_id, keys_only=self.cfg.keys_only_last_layer,
                          group_cost=self._prompt_groups)
        t1 = time.perf_counter()
        responses = decode(self.model, pre, settings, self.eos_ids, self.pad_id, gen, lean=self.cfg.lean_decoder)
        if not reuse:
            self.model.train(was_training)
        # decode_seconds: the decoder build and decode loop (the prompt prefill excluded)
        return Rollout(prompts_N, responses, stats={"decode_seconds": time.perf_counter() - t1,
                                                    "prefill_seconds": t1 - t0},
                       state=pre if reuse else None)

    def _generate_plain(self, prompts_B, settings, gen) -> list[list[int]]:
        pre = prefill(self.model, prompts_B, self.pad_id, keys_only=self.cfg.keys_only_last_layer)
        return decode(self.model, pre, settings, self.eos_ids, self.pad_id, gen, lean=self.cfg.lean_decoder)

    def _hidden(self, prompts_N, rollout, batch, grad: bool) -> torch.Tensor:
        if rollout.state is None and not self.prefill_scoring:
            return super()._hidden(prompts_N, rollout, batch, grad)
        if rollout.state is not None and not self.is_teacher:
            assert prompts_N == rollout.prompts, "a kept prefill scores only the prompts it was sampled on"
            pre = rollout.state
        else:  # the teacher, and rollouts with no kept prefill: the sampling path's prefill, run now
            if grad:
                self.model.train()
            keep = self.prefix_cache if self.is_teacher else None  # only frozen weights' prefix KV outlives a step
            pre = prefill(self.model, prompts_N, self.pad_id, prefix_cache=keep,
                          keys_only=self.cfg.keys_only_last_layer, group_cost=self._prompt_groups)
        group_cost = GROUP_COST_TOKENS if self.cfg.unpadded_scoring else None
        return response_hidden_after_prefill(self.model, pre, rollout.responses, self.pad_id, group_cost)

    def _logprobs(self, h_NTH, tokens_NT, mask_NT) -> torch.Tensor:
        return response_logprobs(self.model, h_NTH, tokens_NT, mask_NT if self.cfg.unpadded_scoring else None)
