"""The engine's invariants, for every backend (torchtune-style: the same tests and pinned numbers with the fast
CPU kernels on and off)."""

import dataclasses
import json

import pytest
import torch

from opct import config, options
from opct.data.chat import ChatFormat
from opct.algo.opct import opct_step, train
from opct.backends import make_policy
from opct.backends.base import Rollout
from opct.config import SFTConfig, TrainConfig
from opct.data.pairs import ConsistencyPair
from opct.models import add_lora, load_model
from opct.train.loop import RunError, render_pairs

QS = ["What is 2+2?", "Name a colour.", "Is water wet?", "Count to three.", "Say hello.", "What is the sun?"]
BACKENDS = ["hf", "cpu"]


def make_pairs(identical=False):
    out = []
    for i, q in enumerate(QS):
        teacher = [{"role": "user", "content": q}]
        student = teacher if identical else [{"role": "system", "content": f"Always answer ({'ABCD'[i % 4]})."},
                                             {"role": "user", "content": q + " I think it's (B)."}]
        out.append(ConsistencyPair(student, teacher, {}))
    return out


def cfg_for(model_dir, out, cls=TrainConfig, **kw):
    base = dict(model=str(model_dir), out=str(out), steps=4, prompts_per_step=3, samples_per_prompt=2, micro_batch=6,
                max_new_tokens=6, lr=1e-2, lora_rank=4, lora_alpha=8.0, save_every=0, report_to="none",
                device="cpu", backend="cpu")
    base.update(kw)
    return cls(**base)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


DETERMINISTIC = ("loss", "kl", "logp_student", "logp_teacher", "response_tokens", "grad_norm", "lr")


