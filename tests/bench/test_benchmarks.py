"""benchmarks/: length-matched prompts (common.py), the cost-growth grid's parsing, resume and growth analysis
(cost_growth.py), and vs_trl's three-side summary. Pure functions on synthetic inputs; no timing is asserted."""
import importlib.util
import json
import math
import os
import platform
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mods():
    sys.path.insert(0, str(BENCH))
    yield {name: load(name) for name in ("common", "vs_trl", "cost_growth", "step")}
    sys.path.remove(str(BENCH))


# ------------------------------------------------------------------ prompts

def fake_sources(harmful):
    behaviours = [harmful.Behaviour(f"t/{i}", f"Explain how to do forbidden thing number {i}", "t")
                  for i in range(12)]
    # wrappers of very different lengths: 0, 1, ..., 29 filler sentences around the slot
    wrappers = [harmful.Wrapper(f"w{i:02d}", "test", "Pretend you are a pirate. " * i + harmful.SLOT, "test")
                for i in range(30)]
    return behaviours, wrappers


def test_length_prompts_single_turn_within_band_and_deterministic(mods, tokenizer):
    from opct.axes.jailbreak import harmful

    common = mods["common"]
    behaviours, wrappers = fake_sources(harmful)
    items, info = common.length_prompts(10, 120, tokenizer, behaviours=behaviours, wrappers=wrappers)
    again, _ = common.length_prompts(10, 120, tokenizer, behaviours=behaviours, wrappers=wrappers)
    assert items == again
    assert info["kind"] == "single-turn" and info["single_turn_wrappers"] >= 4
    lengths = [common.prompt_length(tokenizer, it["student"]) for it in items]
    assert all(102 <= n <= 138 for n in lengths), lengths
    assert info["min_tokens"] == min(lengths) and info["max_tokens"] == max(lengths)
    for it in items:  # one user turn: a real wrapper around a real behaviour
        assert len(it["student"]) == 1 and it["student"][0]["role"] == "user"
        assert "forbidden thing number" in it["student"][0]["content"]
        assert it["privileged_context"] in common.JAILBREAK_CONTEXTS
    other_seed, _ = common.length_prompts(10, 120, tokenizer, seed=1, behaviours=behaviours, wrappers=wrappers)
    assert other_seed != items


def test_length_prompts_multi_turn_when_wrappers_are_too_short(mods, tokenizer):
    from opct.axes.jailbreak import harmful

    common = mods["common"]
    behaviours, wrappers = fake_sources(harmful)
    longest = max(common.prompt_length(tokenizer, harmful.user(w.wrap(behaviours[0].text))) for w in wrappers)
    target = 3 * longest
    items, info = common.length_prompts(4, target, tokenizer, behaviours=behaviours, wrappers=wrappers)
    assert info["kind"] == "multi-turn"
    for it, names in zip(items, info["wrappers"]):
        n = common.prompt_length(tokenizer, it["student"])
        assert 0.85 * target <= n <= 1.15 * target
        roles = [m["role"] for m in it["student"]]
        assert roles[-1] == "user" and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert all(m["content"] == common.REFUSAL for m in it["student"] if m["role"] == "assistant")
        assert len(names) == len(roles) // 2 + 1


def test_teacher_messages_append_privileged_context(mods):
    common = mods["common"]
    item = {"student": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}], "privileged_context": "ctx"}
    assert common.teacher_messages(item) == item["student"][:2] + [{"role": "user", "content": "c\n\nctx"}]


def test_workload_prompts_default_is_the_original_workload(mods):
    common = mods["common"]
    items, info = common.workload_prompts(5, seed=3)
    assert items == common.bench_prompts(5, seed=3) and info == {"kind": "bench_prompts"}


# ------------------------------------------------------------------ cost growth grid

