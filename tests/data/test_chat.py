"""The renderer (opct.data.chat.ChatFormat): prompts with and without a prefill, each side's template options, a
reply split into reasoning and answer (closed, unclosed, none, after a prompt that opens the span), the answer-only
loss mask; on the SmolLM2 tokenizer with <think> / </think> added and a Qwen3-style template of our own."""

import pytest
import torch

from opct.config import SFTConfig, validate
from opct.data.chat import ChatFormat, Split, render_prompt, template_kwargs
from tests.conftest import FIXTURES

THINK_ON, THINK_OFF = '{"enable_thinking": true}', '{"enable_thinking": false}'
Q = {"role": "user", "content": "Is water wet?"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tests.conftest import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = (FIXTURES / "thinking_chat_template.jinja").read_text()
    return tok


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_a_prompt_ends_in_the_generation_prompt_and_a_final_assistant_turn_is_a_prefill(tok):
    fmt = ChatFormat.of(tok)
    assert fmt.prompt([Q]) == enc(tok, "<|im_start|>user\nIs water wet?<|im_end|>\n<|im_start|>assistant\n")
    prefill = fmt.prompt([Q, {"role": "assistant", "content": "Sure, it"}])
    assert prefill == enc(tok, "<|im_start|>user\nIs water wet?<|im_end|>\n<|im_start|>assistant\nSure, it")
    assert fmt.prompt([Q]) == render_prompt(tok, [Q])  # the format's options are none here
    assert fmt.text([Q]) == tok.decode(fmt.prompt([Q]))  # lm-eval's chat text: the same rendering as text


def test_each_side_gets_its_own_template_options_and_the_tags_are_the_tokenizers(tok):
    cfg = validate(SFTConfig(chat_template_kwargs=THINK_ON, teacher_chat_template_kwargs=THINK_OFF))
    student, teacher = ChatFormat.sides(tok, cfg)
    assert (student.options, teacher.options) == template_kwargs(cfg) == ({"enable_thinking": True},
                                                                          {"enable_thinking": False})
    assert student == ChatFormat.of(tok, cfg, "student") and teacher == ChatFormat.of(tok, cfg, "teacher")
    tags = ((tok.convert_tokens_to_ids("<think>"),), (tok.convert_tokens_to_ids("</think>"),))
    assert student.tags == teacher.tags == tags and student.thinks
    s, t = student.prompt([Q]), teacher.prompt([Q])
    assert tok.decode(t).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off: closed span
    assert not student.answers_at_once(s) and teacher.answers_at_once(t)
    shared = validate(SFTConfig(chat_template_kwargs=THINK_OFF))  # no teacher options: the student's
    assert ChatFormat.of(tok, shared, "teacher").options == {"enable_thinking": False}
    assert ChatFormat.of(tok).options == {} and ChatFormat.of(tok).tags == tags  # the settings' defaults
    assert ChatFormat.of(tok, validate(SFTConfig(think_tags="none"))).tags is None
    with pytest.raises(ValueError, match="side must be one of"):
        ChatFormat.of(tok, cfg, "judge")


def test_a_reply_splits_into_reasoning_and_answer_closed_or_not(tok):
    fmt = ChatFormat.of(tok)
    (o,), (c,) = fmt.tags
    w, x, eos = enc(tok, " yes")[0], enc(tok, " no")[0], tok.eos_token_id
    prompt = fmt.prompt([Q])
    assert fmt.split(prompt, [o, w, c, x, eos]) == Split([w], [x, eos], True)
    assert fmt.answer_start(prompt, [o, w, c, x, eos]) == 3
    assert fmt.split(prompt, [o, w, w]) == Split([w, w], [], False)  # the budget ran out inside the reasoning
    assert fmt.answer_start(prompt, [o, w, w]) is None
    assert fmt.split(prompt, [x, eos]) == Split(None, [x, eos], True)  # no reasoning: all answer
    assert fmt.split(prompt, [o, w, c]) == Split([w], [], True)  # closed, empty answer
    opened = prompt + [o]  # a template that opens the span itself (DeepSeek-R1's): the reply never writes <think>
    assert fmt.opens(opened) and not fmt.opens(prompt)
    assert fmt.split(opened, [w, c, x]) == Split([w], [x], True)
    assert fmt.split(opened, [w, x]) == Split([w, x], [], False)
    plain = ChatFormat(tok)  # no tags: a model without reasoning, every token is answer
    assert not plain.thinks and plain.split(prompt, [o, w, x]) == Split(None, [o, w, x], True)


def test_the_answer_mask_keeps_the_answers_only_and_counts_unclosed_replies(tok):
    fmt = ChatFormat.of(tok)
    (o,), (c,) = fmt.tags
    w, eos = enc(tok, " yes")[0], tok.eos_token_id
    prompt = fmt.prompt([Q])
    prompts = [prompt, prompt, prompt, prompt + [o]]
    replies = [[o, w, c, w, eos], [o, w, w], [w, eos], [w, c, w]]
    keep, unclosed = fmt.answer_mask(prompts, replies, T=6)
    assert unclosed == 1
    assert keep.tolist() == [[0, 0, 0, 1, 1, 0], [0] * 6, [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]
    assert fmt.answer_tokens(prompts, replies) == (2 + 0 + 2 + 1, 1)
    keep, unclosed = ChatFormat(tok).answer_mask(prompts, replies, T=6)  # without thinking: every reply token
    assert unclosed == 0 and torch.equal(keep.sum(1), torch.tensor([5.0, 3.0, 2.0, 3.0]))
    assert ChatFormat(tok).answer_tokens(prompts, replies) == (13, 0)
