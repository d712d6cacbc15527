"""The seam between the algorithm and its execution: a `Policy` samples rollouts and scores them.

The OPCT and SFT steps (`opct.algo`) only ever call these four methods; devices, dtypes, kernels and engines live
behind them. A backend is a Policy subclass (`hf`: plain transformers + PEFT; `cpu`: opct's CPU kernels).

    policy.sample(prompts_N, settings, gen) -> Rollout         the student samples, one response per prompt
    policy.score(prompts_N, rollout, grad=...) -> Scores       log-probs of the rollout's tokens after prompts_N
    with policy.teacher() as teacher: teacher.score(...)       the same, by the frozen initial model
    policy.after_step()                                        after each optimizer step (weight sync; no-op here)
    policy.replicas.sum(x)                                     x summed over data-parallel processes (x alone)

Evaluation and in-training probes use the same policy's inference face (no gradients, the weights as they are now,
dropout off), so an axis never touches a model or names a backend:

    policy.generate(prompts_N, settings, gen, batch_size) -> responses    token ids, one response per prompt
    policy.next_token_logprobs(prompts_N, token_ids_N, groups, batch_size) -> [logp_K]
                                                               log P(token | prompt) of the tokens asked for
    policy.continuation_logprobs(prompts_N, continuations_N, batch_size) -> [(logp_T, greedy_T)]
                                                               each continuation token's log-prob after the prompt
                                                               and the tokens before it, and whether it is the
                                                               most likely token there (lm-eval's loglikelihood)

`backends.make_policy(..., train=False)` builds a policy for inference only (no frozen teacher, no optimizer);
`backends.inference_model(name, cfg)` loads a model into one, with its `ChatFormat` (built first). A policy takes and returns token ids only: how
messages become a prompt and where a reply's answer starts is the caller's `opct.data.chat.ChatFormat`.

Shape letters: N sequences (prompts x samples), T response positions, H hidden size, V vocabulary.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from opct.backends.sampling import SamplingSettings
from opct.errors import UserError
from opct.train.distributed import SINGLE, Replicas


class BackendError(UserError, ValueError):
    """The device, dtype or backend asked for cannot be used here; the message says why."""


DECODE_DTYPE_NEEDS_MERGED = ("--decode-dtype {} on the hf backend samples from a merged copy of a LoRA model: add "
                             "--merged-decode (with --lora-rank > 0), or leave --decode-dtype at float32")


@dataclass
class Rollout:
    """One response per prompt. `state` is backend-private and belongs to the rollout as a whole: `parts` drops it
    from any part that is not the whole rollout."""
    prompts: list[list[int]]
    responses: list[list[int]]  # sampled token ids; each ends with EOS when one was produced
    sampler_logp: list[list[float]] | None = None  # the sampler's own log-probs, when it reports them (never used
    #                                                 in a loss: the trainer recomputes its own)
    stats: dict = field(default_factory=dict)  # numbers to log, e.g. decode_seconds
    state: Any = None

    @property
    def n_tokens(self) -> int:
        return sum(len(r) for r in self.responses)

    def parts(self, size: int) -> list[tuple[slice, Rollout]]:
        """Consecutive micro-batches of at most `size` rows, each with the slice of the prompts it covers."""
        n = len(self.responses)
        if size >= n:
            return [(slice(0, n), self)]
        cut = lambda xs, c: None if xs is None else xs[c]  # noqa: E731
        return [(c, Rollout(self.prompts[c], self.responses[c], cut(self.sampler_logp, c)))
                for c in (slice(i, i + size) for i in range(0, n, size))]


@dataclass
class Scores:
    """A policy's view of a rollout's tokens: logp_NT (float32) of each response token, 0 at padding; with
    `hidden=True` also the final hidden states and a function from hidden rows to float32 logits, for the exact
    losses, which stream over positions and never build N x T x V logits at once."""
    logp_NT: torch.Tensor
    mask_NT: torch.Tensor  # 1 on real response tokens
    hidden_NTH: torch.Tensor | None = None
    logits: Callable[[torch.Tensor], torch.Tensor] | None = None  # hidden_MH -> logits_MV (float32)


class Policy:
    """The interface the algorithm consumes. Subclasses set `model` (the trainable module), `tok`, `pad_id`,
    `eos_ids` and `device`."""
    name = "base"
    model: torch.nn.Module
    tok: Any
    pad_id: int
    eos_ids: set[int]
    device: torch.device
    replicas: Replicas = SINGLE  # the data-parallel processes this one belongs to (train/distributed.py)

    def sample(self, prompts_N: list[list[int]], settings: SamplingSettings, gen: torch.Generator) -> Rollout:
        raise NotImplementedError

    def score(self, prompts_N: list[list[int]], rollout: Rollout, *, grad: bool, hidden: bool = False,
              sync: bool = True) -> Scores:
        """`sync`: with data-parallel replicas, whether this score's backward exchanges gradients (False for all
        but a step's last micro-batch)."""
        raise NotImplementedError

    def teacher(self) -> AbstractContextManager[Policy]:
        """`with policy.teacher() as t:` a Policy for the frozen initial model (no grad)."""
        raise NotImplementedError

    def generate(self, prompts_N: list[list[int]], settings: SamplingSettings, gen: torch.Generator,
                 batch_size: int = 16) -> list[list[int]]:
        """One response per prompt (token ids, each ending with EOS when one was produced), in input order, without
        gradients and with dropout off. Prompts run in batches of at most `batch_size` of similar length
        (`batching.by_length`), all drawing from `gen` in that order, so the same call gives the same responses."""
        raise NotImplementedError

    def next_token_logprobs(self, prompts_N: list[list[int]], token_ids_N: list[list[int]],
                            groups: list | None = None, batch_size: int = 32) -> list[torch.Tensor]:
        """For each prompt, log P(t | prompt) (float32, on the CPU) of each token t in token_ids_N[i]: the
        next-token distribution, read without generating. `groups` (one key per prompt): prompts with the same key
        share a token prefix, which may then run once for them all (same numbers up to float rounding)."""
        raise NotImplementedError

    def continuation_logprobs(self, prompts_N: list[list[int]], continuations_N: list[list[int]],
                              batch_size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each prompt and its continuation: log P(c_t | prompt, c_<t) of each continuation token (float32, on
        the CPU) and whether c_t is the most likely token at its position (bool): what lm-eval's loglikelihood
        requests ask (opct.evals.policy_lm). Without gradients, dropout off; requests with the same prompt (a
        question's answer choices) may share its forward (same numbers up to float rounding)."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Called after every optimizer step. In-process backends read the live weights and need nothing."""

    def after_load(self, step: int) -> None:
        """Called when a resumed checkpoint of `step` has replaced the trainable weights; as after_step."""

    def close(self) -> None:
        """Release what the policy holds outside this process (a vLLM engine or server); nothing in-process."""

    def describe(self) -> dict:
        """What run.json records about this policy's execution."""
        p = next(self.model.parameters())
        return {"backend": self.name, "device": str(p.device), "dtype": str(p.dtype).removeprefix("torch.")}
