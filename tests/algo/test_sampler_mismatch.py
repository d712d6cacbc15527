"""Truncated importance sampling in the OPCT step when another engine (vLLM) samples: the weights, what is logged,
and that nothing changes when the sampler's numbers are the trainer's (tiny random model, hf backend)."""

import pytest
import torch

from opct.data.chat import ChatFormat
from opct.algo.opct import opct_step
from opct.backends.base import Policy, Rollout
from opct.train.loop import render_pairs
from tests.train.test_train import cfg_for, make_pairs, policy_for


class OffSampler(Policy):
    """The wrapped policy's own samples, reported with the trainer's log-probs plus `shift_fn(logp)`: a sampler
    whose numbers differ from the trainer's (as vLLM's in bfloat16 do), or equal them (shift 0)."""

    def __init__(self, inner: Policy, shift_fn):
        self.inner, self.shift_fn = inner, shift_fn
        self.ratios: list[float] = []  # p_trainer / p_sampler of every token sampled, as reported
        self.model, self.tok, self.pad_id, self.eos_ids, self.device = (inner.model, inner.tok, inner.pad_id,
                                                                         inner.eos_ids, inner.device)

    def sample(self, prompts_N, settings, gen):
        r = self.inner.sample(prompts_N, settings, gen)
        plain = Rollout(prompts_N, r.responses)
        logp = self.inner.score(prompts_N, plain, grad=False).logp_NT
        rows = [logp[i, :len(resp)] for i, resp in enumerate(r.responses)]
        reported = [self.shift_fn(row) for row in rows]
        self.ratios += torch.cat([(a - b).exp() for a, b in zip(rows, reported)]).tolist()
        return Rollout(prompts_N, r.responses, sampler_logp=[[float(x) for x in row] for row in reported])

    def score(self, prompts_N, rollout, *, grad, hidden=False, sync=True):
        return self.inner.score(prompts_N, rollout, grad=grad, hidden=hidden, sync=sync)

    def teacher(self):
        return self.inner.teacher()


def step(tiny_model_dir, shift_fn=None, **kw):
    """One OPCT step's row and gradients on the tiny model (same seeds: the same sampled tokens every call)."""
    cfg = cfg_for(tiny_model_dir, "unused", backend="hf", sampler="policy", **kw)
    policy, tok = policy_for(tiny_model_dir, "hf", cfg.lora_rank, cfg)
    if shift_fn is not None:
        policy = OffSampler(policy, shift_fn)
    batch = render_pairs(ChatFormat.sides(tok), make_pairs(), 256, cfg.max_new_tokens)[:3]
    row = opct_step(policy, ChatFormat.of(tok, cfg), batch, cfg, torch.Generator().manual_seed(1))
    row["ratios"] = getattr(policy, "ratios", None)
    return row, {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def shifts(logp):
    """A fixed pseudo-random shift per token in [-1, 1] nats: some ratios far above 2, some far below 1."""
    g = torch.Generator().manual_seed(len(logp))
    return logp - (torch.rand(len(logp), generator=g) * 2 - 1)


@pytest.mark.parametrize("loss", ["sampled", "full"])
def test_a_sampler_with_the_trainers_numbers_gives_weights_of_one_and_the_plain_update(tiny_model_dir, loss):
    plain, g_plain = step(tiny_model_dir, loss=loss)
    same, g_same = step(tiny_model_dir, lambda lp: lp, loss=loss)
    assert "is_weight_mean" not in plain and "sampler_logp_gap" not in plain  # the policy sampled itself
    assert same["sampler_logp_gap"] == 0.0
    assert same["is_weight_mean"] == pytest.approx(1.0, abs=1e-6) and same["is_ratio_max"] == pytest.approx(1.0)
    assert same["is_truncated"] == 0.0
    assert same["loss"] == pytest.approx(plain["loss"], rel=1e-6) and same["kl"] == pytest.approx(plain["kl"])
    for n in g_plain:
        assert torch.allclose(g_same[n], g_plain[n], rtol=1e-5, atol=1e-8), n


def test_an_off_sampler_gets_truncated_weights_logged_and_applied(tiny_model_dir):
    plain, g_plain = step(tiny_model_dir)
    off, g_off = step(tiny_model_dir, shifts, sampler_is_cap=2.0)
    # the weights are the trainer's over the sampler's probabilities, truncated at 2: as the sampler reported them
    r = torch.tensor(off["ratios"])
    assert len(r) == off["response_tokens"] and r.max() > 2.0 and r.min() < 0.7
    assert off["is_weight_mean"] == pytest.approx(float(r.clamp(max=2.0).mean()), rel=1e-4)
    assert off["is_truncated"] == pytest.approx(float((r > 2.0).float().mean()))
    assert off["is_ratio_max"] == pytest.approx(float(r.max()), rel=1e-4)
    assert 0 < off["is_truncated"] < 1 and off["is_weight_mean"] != pytest.approx(1.0, abs=0.02)
    assert off["sampler_logp_gap"] > 0.1
    assert off["kl"] == pytest.approx(plain["kl"])  # the logged KL is the unweighted estimate
    assert any(not torch.allclose(g_off[n], g_plain[n]) for n in g_plain)  # the weights reach the update
    # cap 0: no correction, the plain update, only the gap logged
    nocap, g_nocap = step(tiny_model_dir, shifts, sampler_is_cap=0.0)
    assert "is_weight_mean" not in nocap and nocap["sampler_logp_gap"] == pytest.approx(off["sampler_logp_gap"])
    for n in g_plain:
        assert torch.allclose(g_nocap[n], g_plain[n], rtol=1e-5, atol=1e-8), n
