"""Where a response's reasoning ends: the thinking span of reasoning models (Qwen3, DeepSeek-R1 and the like).

A thinking model opens its response with a reasoning span, `<think> ... </think>`, then answers. opct samples and
scores the whole response either way; `train_on_thinking` chooses whether the loss covers the reasoning tokens too
(the paper's default) or only the answer after them. Which tokens delimit the span (`think_tags`):

  auto        <think> and </think> when the tokenizer holds each as one token (Qwen3, DeepSeek-R1 distills); else
              harmony when it holds harmony's markers (gpt-oss); else none: the model does not think, every token is
              answer
  harmony     gpt-oss's harmony format: the reasoning is the analysis channel's message, OPEN is
              `<|channel|>analysis<|message|>` and CLOSE `<|end|><|start|>assistant<|channel|>final<|message|>` (token
              sequences: the final channel's header ends the reasoning and starts the answer)
  none        no reasoning span
  OPEN,CLOSE  two texts of one token each

Tags are token-id sequences (`ThinkTags`; one token each for <think> / </think>). A response's answer starts right
after the first CLOSE. A response without CLOSE has no reasoning when it does
not start with OPEN and its prompt left no span open (a model that skipped thinking, or a prompt that already closed
it, as Qwen3's template does with enable_thinking false), and is *unclosed* when it does (or when its prompt ends in
an open span, as DeepSeek-R1's template's does): its reasoning ran out of tokens before the answer, so it has no
answer tokens; such responses are counted (`unclosed_reasoning`), never scored as answers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from opct.errors import UserError

AUTO_TAGS = ("<think>", "</think>")
HARMONY = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")  # each one (special) token of gpt-oss's


class ReasoningError(UserError, ValueError):
    pass


class ThinkTags(NamedTuple):
    """A reasoning span's delimiters as token-id sequences."""
    open: tuple[int, ...]
    close: tuple[int, ...]


def as_tags(tags) -> ThinkTags | None:
    """ThinkTags from ThinkTags, or from (open id, close id) of one token each."""
    if tags is None or isinstance(tags, ThinkTags):
        return tags
    return ThinkTags(*((t,) if isinstance(t, int) else tuple(t) for t in tags))


def _one_token(tok, text: str) -> int | None:
    ids = tok.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_ids(tok, tags: str) -> ThinkTags | None:
    """The reasoning span's delimiters for `tags` (module docstring), or None when there is none."""
    if tags == "none":
        return None
    if tags in ("auto", "harmony"):
        ids = tuple(_one_token(tok, t) for t in AUTO_TAGS)
        if tags == "auto" and None not in ids:
            return as_tags(ids)
        if all(_one_token(tok, m) is not None for m in HARMONY_MARKERS):
            return ThinkTags(*(tuple(tok.encode(t, add_special_tokens=False)) for t in HARMONY))
        if tags == "auto":
            return None
        raise ReasoningError(f"--think-tags harmony: this tokenizer does not hold harmony's markers "
                             f"{', '.join(HARMONY_MARKERS)} as one token each (not a gpt-oss tokenizer)")
    parts = [t.strip() for t in tags.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ReasoningError(f"--think-tags {tags!r}: expected auto, harmony, none or OPEN,CLOSE "
                             "(e.g. <think>,</think>)")
    ids = tuple(_one_token(tok, t) for t in parts)
    if None in ids:
        bad = [t for t, i in zip(parts, ids) if i is None]
        raise ReasoningError(f"--think-tags {tags!r}: {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not one "
                             "token of this tokenizer (each tag must be one)")
    return as_tags(ids)


def find(seq: list[int], sub: tuple[int, ...], start: int = 0) -> int:
    """The first index >= start where `sub` occurs in `seq`, or -1."""
    n = len(sub)
    for i in range(start, len(seq) - n + 1):
        if seq[i] == sub[0] and tuple(seq[i:i + n]) == sub:
            return i
    return -1


def rfind(seq: list[int], sub: tuple[int, ...]) -> int:
    """The last index where `sub` occurs in `seq`, or -1."""
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and tuple(seq[i:i + n]) == sub:
            return i
    return -1


def opens(prompt: list[int], tags) -> bool:
    """Whether the prompt ends inside a reasoning span (its last OPEN after its last CLOSE): the model's response
    then starts with reasoning without writing OPEN itself."""
    tags = as_tags(tags)
    if tags is None:
        return False
    last_open = rfind(prompt, tags.open)
    return last_open >= 0 and find(prompt, tags.close, last_open + len(tags.open)) < 0


def answers_at_once(prompt: list[int], tags, tail: int = 8) -> bool:
    """Whether a model answers right after this prompt: it has no reasoning tags, or the prompt's generation part
    holds a closed (empty) span, as Qwen3's template renders it with enable_thinking false (a CLOSE within its last
    `tail` tokens). Otherwise a thinking model reasons first, and reading its answer at the prompt's end reads the
    wrong thing."""
    tags = as_tags(tags)
    return tags is None or (find(prompt[-(tail + len(tags.close) - 1):], tags.close) >= 0 and not opens(prompt, tags))


def starts_reasoning(response: list[int], tags) -> bool:
    tags = as_tags(tags)
    return tags is not None and tuple(response[:len(tags.open)]) == tags.open


def answer_start(response: list[int], tags, opened: bool = False) -> int | None:
    """Index of the response's first answer token (len(response) when the answer is empty); None when the reasoning
    never closes. `opened`: the prompt left a span open (`opens`)."""
    tags = as_tags(tags)
    if tags is None:
        return 0
    at = find(response, tags.close)
    if at >= 0:
        return at + len(tags.close)
    return None if opened or starts_reasoning(response, tags) else 0


def reasoning_ids(response: list[int], tags) -> list[int]:
    """The reasoning span's tokens without its tags: after OPEN (when the response writes it), up to the first CLOSE
    (the whole rest when it never closes). For a response that has reasoning (`answer_start` not 0)."""
    tags = as_tags(tags)
    start = len(tags.open) if starts_reasoning(response, tags) else 0
    end = find(response, tags.close)
    return response[start:end if end >= 0 else len(response)]


def answer_mask(responses: list[list[int]], tags, T: int,
                prompts: list[list[int]] | None = None) -> tuple[torch.Tensor, int]:
    """(keep_NT, unclosed): 1 on each response's answer tokens (positions < T), 0 on its reasoning and after its end;
    the number of responses whose reasoning never closes (no answer tokens). `prompts`: each response's prompt, for
    one that leaves a span open (`opens`)."""
    keep_NT = torch.zeros(len(responses), T)
    unclosed = 0
    for i, r in enumerate(responses):
        start = answer_start(r, tags, prompts is not None and opens(prompts[i], tags))
        if start is None:
            unclosed += 1
            continue
        keep_NT[i, start:len(r)] = 1.0
    return keep_NT, unclosed
