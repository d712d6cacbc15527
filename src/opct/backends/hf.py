"""The reference backend: transformers + PEFT on any device and dtype, the model's own modules unpatched.

Sampling runs the model's own forward with a KV cache under explicit settings (`sampling.decode_loop`); scoring
runs prompt + response in one forward and takes log-softmax in float32. Two decode accelerations apply where they
can, each behind its own setting: on CUDA, decode steps replayed as CUDA graphs (static_decode.py, `cuda_graphs`),
and training rollouts sampled from a merged-LoRA copy (merged_decode.py, `merged_decode`, `decode_dtype`). Every
other backend is tested against this one (same log-probs, losses and gradients on the same tokens).
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from opct.algo.losses import token_logprobs
from opct.backends import merged_decode, static_decode
from opct.backends.base import DECODE_DTYPE_NEEDS_MERGED, BackendError, Policy, Rollout, Scores
from opct.backends.batching import Batch, build_batch, by_length, common_prefix, left_pad
from opct.backends.sampling import SamplingSettings, decode_loop
from opct.models import Teacher, lm_parts, unwrap
from opct.train.distributed import set_grad_sync


def head_logits(model, hidden_H: torch.Tensor) -> torch.Tensor:
    """The LM head on final hidden states, with the logit soft-capping or scaling some models apply after it.
    `logit_quirks` lists those; code that computes logits another way must check it."""
    m = unwrap(model)
    logits = m.get_output_embeddings()(hidden_H)
    arch = m.config  # the model's transformers config: these attributes exist on some architectures only
    if getattr(arch, "logit_scale", None) not in (None, 1.0):  # Cohere
        logits = logits * arch.logit_scale
    if getattr(arch, "logits_scaling", None) not in (None, 1.0):  # Granite
        logits = logits / arch.logits_scaling
    if getattr(arch, "final_logit_softcapping", None):  # Gemma 2
        cap = arch.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def logit_quirks(model) -> bool:
    """Whether `head_logits` does more than apply the output layer for this model."""
    arch = unwrap(model).config
    return bool(getattr(arch, "final_logit_softcapping", None) or getattr(arch, "logit_scale", None) not in (None, 1.0)
                or getattr(arch, "logits_scaling", None) not in (None, 1.0))


def response_hidden(model, batch: Batch, replica=None) -> torch.Tensor:
    """Final hidden states predicting each response token: hidden_NTH (position t predicts response_NT[:, t]).
    With a data-parallel `replica` (train/distributed.py) the body runs through it, where DDP / FSDP2 hook in."""
    T = batch.response_BT.shape[1]
    kw = dict(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
              position_ids=batch.position_ids_BL, use_cache=False)
    if replica is not None:
        return replica(part="body", **kw)[:, -T - 1:-1]
    body, _ = lm_parts(model)
    return body(**kw).last_hidden_state[:, -T - 1:-1]


def chunked_token_logprobs(logits_fn, hidden_NTH: torch.Tensor, tokens_NT: torch.Tensor,
                           rows: int = 1024) -> torch.Tensor:
    """token_logprobs(logits_fn(hidden), tokens) over chunks of `rows` positions; under grad each chunk's logits
    are recomputed in backward (activation checkpointing), so at most rows x V logits exist at a time."""
    N, T, H = hidden_NTH.shape
    h_MH, tok_M = hidden_NTH.reshape(N * T, H), tokens_NT.reshape(N * T)

    def one(h, tok):
        return token_logprobs(logits_fn(h), tok)

    grad = torch.is_grad_enabled() and hidden_NTH.requires_grad
    parts = [checkpoint(one, h_MH[i:i + rows], tok_M[i:i + rows], use_reentrant=False) if grad
             else one(h_MH[i:i + rows], tok_M[i:i + rows]) for i in range(0, N * T, rows)]
    return torch.cat(parts).view(N, T)


def generate(model, prompts_N: list[list[int]], settings: SamplingSettings, eos_ids: set[int], pad_id: int, gen,
             cuda_graphs: bool = False, lm=None) -> list[list[int]]:
    """Sample a response to each prompt: one left-padded prefill, then `decode_loop` over a KV cache. With
    `cuda_graphs` on a CUDA device, for a model static_decode supports: a static cache, each decode step one
    replayed CUDA graph; otherwise transformers' dynamic cache. `lm` runs the forward (default `model`; a training
    step's data-parallel wrapper). Call under no_grad."""
    device = next(model.parameters()).device
    ids_NL, mask_NL, pos_NL = left_pad(prompts_N, pad_id, device)
    if cuda_graphs and device.type == "cuda" and static_decode.unsupported_reason(model) is None:
        dtype = unwrap(model).get_input_embeddings().weight.dtype
        first_NV, step = static_decode.prefill(model, unwrap(model).config, ids_NL, mask_NL, pos_NL,
                                               settings.max_new_tokens, dtype, graphs=True)
        return decode_loop(first_NV, step, settings, eos_ids, pad_id, gen)
    lm = model if lm is None else lm
    cache = DynamicCache()
    out = lm(input_ids=ids_NL, attention_mask=mask_NL, position_ids=pos_NL, past_key_values=cache, use_cache=True,
             logits_to_keep=1)
    state = {"mask": mask_NL, "pos": pos_NL[:, -1]}

    def step(tok_N, i):
        state["pos"] = state["pos"] + 1
        state["mask"] = torch.cat([state["mask"], state["mask"].new_ones((len(prompts_N), 1))], dim=1)
        o = lm(input_ids=tok_N[:, None], attention_mask=state["mask"], position_ids=state["pos"][:, None],
               past_key_values=cache, use_cache=True)
        return o.logits[:, -1]

    return decode_loop(out.logits[:, -1], step, settings, eos_ids, pad_id, gen)


