"""benchmarks/vs_trl.py's accounting: FLOPs per phase and the decode bounds (pure functions, synthetic numbers)."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def vs_trl():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("vs_trl", BENCH / "vs_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.path.remove(str(BENCH))


BOUNDS = {"matmul": {"gflops": 100.0}, "bandwidth": {"best_gbs": 50.0},
          "model": {"flops_per_token": {"body": 2e8, "lm_head": 5e7}, "lora_params": 1_000_000,
                    "params": {"total": 10_000_000}},
          "decode": {"32": {"s_per_step_weights": 0.01, "weight_bytes": 5e8, "bandwidth_gbs": 50.0}}}


def side(**kw):
    return {"median_step_s": 6.0, "phases_s": {"sample": 2.0, "teacher": 1.5, "student": 2.5, "optim": 0.05,
                                               "decode": 1.6},
            "prompt_tokens": 500, "teacher_prompt_tokens": 600, "response_tokens": 200, "decode_steps": 32,
            "batch": 8, **kw}


def test_phase_flops_and_fused_prompt_forward_counted_once(vs_trl):
    plain = vs_trl.phase_table(side(), BOUNDS, 32)
    # teacher: forward over prompt + response, lm_head only at response positions
    assert plain["teacher"]["gflop"] == pytest.approx((2e8 * 800 + 5e7 * 200) / 1e9)
    # student with LoRA: forward + activation gradients = 2 x forward
    assert plain["student"]["gflop"] == pytest.approx(2 * (2e8 * 700 + 5e7 * 200) / 1e9)
    fused = vs_trl.phase_table(side(student_prompt_forward_in_sample=True), BOUNDS, 32)
    # the prompt forward already ran (and is bounded) in `sample`: it leaves the student's count
    assert fused["student"]["gflop"] == pytest.approx(plain["student"]["gflop"] - 2e8 * 500 / 1e9)
    assert fused["sample"]["bound_s"] == plain["sample"]["bound_s"]
    assert fused["step"]["bound_s"] == pytest.approx(sum(fused[k]["bound_s"] for k in ("teacher", "student",
                                                                                        "optim", "sample")))


def test_decode_only_against_bandwidth_and_flop_bounds(vs_trl):
    d = vs_trl.phase_table(side(), BOUNDS, 32)["sample"]["decode_only"]
    assert d["s_per_decode_step"] == pytest.approx(1.6 / 32)
    assert d["flop_bound_s_per_step"] == pytest.approx(8 * (2e8 + 5e7) / 100e9)  # 0.02 s > bandwidth's 0.01 s
    assert d["times_bandwidth_bound"] == pytest.approx(0.05 / 0.01)
    assert d["times_max_bound"] == pytest.approx(0.05 / 0.02)
    assert "times_one_stream" not in d  # bounds from before bounds.py measured one stream's rate


def test_decode_only_against_one_stream_rate(vs_trl):
    decode = {**BOUNDS["decode"]["32"], "stream_gbs": 25.0, "s_per_step_weights_one_stream": 0.02}
    d = vs_trl.phase_table(side(), {**BOUNDS, "decode": {"32": decode}}, 32)["sample"]["decode_only"]
    assert d["one_stream_s_per_step"] == 0.02
    assert d["times_one_stream"] == pytest.approx(0.05 / 0.02)


def test_pooling_keeps_per_side_facts(vs_trl):
    run = {"steps_s": [1.0, 3.0], "phases_s": {"sample": 1.0}, "peak_rss_mb": 10.0, "batch": 8,
           "student_prompt_forward_in_sample": True, "decode_steps": 32}
    pooled = vs_trl.pool_runs([run, {**run, "steps_s": [2.0], "peak_rss_mb": 12.0}])
    assert pooled["median_step_s"] == 2.0 and pooled["peak_rss_mb"] == 12.0
    assert pooled["batch"] == 8 and pooled["student_prompt_forward_in_sample"] is True


@pytest.fixture
def keep_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # the benchmarks set their own thread count


def _load(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the benchmarks import each other
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gemm_benchmark_times_both_kernels_in_both_directions(keep_threads):
    out = _load("gemm").measure(hidden=32, intermediate=64, heads=4, kv_heads=2, layers=2, rows=[3, 5], repeats=1,
                                threads=1)
    assert out["shapes_in_out"][1] == (32, 16) and set(out["by_rows"]) == {"3", "5"}
    for r in out["by_rows"].values():
        assert set(r) == {"forward", "backward_dx"}
        for d in r.values():
            assert d["torch"] > 0
            if out["onednn_available"]:
                assert d["onednn"] > 0 and d["onednn_speedup"] == pytest.approx(d["onednn"] / d["torch"])


def test_matmul_peak_is_the_best_kernel_at_each_size(keep_threads):
    out = _load("bounds").matmul_peak_flops(threads=1, sizes=(64, 96), repeats=1)
    assert set(out["by_kernel"]["torch"]) == {"64", "96"}
    for n, best in out["by_size"].items():
        assert best == max(k[n] for k in out["by_kernel"].values())
    assert out["gflops"] == max(out["by_size"].values())


def test_decode_bound_counts_each_weight_once_at_both_rates(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    d = _load("bounds").decode_bound(model, 40.0, batch=2, context=10, stream_gbs=20.0)
    weights = sum(p.numel() * 4 for p in dict(model.named_parameters(remove_duplicate=True)).values())
    assert d["weight_bytes"] == weights
    assert d["s_per_step_weights"] == pytest.approx(weights / 40e9)
    assert d["s_per_step_weights_one_stream"] == pytest.approx(weights / 20e9)
    assert "s_per_step_weights_one_stream" not in _load("bounds").decode_bound(model, 40.0)


def test_ratio_spread_pairs_rounds_and_brackets_the_pooled_ratio(vs_trl):
    opct = [{"steps_s": [5.0, 5.2, 5.1]}, {"steps_s": [5.6, 5.5, 5.7]}]
    trl = [{"steps_s": [10.0, 10.4, 10.2]}, {"steps_s": [11.0, 11.2, 11.1]}, {"error": "trl_step.py exited 1"}]
    spread = vs_trl.ratio_spread(opct, trl)
    assert spread["per_round"] == pytest.approx([5.1 / 10.2, 5.6 / 11.1])
    lo, hi = spread["ci95"]
    pooled = vs_trl.median([5.0, 5.2, 5.1, 5.6, 5.5, 5.7]) / vs_trl.median([10.0, 10.4, 10.2, 11.0, 11.2, 11.1])
    assert 5.0 / 11.2 <= lo <= pooled <= hi <= 5.7 / 10.0
    assert 0.0 < spread["share_of_bootstrap_at_most_0.5"] < 1.0
    assert vs_trl.ratio_spread(opct, trl) == spread  # seeded
    assert vs_trl.ratio_spread(opct, [{"error": "x"}]) is None
    # a failed round pairs with nothing: the rounds after it keep their own partner
    later = vs_trl.ratio_spread([{"error": "x"}, *opct], [{"steps_s": [9.0, 9.1]}, *trl[:2]])
    assert later["per_round"] == pytest.approx(spread["per_round"])


def test_pool_vs_trl_pools_rounds_of_several_files(vs_trl, tmp_path, capsys):
    """benchmarks/pool_vs_trl.py: the rounds of two result files side by side, through vs_trl's own bootstrap."""
    import json

    spec = importlib.util.spec_from_file_location("pool_vs_trl", BENCH / "pool_vs_trl.py")
    pool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool)
    files = []
    for i, (o, t) in enumerate([([5.0, 5.2], [10.0, 10.2]), ([4.0, 4.2], [11.0, 11.4])]):
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps({"config": {"model": "m", "batch": 8},
                                 "configs": {"lora_r32": {"raw_runs": {"opct": [{"steps_s": o}],
                                                                       "trl": [{"steps_s": t}]}}}}))
        files.append(str(f))
    pool.main(files)
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] == 2 and out["configs"][0]["model"] == "m"
    pooled = vs_trl.median([5.0, 5.2, 4.0, 4.2]) / vs_trl.median([10.0, 10.2, 11.0, 11.4])
    assert out["step_time"] == pytest.approx(pooled)
    assert out["spread"]["per_round"] == pytest.approx([5.1 / 10.1, 4.1 / 11.2])
    # files that ran on different CPUs are not pooled
    for i, cpu in enumerate(["CPU A", "CPU B"]):
        r = json.loads((tmp_path / f"r{i}.json").read_text())
        (tmp_path / f"r{i}.json").write_text(json.dumps({**r, "machine": {"cpu": cpu, "cores": 2}}))
    with pytest.raises(SystemExit, match="different CPUs"):
        pool.main(files)
    # nor a file from before cpu_id was recorded with one after it, or two with different ISA flags
    for machines in ([{"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2"]},
                      {"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2"], "cpu_id": "AuthenticAMD family 26 model 2"}],
                     [{"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2"]},
                      {"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2", "avx512f"]}]):
        for i, m in enumerate(machines):
            r = json.loads((tmp_path / f"r{i}.json").read_text())
            (tmp_path / f"r{i}.json").write_text(json.dumps({**r, "machine": m}))
        with pytest.raises(SystemExit, match="different CPUs"):
            pool.main(files)
    # nor files from two generations behind one model name (VMs often say only "AMD EPYC")
    for i, model in enumerate(["17", "2"]):
        r = json.loads((tmp_path / f"r{i}.json").read_text())
        (tmp_path / f"r{i}.json").write_text(json.dumps({**r, "machine": {
            "cpu": "AMD EPYC", "cores": 2, "cpu_id": f"AuthenticAMD family {25 + i} model {model} stepping 1"}}))
    with pytest.raises(SystemExit, match="different CPUs"):
        pool.main(files)
    # files of one CPU, recorded alike, pool
    for i in range(2):
        r = json.loads((tmp_path / f"r{i}.json").read_text())
        (tmp_path / f"r{i}.json").write_text(json.dumps({**r, "machine": {
            "cpu": "AMD EPYC", "cores": 2, "isa": ["avx2", "avx512f"], "cpu_id": "AuthenticAMD family 26 model 2"}}))
    capsys.readouterr()
    pool.main(files)
    assert json.loads(capsys.readouterr().out)["rounds"] == 2
