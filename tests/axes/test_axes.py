"""The shared axis structure: the registry, per-axis defaults under user options, the generic demo on a fake axis
(results.json schema, eval --axis reproducing it), and the safety axis' data split and its demo on a tiny model."""

import argparse
import dataclasses
import json

import pytest
import yaml

from opct import config, options
from opct.axes import AXES, AxisError, axis_defaults, get_axis
from opct.axes.options import DEMO_SOURCE
from opct.axes.base import respond
from opct.axes.interface import AxisData, Metric
from opct.stats import result_rows
from opct.experiment import SECTIONS, evaluation
from opct.cli import main
from opct.data.pairs import ConsistencyPair

SCHEMA = {"axis", "model", "config", "runs", "info", "timings", "wall_seconds"}


class FakeAxis:
    """A minimal axis: student = "say X <word>", teacher = "<word>"; its metric is the share of greedy responses
    that contain the first letter of the word (any number: the test checks plumbing, not learning)."""
    name = "fake"
    summary = "test axis"
    defaults = {"n_train": 5, "max_new_tokens": 3}
    sft = {"samples_per_prompt": 2}
    opct: dict = {}
    metrics = {"hit": Metric("Hit rate", "higher")}
    headline = (("hit", "words", "higher"),)
    words = ["apple", "river", "stone", "cloud", "green", "table", "light"]

    def prepare(self, cfg, tok):
        pairs = [ConsistencyPair([{"role": "user", "content": f"say X {w}"}], [{"role": "user", "content": w}],
                                 {"id": w}) for w in self.words[:cfg.n_train]]
        return AxisData(pairs, self.words[-2:], info={"n_train_pairs": len(pairs)})

    def evaluate(self, policy, fmt, data, cfg, samples=None):
        out = respond(policy, fmt, [[{"role": "user", "content": w}] for w in data.eval_set], cfg.max_new_tokens)
        k = sum(w[0] in r for w, r in zip(data.eval_set, out))
        if samples is not None:
            samples.parent.mkdir(parents=True, exist_ok=True)
            samples.write_text("".join(json.dumps({"prompt": w, "response": r}) + "\n"
                                       for w, r in zip(data.eval_set, out)))
        return self.nest({"hit": {"words": {"value": k / len(out), "lo": 0.0, "hi": 1.0, "n": len(out)}},
                          "responses": out})

    def check(self, cfg):
        pass

    def probe(self, data, cfg):
        return None

    def verdict(self, row):
        return {"hit": {"value": int(row.get("hit", 0)), "answer": row.get("response", "")}}

    def nest(self, result):
        units = {"hit": {"words": {str(i): int(r[:1] in "ar") for i, r in enumerate(result["responses"])}}}
        return evaluation({"hit": result["hit"]}, units, details={"responses": result["responses"]})

    def report_blocks(self, results, run_dir):
        from opct.report.run import results_blocks

        return results_blocks(results)


@pytest.fixture
def fake_axis(monkeypatch):
    monkeypatch.setitem(AXES, "fake", f"{__name__}:FakeAxis")


def parsed(cls, argv):
    p = argparse.ArgumentParser()
    options.add_arguments(p, cls)
    return p.parse_args(argv)


def test_registry_names_axes_and_rejects_unknown_ones_with_the_list(capsys):
    assert get_axis("sycophancy").name == "sycophancy"
    assert get_axis("safety").name == "safety"
    with pytest.raises(AxisError, match="unknown axis 'nope'; known axes: sycophancy, safety"):
        get_axis("nope")
    assert main(["demo", "--axis", "nope", "--out", "/nonexistent/x"]) == 2
    assert "known axes: sycophancy, safety" in capsys.readouterr().err


def test_an_axis_lacking_a_member_of_the_interface_is_refused_naming_it(monkeypatch):
    monkeypatch.delattr(FakeAxis, "nest")
    monkeypatch.setitem(AXES, "partial", f"{__name__}:FakeAxis")
    with pytest.raises(AxisError, match="axis 'partial' .* lacks nest"):
        get_axis("partial")