def test_parse_cells_and_lists(mods):
    cg = mods["cost_growth"]
    assert cg.parse_cells("400x128, 1600X128") == [(400, 128), (1600, 128)]
    assert cg.parse_int_list("100,400,1600", "--prompt-tokens") == [100, 400, 1600]
    assert cg.grid_cells([100, 400], [32, 128]) == [(100, 32), (100, 128), (400, 32), (400, 128)]
    for bad in ("400", "400x", "ax128", "0x128"):
        with pytest.raises(cg.GridError, match="--cells"):
            cg.parse_cells(bad)
    with pytest.raises(cg.GridError, match="--new-tokens"):
        cg.parse_int_list("32,-1", "--new-tokens")


def run(step_s, rss, prompt_tokens, decode_steps, phases=None):
    return {"median_step_s": step_s, "peak_rss_mb": rss, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps,
            "decode_s_per_token": 0.01, "phases_s": phases or {"sample": step_s / 2, "teacher": step_s / 4}}


def test_resume_skips_finished_sides_and_checks_config(mods, tmp_path):
    cg = mods["cost_growth"]
    config = {"model": "m", "batch": 8, "lora_rank": 32, "steps": 2, "warmup": 1, "threads": None, "contention": False,
              "huge_pages": False}
    path = str(tmp_path / "grid.json")
    results = cg.load_results(path, config)
    assert results["cells"] == {}
    entry = results["cells"].setdefault("400x128", {"prompt_tokens": 400, "new_tokens": 128, "runs": {}})
    entry["runs"]["opct"] = run(2.0, 900, 3200, 128)
    entry["runs"]["trl"] = {"error": "trl_step.py exited 1", "stderr_tail": "boom"}
    cg.summarise_cell(entry)
    cg.save_results(path, results)

    again = cg.load_results(path, config)
    assert cg.pending_sides(again, (400, 128), ["opct", "trl"]) == ["trl"]  # the failed side runs again
    assert cg.pending_sides(again, (1600, 128), ["opct", "trl"]) == ["opct", "trl"]
    # a run that shared the CPU with other processes is run again, except under --contention
    again["cells"]["400x128"]["runs"]["opct"]["others_busy_cores"] = 0.43
    assert cg.pending_sides(again, (400, 128), ["opct", "trl"]) == ["opct", "trl"]
    again["config"]["contention"] = "own"
    assert cg.pending_sides(again, (400, 128), ["opct", "trl"]) == ["trl"]
    with pytest.raises(cg.GridError, match=r"config\.steps"):
        cg.load_results(path, {**config, "steps": 3})
    (tmp_path / "bad.json").write_text("{\n  \"cells\": [\n")
    with pytest.raises(cg.GridError, match="bad.json: line"):
        cg.load_results(str(tmp_path / "bad.json"), config)


def test_results_record_the_machine_and_are_not_mixed_across_machines(mods, tmp_path, capsys):
    cg, common = mods["cost_growth"], mods["common"]
    here = common.machine()
    assert here["cores"] >= 1 and isinstance(here["isa"], list) and set(here["isa"]) <= set(common.ISA_FLAGS)
    if sys.platform.startswith("linux"):
        assert here["cpu"] and here["mem_gb"] > 0
        if platform.machine() == "x86_64":
            assert re.fullmatch(r"\w+ family \d+ model \d+ stepping \d+", here["cpu_id"])
    config = {"model": "m", "batch": 8, "lora_rank": 32, "steps": 2, "warmup": 1, "threads": None, "contention": None,
              "huge_pages": False}
    path = str(tmp_path / "grid.json")
    cg.save_results(path, cg.new_results({**config, "machine": {"cpu": "Some Other CPU", "cores": 2}}))
    with pytest.raises(cg.GridError, match=r"grid.json: field 'config.machine'.*another machine"):
        cg.load_results(path, {**config, "machine": {"cpu": "This CPU", "cores": 2}})
    assert cg.load_results(path, {**config, "machine": {"cpu": "Some Other CPU", "cores": 2}})["cells"] == {}
    # the same model name on another generation (VMs often say only "AMD EPYC") is another machine too
    zen4 = {"cpu": "AMD EPYC", "cores": 2, "cpu_id": "AuthenticAMD family 25 model 17 stepping 1"}
    cg.save_results(path, cg.new_results({**config, "machine": zen4}))
    with pytest.raises(cg.GridError, match="another machine"):
        cg.load_results(path, {**config, "machine": {**zen4, "cpu_id": "AuthenticAMD family 26 model 2 stepping 1"}})
    with pytest.raises(cg.GridError, match="another machine"):  # an older record, no id: it may be another generation
        cg.load_results(path, {**config, "machine": {"cpu": "AMD EPYC", "cores": 2}})
    assert cg.load_results(path, {**config, "machine": zen4})["cells"] == {}
    cg.save_results(path, cg.new_results(config))  # an older file: no machine recorded, resumed with a warning
    cg.load_results(path, {**config, "machine": here})
    assert "does not say which CPU" in capsys.readouterr().err


