"""Where a response's reasoning ends (opct.data.reasoning)."""

import pytest
import torch

from opct.data import reasoning

OPEN, CLOSE, EOS = 900, 901, 2


def test_the_answer_starts_after_the_first_close_and_an_unclosed_span_has_none():
    tags = (OPEN, CLOSE)
    assert reasoning.answer_start([OPEN, 5, 6, CLOSE, 7, 8, EOS], tags) == 4
    assert reasoning.answer_start([OPEN, 5, CLOSE, 7, CLOSE, EOS], tags) == 3  # the first close ends it
    assert reasoning.answer_start([OPEN, 5, 6], tags) is None  # ran out of tokens while reasoning
    assert reasoning.answer_start([7, 8, EOS], tags) == 0  # no reasoning (skipped, or closed by the prompt)
    assert reasoning.answer_start([OPEN, 5, CLOSE], tags) == 3  # closed, empty answer
    assert reasoning.answer_start([OPEN, 5, 6], None) == 0  # a model without a reasoning span: all answer


def test_answer_mask_keeps_answer_tokens_only_and_counts_unclosed_spans():
    responses = [[OPEN, 5, CLOSE, 7, EOS], [OPEN, 5, 6], [7, 8, EOS]]
    keep, unclosed = reasoning.answer_mask(responses, (OPEN, CLOSE), T=5)
    assert unclosed == 1
    assert keep.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    keep, unclosed = reasoning.answer_mask(responses, None, T=5)
    assert unclosed == 0 and torch.equal(keep.sum(1), torch.tensor([5.0, 3.0, 3.0]))


def test_think_tags_are_found_only_where_each_is_one_token(tokenizer):
    assert reasoning.think_ids(tokenizer, "auto") is None  # SmolLM2's tokenizer splits <think> into pieces
    assert reasoning.think_ids(tokenizer, "none") is None
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.add_tokens(["<think>", "</think>"])
    ids = reasoning.think_ids(tok, "auto")
    assert ids == ((tok.convert_tokens_to_ids("<think>"),), (tok.convert_tokens_to_ids("</think>"),))
    assert reasoning.think_ids(tok, " <think> , </think> ") == ids
    with pytest.raises(reasoning.ReasoningError, match="<reason> is not one token"):
        reasoning.think_ids(tok, "<reason>,</think>")
    with pytest.raises(reasoning.ReasoningError, match="expected auto, harmony, none or OPEN,CLOSE"):
        reasoning.think_ids(tok, "<think>")


# harmony (gpt-oss): the tags are token sequences
A, H, F, S, CH, M, E = 10, 11, 12, 13, 14, 15, 16  # analysis, (its text), final, <|start|>, <|channel|>, <|message|>, <|end|>
ASSISTANT = 17
SEQ = reasoning.ThinkTags((CH, A, M), (E, S, ASSISTANT, CH, F, M))


def test_sequence_tags_split_a_harmony_reply_at_the_final_channels_header():
    reply = [CH, A, M, 5, 6, E, S, ASSISTANT, CH, F, M, 7, 8, 99]
    assert reasoning.answer_start(reply, SEQ) == 11 and reasoning.reasoning_ids(reply, SEQ) == [5, 6]
    assert reasoning.answer_start([CH, A, M, 5, 6, E, S], SEQ) is None  # the close cut off by the budget
    assert reasoning.reasoning_ids([CH, A, M, 5, 6, E, S], SEQ) == [5, 6, E, S]
    assert reasoning.answer_start([CH, F, M, 7, 99], SEQ) == 0  # no analysis message: not reasoning
    assert reasoning.answer_start([5, E, 6], SEQ) == 0  # a part of the close is not the close
    keep, unclosed = reasoning.answer_mask([reply, [CH, A, M, 5]], SEQ, T=14)
    assert unclosed == 1 and keep[0].tolist() == [0] * 11 + [1] * 3 and keep[1].sum() == 0
    prompt = [S, 3, M, 4, E, S, ASSISTANT]
    assert not reasoning.opens(prompt, SEQ) and not reasoning.answers_at_once(prompt, SEQ)
    assert reasoning.opens(prompt + [CH, A, M], SEQ)
    assert reasoning.answers_at_once(prompt + [CH, A, M, E, S, ASSISTANT, CH, F, M], SEQ)


def test_harmony_tags_are_found_on_a_tokenizer_with_harmonys_markers(tokenizer):
    with pytest.raises(reasoning.ReasoningError, match="not a gpt-oss tokenizer"):
        reasoning.think_ids(tokenizer, "harmony")
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.add_special_tokens({"additional_special_tokens": list(reasoning.HARMONY_MARKERS)})
    tags = reasoning.think_ids(tok, "auto")  # auto finds harmony where <think> is not one token
    assert tags == reasoning.think_ids(tok, "harmony")
    assert tok.decode(list(tags.open)) == "<|channel|>analysis<|message|>"
    assert tok.decode(list(tags.close)) == "<|end|><|start|>assistant<|channel|>final<|message|>"
