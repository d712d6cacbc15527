"""Where a response's reasoning ends: the thinking span of reasoning models (Qwen3, DeepSeek-R1 and the like).

A thinking model opens its response with a reasoning span, `<think> ... </think>`, then answers. opct samples and
scores the whole response either way; `train_on_thinking` chooses whether the loss covers the reasoning tokens too
(the paper's default) or only the answer after them. Which tokens delimit the span (`think_tags`):

  auto        <think> and </think> when the tokenizer holds each as one token (Qwen3, DeepSeek-R1 distills), else
              none: the model does not think, every token is answer
  none        no reasoning span
  OPEN,CLOSE  two texts of one token each

A response's answer starts right after the first CLOSE token. A response without CLOSE has no reasoning when it does
not start with OPEN and its prompt left no span open (a model that skipped thinking, or a prompt that already closed
it, as Qwen3's template does with enable_thinking false), and is *unclosed* when it does (or when its prompt ends in
an open span, as DeepSeek-R1's template's does): its reasoning ran out of tokens before the answer, so it has no
answer tokens; such responses are counted (`unclosed_reasoning`), never scored as answers.
"""

from __future__ import annotations

import torch

AUTO_TAGS = ("<think>", "</think>")


class ReasoningError(ValueError):
    pass


def _one_token(tok, text: str) -> int | None:
    ids = tok.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_ids(tok, tags: str) -> tuple[int, int] | None:
    """(open id, close id) of the reasoning span for `tags` (module docstring), or None when there is none."""
    if tags == "none":
        return None
    if tags == "auto":
        ids = tuple(_one_token(tok, t) for t in AUTO_TAGS)
        return None if None in ids else ids
    parts = [t.strip() for t in tags.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ReasoningError(f"--think-tags {tags!r}: expected auto, none or OPEN,CLOSE (e.g. <think>,</think>)")
    ids = tuple(_one_token(tok, t) for t in parts)
    if None in ids:
        bad = [t for t, i in zip(parts, ids) if i is None]
        raise ReasoningError(f"--think-tags {tags!r}: {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not one "
                             "token of this tokenizer (each tag must be one)")
    return ids


def opens(prompt: list[int], tags: tuple[int, int] | None) -> bool:
    """Whether the prompt ends inside a reasoning span (its last OPEN after its last CLOSE): the model's response
    then starts with reasoning without writing OPEN itself."""
    if tags is None or tags[0] not in prompt:
        return False
    last_open = len(prompt) - 1 - prompt[::-1].index(tags[0])
    return tags[1] not in prompt[last_open:]


def answers_at_once(prompt: list[int], tags: tuple[int, int] | None, tail: int = 8) -> bool:
    """Whether a model answers right after this prompt: it has no reasoning tags, or the prompt's generation part
    holds a closed (empty) span, as Qwen3's template renders it with enable_thinking false (a CLOSE within its last
    `tail` tokens). Otherwise a thinking model reasons first, and reading its answer at the prompt's end reads the
    wrong thing."""
    return tags is None or (tags[1] in prompt[-tail:] and not opens(prompt, tags))


def answer_start(response: list[int], tags: tuple[int, int] | None, opened: bool = False) -> int | None:
    """Index of the response's first answer token (len(response) when the answer is empty); None when the reasoning
    never closes. `opened`: the prompt left a span open (`opens`)."""
    if tags is None:
        return 0
    open_id, close_id = tags
    if close_id in response:
        return response.index(close_id) + 1
    return None if opened or response[:1] == [open_id] else 0


def answer_mask(responses: list[list[int]], tags: tuple[int, int] | None, T: int,
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
