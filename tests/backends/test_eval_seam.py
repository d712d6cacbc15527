"""Evaluation runs through the Policy seam: an inference policy's `generate` and `next_token_logprobs` against
independent references (transformers' own generate, one plain forward per prompt), on the hf and cpu backends, and
every axis' `opct eval --axis` result and per-example samples the same on both backends.

dev/eval_seam_check.py wrote the same results with the code before evaluation moved behind the seam: identical
(dev/LOG.md, 2026-11-28)."""

import json

import pytest
import torch
from tests.conftest import policy_of

from opct.backends.sampling import SamplingSettings
from opct.data.chat import render_prompt
from opct.models import load_model

CHATS = [[{"role": "user", "content": t}] for t in ("hi", "tell me a story about a cat", "2+2?", "ok", "why?")]


@pytest.mark.parametrize("backend", ["hf", "cpu"])
def test_greedy_generate_is_transformers_generate_of_each_prompt_alone(tiny_model_dir, backend):
    model, tok = load_model(str(tiny_model_dir))
    prompts = [render_prompt(tok, c) for c in CHATS]
    ref_model, _ = load_model(str(tiny_model_dir))
    expected = []
    for p in prompts:
        out = ref_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=sorted(policy_of(ref_model, tok).eos_ids))[0, len(p):].tolist()
        expected.append(out)
    policy = policy_of(model, tok, backend=backend)
    model.train()
    got = policy.generate(prompts, SamplingSettings(8, 0.0), torch.Generator().manual_seed(0), batch_size=3)
    assert model.training  # the module's mode is restored
    # transformers pads after EOS; the policy stops there, keeping the EOS token
    assert [g == e[:len(g)] and (len(g) == 8 or g[-1] in policy.eos_ids) for g, e in zip(got, expected)] == [True] * 5
    assert got == policy.generate(prompts, SamplingSettings(8, 0.0), torch.Generator().manual_seed(0), batch_size=1)


@pytest.mark.parametrize("backend", ["hf", "cpu"])
@pytest.mark.parametrize("grouped", [False, True])
def test_next_token_logprobs_are_one_forward_per_prompt(tiny_model_dir, backend, grouped):
    model, tok = load_model(str(tiny_model_dir))
    shared = [{"role": "system", "content": "You answer with one letter."}]
    prompts = [render_prompt(tok, shared + c) for c in CHATS]
    wanted = [[49, 330], [50], [51, 340, 7], [52], [1, 2, 3]]
    with torch.no_grad():
        expected = [torch.log_softmax(model(torch.tensor([p])).logits[0, -1].float(), -1)[w]
                    for p, w in zip(prompts, wanted)]
    policy = policy_of(model, tok, backend=backend)
    got = policy.next_token_logprobs(prompts, wanted, groups=[0] * 5 if grouped else None, batch_size=2)
    for g, e, w in zip(got, expected, wanted):
        assert g.dtype == torch.float32 and g.shape == (len(w),)
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


def test_an_inference_policy_has_no_teacher(tiny_model_dir):
    policy = policy_of(*load_model(str(tiny_model_dir)))
    assert policy.frozen is None
    with pytest.raises(RuntimeError, match="no teacher"):
        with policy.teacher():
            pass


SIZES = {"sycophancy": dict(n_train=8, n_eval=16, cued_n=16),
         "safety": dict(n_train=8, n_eval=8, max_new_tokens=8),
         "jailbreak": dict(n_train=8, n_eval=8, eval_max_new_tokens=8, max_new_tokens=8)}


@pytest.mark.parametrize("axis", list(SIZES))
def test_every_axis_evaluates_the_same_on_hf_and_cpu(tiny_model_dir, tmp_path, axis):
    from opct.config import EvalConfig
    from opct.evaluate import config_for_axis, run_eval

    runs = {}
    for backend in ("hf", "cpu"):
        out = tmp_path / f"{backend}.json"
        res = run_eval(config_for_axis(EvalConfig, axis=axis, model=str(tiny_model_dir), backend=backend,
                                       out=str(out), **SIZES[axis]))
        samples = out.with_suffix(".samples.jsonl")
        runs[backend] = (res, samples.read_text() if samples.is_file() else None)
        assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert runs["hf"] == runs["cpu"]
    res, samples = runs["cpu"]
    assert res["axis"] == axis and samples  # every axis writes each prompt's answer (sycophancy: the letter it read)
    from opct.axes.verdicts import VERDICTS

    rows = [json.loads(x) for x in samples.splitlines()]
    # one verdict shape in every axis' rows: the axis' own verdict of the rest of the row ({} where there is none)
    assert all(r["verdict"] == VERDICTS[axis]({k: v for k, v in r.items() if k != "verdict"}) for r in rows)
    assert any(r["verdict"] for r in rows) and all(set(c) <= {"value", "answer", "explanation"} and c["value"] in (0, 1)
                                                   for r in rows for c in r["verdict"].values())
