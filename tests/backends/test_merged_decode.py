"""Decoding from a merged copy of a LoRA model (backends/merged_decode.py): the copy decodes the PEFT model's logits,
follows updates to the adapter, shares what the adapters do not touch, and leaves the PEFT model as it was."""

import copy

import pytest
import torch

from opct.backends import make_policy, merged_decode
from opct.backends.sampling import SamplingSettings
from opct.config import TrainConfig
from opct.models import unwrap
from tests.backends.test_static_decode import gpu, lora_model, policy_logits


def policies(model, tok, **cfg):
    eos = {tok.eos_token_id}
    return (make_policy("hf", model, tok, eos, TrainConfig(sampler="policy", **cfg)),
            make_policy("hf", model, tok, eos, TrainConfig(sampler="policy", merged_decode=True, **cfg)))


def check_merged_decode(model, tok, monkeypatch, **cfg):
    plain, merged = policies(model, tok, **cfg)
    base_weights = {n: p.detach().clone() for n, p in unwrap(model).named_parameters() if "base_layer" in n}
    want_NTV = policy_logits(plain, monkeypatch)
    got_NTV = policy_logits(merged, monkeypatch)
    torch.testing.assert_close(got_NTV, want_NTV, atol=1e-4, rtol=1e-4)
    # An optimizer step changes the adapter: the next sampling decodes from the new weights.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.add_(torch.randn_like(p) * 0.3)
    want2_NTV = policy_logits(plain, monkeypatch)
    assert (want2_NTV - want_NTV).abs().max() > 1e-2  # the update changes what is decoded
    torch.testing.assert_close(policy_logits(merged, monkeypatch), want2_NTV, atol=1e-4, rtol=1e-4)
    for n, p in unwrap(model).named_parameters():  # the PEFT model's own base weights are untouched
        if n in base_weights:
            assert torch.equal(p, base_weights[n])
    return merged


def test_the_merged_copy_decodes_the_lora_models_logits_and_follows_an_update(tiny_model_dir, monkeypatch):
    model, tok = lora_model(tiny_model_dir, "cpu")
    merged = check_merged_decode(model, tok, monkeypatch, cuda_graphs=False)
    copy = merged.merged.model
    assert not any(hasattr(m, "lora_A") for m in copy.modules())
    assert copy.get_input_embeddings().weight is unwrap(model).get_input_embeddings().weight  # shared, not copied
    n_copied = sum(plain.weight.numel() for _, plain in merged.merged.pairs)
    assert n_copied == sum(m.base_layer.weight.numel() for m in model.modules() if hasattr(m, "lora_A"))


def test_a_model_without_lora_decodes_as_it_is(tiny_model_dir):
    from opct.models import load_model

    model, tok = load_model(str(tiny_model_dir), dtype=torch.float32)
    assert merged_decode.unsupported_reason(model) == "not a PEFT model"
    _, merged = policies(model, tok, cuda_graphs=False)
    merged.sample([[1, 5, 6]], SamplingSettings(max_new_tokens=2), torch.Generator().manual_seed(0))
    assert merged.merged is False  # no copy made: it decodes the model itself


def bf16_policy(model, tok, **cfg):
    return make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy", merged_decode=True,
                                                                         decode_dtype="bfloat16", **cfg))


def bf16_reference_logits(model, tok, monkeypatch):
    """What a bfloat16 merged copy must decode: PEFT's own merge of a copy of `model`, its parameters (not its
    buffers) rounded to bfloat16, decoded as a plain model."""
    ref = copy.deepcopy(model).merge_and_unload()
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    cfg = TrainConfig(sampler="policy", cuda_graphs=False)
    return policy_logits(make_policy("hf", ref, tok, {tok.eos_token_id}, cfg), monkeypatch)


