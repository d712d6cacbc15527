"""The shared axis structure: the registry, per-axis defaults under user options, the generic demo on a fake axis
(results.json schema, eval --axis reproducing it), and the safety axis' data split and its demo on a tiny model."""

import argparse
import json

import pytest
import yaml

from opct import config
from opct.axes import AXES, AxisError, axis_defaults, get_axis
from opct.axes.base import AxisData, generate, result_rows
from opct.cli import main
from opct.data.pairs import ConsistencyPair

SCHEMA = {"axis", "model", "config", "methods", "info", "timings", "wall_seconds"}


class FakeAxis:
    """A minimal axis: student = "say X <word>", teacher = "<word>"; its metric is the share of greedy responses
    that contain the first letter of the word (any number: the test checks plumbing, not learning)."""
    name = "fake"
    summary = "test axis"
    defaults = {"n_train": 5, "max_new_tokens": 3}
    sft = {"samples_per_prompt": 2}
    words = ["apple", "river", "stone", "cloud", "green", "table", "light"]

    def prepare(self, cfg, tok):
        pairs = [ConsistencyPair([{"role": "user", "content": f"say X {w}"}], [{"role": "user", "content": w}],
                                 {"id": w}) for w in self.words[:cfg.n_train]]
        return AxisData(pairs, self.words[-2:], info={"n_train_pairs": len(pairs)})

    def evaluate(self, model, tok, data, cfg, samples=None):
        out = generate(model, tok, [[{"role": "user", "content": w}] for w in data.eval_set], cfg, cfg.max_new_tokens)
        k = sum(w[0] in r for w, r in zip(data.eval_set, out))
        if samples is not None:
            samples.parent.mkdir(parents=True, exist_ok=True)
            samples.write_text("".join(json.dumps({"prompt": w, "response": r}) + "\n"
                                       for w, r in zip(data.eval_set, out)))
        return {"hit": {"words": {"value": k / len(out), "lo": 0.0, "hi": 1.0, "n": len(out)}},
                "responses": out}

    def probe(self, data, cfg):
        return None

    def report_blocks(self, results, run_dir):
        from opct.report import results_blocks

        return results_blocks(results)


@pytest.fixture
def fake_axis(monkeypatch):
    monkeypatch.setitem(AXES, "fake", f"{__name__}:FakeAxis")


def parsed(cls, argv):
    p = argparse.ArgumentParser()
    config.add_arguments(p, cls)
    return p.parse_args(argv)


def test_registry_names_axes_and_rejects_unknown_ones_with_the_list(capsys):
    assert get_axis("sycophancy").name == "sycophancy"
    with pytest.raises(AxisError, match="unknown axis 'nope'; known axes: sycophancy"):
        get_axis("nope")
    assert main(["demo", "--axis", "nope", "--out", "/nonexistent/x"]) == 2
    assert "known axes: sycophancy" in capsys.readouterr().err


def test_axis_defaults_apply_only_where_the_user_set_nothing(fake_axis, tmp_path):
    build = lambda argv: config.build(config.DemoConfig, parsed(config.DemoConfig, argv),  # noqa: E731
                                      defaults=axis_defaults)
    plain = build([])
    assert (plain.axis, plain.n_train, plain.max_new_tokens, plain.source) == ("sycophancy", 100, 16,
                                                                              config.DEMO_SOURCE)
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


def test_result_rows_put_single_cells_first():
    c = {"value": 0.5, "lo": 0.1, "hi": 0.9, "n": 4}
    res = {"a": {"s1": c, "s2": c}, "b": c, "n": {"s1": 4}, "judge": "keyword"}
    assert [(m, s) for m, s, _ in result_rows(res)] == [("b", ""), ("a", "s1"), ("a", "s2")]


def test_generic_demo_on_a_fake_axis_and_eval_axis_reproduces_it(fake_axis, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--axis", "fake", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2",
                 "--prompts-per-step", "2", "--lora-rank", "4", "--probe-every", "0", "--capability", ""])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert SCHEMA <= set(res) and res["axis"] == "fake"
    assert set(res["methods"]) == {"base", "sft", "opct"} and res["info"] == {"n_train_pairs": 5}
    assert res["config"]["n_train"] == 5 and res["config"]["max_new_tokens"] == 3  # the axis' defaults
    assert {"prepare", "eval_base", "train_sft", "eval_sft", "train_opct", "eval_opct"} <= set(res["timings"])
    targets = (out / "sft" / "targets.jsonl").read_text().splitlines()
    assert len(targets) == 5 * 2  # FakeAxis.sft: two targets per teacher prompt
    for m in ("base", "sft", "opct"):
        assert (out / "samples" / f"{m}.jsonl").is_file()
    md = (out / "report.md").read_text()
    assert "Axis: fake" in md and "| words |" in md

    capsys.readouterr()
    code = main(["eval", "--axis", "fake", "--model", str(out / "opct" / "model"), "--out", str(tmp_path / "e.json")])
    assert code == 0
    again = json.loads((tmp_path / "e.json").read_text())
    assert again["axis"] == "fake" and again["hit"] == res["methods"]["opct"]["hit"]
    assert again["responses"] == res["methods"]["opct"]["responses"]
    assert (tmp_path / "e.samples.jsonl").is_file()
    assert "hit" in capsys.readouterr().out
