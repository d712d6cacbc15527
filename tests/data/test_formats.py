"""The community's pair formats (opct.data.formats): CTM's prompt pairs and mcq-bias rows, AttCT's row-aligned
sycophancy files and prefill CSV, read from the examples shipped in examples/formats/, their errors naming file,
line and field, and `opct train` on each."""

import json
import shutil
from pathlib import Path

import pytest

from opct.cli import main
from opct.data.formats import detect, read_pairs
from opct.data.pairs import PairsError

EXAMPLES = Path(__file__).parents[2] / "examples" / "formats"
CTM = EXAMPLES / "ctm_prompt_pairs.jsonl"
ATTCT = EXAMPLES / "attct" / "bct_non_cot_train.jsonl"
PREFILLS = EXAMPLES / "attct" / "prefills.csv"


def test_each_example_is_detected_and_read_with_the_perturbed_side_as_student():
    assert [detect(p) for p in (CTM, ATTCT, PREFILLS, EXAMPLES.parent / "pairs.jsonl")] == ["ctm", "attct", "attct",
                                                                                             "opct"]
    ctm = read_pairs(CTM)
    rows = [json.loads(x) for x in CTM.read_text().splitlines()]
    assert len(ctm) == 4
    for p, row in zip(ctm, rows):
        assert p.student == row["variant_messages"] and p.teacher == row["reference_messages"]
        assert p.meta["pair_id"] == row["pair_id"] and p.meta["metadata"]["biased_option"] in p.student[0]["content"]
    attct = read_pairs(ATTCT)
    clean = [json.loads(x) for x in ATTCT.with_name("control_non_cot_train.jsonl").read_text().splitlines()]
    assert [p.teacher for p in attct] == [r["messages"][:1] for r in clean]  # the user turn; the target is dropped
    assert all(len(p.student) == 1 and p.student[0]["content"] != p.teacher[0]["content"] for p in attct)
    pre = read_pairs(PREFILLS)
    assert len(pre) == 3 and pre[0].student[-1] == {"role": "assistant", "content": "Sure, here is a step-by-step guide:"}
    assert pre[0].teacher == pre[0].student[:1] and pre[0].meta["prefill_type"] == "Affirmative Generic"


def test_ctm_rows_are_cut_after_the_last_user_turn_and_mcq_bias_rows_read_too(tmp_path):
    q = [{"role": "user", "content": "Q?"}]
    row = {"question_id": "q1", "unbiased_messages": [*q, {"role": "assistant", "content": "A"}],
           "biased_messages": [{"role": "user", "content": "Q? I think (C)."}, {"role": "assistant", "content": "C"}],
           "bias_type": "suggested_answer"}
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps(row) + "\n")
    got = read_pairs(p, "ctm")
    assert got[0].teacher == q and got[0].student == [{"role": "user", "content": "Q? I think (C)."}]
    assert got[0].meta["bias_type"] == "suggested_answer"


@pytest.mark.parametrize("edit,expect", [
    (lambda d: d.write_text(CTM.read_text().replace("whale", "orca")), "do not match ctm_prompt_pairs.jsonl.manifest"),
    (lambda d: d.write_text(CTM.read_text() + CTM.read_text().splitlines()[0] + "\n"), "repeats line 1"),
    (lambda d: d.write_text(CTM.read_text().replace('"variant_messages"', '"variant"', 1)),
     "ctm_prompt_pairs.jsonl:1: missing field 'variant_messages'"),
])
def test_a_bad_ctm_file_is_refused_naming_file_line_and_field(tmp_path, edit, expect):
    d = tmp_path / "ctm_prompt_pairs.jsonl"
    if "manifest" in expect:
        shutil.copy(CTM.with_name(CTM.name + ".manifest.json"), tmp_path)
    edit(d)
    with pytest.raises(PairsError, match=expect):
        read_pairs(d, "ctm")


def test_a_bad_attct_file_is_refused_naming_what_is_wrong(tmp_path):
    shutil.copytree(EXAMPLES / "attct", tmp_path / "a")
    with pytest.raises(PairsError, match="this is the clean side; pass its bct_ file"):
        read_pairs(tmp_path / "a" / "control_non_cot_train.jsonl")
    lines = (tmp_path / "a" / "control_non_cot_train.jsonl").read_text().splitlines()
    (tmp_path / "a" / "control_non_cot_train.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(PairsError, match="4 rows, but control_non_cot_train.jsonl has 3"):
        read_pairs(tmp_path / "a" / "bct_non_cot_train.jsonl")
    (tmp_path / "a" / "control_non_cot_train.jsonl").unlink()
    with pytest.raises(PairsError, match="its clean side .*control_non_cot_train.jsonl is missing"):
        read_pairs(tmp_path / "a" / "bct_non_cot_train.jsonl")
    (tmp_path / "a" / "p.csv").write_text("prompt,opener\nx,Sure\n")
    with pytest.raises(PairsError, match=r"p.csv:1: missing column 'prefill'"):
        read_pairs(tmp_path / "a" / "p.csv")
    (tmp_path / "a" / "q.csv").write_text("prompt,prefill\nx,Sure\ny,\n")
    with pytest.raises(PairsError, match=r"q.csv:3: column 'prefill' is empty"):
        read_pairs(tmp_path / "a" / "q.csv")
    (tmp_path / "a" / "other.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(PairsError, match=r"other.jsonl:1: cannot tell the pairs format"):
        read_pairs(tmp_path / "a" / "other.jsonl")


@pytest.mark.parametrize("path", [CTM, ATTCT, PREFILLS], ids=["ctm", "attct", "attct-prefills"])
def test_opct_train_trains_on_each_format(tmp_path, capsys, tiny_model_dir, path):
    out = tmp_path / "out"
    code = main(["train", "--model", str(tiny_model_dir), "--pairs", str(path), "--out", str(out), "--steps", "1",
                 "--prompts-per-step", "2", "--max-new-tokens", "4", "--lora-rank", "2", "--report-to", "none"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((out / "run.json").read_text())["config"]["pairs_format"] == "auto"
    assert (out / "model" / "adapter_config.json").is_file()