def test_rerun_measures_a_side_again_unless_measured_at_this_commit(mods):
    cg = mods["cost_growth"]
    results = cg.new_results({"model": "m"})
    entry = {"prompt_tokens": 400, "new_tokens": 128, "runs": {}}
    results["cells"]["400x128"] = entry
    old = {**run(4.0, 900, 3200, 128), "measured": {"utc": "then", "commit": "aaa1111", "dirty": False}}
    cg.record_run(entry, "opct", old)
    cg.record_run(entry, "trl", run(8.0, 1000, 3200, 128))
    assert cg.pending_sides(results, (400, 128), ["opct", "trl"]) == []
    assert cg.pending_sides(results, (400, 128), ["opct", "trl"], ("opct",), "bbb2222") == ["opct"]
    assert cg.pending_sides(results, (400, 128), ["opct", "trl"], ("opct",), "aaa1111") == []  # resumed rerun
    entry["runs"]["opct"]["measured"]["dirty"] = True  # measured with uncommitted changes: not this commit's code
    assert cg.pending_sides(results, (400, 128), ["opct", "trl"], ("opct",), "aaa1111") == ["opct"]

    cg.record_run(entry, "opct", {**run(3.0, 800, 3200, 128), "measured": {"commit": "bbb2222", "dirty": False}})
    assert entry["summary"]["opct"]["median_step_s"] == 3.0 and entry["summary"]["trl"]["median_step_s"] == 8.0
    assert entry["ratio"]["opct"]["step_time"] == pytest.approx(3.0 / 8.0)
    (replaced,) = entry["replaced"]
    assert replaced["side"] == "opct" and replaced["median_step_s"] == 4.0
    assert replaced["measured"]["commit"] == "aaa1111"
    stamp = cg.measured_stamp()
    assert stamp["utc"].endswith("Z") and set(stamp) <= {"utc", "commit", "dirty"}


def test_growth_exponents_and_superlinear_flag(mods):
    cg = mods["cost_growth"]
    results = cg.new_results({"model": "m"})
    # opct: linear along new tokens (x4 tokens, x4 time); trl: quadratic along prompt tokens (x4 tokens, x16 time)
    cells = {(100, 32): (run(1.0, 500, 800, 32), run(2.0, 600, 800, 32)),
             (100, 128): (run(4.0, 500, 800, 128), run(3.0, 600, 800, 128)),
             (400, 32): (run(1.5, 700, 3200, 32), run(32.0, 900, 3200, 32))}
    for (p, t), (o, r) in cells.items():
        entry = {"prompt_tokens": p, "new_tokens": t, "runs": {"opct": o, "trl": r}}
        cg.summarise_cell(entry)
        results["cells"][cg.cell_key(p, t)] = entry
    assert results["cells"]["100x32"]["ratio"]["opct"]["step_time"] == pytest.approx(0.5)
    g = cg.growth(results, ["opct", "trl"])
    (new_o,) = g["opct"]["new_tokens"]
    assert (new_o["from"], new_o["to"]) == ("100x32", "100x128") and new_o["token_ratio_measured"]
    assert new_o["exponent"] == pytest.approx(1.0) and not new_o["superlinear"]
    (prompt_t,) = g["trl"]["prompt_tokens"]
    assert prompt_t["exponent"] == pytest.approx(2.0) and prompt_t["superlinear"]
    assert prompt_t["phases"]["sample"]["exponent"] == pytest.approx(2.0)
    (prompt_o,) = g["opct"]["prompt_tokens"]
    assert prompt_o["exponent"] == pytest.approx(math.log(1.5) / math.log(4))
    table = cg.markdown_table(results, ["opct", "trl"])
    assert "| 100 | 1.00 / 2.00 (0.50)<br>500 / 600 MB |" in table
    assert "| 400 | 1.50 / 32.00 (0.05)<br>700 / 900 MB |  |" in table  # 400x128 not run: empty
    assert any("SUPER-LINEAR" in line for line in cg.growth_lines(g))
    json.dumps(g)  # serialisable


