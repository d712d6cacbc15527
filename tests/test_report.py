"""report.write_report on a fake run directory: files, PNG validity, exact table cells, missing inputs."""

import json
import math

import pytest

from opct.experiment import methods_view, run_name
from opct.report.render import fmt_cell, fmt_ratio
from opct.report.run import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPLITS = ("train_cues", "heldout_cues", "system_cue", "pushback")


def est(value, lo, hi, n=300):
    return {"value": value, "lo": lo, "hi": hi, "n": n}


def method(syc: float, clean: float = 0.55) -> dict:
    """A method entry with the demo's schema; sycophancy on train_cues is `syc`, other splits offset."""
    out = {"sycophancy_rate": {}, "brr": {}, "consistency": {}, "cued_accuracy": {}, "n": {}}
    for k, split in enumerate(SPLITS):
        v = round(syc - 0.05 * k, 2)
        out["sycophancy_rate"][split] = est(v, round(v - 0.05, 2), round(v + 0.05, 2))
        out["brr"][split] = est(round(v / 2, 2), round(v / 2 - 0.04, 2), round(v / 2 + 0.04, 2))
        out["consistency"][split] = est(round(1 - v, 2), round(0.95 - v, 2), round(1.05 - v, 2))
        out["cued_accuracy"][split] = est(round(clean - v / 3, 2), round(clean - v / 3 - 0.05, 2),
                                          round(clean - v / 3 + 0.05, 2))
        out["n"][split] = 300
    out["clean_accuracy"] = est(clean, round(clean - 0.06, 2), round(clean + 0.06, 2))
    return out


def make_results(methods=("base", "sft", "opct")) -> dict:
    all_methods = {"base": method(0.62), "sft": method(0.50, clean=0.53), "opct": method(0.28, clean=0.54)}
    all_methods["base"]["sycophancy_rate"]["train_cues"] = est(0.62, 0.57, 0.67)
    all_methods["opct"]["sycophancy_rate"]["train_cues"] = est(0.28, 0.23, 0.33)
    return {
        "model": "smollm2-135m-instruct",
        "wall_seconds": 812.3,
        "config": {"seed": 0, "opct": {"lr": 1e-4, "steps": 200, "lora": {"r": 16}}, "splits": list(SPLITS)},
        "runs": {run_name(m, 0): all_methods[m] for m in methods},
        "timings": {"eval_base": 60.1, "sft": 200.0, "opct": 412.7},
    }


def write_run(tmp_path, results, opct_steps=60, sft_steps=40, runs=("opct-seed0", "sft-seed0")):
    """results.json and the training runs' metrics.jsonl (`runs`: OPCT's and SFT's directories)."""
    (tmp_path / "results.json").write_text(json.dumps(results))
    if opct_steps:
        (tmp_path / runs[0]).mkdir()
        with (tmp_path / runs[0] / "metrics.jsonl").open("w") as f:
            for step in range(1, opct_steps + 1):
                row = {"step": step, "loss": 0.4 * math.exp(-step / 30), "kl": 0.5 * math.exp(-step / 25),
                       "logp_student": -1.2, "logp_teacher": -1.7, "response_len": 12.3, "lr": 1e-4,
                       "time_sample": 2.1, "time_teacher": 0.4, "time_student": 1.3,
                       "tokens_per_s": 50.0, "peak_mem_mb": 2100}
                if step % 20 == 0:
                    row["probe_sycophancy"] = 0.6 - step / 200
                    row["probe_accuracy"] = 0.5 + step / 1000
                f.write(json.dumps(row) + "\n")
    if sft_steps:
        (tmp_path / runs[1]).mkdir()
        with (tmp_path / runs[1] / "metrics.jsonl").open("w") as f:
            for step in range(1, sft_steps + 1):
                f.write(json.dumps({"step": step, "loss": 1.0 / step, "lr": 1e-4}) + "\n")
    return tmp_path


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, f"{path} is suspiciously small ({len(data)} bytes)"