@torch.no_grad()
def shared_prefix_logits(model, ids: list[list[int]], pad: int, batch_size: int = 32, groups: list | None = None,
                         tail: list[int] | None = None):
    """Yields (row indices, logits_BKV) for the last positions of each row of `ids`, batch by batch: K is the batch's
    largest `tail[i]` (default 1: the token that follows each row), right-aligned, so row i's logits for its last
    tail[i] positions are logits_BKV[b, K - tail[i]:] (on the model's device, in its dtype).

    Without `groups`: one forward pass per row; rows are sorted by length (less padding), left-padded, given explicit
    position ids (so a padded row equals the same row run alone), and only the last K positions' logits are computed
    (logits_to_keep=K).

    With `groups` (one key per row): rows with the same key share a token prefix (one question with and without its
    cue; one question's answer choices), so that prefix's KV cache is computed once per group and each member only
    runs its own suffix on top of it, which keeps at least its last tail[i] tokens (where it is read). Same numbers
    up to float rounding, fewer tokens.
    """
    device = next(model.parameters()).device
    tail = [1] * len(ids) if tail is None else tail
    members: dict = {}
    for i, g in enumerate(range(len(ids)) if groups is None else groups):
        members.setdefault(g, []).append(i)
    glist = [(common_prefix([ids[i] for i in m]) if groups is not None else 0, m) for m in members.values()]
    glist = [(min(p, min(len(ids[i]) - tail[i] for i in m)), m) for p, m in glist]
    glist.sort(key=lambda g: (g[0], len(ids[g[1][0]])))  # similar lengths together: less padding
    bare = sum(p == 0 for p, _ in glist)  # groups with nothing to share run in chunks of their own
    chunks = [glist[a:min(a + batch_size, end)] for lo, end in ((0, bare), (bare, len(glist)))
              for a in range(lo, end, batch_size)]
    for chunk in chunks:
        kv = None
        if chunk[-1][0] > 0:  # prefix pass for this chunk's groups
            prefix_GP, pmask_GP, _ = left_pad([ids[m[0]][:p] for p, m in chunk], pad)
            pos_GP = (pmask_GP.cumsum(-1) - 1).clamp(min=0)
            cache = model(input_ids=prefix_GP.to(device), attention_mask=pmask_GP.to(device),
                          position_ids=pos_GP.to(device), use_cache=True, logits_to_keep=1).past_key_values
            kv = [(layer.keys, layer.values) for layer in cache.layers]
        rows = sorted(((i, g) for g, (p, m) in enumerate(chunk) for i in m),
                      key=lambda r: len(ids[r[0]]) - chunk[r[1]][0])
        for rstart in range(0, len(rows), batch_size):
            sub = rows[rstart:rstart + batch_size]
            g_B = torch.tensor([g for _, g in sub])
            suffix_BS, smask_BS, _ = left_pad([ids[i][chunk[g][0]:] for i, g in sub], pad)
            mask_BT = smask_BS if kv is None else torch.cat([pmask_GP[g_B], smask_BS], 1)
            # left padding shifts positions; give each row positions 0..len-1 so results match unbatched runs
            pos_BS = (mask_BT.cumsum(-1) - 1).clamp(min=0)[:, -suffix_BS.shape[1]:]
            past = None if kv is None else DynamicCache(
                [(k[g_B.to(k.device)], v[g_B.to(v.device)]) for k, v in kv], config=model.config)
            keep = max(tail[i] for i, _ in sub)
            logits_BKV = model(input_ids=suffix_BS.to(device), attention_mask=mask_BT.to(device),
                               position_ids=pos_BS.to(device), past_key_values=past, use_cache=past is not None,
                               logits_to_keep=keep).logits
            yield [i for i, _ in sub], logits_BKV


