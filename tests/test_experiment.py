"""The methods table and the one comparison (opct.experiment, opct.across_seeds): pairs from the table, paired changes over the units
both methods have, within and across seeds, and earlier results files read into this schema."""

import dataclasses

import pytest

from opct.across_seeds import compare_seeds
from opct.experiment import (METHODS, SECTIONS, TRAINED, compare, evaluation, first_runs, methods_view, on_disk, pairs,
                             parse_methods, parse_run, read_comparison, read_evaluation, read_results, run_name)
from opct.stats import result_rows


def test_every_trained_method_is_compared_with_base_and_the_controls_with_opct():
    assert TRAINED == ("sft", "opct", "opct-shuffled", "opct-fixed", "opct-clip")
    assert pairs(["opct", "sft", "base"]) == [("sft", "base"), ("opct", "base"), ("opct", "sft")]
    assert pairs(["opct-clip", "opct", "base"], trained_only=True) == [("opct-clip", "opct")]
    assert pairs(["opct-clip", "sft"]) == []  # a control without OPCT: nothing to compare it with
    assert all(METHODS[b].trainer or b == "base" for m in METHODS.values() for b in m.compared_with)
    with pytest.raises(ValueError, match="--methods takes some of sft, opct, opct-shuffled"):
        parse_methods("opct,opct")
    assert parse_methods(" sft, opct-fixed ") == ["sft", "opct-fixed"]


def test_compare_gives_paired_changes_over_the_same_units():
    units = {"base": {"rate": {"s": {"a": 1, "b": 1, "c": 0, "d": 1}}},
             "sft": {"rate": {"s": {"a": 1, "b": 0, "c": 0}}},  # d unread (unclosed reasoning)
             "opct": {"rate": {"s": {"a": 0, "b": 0, "c": 0, "d": 0}, "t": {"x": 1}}}}
    comp = compare(units)
    assert list(comp) == ["sft_minus_base", "opct_minus_base", "opct_minus_sft"]
    assert comp["opct_minus_base"]["rate"]["s"]["value"] == -0.75
    assert comp["sft_minus_base"]["rate"]["s"]["value"] == pytest.approx(-1 / 3)  # over a, b, c only
    diff = comp["opct_minus_sft"]["rate"]["s"]
    assert diff["value"] == pytest.approx(-1 / 3) and diff["n"] == 3 and diff["lo"] <= diff["value"] <= diff["hi"]
    assert "t" not in comp["opct_minus_base"]["rate"]  # a split the other method lacks is left out
    assert compare({"base": {}, "opct": {}}) == {}


def test_across_seeds_each_pair_of_trained_methods_is_paired_within_a_seed():
    units = {"opct": [{"r": {"s": {"a": 1, "b": 0}}}, {"r": {"s": {"a": 1, "b": 1}}}],
             "opct-clip": [{"r": {"s": {"a": 0, "b": 0}}}, {"r": {"s": {"a": 1, "b": 0}}}]}
    row = compare_seeds(units, {"r": {"s": {"a": 1, "b": 1}}})["r"]["s"]
    assert set(row) == {"opct", "opct-clip", "base", "opct-clip_minus_opct"}
    assert row["opct-clip_minus_opct"]["value"] == pytest.approx(row["opct-clip"]["value"] - row["opct"]["value"])
    assert row["opct-clip_minus_opct"]["per_seed"] == pytest.approx([-0.5, -0.5])


def test_earlier_results_files_are_read_into_this_schema():
    c = {"value": -0.1, "lo": -0.2, "hi": 0.0, "n": 5}
    d = {"value": 0.3, "lo": 0.1, "hi": 0.5, "n": 5}
    sycophancy = {"vs_base": {"sft": {"heldout_cues": c}, "opct": {"heldout_cues": d, "pushback": c}},
                  "opct_minus_sft": {"heldout_cues": d},
                  "control_minus_opct": {"opct-clip": {"sycophancy_rate": {"pushback": c}}}}
    assert read_comparison(sycophancy) == {
        "sft_minus_base": {"sycophancy_rate": {"heldout_cues": c}},
        "opct_minus_base": {"sycophancy_rate": {"heldout_cues": d, "pushback": c}},
        "opct_minus_sft": {"sycophancy_rate": {"heldout_cues": d}},
        "opct-clip_minus_opct": {"sycophancy_rate": {"pushback": c}}}
    safety = {"pass_rate_change": {"opct": {"heldout": c}}, "over_warning_change": {"opct": {"contrast": d}},
              "opct_minus_sft": {"heldout": d, "contrast": c}}
    assert read_comparison(safety) == {"opct_minus_base": {"pass_rate": {"heldout": c}, "over_warning": {"contrast": d}},
                                       "opct_minus_sft": {"pass_rate": {"heldout": d}, "over_warning": {"contrast": c}}}
    new = compare({"base": {"r": {"s": {"a": 1}}}, "sft": {"r": {"s": {"a": 0}}}})
    assert read_comparison(new) == new  # this schema reads as itself
    assert read_results({"methods": {}})["axis"] == "sycophancy"  # before the axes: a sycophancy run
    with pytest.raises(ValueError, match="x.json: expected a JSON object"):
        read_results([], "x.json")


