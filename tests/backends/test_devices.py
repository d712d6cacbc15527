"""Devices, dtypes and backend choice; the GPU tests skip cleanly without a GPU."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from opct.algo.opct import train
from opct.backends import (BackendError, resolve_backend, resolve_device, resolve_dtype, resolve_eval_engine,
                           resolve_sampler)
from opct.backends.select import resolve_vllm_dtype
from opct.config import SFTConfig, TrainConfig
from opct.data.pairs import ConsistencyPair

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def pairs():
    return [ConsistencyPair([{"role": "user", "content": f"Q{i}? I think (B)."}], [{"role": "user", "content": f"Q{i}?"}])
            for i in range(4)]


def run(tmp_path, model_dir, **kw):
    cfg = TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), steps=2, prompts_per_step=2, micro_batch=2,
                      max_new_tokens=4, lora_rank=4, lora_alpha=8.0, save_every=0, report_to="none", **kw)
    out = train(cfg, pairs=pairs(), show_progress=False)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()], json.loads((out / "run.json").read_text())


def test_auto_choices_on_this_machine():
    dev = resolve_device("cpu")
    assert resolve_dtype("auto", dev) == torch.float32
    assert resolve_backend("auto", dev, torch.float32) == "cpu"
    assert resolve_backend("auto", dev, torch.bfloat16) == "hf"  # the CPU kernels are float32 only
    with pytest.raises(BackendError, match="float32"):
        resolve_backend("cpu", dev, torch.bfloat16)
    with pytest.raises(BackendError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.parametrize("vllm_installed", [True, False])
def test_sampler_and_eval_engine_auto_mean_vllm_on_a_cuda_device_where_it_is_installed(monkeypatch, vllm_installed):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if vllm_installed else None)
                        if name == "vllm" else real(name, *a))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    on_gpu = "vllm" if vllm_installed else "policy"
    assert resolve_sampler(TrainConfig(), cpu) == "policy" and resolve_sampler(TrainConfig(), cuda) == on_gpu
    assert resolve_eval_engine("auto", cpu) == "policy" and resolve_eval_engine("auto", cuda) == on_gpu
    # SFT's targets come from the frozen model (no student sampler: no --sampler to resolve); vLLM cannot hold a
    # LoRA rank above 512; under FSDP2 no rank holds the full weights a sync needs
    assert SFTConfig().sampler == "policy" and "sampler" not in {f.name for f in dataclasses.fields(SFTConfig)}
    assert resolve_sampler(TrainConfig(lora_rank=1024), cuda) == "policy"
    assert resolve_sampler(TrainConfig(), cuda, parallel="fsdp") == "policy"
    for asked in ("policy", "vllm", "vllm-server"):  # an explicit choice is kept as it is
        assert resolve_sampler(TrainConfig(sampler=asked), cpu) == asked
    assert resolve_eval_engine("vllm", cpu) == "vllm" and resolve_eval_engine("policy", cuda) == "policy"


def test_a_vllm_engines_dtype_is_the_models_on_the_cpu_unless_set():
    cpu = torch.device("cpu")
    assert resolve_vllm_dtype("auto", cpu, torch.float32) == torch.float32
    assert resolve_vllm_dtype("auto", cpu, torch.bfloat16) == torch.bfloat16
    assert resolve_vllm_dtype("bfloat16", cpu, torch.float32) == torch.bfloat16
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        assert resolve_vllm_dtype("auto", torch.device("cuda"), torch.float32) == torch.bfloat16


def test_bfloat16_trains_with_the_hf_backend_on_the_cpu(tiny_model_dir, tmp_path):
    rows, info = run(tmp_path, tiny_model_dir, device="cpu", dtype="bfloat16", backend="hf")
    assert info["execution"]["backend"] == "hf" and info["execution"]["dtype"] == "bfloat16"
    assert all(torch.isfinite(torch.tensor([r["loss"], r["kl"], r["grad_norm"]])).all() for r in rows)
    assert rows[-1]["grad_norm"] > 0


def test_run_json_records_execution_and_env_overrides(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OPCT_PACK_WEIGHTS", "0")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    _, info = run(tmp_path, tiny_model_dir, device="cpu")
    assert info["execution"]["backend"] == "cpu" and info["execution"]["env_overrides"] == {"OPCT_PACK_WEIGHTS": "0"}
    assert info["config"]["pack_weights"] is False and info["execution"]["torch"] == torch.__version__
    assert "pack_weights: false" in (tmp_path / "run" / "config.yaml").read_text()
    # --sampler auto (the default) on the CPU: the backend samples; run.json says what was asked and what ran
    assert info["execution"]["sampler_setting"] == "auto" and info["execution"]["sampler_used"] == "policy"


@pytest.mark.parametrize("backend", ["cpu", "hf"])
def test_bfloat16_decode_trains_is_recorded_and_leaves_identical_pairs_at_zero_kl(tiny_model_dir, tmp_path, backend,
                                                                                    monkeypatch):
    """decode_dtype=bfloat16 reaches the lean decoder (set up by the cpu backend) or the hf backend's merged copy, is
    recorded, and changes only what is sampled: the losses stay float32, so pairs whose two prompts are identical
    still give exactly zero KL."""
    from opct.backends.cpu import decoder
    from opct.backends.hf import HFPolicy

    made = []
    real_generate = HFPolicy._generate

    def generate(self, *a):  # which model the hf backend sampled from
        out = real_generate(self, *a)
        made.append(self.merged and {p.dtype for p in self.merged.model.parameters()})
        return out

    same = [ConsistencyPair(p.teacher, p.teacher) for p in pairs()]
    cfg = TrainConfig(model=str(tiny_model_dir), out=str(tmp_path / "run"), steps=2, prompts_per_step=2, micro_batch=2,
                      max_new_tokens=4, lora_rank=4, lora_alpha=8.0, save_every=0, report_to="none", device="cpu",
                      decode_dtype="bfloat16", backend=backend, merged_decode=backend == "hf")
    monkeypatch.setattr(HFPolicy, "_generate", generate)
    out = train(cfg, pairs=same, show_progress=False)
    if backend == "cpu":
        assert decoder.SETTINGS["dtype"] == torch.bfloat16
    else:
        assert made == [{torch.bfloat16}] * 2  # both steps sampled from the bfloat16 merged copy
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["kl"] == 0.0 and r["response_tokens"] > 0 for r in rows)
    assert json.loads((out / "run.json").read_text())["config"]["decode_dtype"] == "bfloat16"
    assert "decode_dtype: bfloat16" in (out / "config.yaml").read_text()


def test_import_changes_no_process_state():
    code = ("import os, json; before = dict(os.environ); "
            "import opct, opct.cli, opct.algo.opct, opct.algo.sft, opct.backends.cpu, opct.demo; "
            "from opct.backends.cpu import process, gemm; "
            "print(json.dumps([sorted(set(os.environ) ^ set(before)), process.keep_freed_memory.cache_info().currsize,"
            " gemm.SETTINGS]))")
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "TOKENIZERS_PARALLELISM")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    changed, malloc_calls, gemm_settings = json.loads(out.stdout.strip().splitlines()[-1])
    assert changed == [] and malloc_calls == 0 and gemm_settings == {"kernel": "onednn", "pack": True}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_trains_on_cuda(tiny_model_dir, tmp_path, dtype):
    rows, info = run(tmp_path, tiny_model_dir, device="cuda", dtype=dtype)
    assert info["execution"]["backend"] == "hf" and info["execution"]["device"].startswith("cuda")
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in rows)


@gpu
@pytest.mark.gpu
def test_cuda_scores_match_cpu_on_the_same_tokens(tiny_model_dir):
    from opct.backends import make_policy
    from opct.backends.base import Rollout
    from opct.data.chat import render_prompt
    from opct.models import load_model

    out = []
    for device in ("cpu", "cuda"):
        model, tok = load_model(str(tiny_model_dir), device=device, dtype=torch.float32)
        policy = make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy"))
        ps = [render_prompt(tok, p.student) for p in pairs()[:2]]
        rollout = policy.sample(ps, __import__("opct.backends.sampling", fromlist=["x"]).SamplingSettings(4, 0.0),
                                torch.Generator().manual_seed(0))
        out.append((rollout.responses, policy.score(ps, Rollout(ps, [[5, 6, 7], [8, 9]]), grad=False).logp_NT.cpu()))
    assert out[0][0] == out[1][0]
    assert torch.allclose(out[0][1], out[1][1], atol=1e-3)
