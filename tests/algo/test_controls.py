"""The attribution controls (docs/controls.md): a shuffled teacher context, a fixed advantage, per-token KL clipping,
and the KL by token position. Their math on fixed tokens, then each on a tiny model's training run."""

import json

import pytest
import torch

from opct.data.chat import ChatFormat
from opct.algo import losses
from opct.algo.opct import KL_HEAD, consistency_loss, other_contexts, train
from opct.backends.base import Scores
from opct.config import TrainConfig, validate
from opct.options import ConfigError
from opct.train.loop import RunError
from tests.train.test_train import cfg_for, make_pairs


def test_fixed_advantage_gradient_is_its_closed_form_on_fixed_tokens():
    """loss = -A sum_t ratio_t; d/d logp_t = -A on every real token, 0 on padding, whatever the teacher says."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss = losses.fixed_advantage_loss(logp, mask, -0.5)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * 5)  # ratio 1 on-policy: -A per real token
    assert torch.equal(logp.grad, torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0]]))
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])  # importance weights scale each token's term
    logp.grad = None
    losses.fixed_advantage_loss(logp, mask, -0.5, w).backward()
    assert torch.equal(logp.grad, torch.tensor([[1.0, 0.5, 0.5], [0.5, 0.25, 0.0]]))


def test_consistency_loss_with_a_fixed_advantage_ignores_the_teacher_but_logs_its_kl():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    cfg = TrainConfig(fixed_advantage=-1.0)
    grads = []
    for teacher in ([[-1.0, -2.0]], [[-9.0, -0.1]]):
        logp.grad = None
        t = Scores(torch.tensor(teacher), mask)
        loss, kl, clipped = consistency_loss(cfg, Scores(logp, mask), t)
        loss.backward()
        grads.append(logp.grad.clone())
        assert kl.item() == pytest.approx(float((logp.detach() - t.logp_NT).sum()))
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], torch.ones(1, 2))


def test_kl_clip_caps_each_tokens_advantage_and_leaves_the_logged_kl_alone():
    logp_s = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    logp_t = torch.tensor([[-4.0, -1.0, -0.6, -9.0]])  # k = [3, -1, 0.1, 6]; the last token is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, kl = losses.sampled_token_loss(logp_s, logp_t, mask, clip=0.5)
    loss.backward()
    assert kl.item() == pytest.approx(3 - 1 + 0.1)  # unclipped
    assert torch.allclose(logp_s.grad, torch.tensor([[0.5, -0.5, 0.1, 0.0]]))  # grad = clamp(k, -0.5, 0.5)
    cfg = TrainConfig(kl_clip=0.5)
    _, _, clipped = consistency_loss(cfg, Scores(logp_s, mask), Scores(logp_t, mask))
    assert clipped == 2


def test_kl_clip_on_an_exact_loss_caps_a_positions_kl_and_stops_its_gradient():
    torch.manual_seed(0)
    H, V = 4, 7
    proj = torch.randn(H, V)
    h_s = torch.randn(1, 3, H, requires_grad=True)
    h_t = torch.randn(1, 3, H)
    mask = torch.ones(1, 3)
    def scores(h):
        return Scores(torch.zeros(1, 3), mask, hidden_NTH=h, logits=lambda x: x @ proj)
    kl_M = losses.reverse_kl(h_s[0].detach() @ proj, h_t[0] @ proj)
    cap = float(kl_M.sort().values[1])  # between the smallest and the largest
    loss, kl, clipped = consistency_loss(TrainConfig(loss="full", kl_clip=cap), scores(h_s), scores(h_t))
    assert kl.item() == pytest.approx(float(kl_M.sum()), rel=1e-5)
    assert loss.item() == pytest.approx(float(kl_M.clamp(max=cap).sum()), rel=1e-5)
    assert clipped == int((kl_M > cap).sum()) == 1
    loss.backward()
    over = int(kl_M.argmax())
    assert torch.equal(h_s.grad[0, over], torch.zeros(H)) and h_s.grad[0].abs().sum() > 0


def test_position_kl_splits_each_response_at_its_first_head_loss_tokens():
    logp_s = torch.zeros(2, 5)
    logp_t = -torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0]])  # k = -logp_t
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])  # the loss skips row 1's first token (e.g. reasoning)
    got = losses.position_kl(logp_s, logp_t, mask, head=2)
    assert got == {"kl_head": 1 + 2 + 20 + 30, "head_tokens": 4, "kl_tail": 3 + 4 + 5, "tail_tokens": 3}


def test_other_contexts_come_from_other_pairs_and_are_drawn_again_on_resume():
    rendered = [([i], [100 + i % 3]) for i in range(9)]  # three teacher prompts, three pairs each
    idx = [0, 4, 8, 2]
    got = other_contexts(rendered, idx, seed=1, step=3)
    assert all(t != rendered[i][1] and t in [r[1] for r in rendered] for i, t in zip(idx, got))
    assert got == other_contexts(rendered, idx, seed=1, step=3)
    draws = {tuple(map(tuple, other_contexts(rendered, idx, seed=1, step=s))) for s in range(20)}
    assert len(draws) > 1  # a fresh draw each step
    with pytest.raises(RunError, match="two different teacher prompts"):
        other_contexts([([1], [7]), ([2], [7])], [0], seed=0, step=0)


def test_a_fixed_advantage_needs_the_sampled_loss_and_the_own_context():
    with pytest.raises(ConfigError, match="--fixed-advantage .*--loss sampled"):
        validate(TrainConfig(fixed_advantage=-1.0, loss="full"))
    with pytest.raises(ConfigError, match="--fixed-advantage .*shuffled"):
        validate(TrainConfig(fixed_advantage=-1.0, teacher_context="shuffled"))
    with pytest.raises(ConfigError, match="--kl-clip must be >= 0"):
        validate(TrainConfig(kl_clip=-1.0))


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_shuffled_teacher_scores_after_other_pairs_prompts(tiny_model_dir, tmp_path, monkeypatch):
    """Every teacher prompt the step scores is another pair's teacher prompt, never the student's own pair's."""
    import opct.algo.opct as algo

    seen = []
    real = algo.opct_step

    def spy(policy, fmt, batch, cfg, gen, tokens=None):
        seen.extend(batch)
        return real(policy, fmt, batch, cfg, gen, tokens)
    monkeypatch.setattr(algo, "opct_step", spy)
    pairs = make_pairs()
    train(cfg_for(tiny_model_dir, tmp_path / "run", steps=2, teacher_context="shuffled", samples_per_prompt=1),
          pairs=pairs, show_progress=False)
    from opct.models import load_model
    from opct.train.loop import render_pairs

    _, tok = load_model(str(tiny_model_dir))
    rendered = render_pairs(ChatFormat.sides(tok), pairs, 10_000, 6)
    own = {tuple(s): tuple(t) for s, t in rendered}
    teachers = {tuple(t) for _, t in rendered}
    assert len(seen) == 6
    assert all(tuple(t) != own[tuple(s)] and tuple(t) in teachers for s, t in seen)