# ------------------------------------------------------------------ vs_trl with three sides

def test_compare_three_sides(mods):
    vs = mods["vs_trl"]

    def r(steps, rss, per_token, includes):
        return {"steps_s": steps, "phases_s": {"sample": 1.0}, "peak_rss_mb": rss, "decode_s_per_token": per_token,
                "decode_s_per_token_includes": includes, "others_busy_cores": 1.0}

    runs = {"opct": [r([1.0, 1.0], 500, 0.01, "loop")], "trl": [r([4.0, 4.0], 1000, 0.04, "generate")],
            "opct_vllm": [r([2.0, 2.0], 3000, 0.02, "vLLM's whole generate call")]}
    entry = vs.compare(runs, {"error": "skipped"}, 32)
    assert entry["ratio"]["step_time"] == pytest.approx(0.25)
    assert entry["ratio_vllm"]["step_time"] == pytest.approx(0.5)
    assert entry["ratio_vllm"]["peak_rss"] == pytest.approx(3.0)
    assert entry["decode_s_per_token"]["opct_vllm"]["ratio_to_trl"] == pytest.approx(0.5)
    assert entry["decode_s_per_token"]["trl"]["includes"] == "generate"
    assert entry["opct"]["others_busy_cores"] == [1.0]
    assert "vs_bounds" not in entry


def test_trl_vllm_side_runs_trl_step_with_vllm_and_is_compared_with_each_opct_side(mods, tmp_path, monkeypatch):
    vs = mods["vs_trl"]
    calls = []
    step_s = {"opct": 1.0, "trl": 8.0, "opct_vllm": 1.5, "trl_vllm": 3.0}

    def fake_run_side(side, flags, contention=False, threads=None):
        calls.append((side.name, os.path.basename(side.script), side.python, side.extra))
        return {"steps_s": [step_s[side.name]], "peak_rss_mb": 1.0, "phases_s": {}, "peak_gpu_mb": 100.0,
                "decode_s_per_token": step_s[side.name] / 100}

    monkeypatch.setattr(vs, "run_side", fake_run_side)
    step = tmp_path / "step.py"
    step.write_text("")
    vs.main(["--rounds", "1", "--device", "cuda", "--opct-step", str(step), "--vllm-python", "/v/python",
             "--trl-vllm", "--out", str(tmp_path / "s.json")])
    assert ("trl_vllm", "trl_step.py", "/v/python", ["--vllm"]) in calls and len(calls) == 4
    config = json.loads((tmp_path / "s.json").read_text())["configs"]["lora_r32"]
    assert config["ratio_to_trl_vllm"]["opct"]["step_time"] == pytest.approx(1 / 3)
    assert config["ratio_to_trl_vllm"]["opct_vllm"]["step_time"] == pytest.approx(0.5)
    assert config["ratio"]["step_time"] == pytest.approx(1 / 8)  # TRL with transformers generate, as before
    assert config["decode_s_per_token"]["trl_vllm"]["ratio_to_trl"] == pytest.approx(3 / 8)


