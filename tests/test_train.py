import json

import pytest
import torch

from opct import config
from opct.config import TrainConfig
from opct.models import Teacher, add_lora, load_model
from opct.opct import RunError, opct_step, render_pairs, train
from opct.pairs import ConsistencyPair

QS = ["What is 2+2?", "Name a colour.", "Is water wet?", "Count to three.", "Say hello.", "What is the sun?"]


def make_pairs(identical=False):
    out = []
    for i, q in enumerate(QS):
        teacher = [{"role": "user", "content": q}]
        student = teacher if identical else [{"role": "system", "content": f"Always answer ({'ABCD'[i % 4]})."},
                                             {"role": "user", "content": q + " I think it's (B)."}]
        out.append(ConsistencyPair(student, teacher, {}))
    return out


def cfg_for(model_dir, out, **kw):
    base = dict(model=str(model_dir), out=str(out), steps=4, prompts_per_step=3, samples_per_prompt=2, micro_batch=6,
                max_new_tokens=6, lr=1e-2, lora_rank=4, lora_alpha=8.0, save_every=0, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


DETERMINISTIC = ("loss", "kl", "logp_student", "logp_teacher", "response_tokens", "grad_norm", "lr")


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_grad_accumulation_equals_one_big_batch(tiny_model_dir, lora_rank):
    grads = []
    for mb in (6, 2):
        torch.manual_seed(0)
        model, tok = load_model(str(tiny_model_dir))
        if lora_rank:
            model = add_lora(model, lora_rank, 8.0)
            with torch.no_grad():  # non-zero B so the adapter has a gradient path through both factors
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.1)
        else:
            model.requires_grad_(True)
        teacher = Teacher(model)
        cfg = cfg_for(tiny_model_dir, "unused", micro_batch=mb, lora_rank=lora_rank)
        batch = render_pairs(tok, make_pairs(), 256, cfg.max_new_tokens)[:3]
        row = opct_step(model, teacher, tok.pad_token_id, {tok.eos_token_id}, batch, cfg, torch.Generator().manual_seed(1))
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, row))
    (g6, r6), (g2, r2) = grads
    assert r6["response_tokens"] == r2["response_tokens"] and r6["kl"] == pytest.approx(r2["kl"], rel=1e-5)
    # mb=6 takes the fused path (prompt prefill shared with sampling), mb=2 the separate one: equal up to float
    # rounding. A normalisation bug (per-micro-batch averaging) would be off by a factor, not by 1e-5.
    for n in g6:
        assert (g6[n] - g2[n]).norm() <= 1e-5 * g6[n].norm() + 1e-7, n


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_identical_pairs_give_zero_kl_and_unchanged_weights(tiny_model_dir, tmp_path, lora_rank):
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, lora_rank=lora_rank, steps=3), pairs=make_pairs(identical=True),
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


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_resume_reproduces_uninterrupted_metrics(tiny_model_dir, tmp_path, lora_rank):
    full = tmp_path / "full"
    train(cfg_for(tiny_model_dir, full, steps=5, save_every=2, lora_rank=lora_rank), pairs=make_pairs(),
          show_progress=False)

    def kill_at_4(model, tok):
        if len(metrics(part)) == 3:  # dies during step 4, after the step-2 checkpoint and before step-4's
            raise Killed

    part = tmp_path / "part"
    with pytest.raises(Killed):
        train(cfg_for(tiny_model_dir, part, steps=5, save_every=2, lora_rank=lora_rank), pairs=make_pairs(),
              probe=kill_at_4, probe_every=1, show_progress=False)
    assert not (part / "model").exists() and not (part / "run.json").exists()  # not complete-looking
    train(cfg_for(tiny_model_dir, part, steps=5, save_every=2, lora_rank=lora_rank, resume=True), pairs=make_pairs(),
          show_progress=False)
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b):
        for k in DETERMINISTIC:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), (ra["step"], k)


def test_saved_adapter_loads_with_peft_and_transformers(tiny_model_dir, tmp_path):
    from peft import AutoPeftModelForCausalLM

    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=2, tensorboard=True), pairs=make_pairs(), show_progress=False)
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
    config.add_arguments(p, TrainConfig)
    cfg = config.build(TrainConfig, p.parse_args(["--config", str(y), "--steps", "9"]))
    assert (cfg.lr, cfg.steps, cfg.loss, cfg.temperature) == (0.001, 9, "topk", 1.0)
    y.write_text("lr: fast\n")
    with pytest.raises(config.ConfigError, match=r"c.yaml: option 'lr' must be float"):
        config.build(TrainConfig, p.parse_args(["--config", str(y)]))
    y.write_text("learning_rate: 1\n")
    with pytest.raises(config.ConfigError, match="unknown option 'learning_rate'"):
        config.build(TrainConfig, p.parse_args(["--config", str(y)]))


def test_sft_trains_on_frozen_clean_answers(tiny_model_dir, tmp_path):
    from opct.config import SFTConfig
    from opct.models import load_model
    from opct.pairs import render_prompt
    from opct.rollout import SamplingSettings, sample
    from opct.sft import train_sft

    out = tmp_path / "sft"
    cfg = SFTConfig(**{**cfg_for(tiny_model_dir, out, steps=12, lr=3e-2, lora_rank=8).__dict__, "temperature": 0.0})
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