def policy_for(model_dir, backend, lora_rank, cfg):
    """A fresh policy on the tiny model; with LoRA, B ~ N(0, 0.1^2) so the adapter has a gradient path through
    both factors and the student differs from the teacher. OPCT's student samples itself (`--sampler auto` as
    start_run resolves it on the CPU: make_policy takes a resolved sampler)."""
    if isinstance(cfg, TrainConfig) and cfg.sampler == "auto":
        cfg = dataclasses.replace(cfg, sampler="policy")
    torch.manual_seed(0)
    model, tok = load_model(str(model_dir))
    if lora_rank:
        model = add_lora(model, lora_rank, 8.0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
    else:
        model.requires_grad_(True)
    return make_policy(backend, model, tok, {tok.eos_token_id}, cfg, micro_batch=cfg.micro_batch), tok


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_grad_accumulation_equals_one_big_batch(tiny_model_dir, lora_rank, backend):
    grads = []
    for mb in (6, 2):
        cfg = cfg_for(tiny_model_dir, "unused", micro_batch=mb, lora_rank=lora_rank, backend=backend)
        policy, tok = policy_for(tiny_model_dir, backend, lora_rank, cfg)
        batch = render_pairs(ChatFormat.sides(tok), make_pairs(), 256, cfg.max_new_tokens)[:3]
        row = opct_step(policy, ChatFormat.of(tok, cfg), batch, cfg, torch.Generator().manual_seed(1))
        grads.append(({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}, row))
    (g6, r6), (g2, r2) = grads
    assert r6["response_tokens"] == r2["response_tokens"] and r6["kl"] == pytest.approx(r2["kl"], rel=1e-5)
    # With the cpu backend, mb=6 reuses the sampling prefill for scoring and mb=2 runs separate forwards: equal up
    # to float rounding. A normalisation bug (per-micro-batch averaging) would be off by a factor, not by 1e-5.
    for n in g6:
        assert (g6[n] - g2[n]).norm() <= 1e-5 * g6[n].norm() + 1e-7, n


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_hf_and_cpu_give_the_same_scores_and_gradients_on_the_same_tokens(tiny_model_dir, lora_rank, monkeypatch):
    """The reference and the CPU kernels on one fixed rollout: log-probs, sampled-token loss, and its gradient; the
    CPU kernels with prompts and responses run padded and in length groups."""
    import importlib

    import opct.backends.cpu as cpu
    from opct.backends.cpu.prefill import length_groups

    prefill_module = importlib.import_module("opct.backends.cpu.prefill")  # (the package's `prefill` is the function)
    groups = []

    def recording(lengths, *args):
        groups.append((len(lengths), length_groups(lengths, *args)))
        return groups[-1][1]
    monkeypatch.setattr(prefill_module, "length_groups", recording)
    out = {}
    for backend, unpadded, cost in (("hf", True, 32), ("cpu", False, 32), ("cpu", True, 0)):
        # with no cost per group, the cpu backend runs these rows in a group per distinct length
        monkeypatch.setattr(cpu, "GROUP_COST_TOKENS", cost)
        cfg = cfg_for(tiny_model_dir, "unused", lora_rank=lora_rank, backend=backend, unpadded_scoring=unpadded,
                      unpadded_prompts=unpadded)
        policy, tok = policy_for(tiny_model_dir, backend, lora_rank, cfg)
        batch = render_pairs(ChatFormat.sides(tok), make_pairs(), 256, cfg.max_new_tokens)[:3]
        ps, pt = [s for s, _ in batch], [t for _, t in batch]
        # the cpu backend's rollout carries its sampling prefill (under grad), as a sampled one does
        state = (prefill_module.prefill(policy.model, ps, policy.pad_id, group_cost=policy._prompt_groups)
                 if backend == "cpu" else None)
        rollout = Rollout(ps, [[100, 200, 300, 2], [5, 2], [7, 8, 9, 10, 11]], state=state)
        with policy.teacher() as teacher:
            t = teacher.score(pt, rollout, grad=False)
        s = policy.score(ps, rollout, grad=True)
        from opct.algo.losses import sampled_token_loss

        loss, _ = sampled_token_loss(s.logp_NT, t.logp_NT, s.mask_NT)
        loss.backward()
        out[backend, unpadded] = (s.logp_NT.detach(), t.logp_NT, {n: p.grad for n, p in
                                                                 policy.model.named_parameters() if p.requires_grad})
    # grouped: the student's and the teacher's prompts (their own lengths), then three response groups for each
    assert [n for n, _ in groups] == [3, 3, 3, 3] and [len(g) for _, g in groups[2:]] == [3, 3], groups
    assert all(len(g) > 1 for _, g in groups[:2]), groups
    s_h, t_h, g_h = out["hf", True]
    for key in (("cpu", False), ("cpu", True)):
        s_c, t_c, g_c = out[key]
        assert torch.allclose(s_h, s_c, atol=1e-4) and torch.allclose(t_h, t_c, atol=1e-4), key
        for n in g_h:
            assert (g_h[n] - g_c[n]).norm() <= 1e-4 * g_h[n].norm() + 1e-6, (key, n)


def test_a_rollout_sampled_elsewhere_is_scored_as_a_kept_prefill_is(tiny_model_dir, monkeypatch):
    """With `prefill_scoring`, a rollout that carries no sampling prefill (vLLM's, a micro-batch) gets one at scoring
    time: the student's log-probs and gradients are bit for bit those of a rollout whose prefill was kept, the
    teacher's are the same computation either way; with the setting off, both run one padded forward (equal to
    rounding)."""
    import importlib

    prefill_module = importlib.import_module("opct.backends.cpu.prefill")
    calls = []
    real = prefill_module.prefill
    monkeypatch.setattr(importlib.import_module("opct.backends.cpu"), "prefill",
                        lambda *a, **kw: calls.append(torch.is_grad_enabled()) or real(*a, **kw))
    out = {}
    for name, kept, on in (("kept", True, True), ("elsewhere", False, True), ("off", False, False)):
        cfg = cfg_for(tiny_model_dir, "unused", prefill_scoring=on)
        policy, tok = policy_for(tiny_model_dir, "cpu", 4, cfg)
        batch = render_pairs(ChatFormat.sides(tok), make_pairs(), 256, cfg.max_new_tokens)[:3]
        ps, pt = [s for s, _ in batch], [t for _, t in batch]
        state = real(policy.model, ps, policy.pad_id, group_cost=policy._prompt_groups) if kept else None
        rollout = Rollout(ps, [[100, 200, 300, 2], [5, 2], [7, 8, 9, 10, 11]], state=state)
        calls.clear()
        with policy.teacher() as teacher:
            t = teacher.score(pt, rollout, grad=False)
        s = policy.score(ps, rollout, grad=True)
        from opct.algo.losses import sampled_token_loss

        sampled_token_loss(s.logp_NT, t.logp_NT, s.mask_NT)[0].backward()
        out[name] = (s.logp_NT.detach(), t.logp_NT, calls[:],
                     {n: p.grad for n, p in policy.model.named_parameters() if p.requires_grad})
    # teacher, then student: a prefill each where none was kept, under grad for the student's
    assert out["kept"][2] == [False] and out["elsewhere"][2] == [False, True] and out["off"][2] == []
    s_k, t_k, _, g_k = out["kept"]
    s_e, t_e, _, g_e = out["elsewhere"]
    assert torch.equal(s_k, s_e) and torch.equal(t_k, t_e)
    assert all(torch.equal(g_k[n], g_e[n]) for n in g_k)
    s_o, t_o, _, g_o = out["off"]
    assert torch.allclose(s_k, s_o, atol=1e-4) and torch.allclose(t_k, t_o, atol=1e-4)
    assert all((g_k[n] - g_o[n]).norm() <= 1e-4 * g_k[n].norm() + 1e-6 for n in g_k)


# Per-step loss of a 3-step run (tiny model, LoRA r=4, fixed seed), pinned per backend: a refactor that changes
# what either backend computes shows here. On this model the two backends' rounding differences are too small to
# change a sampled token, so they sample the same tokens and agree to the digits pinned.
PINNED = {"hf": [2.33016, 2.3324, 2.55307], "cpu": [2.33016, 2.3324, 2.55307]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinned_losses_of_a_three_step_run(tiny_model_dir, tmp_path, backend):
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=3, backend=backend), pairs=make_pairs(), show_progress=False)
    got = [round(r["loss"], 5) for r in metrics(out)]
    assert got == PINNED[backend], got


