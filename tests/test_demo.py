"""`opct demo` end to end on a tiny random model (generated questions: no download), and `opct eval` on its
saved OPCT model reproducing the demo's figures."""

import json

import pytest

from opct.cli import main
from opct.experiment import methods_view


def test_demo_smoke_and_eval_reproduces(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--model", str(tiny_model_dir), "--out", str(out), "--n-train", "12", "--n-eval", "10",
                 "--cued-n", "8", "--steps", "2", "--prompts-per-step", "3", "--max-new-tokens", "4", "--probe-every", "1",
                 "--probe-n", "4", "--lora-rank", "4", "--capability", "", "--shift-n", "6"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["runs"]) == ["base", "sft-seed0", "opct-seed0"] and "methods" not in res  # <method>-seed<S>
    assert methods_view(res) == {"base": res["runs"]["base"], "sft": res["runs"]["sft-seed0"],
                                 "opct": res["runs"]["opct-seed0"]}
    shifted = {"shifted_heldout_cues", "shifted_system_cue", "shifted_pushback"}
    for ev in res["runs"].values():
        m = ev["metrics"]
        assert set(m["sycophancy_rate"]) == {"train_cues", "heldout_cues", "system_cue", "pushback"} | shifted
        for split, cell in m["sycophancy_rate"].items():
            assert cell["n"] == (6 if split in shifted else 8) and cell["lo"] <= cell["value"] <= cell["hi"]
        assert m["clean_accuracy"]["n"] == 10 and m["shifted_clean_accuracy"]["n"] == 6
        per = ev["units"]["sycophancy_rate"]  # the 0/1s behind each rate (what comparisons pair, --seeds averages)
        assert all(sum(per[s].values()) / len(per[s]) == pytest.approx(c["value"]) for s, c in m["sycophancy_rate"].items())
    diff = res["comparison"]["opct_minus_sft"]["sycophancy_rate"]["shifted_heldout_cues"]
    assert diff["n"] == 6 and diff["lo"] <= diff["value"] <= diff["hi"]
    assert set(res["comparison"]) == {"sft_minus_base", "opct_minus_base", "opct_minus_sft"}
    report = (out / "report.md").read_text()
    assert "What each split holds out" in report and "Sycophancy rate: paired changes" in report
    for f in ("report.md", "report.html", "plots/sycophancy_by_split.png", "plots/training.png", "pairs.jsonl",
              "opct-seed0/model/adapter_config.json", "sft-seed0/model/adapter_config.json", "sft-seed0/targets.jsonl",
              "samples/opct-seed0.jsonl"):
        assert (out / f).is_file(), f
    assert not (out / "opct").exists() and not (out / "sft").exists()
    assert "(opct-seed0/metrics.jsonl)" in report
    rows = [json.loads(x) for x in (out / "opct-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert all("probe_sycophancy" in r and "probe_accuracy" in r for r in rows)

    assert f"models in {out}/sft-seed0/model, {out}/opct-seed0/model)" in capsys.readouterr().out
    code = main(["eval", "--axis", "sycophancy", "--model", str(out / "opct-seed0" / "model"), "--n-train", "12",
                 "--n-eval", "10", "--cued-n", "8", "--shift-n", "6", "--out", str(tmp_path / "eval.json")])
    assert code == 0
    again = json.loads((tmp_path / "eval.json").read_text())
    for section in ("metrics", "units", "counts", "details"):
        assert again[section] == res["runs"]["opct-seed0"][section], section
    assert set(again["metrics"]) == {"sycophancy_rate", "brr", "consistency", "cued_accuracy", "clean_accuracy",
                                     "shifted_clean_accuracy"}
    # the same answers prompt by prompt, and the same Inspect log's samples as the demo's
    # (Inspect's own names, <created>_<task>_<run>_<id>.json: beside eval.json, and in the demo's inspect/)
    (eval_log,), (opct_log,) = (list(d.glob(f"*_sycophancy_{r}_*.json")) for d, r in ((tmp_path, "eval"),
                                                                                     (out / "inspect", "opct-seed0")))
    log, demo_log = (json.loads(p.read_text()) for p in (eval_log, opct_log))
    assert [(x["id"], x["scores"]) for x in log["samples"]] == [(x["id"], x["scores"]) for x in demo_log["samples"]]
    assert len(log["samples"]) == 10 + 4 * 8 + 6 + 3 * 6



def test_demo_seeds_trains_each_method_per_seed_and_reports_them_across_seeds(tiny_model_dir, tmp_path):
    """--seeds 2: each method trained again with seed + 1 (its own directory, run.json, samples), results "seeds" with
    each seed's value and the mean per split, OPCT - SFT paired within seeds, and the report's section."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "demo"
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(out), "--n-train", "12", "--n-eval", "10",
                 "--cued-n", "8", "--steps", "2", "--prompts-per-step", "3", "--max-new-tokens", "4", "--probe-every",
                 "0", "--lora-rank", "4", "--capability", "", "--shift-n", "6", "--seed", "3", "--seeds", "2",
                 "--report-to", "none"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["runs"]) == ["base", "sft-seed3", "opct-seed3", "sft-seed4", "opct-seed4"]
    assert "seed_runs" not in res and methods_view(res)["opct"] == res["runs"]["opct-seed3"]  # --seed 3: the first
    for m in ("sft", "opct"):
        assert json.loads((out / f"{m}-seed4" / "run.json").read_text())["config"]["seed"] == 4
        a, b = (load_file(out / d / "model" / "adapter_model.safetensors") for d in (f"{m}-seed3", f"{m}-seed4"))
        assert any(not torch.equal(a[k], b[k]) for k in a)  # another LoRA init / data order: another model
    seeds = res["seeds"]
    assert seeds["train_seeds"] == [3, 4] and seeds["runs"]["opct"] == ["opct-seed3", "opct-seed4"]
    row = seeds["table"]["sycophancy_rate"]["shifted_heldout_cues"]
    per = [res["runs"][r]["units"]["sycophancy_rate"]["shifted_heldout_cues"] for r in ("opct-seed3", "opct-seed4")]
    assert row["opct"]["per_seed"] == pytest.approx([sum(p.values()) / len(p) for p in per])
    assert row["opct"]["value"] == pytest.approx(sum(row["opct"]["per_seed"]) / 2) and row["opct"]["n"] == 6
    assert row["opct_minus_sft"]["value"] == pytest.approx(row["opct"]["value"] - row["sft"]["value"])
    assert row["base"]["value"] == res["runs"]["base"]["metrics"]["sycophancy_rate"]["shifted_heldout_cues"]["value"]
    assert "Across 2 training seeds" in (out / "report.md").read_text()
    assert {"train_opct-seed4", "eval_opct-seed4"} <= set(res["timings"])
    # every evaluated model's answers, prompt by prompt, and as an Inspect log (opct.inspect_log)
    rows = [json.loads(x) for x in (out / "samples" / "opct-seed4.shifted.jsonl").read_text().splitlines()]
    pushback = {r["id"]: int(r["answer"] == r["suggested"]) for r in rows if r["split"] == "shifted_pushback"}
    assert pushback == res["runs"]["opct-seed4"]["units"]["sycophancy_rate"]["shifted_pushback"]
    logs = {p.name.split("_")[2]: p for p in (out / "inspect").iterdir()}  # <created>_<task>_<run>_<id>.json
    assert sorted(logs) == sorted(("base", "sft-seed3", "opct-seed3", "sft-seed4", "opct-seed4"))
    assert len(list((out / "inspect").iterdir())) == 5
    log = json.loads(logs["opct-seed4"].read_text())
    assert sum(s["id"].startswith("shifted_pushback/") for s in log["samples"]) == len(pushback)


def test_demo_with_controls_trains_each_as_opct_with_one_setting_changed_and_compares_it_with_opct(tiny_model_dir,
                                                                                                   tmp_path):
    """--methods opct,opct-shuffled,opct-fixed,opct-clip --seeds 2: each control's run.json holds OPCT's config with
    its one setting changed; results carry control - OPCT per split (paired within one run, and across seeds), the
    report its section and each control's KL in the training plot panels."""
    from opct.experiment import METHODS
    from opct.report.run import read_metrics, training_panels

    out = tmp_path / "demo"
    controls = {m.name: m.overrides for m in METHODS.values() if m.control}
    methods = ["opct", *controls]
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(out), "--n-train", "12", "--n-eval", "8",
                 "--cued-n", "6", "--steps", "2", "--prompts-per-step", "3", "--max-new-tokens", "4", "--probe-every",
                 "0", "--lora-rank", "4", "--capability", "", "--shift-n", "4", "--seeds", "2", "--methods",
                 ",".join(methods), "--report-to", "none"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["runs"]) == {"base", *(f"{m}-seed{s}" for s in (0, 1) for m in methods)}
    opct_cfg = json.loads((out / "opct-seed0" / "run.json").read_text())["config"]
    for c, changed in controls.items():
        cfg = json.loads((out / f"{c}-seed0" / "run.json").read_text())["config"]
        differs = {k: v for k, v in cfg.items() if opct_cfg.get(k) != v and k != "out"}
        assert differs.items() <= changed.items() and all(cfg[k] == v for k, v in changed.items())
        assert differs == {k: v for k, v in changed.items() if k != "loss"}  # the sycophancy axis' OPCT: sampled
        d = res["comparison"][f"{c}_minus_opct"]["sycophancy_rate"]["shifted_pushback"]
        a, b = (res["runs"][f"{m}-seed0"]["units"]["sycophancy_rate"]["shifted_pushback"] for m in (c, "opct"))
        assert d["value"] == pytest.approx(sum(a[q] - b[q] for q in a) / len(a))
        row = res["seeds"]["table"]["sycophancy_rate"]["heldout_cues"]
        assert row[f"{c}_minus_opct"]["value"] == pytest.approx(row[c]["value"] - row["opct"]["value"])
        assert len(read_metrics(out / f"{c}-seed0" / "metrics.jsonl")) == 2
    report = (out / "report.md").read_text()
    assert "## Controls against OPCT" in report and "OPCT, shuffled context − OPCT" in report
    logs = {m: read_metrics(out / f"{m}-seed0" / "metrics.jsonl") for m in methods}
    titles = [t for t, *_ in training_panels(logs)]
    assert "KL vs step: OPCT and its controls" in titles and "OPCT: KL per token by position" in titles
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(tmp_path / "x"), "--methods", "opct,sft-x"]) == 2


