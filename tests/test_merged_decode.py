"""Decoding from a merged copy of a LoRA model (backends/merged_decode.py): the copy decodes the PEFT model's logits,
follows updates to the adapter, shares what the adapters do not touch, and leaves the PEFT model as it was."""

import pytest
import torch

from opct.backends import make_policy, merged_decode
from opct.backends.sampling import SamplingSettings
from opct.config import TrainConfig
from opct.models import unwrap
from test_static_decode import gpu, lora_model, policy_logits


def policies(model, tok, **cfg):
    eos = {tok.eos_token_id}
    return (make_policy("hf", model, tok, eos, TrainConfig(**cfg)),
            make_policy("hf", model, tok, eos, TrainConfig(merged_decode=True, **cfg)))


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


@gpu
@pytest.mark.gpu
def test_the_merged_copy_under_cuda_graphs_decodes_the_lora_models_logits(tiny_model_dir, monkeypatch):
    model, tok = lora_model(tiny_model_dir, "cuda")
    check_merged_decode(model, tok, monkeypatch, cuda_graphs=True)
