"""The lean decode path (decoder.py) against the Hugging Face forward it replaces while sampling."""

import weakref

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import lora_model
from opct.backends.cpu.decoder import LeanDecoder, unsupported_reason
from opct.models import load_model
from opct.data.chat import render_prompt
from opct.backends.sampling import SamplingSettings
from opct.backends.cpu.prefill import decode, prefill


def prompts(tok):
    qs = ("Hi", "What is the capital of France?", "Name a colour.")
    return [render_prompt(tok, [{"role": "user", "content": q}]) for q in qs]


def hf_and_lean_logits(model, tok, tokens_BT):
    """Logits of HF decode steps and of LeanDecoder steps, feeding the same tokens after the same prefill."""
    ps = prompts(tok)
    B, T = tokens_BT.shape
    with torch.no_grad():
        pre = prefill(model, ps, tok.pad_token_id)
        P = pre.mask_BL.shape[1]
        dec = LeanDecoder.build(model, B)
        assert dec is not None
        cache = dec.new_cache(B, P + T)
        for (k, v), layer in zip(cache, pre.cache.layers):
            k[:, :, :P], v[:, :, :P] = layer.keys, layer.values
        att = torch.zeros(B, 1, 1, P + T, dtype=torch.bool)
        att[:, 0, 0, :P] = pre.mask_BL.bool()
        hf_cache = DynamicCache(ddp_cache_data=[(lay.keys, lay.values) for lay in pre.cache.layers])
        mask_BL, pos_B, hf, lean = pre.mask_BL, pre.last_pos_B, [], []
        for t in range(T):
            pos_B = pos_B + 1
            mask_BL = torch.cat([mask_BL, torch.ones(B, 1, dtype=mask_BL.dtype)], 1)
            hf.append(model(input_ids=tokens_BT[:, t:t + 1], attention_mask=mask_BL, position_ids=pos_B[:, None],
                            past_key_values=hf_cache, use_cache=True).logits[:, -1])
            att[:, 0, 0, P + t] = True
            lean.append(dec.step(tokens_BT[:, t], pos_B, cache, P + t, att[..., :P + t + 1]))
    return torch.stack(hf, 1), torch.stack(lean, 1)


KINDS = ["onednn", "mkl", "dense"]


@pytest.fixture(params=KINDS)
def matmul_kind(request, monkeypatch):
    """Run a test once per decode matmul backend (packing() falls back where one is unavailable)."""
    from opct.backends.cpu import decoder

    decoder.configure(request.param)
    return request.param


def test_lean_logits_match_hf_with_lora_and_gqa(tiny_model_dir, matmul_kind):
    model, tok = lora_model(tiny_model_dir)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    tokens = torch.tensor([[100, 200, 300, 7], [5, 2, 9, 11], [42, 43, 44, 45]])
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert torch.allclose(hf, lean, atol=1e-4), (hf - lean).abs().max()
    # with the adapter disabled (the teacher) the decoder follows the base weights
    with model.disable_adapter():
        hf0, lean0 = hf_and_lean_logits(model, tok, tokens)
    assert torch.allclose(hf0, lean0, atol=1e-4)
    assert (hf0 - hf).abs().max() > 1e-2  # the adapter really changes the outputs


def test_lean_decode_samples_the_same_tokens_as_hf_decode(tiny_model_dir):
    model, tok = lora_model(tiny_model_dir)
    ps = prompts(tok)
    s = SamplingSettings(max_new_tokens=8, temperature=1.0)
    out = {}
    for lean in (True, False):
        with torch.no_grad():
            pre = prefill(model, ps, tok.pad_token_id)
            out[lean] = decode(model, pre, s, {tok.eos_token_id}, tok.pad_token_id, torch.Generator().manual_seed(5),
                               lean=lean)
    assert out[True] == out[False] and sum(map(len, out[True])) > 3


def test_packed_weights_follow_in_place_updates(tiny_model_dir, matmul_kind):
    """Full fine-tuning changes the base weights in place between rollouts: the cached packing must notice."""
    model, tok = load_model(str(tiny_model_dir))
    tokens = torch.tensor([[100, 200], [5, 2], [42, 43]])
    hf_and_lean_logits(model, tok, tokens)  # fills the packed-weight cache
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)  # an in-place update, as an optimizer step makes
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert torch.allclose(hf, lean, atol=1e-4)