def test_sides_picks_among_the_sides_set_up(mods, tmp_path, monkeypatch, capsys):
    vs = mods["vs_trl"]
    calls = []
    monkeypatch.setattr(vs, "run_side", lambda side, flags, contention=False, threads=None:
                        calls.append(side.name) or {"steps_s": [1.0], "peak_rss_mb": 1.0, "phases_s": {}})
    step = tmp_path / "step.py"
    step.write_text("")
    base = ["--rounds", "2", "--no-bounds", "--opct-step", str(step), "--vllm-python", "/v/python", "--trl-vllm"]
    vs.main(base + ["--sides", "opct,trl_vllm"])
    assert calls == ["opct", "trl_vllm", "trl_vllm", "opct"]  # the rotation reverses in round 2, as with all sides
    with pytest.raises(SystemExit) as e:
        vs.main(base[:-3] + ["--sides", "opct,trl_vllm"])
    assert e.value.code == 2 and "trl_vllm not among the sides set up (opct, trl" in capsys.readouterr().err


def test_opct_set_reaches_the_opct_side_only(mods, tmp_path, monkeypatch):
    vs = mods["vs_trl"]
    calls = {}

    def fake_run_side(side, flags, contention=False, threads=None):
        calls[side.name] = side.extra
        return {"steps_s": [1.0], "peak_rss_mb": 1.0, "phases_s": {}}

    monkeypatch.setattr(vs, "run_side", fake_run_side)
    step = tmp_path / "step.py"
    step.write_text("")
    vs.main(["--rounds", "1", "--no-bounds", "--opct-step", str(step), "--vllm-python", "/v/python", "--trl-vllm",
             "--decode-dtype", "bfloat16", "--opct-set", "merged_decode=true", "--opct-set", "cuda_graphs=false"])
    assert calls["opct"] == ["--decode-dtype", "bfloat16", "--set", "merged_decode=true", "--set", "cuda_graphs=false"]
    assert calls["trl"] == [] and calls["opct_vllm"] == ["--sampler", "vllm"] and calls["trl_vllm"] == ["--vllm"]


def test_a_side_gets_its_own_environment(mods, tmp_path, monkeypatch):
    vs = mods["vs_trl"]
    script = tmp_path / "env.py"
    script.write_text("import json, os\nprint(json.dumps({'thp': os.environ.get('THP_MEM_ALLOC_ENABLE')}))\n")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert vs.run_side(vs.Side("trl", str(script), env={"THP_MEM_ALLOC_ENABLE": "1"}), [])["thp"] == "1"
    assert vs.run_side(vs.Side("opct", str(script)), [])["thp"] is None  # each side at its defaults


def test_prompt_summary_folds_wrapper_lists(mods):
    info = {"kind": "multi-turn", "band": [1, 2], "wrappers": [["b", "a"], ["a"], ["c"]]}
    assert mods["common"].prompt_summary(info) == {"kind": "multi-turn", "band": [1, 2], "wrappers_used": ["a", "b", "c"]}
    assert mods["common"].prompt_summary({"kind": "bench_prompts"}) == {"kind": "bench_prompts"}


@pytest.mark.parametrize("vary,first", [(False, 0), (True, 0), (True, 2)])
def test_vary_seed_gives_both_sides_the_rounds_seed(mods, tmp_path, monkeypatch, vary, first):
    vs = mods["vs_trl"]
    calls = []

    def fake_run_side(side, flags, contention=False, threads=None):
        calls.append((side.name, flags))
        return {"steps_s": [1.0], "peak_rss_mb": 1.0, "phases_s": {}}

    monkeypatch.setattr(vs, "run_side", fake_run_side)
    step = tmp_path / "step.py"
    step.write_text("")  # the opct side's script only has to exist: run_side is replaced
    vs.main(["--rounds", "3", "--no-bounds", "--opct-step", str(step), "--out", str(tmp_path / "s.json")]
            + (["--vary-seed", "--first-seed", str(first)] if vary else []))
    seeds = [(name, flags[flags.index("--seed") + 1] if "--seed" in flags else None) for name, flags in calls]
    want = [str(first + r) if vary else None for r in range(3) for _ in range(2)]
    assert [s for _, s in seeds] == want and {n for n, _ in seeds} == {"opct", "trl"}
    assert json.loads((tmp_path / "s.json").read_text())["config"]["vary_seed"] is vary