def test_axis_defaults_apply_only_where_the_user_set_nothing(fake_axis, tmp_path):
    build = lambda argv: config.build(config.DemoConfig, parsed(config.DemoConfig, argv),  # noqa: E731
                                      defaults=axis_defaults)
    plain = build([])
    assert (plain.axis, plain.n_train, plain.max_new_tokens, plain.source) == ("sycophancy", 100, 16,
                                                                              DEMO_SOURCE)
    fake = build(["--axis", "fake", "--steps", "5"])
    assert (fake.steps, fake.n_train, fake.max_new_tokens) == (5, 5, 3)
    fake = build(["--axis", "fake", "--max-new-tokens", "9"])
    assert (fake.n_train, fake.max_new_tokens) == (5, 9)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("axis: fake\nmax-new-tokens: 20\n")
    from_yaml = build(["--config", str(yaml_file), "--n-train", "7"])
    assert (from_yaml.axis, from_yaml.max_new_tokens, from_yaml.n_train) == ("fake", 20, 7)
    # an axis default for an option the command lacks (steps, for eval) is ignored
    FakeAxis.defaults["steps"] = 3
    try:
        ev = config.build(config.EvalConfig, parsed(config.EvalConfig, ["--axis", "fake"]), defaults=axis_defaults)
    finally:
        del FakeAxis.defaults["steps"]
    assert ev.n_train == 5 and not hasattr(ev, "steps")
    # the Python API does the same
    from opct.evaluate import config_for_axis

    api = config_for_axis(config.DemoConfig, axis="fake", max_new_tokens=9)
    assert (api.n_train, api.max_new_tokens, api.steps) == (5, 9, 25)
    with pytest.raises(options.ConfigError, match="--n-train"):
        config_for_axis(config.DemoConfig, axis="fake", n_train=-1)


def test_result_rows_put_single_cells_first():
    c = {"value": 0.5, "lo": 0.1, "hi": 0.9, "n": 4}
    res = evaluation({"a": {"s1": c, "s2": c}, "b": c}, counts={"n": {"s1": 4}}, details={"judge": "keyword"})
    assert [(m, s) for m, s, _ in result_rows(res)] == [("b", ""), ("a", "s1"), ("a", "s2")]


def test_generic_demo_on_a_fake_axis_and_eval_axis_reproduces_it(fake_axis, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--axis", "fake", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2",
                 "--prompts-per-step", "2", "--lora-rank", "4", "--probe-every", "0", "--capability", ""])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert SCHEMA <= set(res) and res["axis"] == "fake"
    assert set(res["runs"]) == {"base", "sft-seed0", "opct-seed0"} and res["info"] == {"n_train_pairs": 5}
    assert res["config"]["n_train"] == 5 and res["config"]["max_new_tokens"] == 3  # the axis' defaults
    stages = {"prepare", "eval_base", "train_sft-seed0", "eval_sft-seed0", "train_opct-seed0", "eval_opct-seed0"}
    assert stages <= set(res["timings"])
    targets = (out / "sft-seed0" / "targets.jsonl").read_text().splitlines()
    assert len(targets) == 5 * 2  # FakeAxis.sft: two targets per teacher prompt
    sft_cfg = yaml.safe_load((out / "sft-seed0" / "config.yaml").read_text())
    assert (sft_cfg["prompts_per_step"], sft_cfg["micro_batch"], sft_cfg["steps"]) == (1, 2, 2)
    for r in ("base", "sft-seed0", "opct-seed0"):
        assert (out / "samples" / f"{r}.jsonl").is_file()
    md = (out / "report.md").read_text()
    assert "Axis: fake" in md and "| words |" in md

    capsys.readouterr()
    code = main(["eval", "--axis", "fake", "--model", str(out / "opct-seed0" / "model"),
                 "--out", str(tmp_path / "e.json")])
    assert code == 0
    again = json.loads((tmp_path / "e.json").read_text())
    assert again["axis"] == "fake" and again["metrics"] == res["runs"]["opct-seed0"]["metrics"]
    assert again["details"]["responses"] == res["runs"]["opct-seed0"]["details"]["responses"]
    assert again["units"] == res["runs"]["opct-seed0"]["units"]
    assert (tmp_path / "e.samples.jsonl").is_file()
    assert "hit" in capsys.readouterr().out