def test_every_run_is_named_method_seed_and_the_first_seed_is_a_view():
    assert [run_name(m, 0) for m in ("base", "opct", "opct-shuffled")] == ["base", "opct-seed0", "opct-shuffled-seed0"]
    assert [parse_run(r) for r in ("opct-shuffled-seed12", "base", "opct", "x-seedy")] == [
        ("opct-shuffled", 12), ("base", None), ("opct", None), ("x-seedy", None)]
    r = {"base": {"a": 0}, "sft-seed3": {"a": 1}, "opct-seed3": {"a": 2}, "sft-seed4": {"a": 3}, "opct-seed4": {"a": 4}}
    res = {"config": {"seed": 3, "seeds": 2}, "runs": r}
    assert first_runs(res) == {"base": "base", "sft": "sft-seed3", "opct": "opct-seed3"}
    assert methods_view(res) == {"base": {"a": 0}, "sft": {"a": 1}, "opct": {"a": 2}}
    assert first_runs({"runs": {"opct-seed7": {}, "opct-seed5": {}}}) == {"opct": "opct-seed5"}  # no config: lowest
    assert methods_view({"runs": {"base": None, "opct-seed0": {}}}) == {"opct": {}}  # malformed entries left out


def test_an_earlier_results_file_reads_as_one_map_of_runs_named_method_seed(tmp_path):
    """Earlier demos wrote results "methods" (base and the first seed's runs, named after their method) and
    "seed_runs" (the other seeds'); read_results gives this schema's "runs", every run "<method>-seed<S>" with the
    first seed the config's --seed, and results "seeds" "runs" named so too; the files they wrote are found where
    they are (on_disk)."""
    c = {"value": 0.5, "lo": 0.1, "hi": 0.9, "n": 4}
    old = {"axis": "sycophancy", "config": {"seed": 3, "seeds": 2},
           "methods": {"base": {"r": c}, "sft": {"r": c}, "opct": {"r": c}},
           "seed_runs": {"sft-seed4": {"r": c}, "opct-seed4": {"r": c}},
           "seeds": {"train_seeds": [3, 4], "runs": {"sft": ["sft", "sft-seed4"], "opct": ["opct", "opct-seed4"]},
                     "table": {}},
           "comparison": {"opct_minus_sft": {"r": {"s": c}}}}
    new = read_results(old)
    assert list(new["runs"]) == ["base", "sft-seed3", "opct-seed3", "sft-seed4", "opct-seed4"]
    assert "methods" not in new and "seed_runs" not in new and new["comparison"] == old["comparison"]
    assert new["seeds"]["runs"] == {"sft": ["sft-seed3", "sft-seed4"], "opct": ["opct-seed3", "opct-seed4"]}
    assert methods_view(new) == {m: evaluation(r) for m, r in old["methods"].items()}  # flat: filed (Axis.nest)
    assert read_results(new) == new  # this schema reads as itself
    assert list(read_results({"methods": {"base": {}, "opct": {}}})["runs"]) == ["base", "opct-seed0"]  # no config
    (tmp_path / "opct").mkdir()  # an earlier demo's folder: <out>/opct
    (tmp_path / "sft-seed3").mkdir()
    assert [on_disk(tmp_path, r, new) for r in ("opct-seed3", "sft-seed3", "opct-seed4", "base")] == [
        "opct", "sft-seed3", "opct-seed4", "base"]