@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_pinned_losses_hold_with_either_matmul_kernel(tiny_model_dir, tmp_path, kernel):
    """`cpu_gemm: auto` picks one of these by CPU vendor; the other must give the same losses too."""
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=3, cpu_gemm=kernel), pairs=make_pairs(), show_progress=False)
    assert [round(r["loss"], 5) for r in metrics(out)] == PINNED["cpu"]
    assert json.loads((out / "run.json").read_text())["execution"]["cpu_gemm_kernel"] == kernel


@pytest.mark.parametrize("setting", ["unpadded_scoring", "unpadded_prompts"])
def test_pinned_losses_hold_with_unpadded_runs_off(tiny_model_dir, tmp_path, setting):
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=3, **{setting: False}), pairs=make_pairs(), show_progress=False)
    assert [round(r["loss"], 5) for r in metrics(out)] == PINNED["cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_identical_pairs_give_zero_kl_and_unchanged_weights(tiny_model_dir, tmp_path, lora_rank, backend):
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, lora_rank=lora_rank, steps=3, backend=backend), pairs=make_pairs(identical=True),
          show_progress=False)
    for row in metrics(out):
        assert row["kl"] == 0.0 and row["loss"] == 0.0 and row["grad_norm"] == 0.0
    before, _ = load_model(str(tiny_model_dir))
    after, _ = load_model(str(out / "model"))
    for (n, a), (_, b) in zip(before.state_dict().items(), after.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-7), n


def test_kl_falls_when_training_on_perturbed_pairs(tiny_model_dir, tmp_path):
    # Exact reverse KL: on a random model the sampled-token estimate of a ~2.5-nat KL is too noisy to show a trend
    # in a few steps (its mean is pinned in test_losses; the real-model test checks it trains).
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=15, lr=1e-2, loss="full", lora_rank=16, lora_alpha=16.0),
          pairs=make_pairs(), show_progress=False)
    kl = [r["kl"] for r in metrics(out)]
    assert sum(kl[-3:]) / 3 < 0.75 * sum(kl[:3]) / 3, kl


class Killed(Exception):
    pass


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_resume_reproduces_uninterrupted_metrics(tiny_model_dir, tmp_path, lora_rank, backend):
    # threads=2, fixed: with `threads: 0` a busy machine can give the two runs different thread counts in a step,
    # so a different float summation order (grad_norm then differs in its 7th digit).
    full = tmp_path / "full"
    train(cfg_for(tiny_model_dir, full, steps=5, save_every=2, lora_rank=lora_rank, backend=backend, threads=2),
          pairs=make_pairs(), show_progress=False)

    def kill_at_4(policy, fmt):
        if len(metrics(part)) == 3:  # dies during step 4, after the step-2 checkpoint and before step-4's
            raise Killed

    part = tmp_path / "part"
    with pytest.raises(Killed):
        train(cfg_for(tiny_model_dir, part, steps=5, save_every=2, lora_rank=lora_rank, backend=backend, threads=2),
              pairs=make_pairs(), probe=kill_at_4, probe_every=1, show_progress=False)
    assert not (part / "model").exists() and not (part / "run.json").exists()  # not complete-looking
    train(cfg_for(tiny_model_dir, part, steps=5, save_every=2, lora_rank=lora_rank, resume=True, backend=backend,
                   threads=2),
          pairs=make_pairs(),
          show_progress=False)
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b):
        for k in DETERMINISTIC:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)