def next_token_logprobs(model, ids: list[list[int]], pad: int, batch_size: int = 32, groups: list | None = None):
    """Yields (row indices, logp_BV) for the token that follows each prompt in `ids`, batch by batch (on the CPU,
    float32); `groups` as in shared_prefix_logits."""
    for rows, logits_BKV in shared_prefix_logits(model, ids, pad, batch_size, groups):
        yield rows, torch.log_softmax(logits_BKV[:, -1].float(), -1).cpu()


def continuation_logprobs(model, prompts: list[list[int]], conts: list[list[int]], pad: int, batch_size: int = 32):
    """[(logp_T, greedy_T)] per (prompt, continuation): each continuation token's log-prob after the prompt and the
    tokens before it (float32, on the CPU) and whether it is the most likely token there. Requests with the same
    prompt (a question's answer choices) share its KV cache (shared_prefix_logits)."""
    if any(not c for c in conts) or any(not p for p in prompts):
        raise ValueError("a continuation's log-probs need at least one prompt token and one continuation token")
    out: list = [None] * len(prompts)
    rows_in = [p + c[:-1] for p, c in zip(prompts, conts)]  # the last len(c) positions predict c
    for rows, logits_BKV in shared_prefix_logits(model, rows_in, pad, batch_size, [tuple(p) for p in prompts],
                                                 [len(c) for c in conts]):
        K = logits_BKV.shape[1]
        for b, i in enumerate(rows):
            c = torch.tensor(conts[i], device=logits_BKV.device)
            logits_TV = logits_BKV[b, K - len(c):].float()
            logp_T = torch.log_softmax(logits_TV, -1).gather(-1, c[:, None])[:, 0]
            out[i] = (logp_T.cpu(), (logits_TV.argmax(-1) == c).cpu())
    return out