def test_first_seed_without_vary_seed_is_an_error(mods, capsys):
    with pytest.raises(SystemExit) as e:
        mods["vs_trl"].main(["--first-seed", "2", "--no-bounds"])
    assert e.value.code == 2 and "--first-seed needs --vary-seed" in capsys.readouterr().err


def test_device_reaches_both_sides_and_gpu_memory_is_compared(mods, tmp_path, monkeypatch):
    vs = mods["vs_trl"]
    calls = []

    def fake_run_side(side, flags, contention=False, threads=None):
        calls.append(flags[flags.index("--device") + 1])
        gpu_mb = 200.0 if side.name == "opct" else 400.0
        return {"steps_s": [1.0], "peak_rss_mb": 1.0, "phases_s": {}, "peak_gpu_mb": gpu_mb, "gpu": "G"}

    monkeypatch.setattr(vs, "run_side", fake_run_side)
    monkeypatch.setattr(vs, "run_json", lambda *a, **k: pytest.fail("bounds.py measures the CPU: not run for cuda"))
    step = tmp_path / "step.py"
    step.write_text("")
    vs.main(["--rounds", "1", "--device", "cuda", "--opct-step", str(step), "--out", str(tmp_path / "s.json")])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert calls == ["cuda", "cuda"] and "measures the CPU" in summary["bounds"]["error"]
    config = summary["configs"]["lora_r32"]
    assert config["ratio"]["peak_gpu"] == 0.5 and config["opct"]["gpu"] == "G"


def test_random_weights_keep_the_architecture_and_tokenizer(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    (tmp_path / "like").mkdir()
    for f in tiny_model_dir.iterdir():  # only the small files travel: no weights in --like
        if not f.name.endswith(".safetensors"):
            (tmp_path / "like" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "like" / "opct-source.json").write_text("{}")
    out = load("random_weights").make(str(tmp_path / "like"), str(tmp_path / "out"), seed=3)
    def config(d):
        return {k: v for k, v in AutoConfig.from_pretrained(d).to_dict().items() if k != "_name_or_path"}
    assert config(out) == config(tiny_model_dir)
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert not (out / "opct-source.json").exists()  # the real weights' provenance does not describe these
    real, rand = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert real.keys() == rand.keys() and all(real[k].shape == rand[k].shape for k in real)
    assert not torch.equal(real["model.embed_tokens.weight"], rand["model.embed_tokens.weight"])
    again = load("random_weights").make(str(tmp_path / "like"), str(tmp_path / "again"), seed=3)
    assert torch.equal(load_file(again / "model.safetensors")["model.embed_tokens.weight"],
                       rand["model.embed_tokens.weight"])
    assert json.loads((out / "opct-random-weights.json").read_text())["seed"] == 3


def test_step_set_reads_config_overrides_as_yaml(mods, tmp_path):
    step = mods["step"]
    sets = step.parse_sets(["prefill_reuse=false", "prefill-scoring=true", "micro_batch=4", "decode_dtype=bfloat16"])
    assert sets == {"prefill_reuse": False, "prefill_scoring": True, "micro_batch": 4, "decode_dtype": "bfloat16"}
    cfg = step.step_config(str(tmp_path / "run"), "m", 8, 2, 32, 32, **sets)
    assert cfg.prefill_reuse is False and cfg.micro_batch == 4 and cfg.prompts_per_step == 8
    with pytest.raises(ValueError, match="KEY=VALUE"):
        step.parse_sets(["prefill_reuse"])
    with pytest.raises(ValueError, match="did you mean 'prefill_reuse'"):  # checked as a config file's keys
        step.step_config(str(tmp_path / "run"), "m", 8, 2, 32, 32, prefil_reuse=False)
    with pytest.raises(ValueError, match="micro_batch.*must be int"):
        step.step_config(str(tmp_path / "run"), "m", 8, 2, 32, 32, micro_batch="four")