def test_frozen_packed_weights_are_kept_across_rollouts_until_they_change(tiny_model_dir):
    """The LM head (always frozen) and, with the adapter disabled, the whole body keep their packed copy from one
    decoder to the next; with LoRA active the body is merged anew each time, and an in-place change of a frozen
    weight or another batch size forces a repack. Logits follow the HF model throughout."""
    model, tok = lora_model(tiny_model_dir)
    tokens = torch.tensor([[100, 200, 300], [5, 2, 9], [42, 43, 44]])
    d1, d2 = LeanDecoder.build(model, 3), LeanDecoder.build(model, 3)
    assert d1.head is d2.head and d1.layers[0]["qkv"] is not d2.layers[0]["qkv"]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-2.0)  # an optimizer step on the adapter
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert torch.allclose(hf, lean, atol=1e-4), (hf - lean).abs().max()
    with model.disable_adapter():
        e1, e2 = LeanDecoder.build(model, 3), LeanDecoder.build(model, 3)
        assert e1.layers[0]["qkv"] is e2.layers[0]["qkv"] and e1.head is d1.head
        with torch.no_grad():
            model.get_base_model().model.layers[0].mlp.down_proj.base_layer.weight.mul_(1.5)  # frozen, but changed
            model.get_base_model().lm_head.weight.mul_(0.5)
        e3 = LeanDecoder.build(model, 3)
        assert e3.layers[0]["qkv"] is not e1.layers[0]["qkv"] and e3.head is not e1.head
        hf, lean = hf_and_lean_logits(model, tok, tokens)
        assert torch.allclose(hf, lean, atol=1e-4), (hf - lean).abs().max()
        assert LeanDecoder.build(model, 2).head is not e3.head  # packed per batch size
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert torch.allclose(hf, lean, atol=1e-4), (hf - lean).abs().max()