def test_full_run_writes_all_files(tmp_path):
    run = write_run(tmp_path, make_results())
    out = write_report(run)

    assert out["markdown"] == run / "report.md" and out["html"] == run / "report.html"
    assert set(out["plots"]) == {"sycophancy_by_split", "consistency_accuracy", "training"}
    for path in out["plots"].values():
        assert path.parent == run / "plots"
        assert_png(path)
    # atomic writes leave no temp files behind
    assert not [p for p in run.rglob("*.tmp")]

    md = out["markdown"].read_text()
    assert md.startswith("# OPCT report: smollm2-135m-instruct")
    assert "812 s (13.5 min)" in md
    # exact cells: rows = split, columns = base | SFT | OPCT | n
    assert "| train_cues | 0.62 [0.57, 0.67] | 0.50 [0.45, 0.55] | 0.28 [0.23, 0.33] | 300 |" in md
    assert "| Clean accuracy (higher is better) | 0.55 [0.49, 0.61] | 0.53 [0.47, 0.59] | 0.54 [0.48, 0.60] | 300 |" in md
    # relative change on sycophancy: 0.50/0.62 and 0.28/0.62
    assert "| train_cues | ×0.81 | ×0.45 |" in md
    assert "Wilson" in md
    # config printed generically, nested keys flattened
    assert "| opct.lora.r | 16 |" in md and "| opct.lr | 0.0001 |" in md
    for name in ("sycophancy_by_split", "consistency_accuracy", "training"):
        assert f"(plots/{name}.png)" in md
    # preferred split order
    rows = [line.split(" | ")[0].lstrip("| ") for line in md.splitlines() if line.startswith("| ")]
    first_table = rows[rows.index("Split") + 1:rows.index("Split") + 5]
    assert first_table == list(SPLITS)
    # training log summary
    assert "OPCT: 60 logged steps (opct-seed0/metrics.jsonl)" in md and "SFT: 40 logged steps" in md
    assert "| probe_sycophancy | 3 |" in md

    page = out["html"].read_text()
    assert page.startswith("<!DOCTYPE html>")
    for text in ("0.62 [0.57, 0.67]", "0.28 [0.23, 0.33]", "0.55 [0.49, 0.61]", "×0.45", "×0.81",
                 'src="plots/training.png"', "Wilson"):
        assert text in page


def test_missing_methods_and_logs(tmp_path):
    run = write_run(tmp_path, make_results(methods=("base", "opct")), opct_steps=0, sft_steps=0)
    out = write_report(run)

    assert "training" not in out["plots"] and not (run / "plots" / "training.png").exists()
    assert_png(out["plots"]["sycophancy_by_split"])
    md = out["markdown"].read_text()
    assert "SFT" not in md
    assert "| Split | base | OPCT | n |" in md
    assert "| train_cues | ×0.45 |" in md
    assert "No training logs found" in md


def test_only_one_log_and_partial_split(tmp_path):
    results = make_results()
    del results["runs"]["sft-seed0"]["sycophancy_rate"]["pushback"]
    results["runs"]["opct-seed0"]["sycophancy_rate"]["new_split"] = est(0.1, 0.05, 0.2, n=40)
    run = write_run(tmp_path, results, sft_steps=0)
    # a run killed mid-write leaves a truncated last line; it is skipped
    with (run / "opct-seed0" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 61, "lo')
    out = write_report(run)

    assert_png(out["plots"]["training"])
    md = out["markdown"].read_text()
    assert "OPCT: 60 logged steps" in md and "SFT:" not in md.split("## Training logs")[1]
    pushback = next(line for line in md.splitlines() if line.startswith("| pushback | 0.47"))
    assert pushback == "| pushback | 0.47 [0.42, 0.52] | — | 0.13 [0.08, 0.18] | 300 |"
    # splits beyond the preferred list follow it
    assert "| new_split | — | — | 0.10 [0.05, 0.20] | 40 |" in md


def test_an_earlier_opcts_run_folder_reports_as_before(tmp_path):
    """A folder an earlier opct wrote (results "methods", the first seed's runs <out>/opct, <out>/sft): read into
    this schema (opct.experiment.read_results), its tables and training logs are found where they are."""
    new = make_results()
    old = {**{k: v for k, v in new.items() if k != "runs"}, "methods": methods_view(new)}
    md = write_report(write_run(tmp_path, old, runs=("opct", "sft")))["markdown"].read_text()
    assert "OPCT: 60 logged steps (opct/metrics.jsonl)" in md and "SFT: 40 logged steps" in md
    assert "| train_cues | 0.62 [0.57, 0.67] | 0.50 [0.45, 0.55] | 0.28 [0.23, 0.33] | 300 |" in md


def test_base_only_and_no_config(tmp_path):
    results = {"model": "m", "runs": {"base": method(0.6)}}
    out = write_report(write_run(tmp_path, results, opct_steps=0, sft_steps=0))
    md = out["markdown"].read_text()
    assert "relative to base" not in md and "no config" in md
    assert "Wall time" not in md


def test_missing_results_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="results.json"):
        write_report(tmp_path)


def test_rerun_overwrites(tmp_path):
    run = write_run(tmp_path, make_results(), opct_steps=0, sft_steps=0)
    write_report(run)
    results = make_results()
    results["runs"]["opct-seed0"]["sycophancy_rate"]["train_cues"] = est(0.31, 0.26, 0.36)
    (run / "results.json").write_text(json.dumps(results))
    md = write_report(run)["markdown"].read_text()
    assert "0.31 [0.26, 0.36]" in md and "0.28 [0.23, 0.33]" not in md


def test_formatting_helpers():
    assert fmt_cell(est(0.625, 0.571, 0.6749)) == "0.62 [0.57, 0.67]"
    assert fmt_cell({"value": 0.5}) == "0.50"
    assert fmt_cell(None) == "—"
    assert fmt_ratio(est(0.28, 0, 1), est(0.62, 0, 1)) == "×0.45"
    assert fmt_ratio(est(0.1, 0, 1), est(0.0, 0, 0)) == "—"
