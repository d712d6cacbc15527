"""opct.attention: the matmul form of grouped-query attention agrees with Hugging Face's eager attention."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from opct.backends.cpu import attention
from tests.conftest import cpu_model
from opct.backends.batching import left_pad

PROMPTS = [[1, 5, 9, 13, 2, 7], [4, 4, 8], [3, 11, 6, 10, 12, 14, 15, 16, 17]]


def _run(model, ids, mask, pos):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    (logits[mask.bool()].logsumexp(-1).sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_matches_eager_attention_with_padding_forward_and_backward(tiny_model_dir):
    model, _ = cpu_model(tiny_model_dir)
    assert model.config._attn_implementation == attention.NAME
    model.requires_grad_(True)
    ids, mask, pos = left_pad(PROMPTS, 0)
    ours, g_ours = _run(model, ids, mask, pos)
    model.set_attn_implementation("eager")
    ref, g_ref = _run(model, ids, mask, pos)
    real = mask.bool()
    assert ours.isfinite().all()  # padding queries attend to nothing: finite, not NaN
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-5, atol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_causal_without_mask_matches_eager(tiny_model_dir):
    model, _ = cpu_model(tiny_model_dir)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_long_sequences_take_the_sdpa_kernel(tiny_model_dir, monkeypatch):
    model, _ = cpu_model(tiny_model_dir)
    ids, mask, pos = left_pad(PROMPTS, 0)
    monkeypatch.setattr(attention, "MAX_SCORES", 0)  # every call counts as long
    calls = []
    real_flash = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a: calls.append(1) or real_flash(*a))
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # the same kernel, key/value heads not repeated


@pytest.mark.parametrize("chunk", [2, 4])
def test_long_causal_attention_in_query_chunks_matches_eager(tiny_model_dir, monkeypatch, chunk):
    """Past MAX_SCORES, causal attention runs the flash kernel on query chunks that read only the keys up to their
    own positions: the same logits and gradients as eager attention, padding included."""
    model, _ = cpu_model(tiny_model_dir)
    model.requires_grad_(True)
    ids, mask, pos = left_pad(PROMPTS, 0)
    monkeypatch.setattr(attention, "MAX_SCORES", 0)
    monkeypatch.setattr(attention, "CHUNK_QUERIES", chunk)
    chunks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: chunks.append(q.shape[2]) or real_sdpa(q, *a, **kw))
    ours, g_ours = _run(model, ids, mask, pos)
    T, L = ids.shape[1], model.config.num_hidden_layers
    assert len(chunks) == L * -(-T // chunk) and max(chunks) <= chunk and sum(chunks) == L * T
    model.set_attn_implementation("eager")
    ref, g_ref = _run(model, ids, mask, pos)
    real = mask.bool()
    assert ours.isfinite().all()
    torch.testing.assert_close(ours[real], ref[real], rtol=1e-5, atol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_flash_attention_chunks_read_only_keys_up_to_each_chunk(monkeypatch):
    """Queries that are the last T of S positions (a continuation over a cache): chunk [a, e) reads keys
    [0, S - T + e); the result equals one masked flash call with repeated key/value heads, also for a mask that
    lets a query see a later key (not causal: one call over all keys)."""
    torch.manual_seed(0)
    B, H, K, T, S, D = 2, 6, 2, 7, 11, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, K, S, D), torch.randn(B, K, S, D)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool).tril(S - T)
    mask[1, :, :, :3] = False  # left padding in row 1
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                           attn_mask=mask, scale=0.3)
    bad = mask.clone()
    bad[0, 0, 0, S - 1] = True  # the first query sees the last key
    ref_bad = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=bad, scale=0.3)
    for chunk in (1, 3, 6, 7):
        monkeypatch.setattr(attention, "CHUNK_QUERIES", chunk)
        torch.testing.assert_close(attention.flash_attention(q, k, v, mask, 0.3), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(attention.flash_attention(q, k, v, bad, 0.3), ref_bad, rtol=1e-5, atol=1e-6)


def test_saved_model_does_not_name_it(tiny_model_dir, tmp_path):
    model, tok = cpu_model(tiny_model_dir)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert attention.NAME not in json.dumps(cfg)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation != attention.NAME


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_head_groups(heads, kv_heads):
    """Query head h reads key/value head h // (heads / kv_heads), as transformers' repeat_kv."""
    torch.manual_seed(0)
    B, T, S, D = 2, 3, 5, 8
    q, k, v = torch.randn(B, heads, T, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool).tril(S - T)
    mask[0, :, :, 0] = False
    module = torch.nn.Module()
    out, _ = attention.short_attention(module, q, k, v, mask, scaling=0.5)
    rep = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