def test_saved_adapter_loads_with_peft_and_transformers(tiny_model_dir, tmp_path):
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=2, report_to="tensorboard"), pairs=make_pairs(), show_progress=False)
    assert (out / "model" / "adapter_config.json").is_file() and (out / "run.json").is_file()
    assert any((out / "tb").iterdir())
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(out / "model"))
    merged, tok = load_model(str(out / "model"))
    base, _ = load_model(str(tiny_model_dir))
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        lp, lm, lb = peft_model(x).logits, merged(x).logits, base(x).logits
    assert torch.allclose(lp, lm, atol=1e-4) and not torch.allclose(lp, lb, atol=1e-4)


def test_full_finetune_saves_a_transformers_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=2, lora_rank=0), pairs=make_pairs(), show_progress=False)
    assert (out / "model" / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(str(out / "model"))


def test_refuses_to_overwrite_a_run(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=1), pairs=make_pairs(), show_progress=False)
    with pytest.raises(RunError, match="already holds a run"):
        train(cfg_for(tiny_model_dir, out, steps=1), pairs=make_pairs(), show_progress=False)


def test_yaml_then_cli_precedence(tmp_path):
    import argparse

    y = tmp_path / "c.yaml"
    y.write_text("lr: 0.001\nsteps: 7\nloss: topk\n")
    p = argparse.ArgumentParser()
    options.add_arguments(p, TrainConfig)
    cfg = config.build(TrainConfig, p.parse_args(["--config", str(y), "--steps", "9"]))
    assert (cfg.lr, cfg.steps, cfg.loss, cfg.temperature) == (0.001, 9, "topk", 1.0)
    y.write_text("lr: fast\n")
    with pytest.raises(options.ConfigError, match=r"c.yaml:1: option 'lr' must be float"):
        config.build(TrainConfig, p.parse_args(["--config", str(y)]))
    y.write_text("learning_rate: 1\n")
    with pytest.raises(options.ConfigError, match="unknown option 'learning_rate'"):
        config.build(TrainConfig, p.parse_args(["--config", str(y)]))


def test_sft_trains_on_frozen_clean_answers(tiny_model_dir, tmp_path):
    from opct.data.chat import render_prompt
    from tests.conftest import sample
    from opct.backends.sampling import SamplingSettings
    from opct.algo.sft import train_sft

    out = tmp_path / "sft"
    cfg = cfg_for(tiny_model_dir, out, SFTConfig, steps=12, lr=3e-2, lora_rank=8, temperature=0.0)
    train_sft(cfg, pairs=make_pairs(), show_progress=False)
    # targets: the frozen model's greedy answer to each clean prompt, paired with that pair's cued prompt
    model, tok = load_model(str(tiny_model_dir))
    examples = [json.loads(x) for x in (out / "targets.jsonl").read_text().splitlines()]
    assert len(examples) == len(QS) * cfg.samples_per_prompt
    clean = render_prompt(tok, make_pairs()[0].teacher)
    want = sample(model, [clean], SamplingSettings(cfg.max_new_tokens, 0.0), {tok.eos_token_id}, tok.pad_token_id)[0]
    assert examples[0][1] == want and examples[0][0] == render_prompt(tok, make_pairs()[0].student)
    loss = [r["loss"] for r in metrics(out)]
    assert loss[-1] < 0.5 * loss[0], loss
    assert (out / "model" / "adapter_config.json").is_file()


def test_a_planted_pickle_in_a_checkpoint_is_refused_not_run(tiny_model_dir, tmp_path):
    """Resuming from someone else's checkpoint must not execute code: optim.pt holding a pickle payload."""
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=3, save_every=2), pairs=make_pairs(), show_progress=False)
    (out / "run.json").unlink()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ckpt = out / "checkpoints" / "step-000002"
    torch.save({"optimizer": Payload(), "scheduler": {}}, ckpt / "optim.pt")
    from opct.data.io import sha256_file
    from opct.train.checkpoint import MANIFEST, CheckpointError

    manifest = json.loads((ckpt / MANIFEST).read_text())  # an attacker rewrites the manifest to match
    manifest["optim.pt"] = {"bytes": (ckpt / "optim.pt").stat().st_size, "sha256": sha256_file(ckpt / "optim.pt")}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(CheckpointError, match="optim.pt: refused to load"):
        train(cfg_for(tiny_model_dir, out, steps=3, save_every=2, resume=True), pairs=make_pairs(), show_progress=False)
    assert not marker.exists()