class HFPolicy(Policy):
    name = "hf"

    def __init__(self, model, tok, eos_ids: set[int], cuda_graphs: bool = False, merged_decode: bool = False,
                 decode_dtype: str = "float32", train: bool = True):
        self.model, self.tok, self.eos_ids = model, tok, set(eos_ids)
        # On CUDA, decode over a static KV cache, each step one replayed CUDA graph, where `generate` finds it applies.
        self.cuda_graphs = cuda_graphs
        # A LoRA model samples from a copy with the adapters merged in (backends/merged_decode.py), made on first use
        # (None: not made yet; False: this model or setup cannot), in decode_dtype where that is not the model's.
        self.merged_decode = merged_decode
        self.merged = None
        dtype = getattr(torch, decode_dtype)  # float32 (the default) means the model's own dtype, whatever it is
        self.decode_dtype = None if dtype in (torch.float32, next(model.parameters()).dtype) else dtype
        if self.decode_dtype is not None and not merged_decode:
            raise BackendError(DECODE_DTYPE_NEEDS_MERGED.format(decode_dtype))
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.device = next(model.parameters()).device
        self.frozen = Teacher(model) if train else None  # before any update: the frozen initial model
        self.is_teacher = False
        self.replica = None  # the DDP / FSDP2-wrapped module every forward runs through, when data-parallel

    # -- the seam ------------------------------------------------------------------------------------------------

    def sample(self, prompts_N, settings: SamplingSettings, gen) -> Rollout:
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            responses = self._generate(prompts_N, settings, gen)
        self.model.train(was_training)
        return Rollout(prompts_N, responses, stats={"decode_seconds": time.perf_counter() - t0})

    def score(self, prompts_N, rollout: Rollout, *, grad: bool, hidden: bool = False, sync: bool = True) -> Scores:
        b = build_batch(prompts_N, rollout.responses, self.pad_id, self.device)
        if grad and self.replica is not None:
            set_grad_sync(self.replica, sync)
        with torch.set_grad_enabled(grad):
            h_NTH = self._hidden(prompts_N, rollout, b, grad)
            logp_NT = self._logprobs(h_NTH, b.response_BT, b.mask_BT)
        logp_NT = logp_NT * b.mask_BT
        return Scores(logp_NT, b.mask_BT, h_NTH if hidden else None, self._logits_fn() if hidden else None)

    @contextmanager
    def teacher(self):
        if self.frozen is None:
            raise RuntimeError("an inference policy (make_policy(..., train=False)) has no teacher")
        with self.frozen() as frozen_model:
            view = copy.copy(self)
            view.model, view.is_teacher = frozen_model, True
            view.merged, view.decode_dtype = False, None  # the frozen model samples itself, never the student's copy
            if not self.frozen.shared:  # a separate frozen copy: its own sharded module under FSDP2, else none
                view.replica = self.frozen.replica
            yield view

    # -- inference --------------------------------------------------------------------------------------------------

    @contextmanager
    def _inference(self):
        """No gradients, dropout off; the module's train/eval mode restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def generate(self, prompts_N, settings: SamplingSettings, gen, batch_size: int = 16) -> list[list[int]]:
        with self._inference():
            return by_length(prompts_N, batch_size, lambda b: self._generate_plain(b, settings, gen))

    def next_token_logprobs(self, prompts_N, token_ids_N, groups=None, batch_size: int = 32) -> list[torch.Tensor]:
        out: list = [None] * len(prompts_N)
        with self._inference():
            for rows, logp_BV in next_token_logprobs(self.model, prompts_N, self.pad_id, batch_size, groups):
                for b, i in enumerate(rows):
                    out[i] = logp_BV[b, token_ids_N[i]]
        return out

    def continuation_logprobs(self, prompts_N, continuations_N, batch_size: int = 32):
        with self._inference():
            return continuation_logprobs(self.model, prompts_N, continuations_N, self.pad_id, batch_size)

    # -- what subclasses change ------------------------------------------------------------------------------------

    def _generate(self, prompts_N, settings, gen) -> list[list[int]]:
        if self.merged is None:  # decided once: data parallelism is set up before the first sampling
            why = ("data-parallel runs sample from the model itself" if self.replica is not None
                   else merged_decode.unsupported_reason(self.model, self.decode_dtype))
            if why and self.decode_dtype is not None:
                raise BackendError(f"--decode-dtype {str(self.decode_dtype).removeprefix('torch.')} on the hf "
                                   f"backend samples from a merged copy of a LoRA model, and this run cannot make one "
                                   f"({why}): leave --decode-dtype at float32")
            use = self.merged_decode and why is None
            self.merged = merged_decode.MergedCopy(self.model, self.decode_dtype) if use else False
        if self.merged:
            model = self.merged.refresh().model  # the adapters as they are now, after the last update
            return generate(model, prompts_N, settings, self.eos_ids, self.pad_id, gen, cuda_graphs=self.cuda_graphs)
        lm = self.model if self.replica is None else lambda **kw: self.replica(part="lm", **kw)
        # CUDA graphs only outside data parallelism: a DDP / FSDP2 forward runs collectives and hooks of its own.
        return generate(self.model, prompts_N, settings, self.eos_ids, self.pad_id, gen,
                        cuda_graphs=self.cuda_graphs and self.replica is None, lm=lm)

    def _generate_plain(self, prompts_B, settings, gen) -> list[list[int]]:
        """Inference sampling: the model itself (never a merged copy), its own forward, no data-parallel wrapper."""
        return generate(self.model, prompts_B, settings, self.eos_ids, self.pad_id, gen,
                        cuda_graphs=self.cuda_graphs and self.replica is None)

    def _hidden(self, prompts_N, rollout, batch: Batch, grad: bool) -> torch.Tensor:
        if grad:
            self.model.train()
        return response_hidden(self.model, batch, self.replica)

    def _logprobs(self, h_NTH, tokens_NT, mask_NT) -> torch.Tensor:
        return chunked_token_logprobs(lambda h: head_logits(self.model, h).float(), h_NTH, tokens_NT)

    def _logits_fn(self):
        """hidden rows -> float32 logits, by this policy's model; a teacher's re-enters the frozen model's context,
        since the exact losses call it again in backward."""
        if not self.is_teacher:
            model = self.model
            return lambda h: head_logits(model, h).float()
        frozen = self.frozen

        def teacher_logits(h):
            with frozen() as m:
                return head_logits(m, h).float()
        return teacher_logits
