"""One renderer per model and side: messages -> prompt ids, and a reply -> its reasoning, its answer and the loss mask.

A `ChatFormat` is built once from a tokenizer, the chat template's options of one side (--chat-template-kwargs, and
for the teacher --teacher-chat-template-kwargs merged over them: `template_kwargs`) and the reasoning tags
(--think-tags, opct.data.reasoning.think_ids), by whoever builds the policy, before the policy and any engine:
train.loop.start_run (both sides), the demo and `opct eval` (the evaluated model's, the student's options, in
backends.inference_model). Every consumer asks it and nothing else how a prompt renders and where an answer starts:
the training step and SFT (the answer-only loss mask), the axes (`respond`, the sycophancy reading), the in-training
probes and lm-eval's adapter (opct.evals.policy_lm).

    fmt = ChatFormat.of(tok, cfg, "student")
    ids = fmt.prompt(messages)             # chat template + generation prompt; a final assistant turn is a prefill
    s = fmt.split(ids, reply)              # Split(reasoning ids | None, answer ids, closed)
    keep_NT, unclosed = fmt.answer_mask(prompts, replies, T)

Where an answer starts is data/reasoning.py's rule (its docstring): after the first CLOSE; a reply without one has
no reasoning unless it starts with OPEN or its prompt left a span open, and then its reasoning is *unclosed* (no
answer). A format without tags (`tags` None) reads every reply token as answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2 import TemplateError

from opct.data import reasoning
from opct.data.pairs import PairsError
from opct.data.reasoning import ThinkTags

SIDES = ("student", "teacher")

def template_kwargs(cfg) -> tuple[dict, dict]:
    """(student's, teacher's) chat-template options of a config with the chat settings (config.ChatSettings): the
    teacher's merged over the shared."""
    shared = json.loads(cfg.chat_template_kwargs) if cfg.chat_template_kwargs else {}
    return shared, {**shared, **(json.loads(cfg.teacher_chat_template_kwargs)
                                 if cfg.teacher_chat_template_kwargs else {})}


def _template_error() -> type[Exception]:
    return TemplateError


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` + the assistant generation prompt, via the tokenizer's chat template with its options
    `template_kwargs` (e.g. enable_thinking); when the last message is an assistant turn, it is left open instead (a
    response prefix the model continues)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PairsError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
            "consistency pairs are chat transcripts, so use an instruction-tuned model or set tokenizer.chat_template")
    # A final assistant turn is a response prefix: rendered open (no end-of-turn) for the model to continue.
    prefix = messages[-1]["role"] == "assistant"
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=not prefix,
                                            continue_final_message=prefix, return_dict=False,
                                            **(template_kwargs or {}))
    except Exception as e:  # an option the template (its raise_exception, jinja2's TemplateError) or transformers
        if not template_kwargs or not isinstance(e, (TypeError, ValueError, _template_error())):  # refuses
            raise
        raise PairsError(f"--chat-template-kwargs {json.dumps(template_kwargs)}: the chat template of "
                         f"{getattr(tokenizer, 'name_or_path', '?')!r} refused it ({e})") from None
    if hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass(frozen=True)
class Split:
    """A reply split where its reasoning ends: `reasoning` the span's ids without its tags (None: the reply has no
    reasoning), `answer` the ids after it (the whole reply without reasoning; [] when unclosed), `closed` False when
    the reasoning never closed (the token budget ran out inside it): then there is no answer, and each consumer
    decides what that counts as (an axis counts it as unclosed, the loss leaves it out)."""
    reasoning: list[int] | None
    answer: list[int]
    closed: bool = True


@dataclass(frozen=True)
class ChatFormat:
    """How one model's prompts render on one side and where its replies' answers start (module docstring).
    `options`: the chat template's options (e.g. enable_thinking); `tags`: the reasoning span's delimiters, or None
    for a model that does not reason."""
    tok: Any
    options: dict = field(default_factory=dict)
    tags: ThinkTags | None = None

    @classmethod
    def of(cls, tok, cfg=None, side: str = "student") -> ChatFormat:
        """The format of `side` ("student" or "teacher") for `tok` under a config with the chat settings
        (config.ChatSettings: its chat_template_kwargs per side, `template_kwargs`, and its think_tags); None: the
        settings' defaults (no options, think_tags auto). A tag that is not one token of `tok` raises
        reasoning.ReasoningError."""
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        if cfg is None:
            return cls(tok, {}, reasoning.think_ids(tok, "auto"))
        return cls(tok, template_kwargs(cfg)[SIDES.index(side)], reasoning.think_ids(tok, cfg.think_tags))

    @classmethod
    def sides(cls, tok, cfg=None) -> tuple[ChatFormat, ChatFormat]:
        """(student's, teacher's) formats: what a training run renders its pairs with (train.loop.render_pairs)."""
        return cls.of(tok, cfg, "student"), cls.of(tok, cfg, "teacher")

    @property
    def thinks(self) -> bool:
        """Whether replies may hold a reasoning span (the format has tags)."""
        return self.tags is not None

    def prompt(self, messages: list[dict]) -> list[int]:
        """The prompt ids of `messages` (`render_prompt` with this side's options): a generation prompt after them,
        or, when the last message is an assistant turn, that turn left open as a prefill the model continues."""
        return render_prompt(self.tok, messages, self.options)

    def text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template's text of `messages` with this side's options, as lm-eval asks for it
        (`TemplateLM.apply_chat_template`): with a generation prompt, or else the last message left open."""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=not add_generation_prompt, **self.options)

    def opens(self, prompt: list[int]) -> bool:
        """Whether `prompt` ends inside a reasoning span (its reply starts reasoning without writing OPEN)."""
        return reasoning.opens(prompt, self.tags)

    def answers_at_once(self, prompt: list[int]) -> bool:
        """Whether the model answers right after `prompt` (reasoning.answers_at_once: no tags, or the template
        closed the span in the generation prompt)."""
        return reasoning.answers_at_once(prompt, self.tags)

    def answer_start(self, prompt: list[int], reply: list[int]) -> int | None:
        """Index of the reply's first answer token after `prompt` (0 without reasoning, len(reply) for an empty
        answer); None when its reasoning never closes."""
        return reasoning.answer_start(reply, self.tags, self.opens(prompt))

    def split(self, prompt: list[int], reply: list[int]) -> Split:
        """The reply after `prompt` as (reasoning, answer, closed): `Split`."""
        start = self.answer_start(prompt, reply)
        if start == 0:
            return Split(None, list(reply))
        thought = reasoning.reasoning_ids(reply, self.tags)
        return Split(thought, [], closed=False) if start is None else Split(thought, reply[start:])

    def answer_mask(self, prompts: list[list[int]], replies: list[list[int]], T: int) -> tuple[torch.Tensor, int]:
        """(keep_NT, unclosed) for a loss over the answers only (train_on_thinking off): 1 on each reply's answer
        tokens (positions < T), 0 on its reasoning and after its end; the number of replies whose reasoning never
        closes (they keep no token)."""
        return reasoning.answer_mask(replies, self.tags, T, prompts)

    def answer_tokens(self, prompts: list[list[int]], replies: list[list[int]]) -> tuple[int, int]:
        """(answer tokens over all replies, replies whose reasoning never closes): an answer-only loss's token count
        and what it left out."""
        starts = [self.answer_start(p, r) for p, r in zip(prompts, replies)]
        return sum(len(r) - s for r, s in zip(replies, starts) if s is not None), starts.count(None)