def test_a_bfloat16_merged_copy_decodes_the_rounded_merge_and_follows_an_update(tiny_model_dir, monkeypatch):
    """decode_dtype=bfloat16 with merged_decode on a float32 LoRA model: the copy holds every parameter in bfloat16
    (none shared), buffers such as the rotary frequencies in float32, decodes exactly what PEFT's merge rounded to
    bfloat16 decodes, before and after an adapter update, and leaves the float32 model as it was."""
    model, tok = lora_model(tiny_model_dir, "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp32, _ = policies(model, tok, cuda_graphs=False)
    bf16 = bf16_policy(model, tok, cuda_graphs=False)
    got_NTV = policy_logits(bf16, monkeypatch)
    assert torch.equal(got_NTV, bf16_reference_logits(model, tok, monkeypatch))
    want_NTV = policy_logits(fp32, monkeypatch)
    assert 0 < (got_NTV - want_NTV).abs().max() < 0.1 * want_NTV.abs().max()  # rounded, still the same model

    copy_model = bf16.merged.model
    assert {p.dtype for p in copy_model.parameters()} == {torch.bfloat16}
    assert {b.dtype for n, b in copy_model.named_buffers() if "inv_freq" in n} == {torch.float32}
    ids = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert not any(id(t) in ids for t in [*copy_model.parameters(), *copy_model.buffers()])
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.add_(torch.randn_like(p) * 0.3)
    got2_NTV = policy_logits(bf16, monkeypatch)
    assert not torch.equal(got2_NTV, got_NTV)
    assert torch.equal(got2_NTV, bf16_reference_logits(model, tok, monkeypatch))


def test_bfloat16_decoding_on_the_hf_backend_needs_a_merged_lora_copy(tiny_model_dir):
    """The hf backend samples in bfloat16 only from a merged copy: without --merged-decode, or without LoRA, the
    run stops before any work with a message naming the options; the cpu backend and a vLLM sampler are not asked."""
    from opct.backends import BackendError, check_training, other_decode_dtype, resolve
    from opct.models import load_model

    def checked(cfg):
        _, dtype, backend = resolve(cfg)
        check_training(cfg, dtype, backend, None)  # the backend samples
        return backend

    bf16 = dict(device="cpu", dtype="float32", decode_dtype="bfloat16")
    with pytest.raises(BackendError, match="--decode-dtype bfloat16 on the hf backend.*--merged-decode"):
        checked(TrainConfig(backend="hf", **bf16))
    with pytest.raises(BackendError, match="--merged-decode"):
        checked(TrainConfig(backend="hf", merged_decode=True, lora_rank=0, **bf16))
    assert checked(TrainConfig(backend="hf", merged_decode=True, **bf16)) == "hf"
    assert other_decode_dtype(TrainConfig(backend="hf", sampler="vllm", **bf16), torch.float32) is None
    assert checked(TrainConfig(backend="cpu", **bf16)) == "cpu"
    assert checked(TrainConfig(backend="hf", device="cpu", dtype="bfloat16", decode_dtype="bfloat16")) == "hf"

    model, tok = lora_model(tiny_model_dir, "cpu")
    with pytest.raises(BackendError, match="--merged-decode"):
        make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy", **bf16))
    plain, _ = load_model(str(tiny_model_dir), dtype=torch.float32)
    policy = make_policy("hf", plain, tok, {tok.eos_token_id},
                         TrainConfig(sampler="policy", merged_decode=True, **bf16))
    with pytest.raises(BackendError, match=r"cannot make one \(not a PEFT model\): leave --decode-dtype at float32"):
        policy.sample([[1, 5, 6]], SamplingSettings(max_new_tokens=2), torch.Generator().manual_seed(0))


def test_a_bfloat16_model_shares_its_tensors_and_other_trained_parameters_are_refused(tiny_model_dir, monkeypatch):
    """decode_dtype=bfloat16 on a bfloat16 model is the model's own dtype: the copy shares what the adapters do not
    touch, as at float32. A float32 copy in bfloat16 shares nothing, so a trained parameter outside the adapters
    would go stale in it: such a run is refused at its first sampling, naming the parameter."""
    from opct.backends import BackendError
    from opct.models import add_lora, load_model

    model, tok = load_model(str(tiny_model_dir), dtype=torch.bfloat16)
    model = add_lora(model, 4, 8.0)
    policy = bf16_policy(model, tok, cuda_graphs=False, dtype="bfloat16")
    policy.sample([[1, 5, 6]], SamplingSettings(max_new_tokens=2), torch.Generator().manual_seed(0))
    assert policy.merged.model.get_input_embeddings().weight is unwrap(model).get_input_embeddings().weight

    model, tok = lora_model(tiny_model_dir, "cpu")
    norm = next(n for n, p in model.named_parameters() if "norm" in n)
    model.get_parameter(norm).requires_grad_(True)
    policy = bf16_policy(model, tok, cuda_graphs=False)
    with pytest.raises(BackendError, match=f"cannot make one \\(parameters other than LoRA's are trained \\({norm}"):
        policy.sample([[1, 5, 6]], SamplingSettings(max_new_tokens=2), torch.Generator().manual_seed(0))


def test_the_frozen_teacher_never_samples_from_the_students_merged_copy(tiny_model_dir, monkeypatch):
    """After the student has sampled (its merged copy made, adapters merged in), the teacher view samples the frozen
    model itself: the same logits as a policy without merged decoding, bit for bit."""
    model, tok = lora_model(tiny_model_dir, "cpu")
    plain, merged = policies(model, tok, cuda_graphs=False)
    policy_logits(merged, monkeypatch)
    assert merged.merged
    with plain.teacher() as t:
        want_NTV = policy_logits(t, monkeypatch)
    with merged.teacher() as t:
        got_NTV = policy_logits(t, monkeypatch)
        assert t.merged is False
    assert torch.equal(got_NTV, want_NTV)
    assert not torch.allclose(policy_logits(merged, monkeypatch), want_NTV, atol=1e-2)  # the student's differ


def test_a_data_parallel_run_refuses_a_decode_dtype_before_any_work():
    """A data-parallel run samples from the model itself (no lean decoder, no merged copy)."""
    from opct.train import distributed, loop

    ddp = distributed.Replicas(rank=0, world=2, mode="ddp")
    cfg = TrainConfig(prompts_per_step=2, decode_dtype="bfloat16", merged_decode=True)
    with pytest.raises(loop.RunError, match="--decode-dtype bfloat16: a data-parallel run samples from the model"):
        loop.check_distributed(cfg, ddp, torch.float32)
    assert loop.check_distributed(cfg, ddp, torch.bfloat16) == "hf"  # the model's own dtype: nothing to do
    assert loop.check_distributed(TrainConfig(prompts_per_step=2), ddp, torch.float32) == "hf"


@gpu
@pytest.mark.gpu
def test_the_merged_copy_under_cuda_graphs_decodes_the_lora_models_logits(tiny_model_dir, monkeypatch):
    model, tok = lora_model(tiny_model_dir, "cuda")
    check_merged_decode(model, tok, monkeypatch, cuda_graphs=True)


@gpu
@pytest.mark.gpu
def test_a_bfloat16_merged_copy_under_cuda_graphs_decodes_the_rounded_merge(tiny_model_dir, monkeypatch):
    model, tok = lora_model(tiny_model_dir, "cuda")
    bf16 = bf16_policy(model, tok, cuda_graphs=True)
    torch.testing.assert_close(policy_logits(bf16, monkeypatch), bf16_reference_logits(model, tok, monkeypatch),
                               atol=1e-2, rtol=1e-2)