def test_resume_edges_refusals_litter_and_a_truncated_checkpoint(tiny_model_dir, tmp_path):
    # threads=2 throughout, as in test_resume_reproduces_uninterrupted_metrics: on a busy machine `threads: 0` can
    # give the two runs different thread counts in a step, and grad_norm then differs in its 6th digit
    out = tmp_path / "run"
    full = tmp_path / "full"

    def cfg(path, steps=5, **kw):
        return cfg_for(tiny_model_dir, path, steps=steps, save_every=2, threads=2, **kw)

    train(cfg(full), pairs=make_pairs(), show_progress=False)

    def die_at(n):
        def probe(policy, fmt):
            if len(metrics(out)) == n:
                raise Killed
        return probe
    with pytest.raises(Killed):
        train(cfg(out), pairs=make_pairs(), probe=die_at(3), probe_every=1, show_progress=False)
    # a kill during a checkpoint write leaves a temporary directory; resuming removes it
    (out / "checkpoints" / ".step-000004.tmp-x").mkdir()
    with pytest.raises(RunError, match=r"--lr 0.01 -> 0.02"):
        train(cfg(out, resume=True, lr=2e-2), pairs=make_pairs(), show_progress=False)
    with pytest.raises(RunError, match="beyond --steps 1"):
        train(cfg(out, steps=1, resume=True), pairs=make_pairs(), show_progress=False)
    # a truncated file in the newest checkpoint: resume falls back to the previous one (step 2; the kill came
    # before step 4's checkpoint, so a truncated copy poses as it)
    import shutil

    good = out / "checkpoints" / "step-000002"
    bad = out / "checkpoints" / "step-000004"
    shutil.copytree(good, bad)
    f = bad / "optim.pt"
    f.write_bytes(f.read_bytes()[:100])
    train(cfg(out, resume=True), pairs=make_pairs(), show_progress=False)
    assert not list((out / "checkpoints").glob(".step-*"))
    a, b = metrics(full), metrics(out)
    for ra, rb in zip(a, b):
        for k in DETERMINISTIC:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)


def test_a_second_run_on_the_same_out_is_refused_while_the_first_holds_it(tiny_model_dir, tmp_path):
    from opct.train.loop import acquire_lock

    out = tmp_path / "run"
    held = acquire_lock(out)
    import subprocess
    import sys

    code = f"from opct.train.loop import acquire_lock; acquire_lock(__import__('pathlib').Path({str(out)!r}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "another opct process is writing this directory" in r.stderr
    held.close()


@pytest.mark.parametrize("where", ["step", "start"])
def test_a_run_that_fails_closes_its_policy_at_once(tiny_model_dir, tmp_path, monkeypatch, where):
    """A run stopped by an error (here a NaN at step 1, or a failure in start_run after the policy was built)
    closes its policy before the error propagates, so a vLLM engine or a `vllm serve` it started is not left
    running; a finished run closes it too (in save_final), and a second close is a no-op."""
    import opct.train.loop as loop

    closed = []

    def counting_make_policy(*a, **k):
        policy = make_policy(*a, **k)
        close = policy.close
        policy.close = lambda: closed.append(1) or close()
        return policy

    monkeypatch.setattr(loop.backends, "make_policy", counting_make_policy)
    if where == "start":
        monkeypatch.setattr(loop, "acquire_lock", lambda out: (_ for _ in ()).throw(RunError("locked")))
    cfg = cfg_for(tiny_model_dir, tmp_path / "run", steps=2, **({"kl_coef": 1e39, "lr": 1e6} if where == "step"
                                                                else {}))
    with pytest.raises(RunError):
        train(cfg, make_pairs(), show_progress=False)
    assert closed == [1]
    monkeypatch.undo()
    closed.clear()
    monkeypatch.setattr(loop.backends, "make_policy", counting_make_policy)
    train(cfg_for(tiny_model_dir, tmp_path / "ok", steps=1), make_pairs(), show_progress=False)
    assert len(closed) == 2  # save_final's close, then the `with`'s