def test_each_control_trains_on_the_tiny_model_and_logs_the_kl_by_position(tiny_model_dir, tmp_path):
    rows_of = {}
    for name, kw in {"opct": {}, "fixed": {"fixed_advantage": -1.0}, "clip": {"kl_clip": 0.05},
                     "shuffled": {"teacher_context": "shuffled"}}.items():
        train(cfg_for(tiny_model_dir, tmp_path / name, steps=2, **kw), pairs=make_pairs(), show_progress=False)
        rows_of[name] = rows(tmp_path / name)
    base = rows_of["opct"]
    for r in base:  # max_new_tokens=6 < KL_HEAD: every scored token is in the head
        assert KL_HEAD >= 6 and "kl_tail" not in r and r["kl_head"] == pytest.approx(r["kl"], rel=1e-4, abs=1e-6)
    # the same tokens at step 1 (same seed, same weights), a different update
    assert rows_of["fixed"][0]["response_tokens"] == base[0]["response_tokens"]
    assert rows_of["fixed"][0]["kl"] == pytest.approx(base[0]["kl"], rel=1e-5)
    assert rows_of["fixed"][0]["grad_norm"] != pytest.approx(base[0]["grad_norm"], rel=1e-3)
    assert 0 < rows_of["clip"][0]["kl_clipped"] <= 1 and "kl_clipped" not in base[0]
    assert rows_of["clip"][0]["grad_norm"] < base[0]["grad_norm"]
    assert rows_of["shuffled"][0]["logp_teacher"] != pytest.approx(base[0]["logp_teacher"], rel=1e-4)