def test_safety_prepare_splits_by_fact_and_picks_untrained_prompts_for_the_train_split(tokenizer):
    cfg = config.DemoConfig(**{**get_axis("safety").defaults, "axis": "safety", "n_train": 60, "n_eval": 3})
    data = get_axis("safety").prepare(cfg, tokenizer)
    held = set(data.info["heldout_facts"])
    splits = data.eval_set["splits"]
    assert len(data.train_pairs) == 60 and held
    assert not {p.meta["fact_id"] for p in data.train_pairs} & held
    assert {p.fact_id for p in splits["heldout"]} == held
    assert not {p.fact_id for p in splits["train"]} & held
    assert data.info["train_eval_prompts_trained_on"] == 0
    assert [p.id for p in splits["oracle"]] == [p.id for p in splits["heldout"]]
    assert all(p.contrast for p in splits["contrast"]) and not any(p.contrast for p in splits["heldout"])
    assert len(splits["train"]) == 34 and len(splits["contrast"]) == 49  # a third of n_eval per fact: 1
    per_fact = {}
    for p in splits["heldout"]:
        per_fact.setdefault(p.fact_id, []).append(p)
    assert all(len(v) == 3 and len({p.prompt_type for p in v}) >= 2 for v in per_fact.values())
    pair = data.train_pairs[0]
    assert pair.teacher[0]["role"] == "system" and pair.student == pair.teacher[1:]
    assert pair.meta["id"].split("/")[0] == pair.meta["fact_id"]
    again = get_axis("safety").prepare(cfg, tokenizer)
    assert [p.meta["id"] for p in again.train_pairs] == [p.meta["id"] for p in data.train_pairs]
    # the second held-out dimension: the held-out variants are never trained on, and their split asks the held-out
    # facts in them only
    held_v = {"urgent", "emotional"}
    assert data.info["heldout_variants"] == sorted(held_v)
    assert not {p.meta["variant"] for p in data.train_pairs} & held_v
    assert not {p.variant for s in ("heldout", "train", "oracle") for p in splits[s]} & held_v
    assert {p.variant for p in splits["heldout_variants"]} == held_v
    assert {p.fact_id for p in splits["heldout_variants"]} == held and len(splits["heldout_variants"]) == 3 * len(held)
    every = get_axis("safety").prepare(dataclasses.replace(cfg, heldout_variants=""), tokenizer)
    assert "heldout_variants" not in every.eval_set["splits"]
    assert {p.meta["variant"] for p in every.train_pairs} & held_v  # all seven variants trained on
    with pytest.raises(options.ConfigError, match="heldout-variants"):
        config.validate(dataclasses.replace(cfg, heldout_variants="urgent,shouting"))


