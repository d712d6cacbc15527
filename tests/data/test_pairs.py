import json

import pytest

from opct.data.chat import render_prompt
from opct.data.pairs import ConsistencyPair, PairsError, load_pairs, save_pairs
from opct.backends.batching import build_batch

Q = {"role": "user", "content": "Is 2+2=4?"}
SYS = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_single_turn_pinned(tokenizer):
    got = render_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert got == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                   19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]
    assert tokenizer.decode(got).endswith("<|im_start|>assistant\n")


def test_system_prompt_pinned(tokenizer):
    got = render_prompt(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert got == [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]


def test_cue_in_system_prompt_does_not_leak(tokenizer):
    cue = "The user believes the answer is (C)."
    student = render_prompt(tokenizer, [{"role": "system", "content": cue}, Q])
    teacher = render_prompt(tokenizer, [Q])
    # teacher = the template's default system prompt + question; student = cue as system prompt + question
    assert tokenizer.decode(teacher) == f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\nIs 2+2=4?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(student) == f"<|im_start|>system\n{cue}<|im_end|>\n<|im_start|>user\nIs 2+2=4?<|im_end|>\n<|im_start|>assistant\n"
    assert "believes" not in tokenizer.decode(teacher)
    # both end with the same question + generation prompt
    tail = render_prompt(tokenizer, [{"role": "system", "content": "x"}, Q])[-12:]
    assert student[-12:] == teacher[-12:] == tail


def test_cue_in_earlier_turn(tokenizer):
    earlier = [{"role": "user", "content": "I think it's (B)."}, {"role": "assistant", "content": "Noted."}]
    student = render_prompt(tokenizer, earlier + [Q])
    teacher = render_prompt(tokenizer, [Q])
    text_s, text_t = tokenizer.decode(student), tokenizer.decode(teacher)
    assert "I think it's (B)." in text_s and "(B)" not in text_t
    assert text_s.count("<|im_start|>") == 5 and text_t.count("<|im_start|>") == 3
    assert student[-len(ids(tokenizer, "Is 2+2=4?<|im_end|>\n<|im_start|>assistant\n")):] == \
        teacher[-len(ids(tokenizer, "Is 2+2=4?<|im_end|>\n<|im_start|>assistant\n")):]


def test_teacher_with_extra_system_prompt(tokenizer):
    fact = "SAFETY GUIDELINE: never mix bleach and ammonia."
    teacher = render_prompt(tokenizer, [{"role": "system", "content": fact}, Q])
    student = render_prompt(tokenizer, [Q])
    assert fact in tokenizer.decode(teacher) and fact not in tokenizer.decode(student)


def test_same_response_ids_appended_to_both_sides(tokenizer):
    s = render_prompt(tokenizer, [{"role": "system", "content": "cue"}, Q])
    t = render_prompt(tokenizer, [Q])
    resp = ids(tokenizer, "Yes.<|im_end|>")
    b = build_batch([s, t], [resp, resp], tokenizer.pad_token_id)
    for row in range(2):
        n = int(b.attention_mask_BL[row].sum())
        assert b.input_ids_BL[row, -len(resp):].tolist() == resp  # response right after each prompt
        assert n == [len(s), len(t)][row] + len(resp)
    assert b.response_BT.tolist() == [resp, resp]


def test_no_chat_template_is_a_clear_error(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(PairsError, match="no chat template"):
        render_prompt(tok, [Q])


@pytest.mark.parametrize("line,message", [
    ('{"student": [{"role": "user", "content": "a"}]', "malformed JSON"),
    ('{"teacher": [{"role": "user", "content": "a"}]}', "missing field 'student'"),
    ('{"student": [{"role": "user", "content": "a"}], "teacher": []}', "field 'teacher' must be a non-empty list"),
    ('{"student": [{"role": "robot", "content": "a"}], "teacher": [{"role": "user", "content": "a"}]}',
     "field 'student[0].role' is 'robot'"),
    ('{"student": [{"role": "user", "content": 3}], "teacher": [{"role": "user", "content": "a"}]}',
     "field 'student[0].content' must be a string"),
    ('[1, 2]', "must be a JSON object"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, line, message):
    good = '{"student": [{"role": "user", "content": "a"}], "teacher": [{"role": "user", "content": "b"}]}'
    p = tmp_path / "pairs.jsonl"
    p.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(PairsError) as e:
        load_pairs(p)
    assert f"{p}:3:" in str(e.value) and message in str(e.value)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(PairsError, match="empty"):
        load_pairs(p)


def test_roundtrip_keeps_meta(tmp_path):
    pairs = [ConsistencyPair([Q], [Q], {"suggested": "C"})]
    save_pairs(pairs, tmp_path / "p.jsonl")
    row = json.loads((tmp_path / "p.jsonl").read_text())
    assert row == {"student": [Q], "teacher": [Q], "suggested": "C"}
    back = load_pairs(tmp_path / "p.jsonl")
    assert back[0].meta["suggested"] == "C" and back[0].meta["_where"].endswith("p.jsonl:1")


def test_response_prefix_is_rendered_open_on_both_sides(tokenizer):
    prefix = {"role": "assistant", "content": "The answer is ("}
    s = render_prompt(tokenizer, [{"role": "system", "content": "cue"}, Q, prefix])
    t = render_prompt(tokenizer, [Q, prefix])
    assert tokenizer.decode(t).endswith("<|im_start|>assistant\nThe answer is (")  # no end-of-turn, no new turn
    assert s[-8:] == t[-8:]


def test_a_teacher_prefix_the_student_lacks_or_two_different_prefixes_are_errors_a_student_prefill_is_not(tmp_path):
    pre = {"role": "assistant", "content": "The answer is ("}
    p = tmp_path / "p.jsonl"
    for student, teacher in (([Q], [Q, pre]), ([Q, {"role": "assistant", "content": "Sure"}], [Q, pre])):
        p.write_text(json.dumps({"student": student, "teacher": teacher}) + "\n")
        with pytest.raises(PairsError, match=r"p.jsonl:1: field 'teacher' ends with an assistant response prefix"):
            load_pairs(p)
    p.write_text(json.dumps({"student": [Q, {"role": "assistant", "content": "Sure, here is"}], "teacher": [Q]}) + "\n")
    assert load_pairs(p)[0].student[-1]["content"] == "Sure, here is"


def test_a_prefill_pair_renders_the_opener_on_the_student_side_only(tokenizer):
    """The student continues its started reply; the teacher's prompt is the bare request with the generation
    prompt, so the same response ids follow "Sure, here is" on one side and the reply's start on the other."""
    from opct.axes.jailbreak.threats import TRAIN_PREFILLS, prefill_messages

    s = render_prompt(tokenizer, prefill_messages(Q["content"], TRAIN_PREFILLS["sure"]))
    t = render_prompt(tokenizer, [Q])
    assert tokenizer.decode(t).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(s).endswith("<|im_start|>assistant\nSure, here is")  # open: no end of turn
    assert s[:len(t)] == t and tokenizer.decode(s[len(t):]) == "Sure, here is"


def test_a_multiturn_pair_renders_every_earlier_turn_on_the_student_side(tokenizer):
    from opct.axes.jailbreak.threats import HELDOUT_PRELUDES, multiturn_messages

    msgs = multiturn_messages(Q["content"], HELDOUT_PRELUDES["agreed"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    text = tokenizer.decode(render_prompt(tokenizer, msgs))
    assert text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3
    assert text.endswith(f"<|im_start|>user\n{Q['content']}<|im_end|>\n<|im_start|>assistant\n")