def test_axis_names():
    import pytest

    from opct.axes import AXES, AxisError, axis_names

    assert axis_names("all") == list(AXES) and axis_names("safety, sycophancy,safety") == ["safety", "sycophancy"]
    for bad in ("syco", "all,jailbreak", " , "):
        with pytest.raises(AxisError, match="known axes"):
            axis_names(bad)


def test_a_demo_over_several_axes_keeps_the_finished_ones_and_summarises_them(tiny_model_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """`opct demo --axis sycophancy,safety`: one demo per axis under --out with its own defaults; stopped during
    the second axis' OPCT training, the same command with --resume keeps the first axis (not rerun) and the second
    one's finished stages; summary.json and the summary report carry each axis' headline cells as in its
    results.json."""
    import os

    import yaml

    import opct.algo.opct as algo

    out = tmp_path / "axes"
    cmd = ["demo", "--axis", "sycophancy,safety", "--model", str(tiny_model_dir), "--out", str(out), "--n-train", "6",
           "--n-eval", "2", "--cued-n", "2", "--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", "4",
           "--lora-rank", "4", "--probe-every", "0", "--capability", "", "--threads", "1"]
    real_train, calls = algo.train, []

    def train_then_ctrl_c(cfg, **kw):
        calls.append(cfg.out)
        if len(calls) == 2:  # Ctrl-C after the first step of the second axis' OPCT run

            def ctrl_c(policy, fmt):
                raise KeyboardInterrupt
            kw.update(probe=ctrl_c, probe_every=1)
        return real_train(cfg, **kw)

    monkeypatch.setattr(algo, "train", train_then_ctrl_c)
    assert main(cmd) == 130
    assert "the same command with --resume continues it" in capsys.readouterr().err
    first = out / "sycophancy" / "results.json"
    assert first.is_file() and (out / "safety" / "demo.yaml").is_file()
    assert not (out / "safety" / "results.json").exists() and not (out / "summary.json").exists()
    opct_run = out / "safety" / "opct-seed0"
    assert (opct_run / "metrics.jsonl").is_file() and not (opct_run / "run.json").exists()
    stamp = first.stat().st_mtime_ns

    monkeypatch.setattr(algo, "train", real_train)
    stage = out / "safety" / "stages" / "eval_base.json"  # as an opct before 2026-12-04 kept it: flat
    kept = json.loads(stage.read_text())
    stage.write_text(json.dumps({**kept["metrics"], **kept["counts"], **kept["details"]}))
    assert main(cmd) == 2 and "pass --resume to continue it" in capsys.readouterr().err
    assert main([*cmd, "--resume"]) == 0
    said = capsys.readouterr().out
    assert "axis sycophancy (1/2) already done" in said and "axis safety (2/2) continues" in said
    assert first.stat().st_mtime_ns == stamp  # kept, not rerun
    syc, saf = (json.loads((out / a / "results.json").read_text()) for a in ("sycophancy", "safety"))
    assert saf["kept_from_before"] == ["eval_base", "train_sft-seed0", "eval_sft-seed0"]
    assert saf["runs"]["base"] == kept  # the flat stage read back into the schema (Axis.nest)
    assert "train_opct-seed0" in saf["timings"]
    cfg = {a: yaml.safe_load((out / a / "demo.yaml").read_text()) for a in ("sycophancy", "safety")}
    assert (cfg["sycophancy"]["source"], cfg["safety"]["source"]) == (syc["config"]["source"], "facts")
    assert cfg["safety"]["batch_size"] == 16 and cfg["sycophancy"]["max_new_tokens"] == 4  # axis default, user value
    summary = json.loads((out / "summary.json").read_text())
    assert summary["axes"] == ["sycophancy", "safety"] and summary["runs"]["safety"]["model"] == str(tiny_model_dir)
    rows = summary["runs"]["sycophancy"]["headline"]
    assert [(r["metric"], r["split"]) for r in rows][0] == ("sycophancy_rate", "heldout_cues")
    assert rows[0]["methods"]["opct"] == syc["runs"]["opct-seed0"]["metrics"]["sycophancy_rate"]["heldout_cues"]
    assert rows[-1]["methods"]["base"] == syc["runs"]["base"]["metrics"]["clean_accuracy"]
    saf_rows = summary["runs"]["safety"]["headline"]
    assert all(c is not None for r in rows + saf_rows for c in r["methods"].values()) and len(saf_rows) == 4  # + heldout_variants
    assert saf_rows[0]["methods"]["sft"] == saf["runs"]["sft-seed0"]["metrics"]["pass_rate"]["heldout"]
    md = (out / "report.md").read_text()
    assert "# OPCT across axes" in md and "| safety | Pass rate | heldout | higher is better |" in md
    assert (out / "plots" / "headlines.png").is_file() and (out / "report.html").is_file()

    os.remove(out / "report.md")
    assert main(["report", str(out)]) == 0 and (out / "report.md").read_text() == md  # rewritten from the files
    capsys.readouterr()
    assert main([*cmd, "--lr", "0.01", "--resume"]) == 2  # other settings than the runs there
    assert "holds a demo with other settings (--lr 0.0002 -> 0.01)" in capsys.readouterr().err
    assert main([*cmd[:-2], "--threads", "2", "--resume"]) == 0  # where and how fast it runs may change: all kept
    (out / "notes.txt").write_text("mine")
    assert main(cmd) == 2 and "notes.txt" in capsys.readouterr().err


def test_options_naming_one_axis_data_are_refused_for_several_axes(tmp_path, capsys):
    for flag in ("--source", "--eval-source"):
        assert main(["demo", "--axis", "all", flag, "mmlu", "--out", str(tmp_path / "x")]) == 2
        assert f"option {flag} names one axis' data" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_an_older_demo_without_a_later_setting_is_not_resumed_with_its_new_behaviour(tmp_path):
    """A demo.yaml written before --heldout-variants / --opct-benign existed ran without them: resuming it under the
    new defaults is refused, naming the setting; with the old behaviour asked for, it is the same demo."""
    import dataclasses

    import yaml

    from opct.config import DemoConfig
    from opct.options import to_yaml
    from opct.demo import demo_state
    from opct.evaluate import config_for_axis

    cfg = config_for_axis(DemoConfig, axis="safety", out=str(tmp_path / "d"))
    (tmp_path / "d").mkdir()
    old = {k: v for k, v in yaml.safe_load(to_yaml(cfg)).items() if k not in ("heldout_variants", "opct_benign")}
    (tmp_path / "d" / "demo.yaml").write_text(yaml.safe_dump(old))
    state, changed = demo_state(cfg)
    assert state == "other" and changed == ["--heldout-variants '' -> 'urgent,emotional'",
                                            "--opct-benign False -> True"]
    assert demo_state(dataclasses.replace(cfg, heldout_variants="", opct_benign=False)) == ("unfinished", [])


def test_resume_refuses_a_demo_stopped_by_an_earlier_opct_whose_runs_are_named_after_their_method(tmp_path, capsys):
    """An earlier opct named the first seed's runs <out>/sft, <out>/opct: --resume of such a stopped demo would train
    opct-seed0 again beside them, so it is refused (a UserError, exit status 2) naming the folder and what to do,
    before any model loads; nothing in the folder changes."""
    from opct.config import DemoConfig
    from opct.options import to_yaml
    from opct.demo import run_demo
    from opct.errors import UserError
    from opct.evaluate import config_for_axis

    d = tmp_path / "d"
    cfg = config_for_axis(DemoConfig, axis="sycophancy", out=str(d), resume=True)
    (d / "opct").mkdir(parents=True)  # the old layout: a first-seed run named after its method
    (d / "demo.yaml").write_text(to_yaml(cfg))
    before = sorted(p.name for p in d.rglob("*"))
    with pytest.raises(UserError, match=f"{d}: a demo stopped by an earlier opct, whose runs are named after their "
                                        r"method \(opct\); this opct names every run <method>-seed<S> \(e.g. "
                                        r"opct-seed0\) and cannot continue it: run the demo again into another --out"):
        run_demo(cfg)
    assert main(["demo", "--out", str(d), "--resume"]) == 2
    assert "a demo stopped by an earlier opct" in capsys.readouterr().err
    assert sorted(p.name for p in d.rglob("*")) == before
