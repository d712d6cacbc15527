"""`opct check` (opct.lens.check) on a tiny random model: its verdicts, its files, its errors."""

import json

import pytest

from opct.cli import main
from opct.lens.check import answer_changes, answer_key, gap_summary, verdict
from opct.data.pairs import ConsistencyPair
from tests.train.test_train import QS, make_pairs


def write(path, pairs):
    path.write_text("".join(json.dumps({"student": p.student, "teacher": p.teacher}) + "\n" for p in pairs))
    return path


def check(tiny_model_dir, tmp_path, pairs_file, *more):
    out = tmp_path / "check"
    rc = main(["check", "--pairs", str(pairs_file), "--model", str(tiny_model_dir), "--n", "4", "--max-new-tokens",
               "4", "--device", "cpu", "--out", str(out), *more])
    return rc, out


def test_identical_sides_are_no_signal(tiny_model_dir, tmp_path, capsys):
    rc, out = check(tiny_model_dir, tmp_path, write(tmp_path / "same.jsonl", make_pairs(identical=True)))
    assert rc == 0
    got = json.loads((out / "check.json").read_text())
    assert got["verdict"] == "no signal" and got["identical"] == got["sampled"] == 4
    assert got["gap"]["mean_per_token"] == 0.0  # the same model after the same prompt: the same log-probs
    assert "no signal" in capsys.readouterr().out
    assert (out / "check.html").is_file()


def cued(reword=False):
    """A cue added to each question; `reword`: the clean side's question also says "Please" (the cued one not)."""
    return [ConsistencyPair([{"role": "user", "content": q + " I think it's (B)."}],
                            [{"role": "user", "content": ("Please: " if reword else "") + q}]) for q in QS]


def test_a_cued_file_reports_its_difference_and_gap(tiny_model_dir, tmp_path):
    rc, out = check(tiny_model_dir, tmp_path, write(tmp_path / "cued.jsonl", cued()))
    assert rc == 0
    got = json.loads((out / "check.json").read_text())
    assert got["identical"] == 0 and got["sampled"] == 4 and len(got["pairs"]) == 4
    assert got["beyond_cue"] == 0 and got["warnings"] == []  # a cue added to the question, nothing else
    assert got["verdict"] in ("ready", "concentrated", "no signal")
    assert all(r["differing_tokens"]["student"] > 0 and r["added_only"] for r in got["pairs"])
    assert got["gap"]["tokens"] == sum(r["gap_tokens"] for r in got["pairs"]) > 0
    html = (out / "check.html").read_text()
    assert got["line"] in html or got["line"].replace("'", "&#x27;") in html


def test_pairs_that_also_reword_the_clean_prompt_are_named(tiny_model_dir, tmp_path):
    rc, out = check(tiny_model_dir, tmp_path, write(tmp_path / "reworded.jsonl", cued(reword=True)))
    got = json.loads((out / "check.json").read_text())
    assert rc == 0 and got["beyond_cue"] == 4
    assert all(r["changed_text"].startswith("Please: ") for r in got["pairs"])
    assert "4 of 4 pairs differ beyond added text" in got["warnings"][0]
    # a template's default system prompt, which a student side with its own system turn replaces, counts too
    rc, out = check(tiny_model_dir, tmp_path, write(tmp_path / "system.jsonl", make_pairs()))
    assert json.loads((out / "check.json").read_text())["beyond_cue"] == 4


def test_a_declared_cue_must_be_in_the_perturbed_prompt_alone(tiny_model_dir, tmp_path):
    """CTM's mcq-bias rows declare their cue (biasing_text): read as CTM's reader reads them, it is checked."""
    rows = []
    for i, q in enumerate(QS[:4]):
        cue = "I think it's (B)."
        rows.append({"question": q, "question_id": str(i), "source_dataset": "x", "prompt_style": "none",
                     "bias_type": "suggested_answer", "ground_truth": "A", "biased_option": "B",
                     "biasing_text": cue if i else "a cue that is nowhere",
                     "biased_messages": [{"role": "user", "content": f"{q} {cue}"}],
                     "unbiased_messages": [{"role": "user", "content": q}]})
    f = tmp_path / "mcq_bias.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out = check(tiny_model_dir, tmp_path, f, "--pairs-format", "ctm")
    got = json.loads((out / "check.json").read_text())
    assert rc == 0 and got["declared_cues"] == 4 and got["cues_misplaced"] == 1
    assert [r["cue_in_place"] for r in got["pairs"]] == [False, True, True, True]
    assert any("declare a cue that is not in the perturbed prompt" in w for w in got["warnings"])


def test_a_bad_pairs_file_is_exit_2_naming_file_and_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"student": [{"role": "user", "content": "x"}], "teacher": []}\n')
    rc, out = check(tiny_model_dir, tmp_path, bad)
    assert rc == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert not (out / "check.json").exists()


def test_answer_reading():
    assert [answer_key(t) for t in ("The answer is (B).", "C) Paris", "The answer is \"nose.\"", "A cat.", "")] == \
        ["B", "C", "nose", None, None]
    mc = answer_changes(["(A)", "(B)", "no idea"], ["(A)", "(C)", "(D)"])
    assert mc["kind"] == "multiple-choice" and mc["changed"]["value"] == 0.5 and mc["unread"] == 1
    free = answer_changes(["Sure, here", "No."], ["I can't", "no."])
    assert free["kind"] == "free text" and free["changed"]["value"] == 0.5


def test_verdicts():
    flat = gap_summary([[0.0, 0.0]] * 10)
    none = {"changed": {"value": 0.0}}
    assert verdict(10, 10, flat, none)[0] == "no signal"
    assert verdict(10, 0, flat, none)[0] == "no signal"
    one = gap_summary([[5.0] * 4] + [[0.01, -0.01]] * 19)  # one pair carries nearly all of it
    assert one["top_share"] > 0.9 and verdict(20, 0, one, none)[0] == "concentrated"
    even = gap_summary([[0.3, 0.2]] * 20)
    assert verdict(20, 0, even, {"changed": {"value": 0.2}})[0] == "ready"
    assert even["head_share"] == pytest.approx(1.0)  # every token is in the first 8


def test_its_options_are_checked_before_any_model_loads(tmp_path, capsys):
    assert main(["check", "--out", str(tmp_path / "c")]) == 2
    assert "--pairs must name a pairs file" in capsys.readouterr().err
    assert main(["check", "--pairs", "x.jsonl", "--n", "0", "--out", str(tmp_path / "c")]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err
    assert main(["check", "--pairs", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path / "c")]) == 2
    assert "absent.jsonl: no such file" in capsys.readouterr().err