def test_a_flat_evaluation_an_earlier_opct_wrote_reads_into_the_four_sections():
    """Before 2026-12-04 an evaluation held its metrics, per-item tables and counts side by side; each axis files
    them (Axis.nest): metrics, units (what comparisons pair), counts, details. One in the schema reads as itself,
    one of an axis this opct does not know is left as it is."""
    c = {"value": 0.5, "lo": 0.1, "hi": 0.9, "n": 2}
    syc = {"sycophancy_rate": {"pushback": c}, "clean_accuracy": c, "n": {"pushback": 2},
           "per_item": {"pushback": {"q1": 1, "q2": 0}}, "degenerate": "option A chosen for 20 of 20 questions"}
    assert read_evaluation(syc, "sycophancy") == {
        "metrics": {"sycophancy_rate": {"pushback": c}, "clean_accuracy": c},
        "units": {"sycophancy_rate": {"pushback": {"q1": 1, "q2": 0}}}, "counts": {"n": {"pushback": 2}},
        "details": {"degenerate": "option A chosen for 20 of 20 questions"}}
    safety = {"judge": "keyword", "pass_rate": {"heldout": c, "oracle": c}, "over_warning": {"contrast": c},
              "n_responses": {"heldout": 2}, "n_unparsed": {"heldout": 0},
              "per_fact": {"heldout": {"f1": 1.0, "f2": 0.0}, "oracle": {"f1": 1.0}, "contrast": {"f3": 0.5}}}
    ev = read_evaluation(safety, "safety")
    assert ev["units"] == {"pass_rate": {"heldout": {"f1": 1.0, "f2": 0.0}}, "over_warning": {"contrast": {"f3": 0.5}}}
    assert ev["counts"] == {"n_responses": {"heldout": 2}, "n_unparsed": {"heldout": 0}}
    assert ev["details"] == {"judge": "keyword", "per_fact": safety["per_fact"]}  # oracle's facts: the report's table
    assert set(ev["metrics"]) == {"pass_rate", "over_warning"}
    jb = {"asr": {"bare": c}, "over_refusal": None, "unparseable": {"bare": 0}, "n": {"bare": 2}, "judge": "refusal",
          "per_item": {"asr": {"bare": {"b1": 1, "b2": 0}}}, "second_judge": {"judge": "advbench", "over_refusal": c},
          "adaptive_attack": {"cracked": c, "defence": c, "attempts_per_behaviour": 3, "wrappers": ["w"]}}
    ev = read_evaluation(jb, "jailbreak")
    assert ev["metrics"] == {"asr": {"bare": c}, "adaptive_attack": {"cracked": c, "defence": c}}  # no benign: none
    assert ev["details"] == {"judge": "refusal", "second_judge": jb["second_judge"],
                             "adaptive_attack": {"attempts_per_behaviour": 3, "wrappers": ["w"]}}
    assert ev["units"] == jb["per_item"] and ev["counts"] == {"unparseable": {"bare": 0}, "n": {"bare": 2}}
    assert result_rows(ev) == [("asr", "bare", c), ("adaptive_attack", "cracked", c), ("adaptive_attack", "defence", c)]
    assert read_evaluation(ev, "jailbreak") == ev and tuple(ev) == SECTIONS
    assert read_evaluation({"x": 1}, "nope") == {"x": 1} and read_evaluation(None, "safety") is None


@pytest.mark.parametrize("axis", ["sycophancy", "safety", "jailbreak"])
def test_each_methods_run_config_comes_from_its_row(axis, tmp_path):
    """A control's run is OPCT's config with its row's settings changed, which win over the axis' own (jailbreak's
    OPCT uses the exact loss; its opct-fixed the sampled one: before the table this combination stopped the demo
    with a TypeError); SFT's run is an SFTConfig."""
    from opct.axes import get_axis
    from opct.config import DemoConfig, SFTConfig, TrainConfig
    from opct.demo import run_config
    from opct.evaluate import config_for_axis

    cfg, ax = config_for_axis(DemoConfig, axis=axis), get_axis(axis)
    opct = run_config(cfg, ax, "opct", 3, tmp_path / "opct")
    assert isinstance(opct, TrainConfig) and opct.seed == 3 and opct.out == str(tmp_path / "opct")
    assert all(getattr(opct, k) == v for k, v in ax.opct.items())
    assert isinstance(run_config(cfg, ax, "sft", 3, tmp_path / "sft"), SFTConfig)
    sleepy = dataclasses.replace(cfg, vllm_sleep=1)  # a GPU demo's sleep mode is its vLLM sampler's, not SFT's
    assert run_config(sleepy, ax, "sft", 3, tmp_path / "sft").vllm_sleep == 0
    assert run_config(sleepy, ax, "opct", 3, tmp_path / "opct").vllm_sleep == 1
    for m in (m for m in METHODS.values() if m.control):
        c = run_config(cfg, ax, m.name, 3, tmp_path / "opct")
        differs = {f: getattr(c, f) for f in vars(c) if getattr(c, f) != getattr(opct, f)}
        assert differs == {k: v for k, v in m.overrides.items() if getattr(opct, k) != v}
        assert all(getattr(c, k) == v for k, v in m.overrides.items())