def test_trainable_base_weights_are_packed_per_rollout(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    model.requires_grad_(True)  # full fine-tuning: a kept copy would be stale after every step
    assert LeanDecoder.build(model, 2).head is not LeanDecoder.build(model, 2).head


def test_unsupported_models_fall_back_to_hf(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).eval()
    assert unsupported_reason(gpt2) is not None and LeanDecoder.build(gpt2, 2) is None
    ids = [[1, 2, 3], [4, 5]]
    with torch.no_grad():
        out = decode(gpt2, prefill(gpt2, ids, 0), SamplingSettings(3, 0.0), set(), 0)
    assert [len(r) for r in out] == [3, 3]

    model, _ = load_model(str(tiny_model_dir))
    dora = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    assert "LoRA variant" in unsupported_reason(dora)


@pytest.mark.parametrize("batch", [1, 3])
def test_packed_linear_equals_f_linear_and_mkl_refuses_other_batch_sizes(tiny_model_dir, matmul_kind, batch):
    model, tok = load_model(str(tiny_model_dir))
    dec = LeanDecoder.build(model, batch)
    lin = dec.layers[0]["qkv"]
    if matmul_kind == "dense" or torch.backends.mkldnn.is_available():
        assert lin.kind == matmul_kind  # the setting is honoured where the backend exists
    a = model.model.layers[0].self_attn
    # the attention's 1/sqrt(head_dim) is folded into the q rows
    w = torch.cat([a.q_proj.weight * a.scaling, a.k_proj.weight, a.v_proj.weight])
    for rows in (batch, batch + 1):
        x = torch.randn(rows, model.config.hidden_size)
        if lin.kind == "mkl" and rows != batch:
            with pytest.raises(AssertionError):  # MKL's packing is only valid for the batch it was packed for
                lin(x)
        else:
            assert torch.allclose(lin(x), torch.nn.functional.linear(x, w), atol=1e-5)


def test_unknown_decode_matmul_is_an_error():
    from opct.backends.cpu import decoder

    with pytest.raises(ValueError, match="decode_matmul='fast'"):
        decoder.configure("fast")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_body_is_merged_in_place_into_kept_packed_weights(tmp_path, dtype):
    """Where oneDNN packs weights as blocks of whole rows (gemm.block_rows) and every projection fills whole blocks
    (hidden 128: q 128 rows, k/v 64), a LoRA decoder writes W + s B A straight into packed buffers that are kept
    across rollouts: the next decoder reuses them once the previous one is gone, a decoder still alive keeps its
    own, and logits follow the HF model through adapter updates (to bfloat16 rounding with decode_dtype bfloat16,
    whose buffers are bfloat16 in their own layout)."""
    from opct.backends.cpu import decoder, gemm

    from tests.conftest import make_tiny_model

    torch_dtype = getattr(torch, dtype)
    if not gemm.onednn_works(torch_dtype):
        pytest.skip(f"oneDNN cannot run {dtype} products on this CPU")
    if gemm.block_rows(256, 128, 3, torch_dtype) is None:
        pytest.skip("oneDNN's packed layout here is not whole row blocks")
    model, tok = lora_model(make_tiny_model(tmp_path / "m128", hidden=128))
    decoder.configure("onednn", dtype)
    # fp32: rounding only; bfloat16: weights rounded to 8 bits, through two layers of this large-weight random model
    close = lambda a, b: (a - b).abs().max() < (1e-4 if dtype == "float32" else 0.06 * a.abs().max())  # noqa: E731
    tokens = torch.tensor([[100, 200, 300], [5, 2, 9], [42, 43, 44]])
    d1 = LeanDecoder.build(model, 3)
    kept = d1.layers[0]["qkv"].packed
    d2 = LeanDecoder.build(model, 3)  # d1 is alive: d2 must not write into d1's buffers
    assert d2.layers[0]["qkv"].packed is not kept
    del d1, d2
    d3 = LeanDecoder.build(model, 3)
    assert d3.layers[0]["qkv"].packed is kept and d3.layers[1]["down"].kind == "onednn"
    assert d3.layers[0]["qkv"].dtype == torch_dtype
    del d3
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert close(hf, lean), (hf - lean).abs().max()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(-1.5)  # an optimizer step on the adapter: the kept buffers are rewritten, not stale
    hf2, lean2 = hf_and_lean_logits(model, tok, tokens)
    assert close(hf2, lean2), (hf2 - lean2).abs().max()
    assert (hf2 - hf).abs().max() > 4 * (hf2 - lean2).abs().max()
    # the packed merged weights are W + s B A (rounded to bfloat16 there: the product of the rounded factors)
    dec = LeanDecoder.build(model, 3)
    a = model.get_base_model().model.layers[1].mlp
    w = torch.cat([a.gate_proj.get_delta_weight("default") + a.gate_proj.base_layer.weight,
                   a.up_proj.get_delta_weight("default") + a.up_proj.base_layer.weight])
    x = torch.randn(3, 128)
    want = x.to(torch_dtype).float() @ w.to(torch_dtype).float().T
    assert torch.allclose(dec.layers[1]["gate_up"](x), want, atol=1e-5 if dtype == "float32" else 0.05)


def test_bf16_decode_follows_the_lora_model_to_bf16_rounding(tiny_model_dir):
    """decode_dtype=bfloat16: the body (LoRA merged in fp32) and the head are rounded to bfloat16; logits stay float32
    and follow the HF model to bfloat16 rounding, adapter included."""
    from opct.backends.cpu import decoder

    model, tok = lora_model(tiny_model_dir)
    decoder.configure("onednn", "bfloat16")  # after lora_model, whose backend setup applies the default
    tokens = torch.tensor([[100, 200, 300, 7], [5, 2, 9, 11], [42, 43, 44, 45]])
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert lean.dtype == torch.float32
    err = (hf - lean).abs().max()
    assert 1e-4 < err < 0.05 * hf.abs().max(), err  # rounded (not fp32-exact), yet close
    with model.disable_adapter():
        hf0, _ = hf_and_lean_logits(model, tok, tokens)
    assert (hf0 - hf).abs().max() > 5 * err  # the adapter's effect is well above the rounding
    dec = LeanDecoder.build(model, 3)
    assert dec.head.dtype == torch.bfloat16 and dec.layers[0]["qkv"].dtype == torch.bfloat16


@pytest.mark.parametrize("bf16_onednn", [True, False])
def test_bf16_decode_takes_plain_products_where_onednn_cannot_run_bfloat16(tiny_model_dir, monkeypatch, bf16_onednn):
    """On a CPU without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT oneDNN cannot pack bfloat16 weights (it raised there
    before): decode_dtype=bfloat16 then takes plain bfloat16 products, with the same logits to bfloat16 rounding."""
    from opct.backends.cpu import decoder, gemm

    if bf16_onednn and not gemm.onednn_works(torch.bfloat16):
        pytest.skip("oneDNN cannot run bfloat16 products on this CPU")
    works = gemm.onednn_works
    monkeypatch.setattr(gemm, "onednn_works", lambda dtype=torch.float32: works(dtype) and
                        (bf16_onednn or dtype == torch.float32))
    model, tok = lora_model(tiny_model_dir)
    decoder.configure("onednn", "bfloat16")
    tokens = torch.tensor([[100, 200, 300, 7], [5, 2, 9, 11], [42, 43, 44, 45]])
    hf, lean = hf_and_lean_logits(model, tok, tokens)
    assert (hf - lean).abs().max() < 0.05 * hf.abs().max()
    dec = LeanDecoder.build(model, 3)
    assert dec.layers[0]["qkv"].kind == ("onednn" if bf16_onednn else "dense")


def test_bf16_decode_samples_valid_responses_and_float32_is_unchanged(tiny_model_dir):
    """Sampling through the bfloat16 decoder is seeded and reproducible; switching back to float32 decodes exactly as
    before (the kept float32 copies are not confused with the bfloat16 ones)."""
    from opct.backends.cpu import decoder

    model, tok = lora_model(tiny_model_dir)
    ps = prompts(tok)
    s = SamplingSettings(max_new_tokens=8, temperature=1.0)

    def sample(seed):
        with torch.no_grad():
            pre = prefill(model, ps, tok.pad_token_id)
            return decode(model, pre, s, {tok.eos_token_id}, tok.pad_token_id, torch.Generator().manual_seed(seed))

    fp32 = sample(5)
    decoder.configure("onednn", "bfloat16")
    bf16 = [sample(5), sample(5)]
    decoder.configure("onednn", "float32")
    assert bf16[0] == bf16[1] and all(0 < len(r) <= 8 for r in bf16[0])
    assert all(0 <= t < model.config.vocab_size for r in bf16[0] for t in r)
    assert sample(5) == fp32


def test_unknown_decode_dtype_is_an_error():
    from opct.backends.cpu import decoder

    with pytest.raises(ValueError, match="decode_dtype='float16'"):
        decoder.configure("onednn", "float16")


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages (kB) of the mapping in /proc/self/smaps that holds `addr`."""
    inside, kb = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb


def test_collapse_to_huge_pages_keeps_contents_and_needs_a_whole_huge_page():
    from opct.backends.cpu import process

    small = torch.arange(1000.0)
    assert process.collapse_to_huge_pages(small.data_ptr(), 4000) is False  # holds no whole 2 MB page
    big = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MB
    want = big.clone()
    ok = process.collapse_to_huge_pages(big.data_ptr(), big.numel() * 4)
    assert torch.equal(big, want)
    if ok:  # Linux 6.1+ that allows it: the range now sits on 2 MB pages
        assert _anon_huge_kb(big.data_ptr()) >= 2048


def test_only_kept_packed_weights_go_to_huge_pages_once(tiny_model_dir, monkeypatch):
    """decode_huge_pages: a kept copy (the head; the whole body with the adapter disabled) is moved onto huge pages
    when it is made, and not again when a later decoder reuses it; a LoRA body packed afresh for one rollout is not
    (it would pay the copy every rollout); with the setting off, nothing is."""
    from opct.backends.cpu import decoder, gemm, process

    model, tok = lora_model(tiny_model_dir)
    calls = []
    monkeypatch.setattr(process, "collapse_to_huge_pages", lambda addr, n: calls.append((addr, n)) or True)
    monkeypatch.setattr(gemm, "_KEPT", weakref.WeakKeyDictionary())
    decoder.configure("onednn", "float32", huge_pages=True)
    d1 = LeanDecoder.build(model, 3)
    if d1.head.kind != "onednn" or "decode_merged" in gemm._KEPT.get(d1.body, {}):
        pytest.skip("needs oneDNN packing, and a tiny model whose LoRA body is not merged into kept buffers")
    assert calls == [(torch.ops.mkldnn.data_ptr(d1.head.packed), torch.ops.mkldnn._nbytes(d1.head.packed))]
    LeanDecoder.build(model, 3)
    assert len(calls) == 1  # the head reused; the LoRA body packed afresh, not moved
    with model.disable_adapter():
        LeanDecoder.build(model, 3)
        n_linears = 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down a layer
        assert len(calls) == 1 + n_linears
        LeanDecoder.build(model, 3)
        assert len(calls) == 1 + n_linears
    decoder.configure("onednn", "float32", huge_pages=False)
    gemm._KEPT.clear()
    LeanDecoder.build(model, 3)
    assert len(calls) == 1 + n_linears


def test_a_kept_head_on_huge_pages_decodes_as_before(tiny_model_dir):
    """With the real call: the kept head (49,152 x 32 fp32, 6 MB) lands on 2 MB pages where the kernel allows it, and
    logits still follow the HF model."""
    from opct.backends.cpu import decoder, gemm

    model, tok = lora_model(tiny_model_dir)
    gemm._KEPT.clear()
    decoder.configure("onednn", "float32", huge_pages=True)
    dec = LeanDecoder.build(model, 3)
    if dec.head.kind == "onednn":
        from opct.backends.cpu import process

        probe = torch.ones(3 * 2**20)  # written: the call collapses populated pages only
        if process.collapse_to_huge_pages(probe.data_ptr(), probe.numel() * 4):  # the kernel allows it here
            assert _anon_huge_kb(torch.ops.mkldnn.data_ptr(dec.head.packed)) >= 2048
    hf, lean = hf_and_lean_logits(model, tok, torch.tensor([[100, 200, 300], [5, 2, 9], [42, 43, 44]]))
    assert torch.allclose(hf, lean, atol=1e-4), (hf - lean).abs().max()