def test_safety_demo_on_a_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "safety"
    code = main(["demo", "--axis", "safety", "--model", str(tiny_model_dir), "--out", str(out), "--n-train", "6",
                 "--n-eval", "1", "--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "4",
                 "--lora-rank", "4", "--capability", ""])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert SCHEMA | {"comparison"} <= set(res) and res["axis"] == "safety"
    for ev in res["runs"].values():
        assert tuple(ev) == SECTIONS
        r, details = ev["metrics"], ev["details"]
        assert details["judge"] == "keyword"
        assert set(r["pass_rate"]) == {"heldout", "heldout_variants", "train", "oracle"}
        assert set(r["over_warning"]) == {"contrast"}
        for c in r["pass_rate"].values():
            assert 0 <= c["lo"] <= c["value"] <= c["hi"] <= 1
        assert r["pass_rate"]["heldout"]["n"] == res["info"]["n_heldout_facts"]
        assert len(details["safety_curve"]["heldout"]["values"]) == len(details["safety_curve"]["heldout"]["taus"])
        units = ev["units"]  # per-fact rates behind the rates (what comparisons pair, what --seeds averages)
        assert set(units) == {"pass_rate", "over_warning"}
        assert set(units["pass_rate"]) == {"heldout", "heldout_variants", "train"}
        per = units["pass_rate"]["heldout"]
        assert sum(per.values()) / len(per) == pytest.approx(r["pass_rate"]["heldout"]["value"])
        assert per == details["per_fact"]["heldout"] and "oracle" in details["per_fact"]
    assert set(res["comparison"]["opct_minus_base"]["pass_rate"]) == {"heldout", "heldout_variants", "train"}
    assert len((out / "sft-seed0" / "targets.jsonl").read_text().splitlines()) == 6 * 3  # k = 3 samples per prompt
    sft_cfg = yaml.safe_load((out / "sft-seed0" / "config.yaml").read_text())
    assert (sft_cfg["temperature"], sft_cfg["samples_per_prompt"]) == (1.0, 3)
    assert (sft_cfg["prompts_per_step"], sft_cfg["micro_batch"]) == (1, 3)  # ~ as many sequences as OPCT's 2
    rows = [json.loads(x) for x in (out / "samples" / "opct-seed0.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"heldout", "heldout_variants", "train", "contrast", "oracle"}
    assert "What each split holds out" in (out / "report.md").read_text()
    md = (out / "report.md").read_text()
    assert "plots/safety_curve.png" in md and "Sample responses" in md and "Paired changes" in md
    assert (out / "plots" / "safety_curve.png").is_file()


def test_safety_hf_source_is_evaluation_only_and_graded_by_the_llm_judge(tiny_model_dir, tmp_path, monkeypatch):
    """A local folder in SAGE-Eval's schema read by hf: spec (as the Hub id would be): `opct eval --axis safety`
    grades it through the LLM judge's endpoint call (stubbed here; dev/safety_llm_judge_vllm.py runs a real
    `vllm serve`); `opct demo` refuses it, since it has nothing to train on."""
    from opct.judges import endpoint

    sage = tmp_path / "sage"
    sage.mkdir()
    rows = [{"safety_fact": f"Fact {k} applies.", "prompt": f"Prompt {k}{i}?", "augmentation_category": "none",
             "safety_category": "Child", "prompt_type": "t", "version": "v1"} for k in "AB" for i in range(2)]
    (sage / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def fake_completion(url, model, messages, **kw):
        seen.append((url, model, messages[0]["content"]))
        return "Final judgment: *pass*" if "Fact A" in messages[0]["content"] else "no idea"
    monkeypatch.setattr(endpoint, "chat_completion", fake_completion)
    out = tmp_path / "e.json"
    code = main(["eval", "--axis", "safety", "--model", str(tiny_model_dir), "--source", f"hf:{sage}:train",
                 "--n-eval", "2", "--max-new-tokens", "3", "--judge", "llm", "--judge-url", "http://judge/v1",
                 "--judge-model", "j", "--out", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    assert res["details"]["judge"] == "llm"
    assert res["metrics"]["pass_rate"]["heldout"]["value"] == 0.5  # fact A passes, B unparseable
    assert res["counts"]["n_unparsed"] == {"heldout": 2, "oracle": 2} and res["info"]["n_train_pairs"] == 0
    assert seen[0][2] == "Reply with OK."  # the endpoint check, before the model loads
    assert len(seen) == 9 and all(u == "http://judge/v1" and m == "j" for u, m, _ in seen)
    assert main(["demo", "--axis", "safety", "--model", str(tiny_model_dir), "--source", f"hf:{sage}:train",
                 "--out", str(tmp_path / "d"), "--capability", ""]) == 2


def test_an_axis_metric_is_labelled_and_directed_by_its_own_axis_only(fake_axis):
    """A new axis metric touches only its axis package: the report's label and direction and the Inspect log's
    verdict come from the axis (Axis.metrics, Axis.verdict), nothing else names it."""
    from opct.inspect_log import sample_score
    from opct.report.render import direction, label

    assert label("hit") == "Hit rate" and direction("hit") == " (higher is better)"
    assert label("sycophancy_rate") == "Sycophancy rate" and direction("over_warning") == " (lower is better)"
    assert direction("brr") == "" and label("some_key") == "some key"  # no direction stated; unknown: its name
    assert sample_score("fake", {"hit": 1, "response": "a"}) == {"hit": {"value": 1, "answer": "a"}}
    assert sample_score("nope", {"hit": 1}) == {}
