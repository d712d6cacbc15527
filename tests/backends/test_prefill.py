import pytest
import torch

from tests.conftest import lora_model
from opct.models import load_model
from opct.data.chat import render_prompt
from tests.conftest import response_logits, sample
from opct.backends.batching import build_batch
from opct.backends.sampling import SamplingSettings, next_token


def prompts(tok):
    return [render_prompt(tok, [{"role": "user", "content": q}]) for q in ("Hi", "What is the capital of France?")]


def test_batched_left_padded_scoring_equals_unbatched(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    ps = prompts(tok)
    rs = [[100, 200, 300], [5, 2]]
    together = response_logits(model, build_batch(ps, rs, tok.pad_token_id))
    for i in range(2):
        alone = response_logits(model, build_batch([ps[i]], [rs[i]], tok.pad_token_id))
        n = len(rs[i])
        assert torch.allclose(together[i, :n], alone[0, :n], atol=1e-4)


def test_greedy_sampling_matches_hf_generate(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    p = prompts(tok)[1]
    ours = sample(model, [p], SamplingSettings(max_new_tokens=8, temperature=0), {tok.eos_token_id}, tok.pad_token_id)[0]
    hf = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
    assert ours == hf[:len(ours)] and len(ours) > 0


def test_sampling_is_seeded_and_batched_rows_are_independent_of_padding(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    ps = prompts(tok)
    s = SamplingSettings(max_new_tokens=6, temperature=1.0)
    a = sample(model, ps, s, {tok.eos_token_id}, tok.pad_token_id, torch.Generator().manual_seed(3))
    b = sample(model, ps, s, {tok.eos_token_id}, tok.pad_token_id, torch.Generator().manual_seed(3))
    assert a == b and all(1 <= len(r) <= 6 for r in a)
    greedy = SamplingSettings(max_new_tokens=6, temperature=0)
    batched = sample(model, ps, greedy, {tok.eos_token_id}, tok.pad_token_id)
    alone = [sample(model, [p], greedy, {tok.eos_token_id}, tok.pad_token_id)[0] for p in ps]
    assert batched == alone


def test_stops_at_eos_and_keeps_it(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    p = prompts(tok)[0]
    first = sample(model, [p], SamplingSettings(max_new_tokens=1, temperature=0), set(), tok.pad_token_id)[0][0]
    out = sample(model, [p], SamplingSettings(max_new_tokens=5, temperature=0), {first}, tok.pad_token_id)[0]
    assert out == [first]  # the EOS token is the last token of the response


@pytest.mark.parametrize("lean", [True, False])
def test_n_tokens_take_n_minus_one_forward_passes_after_the_prefill(tiny_model_dir, monkeypatch, lean):
    """The prefill's last position gives the first token; the last sampled token needs no forward pass."""
    from opct.backends.cpu.decoder import LeanDecoder
    from opct.backends.cpu.prefill import decode, prefill

    model, tok = load_model(str(tiny_model_dir))
    model.eval()
    calls = []
    if lean:
        step = LeanDecoder.step
        monkeypatch.setattr(LeanDecoder, "step", lambda self, *a: calls.append(1) or step(self, *a))
    else:
        monkeypatch.setattr(model, "forward", lambda *a, _f=model.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.no_grad():
        out = decode(model, prefill(model, prompts(tok), tok.pad_token_id), SamplingSettings(5, temperature=1.0),
                     set(), tok.pad_token_id, torch.Generator().manual_seed(0), lean=lean)
    assert [len(r) for r in out] == [5, 5] and len(calls) == 4


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    k1 = next_token(logits, SamplingSettings(temperature=1.0, top_k=1), g)
    assert set(k1.tolist()) == {0}
    p = next_token(logits, SamplingSettings(temperature=1.0, top_p=0.8), g)
    assert set(p.tolist()) == {0, 1}  # softmax = .665, .245, .09, ...: the 0.8 nucleus is {0, 1}
    full = next_token(logits, SamplingSettings(temperature=1.0), g)
    assert {0, 1, 2} <= set(full.tolist())


def test_sampling_frequencies_match_the_softmax():
    """Inverse-CDF sampling: each row's draws follow its own softmax; zero-probability tokens never come up."""
    logits_BV = torch.tensor([[2.0, 1.0, 0.0, float("-inf"), -1.0], [float("-inf"), 0.0, 0.0, 0.0, float("-inf")]])
    g = torch.Generator().manual_seed(1)
    n = 20000
    draws_NB = torch.stack([next_token(logits_BV, SamplingSettings(temperature=1.0), g) for _ in range(n)])
    for b in range(2):
        freq_V = torch.bincount(draws_NB[:, b], minlength=5).double() / n
        want_V = logits_BV[b].double().softmax(-1)
        assert freq_V[want_V == 0].sum() == 0
        assert torch.allclose(freq_V, want_V, atol=4 * (0.25 / n) ** 0.5), (freq_V, want_V)  # 4 sigma at p=0.5
    # temperature sharpens: at T=0.5 token 0's share rises from .64 to .86
    sharp = torch.stack([next_token(logits_BV[:1], SamplingSettings(temperature=0.5), g) for _ in range(4000)])
    assert (sharp == 0).double().mean().item() == pytest.approx(0.86, abs=0.03)


def test_response_forward_on_prefill_cache_equals_full_forward_with_gradients(tiny_model_dir):
    from opct.backends.cpu.prefill import prefill
    from tests.conftest import response_logits_after_prefill

    model, tok = lora_model(tiny_model_dir, std=0.1)
    ps = prompts(tok)
    rs = [[100, 200, 300, 2], [5, 2]]
    full = response_logits(model, build_batch(ps, rs, tok.pad_token_id))
    g_full = torch.autograd.grad(full[0, :4].sum() + full[1, :2].sum(), [p for p in model.parameters() if p.requires_grad])
    fused = response_logits_after_prefill(model, prefill(model, ps, tok.pad_token_id), rs, tok.pad_token_id)
    g_fused = torch.autograd.grad(fused[0, :4].sum() + fused[1, :2].sum(), [p for p in model.parameters() if p.requires_grad])
    assert torch.allclose(full[0, :4], fused[0, :4], atol=1e-4) and torch.allclose(full[1, :2], fused[1, :2], atol=1e-4)
    for a, b in zip(g_full, g_fused):
        assert (a - b).norm() <= 1e-5 * a.norm()


def test_shared_prefix_prefill_equals_full_prefill(tiny_model_dir):
    from opct.backends.batching import common_prefix
    from opct.backends.cpu.prefill import prefill

    model, tok = load_model(str(tiny_model_dir))
    ps = prompts(tok)
    assert common_prefix(ps) >= 8  # the chat template's system prompt
    with torch.no_grad():
        shared = prefill(model, ps, tok.pad_token_id)
        full = prefill(model, ps, tok.pad_token_id, min_shared=10_000)
    # the shared layout is [prefix | pads | suffix] for every row; the full one is [pads | prompt]
    assert bool(shared.mask_BL[:, 0].all()) and not bool(full.mask_BL[:, 0].all())
    assert torch.allclose(shared.last_hidden_BH, full.last_hidden_BH, atol=1e-4)
    assert torch.equal(shared.last_pos_B, full.last_pos_B)
    s = SamplingSettings(max_new_tokens=6, temperature=0)
    with torch.no_grad():
        from opct.backends.cpu.prefill import decode
        assert decode(model, shared, s, set(), tok.pad_token_id) == decode(model, full, s, set(), tok.pad_token_id)


@pytest.mark.parametrize("min_shared", [8, 10_000])  # with the shared prefix run once, and without
def test_prompts_in_length_groups_give_the_one_batch_prefill_and_its_gradients(tiny_model_dir, monkeypatch, min_shared):
    import importlib

    from opct.backends.cpu.prefill import decode, prefill
    from tests.conftest import response_logits_after_prefill

    prefill_module = importlib.import_module("opct.backends.cpu.prefill")
    model, tok = lora_model(tiny_model_dir, std=0.1)
    qs = ("Hi", "What is the capital of France?", "Name a colour.", "Why is the sky blue on a clear day, and why "
          "is it red at sunset?")
    ps = [render_prompt(tok, [{"role": "user", "content": q}]) for q in qs]
    rs = [[100, 200, 300, 2], [5, 2], [7, 8, 9], [11]]
    runs = []
    grouping = prefill_module.length_groups
    monkeypatch.setattr(prefill_module, "length_groups", lambda *a: runs.append(grouping(*a)) or runs[-1])
    params = [p for p in model.parameters() if p.requires_grad]
    outs = {}
    for cost in (None, 0):  # one padded batch; a group per distinct length (no cost per group)
        pre = prefill(model, ps, tok.pad_token_id, min_shared=min_shared, group_cost=cost)
        kv = [(lay.keys.detach().clone(), lay.values.detach().clone()) for lay in pre.cache.layers]
        with torch.no_grad():
            tokens = decode(model, pre, SamplingSettings(max_new_tokens=6, temperature=0), set(), tok.pad_token_id)
        logits = response_logits_after_prefill(model, pre, rs, tok.pad_token_id)  # (appends to pre.cache)
        loss = sum(logits[i, :len(r)].sum() for i, r in enumerate(rs))
        outs[cost] = (pre, kv, logits, torch.autograd.grad(loss, params), tokens)
    assert [len(g) for g in runs] == [4]  # only the grouped prefill asked, and got one group per prompt length
    (one, kv_one, l_one, g_one, t_one), (grp, kv_grp, l_grp, g_grp, t_grp) = outs[None], outs[0]
    assert torch.equal(one.mask_BL, grp.mask_BL) and torch.equal(one.last_pos_B, grp.last_pos_B)
    assert torch.allclose(one.last_hidden_BH, grp.last_hidden_BH, atol=1e-5)
    real = one.mask_BL.bool()  # [B, L]: the cached positions that are not padding
    for a, b in zip(kv_one, kv_grp):
        for x, y in zip(a, b):
            assert x.shape == y.shape
            assert torch.allclose(x.transpose(1, 2)[real], y.transpose(1, 2)[real], atol=1e-5)
    for i, r in enumerate(rs):
        assert torch.allclose(l_one[i, :len(r)], l_grp[i, :len(r)], atol=1e-4)
    for a, b in zip(g_one, g_grp):
        assert (a - b).norm() <= 1e-5 * a.norm()
    assert t_one == t_grp


def test_prefix_cache_reuses_the_shared_prefix_only_without_grad_and_for_the_same_tokens(tiny_model_dir):
    from opct.backends.batching import common_prefix
    from opct.backends.cpu.prefill import prefill

    model, tok = load_model(str(tiny_model_dir))
    ps = prompts(tok)
    k = common_prefix(ps)
    cache = {}
    with torch.no_grad():
        plain = prefill(model, ps, tok.pad_token_id)
        first = prefill(model, ps, tok.pad_token_id, prefix_cache=cache)
        kv = cache["kv"]
        again = prefill(model, ps[::-1], tok.pad_token_id, prefix_cache=cache)  # other rows, same prefix: reused
        assert cache["kv"] is kv and len(cache["ids"]) == min(k, min(map(len, ps)) - 1)
        plain_again = prefill(model, ps[::-1], tok.pad_token_id)
    # bit for bit the uncached computation, first and on reuse
    assert torch.equal(first.last_hidden_BH, plain.last_hidden_BH)
    assert torch.equal(again.last_hidden_BH, plain_again.last_hidden_BH)
    other = [[7, 7] + p for p in ps]  # another shared prefix replaces the kept one
    with torch.no_grad():
        prefill(model, other, tok.pad_token_id, prefix_cache=cache)
    assert cache["ids"][:2] == (7, 7) and cache["kv"] is not kv
    kept = dict(cache)
    prefill(model, ps, tok.pad_token_id, prefix_cache=cache)  # under grad: neither read nor written
    assert cache == kept


def test_response_logprobs_from_hidden_equal_full_logits(tiny_model_dir):
    from opct.algo.losses import token_logprobs
    from opct.backends.hf import response_hidden
    from opct.backends.cpu.logprobs import response_logprobs

    model, tok = load_model(str(tiny_model_dir))
    b = build_batch(prompts(tok), [[100, 200, 300, 2], [5, 2]], tok.pad_token_id)
    h_BTH = response_hidden(model, b)
    got = response_logprobs(model, h_BTH, b.response_BT)
    want = token_logprobs(response_logits(model, b), b.response_BT)
    assert got.shape == want.shape == (2, 4) and torch.allclose(got, want, atol=1e-5)


def test_prefill_runs_the_last_layer_in_full_only_for_the_last_position(tiny_model_dir):
    """`last_layer_keys_only`: the last layer's query projection sees one row per prompt, while the cache, the last
    hidden state and the gradients are those of running every position through every layer."""
    from opct.backends.cpu.prefill import _prefill, prefill

    model, tok = lora_model(tiny_model_dir, std=0.1)
    ps = prompts(tok)
    rows = []
    q_last = model.get_base_model().model.layers[-1].self_attn.q_proj
    hook = q_last.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    params = [p for p in model.parameters() if p.requires_grad]
    w_H = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, fn in (("keys_only", prefill), ("full", _prefill)):
        rows.clear()
        pre = fn(model, ps, tok.pad_token_id, 8, None)
        # (a weighted sum: the plain sum of squares of a normalised state has next to no gradient)
        loss = (pre.last_hidden_BH @ w_H).sum() + sum(lay.keys.sum() + lay.values.square().sum()
                                                      for lay in pre.cache.layers)
        outs[name] = (pre, torch.autograd.grad(loss, params), list(rows))
    hook.remove()
    (pre, grads, q_rows), (ref, ref_grads, ref_rows) = outs["keys_only"], outs["full"]
    assert q_rows == [1, len(ps)] and ref_rows[1] > len(ps)  # shared prefix (batch 1), then the suffixes
    assert torch.allclose(pre.last_hidden_BH, ref.last_hidden_BH, atol=1e-5)
    for a, b in zip(pre.cache.layers, ref.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        assert (a - b).norm() <= 1e-5 * b.norm()
    assert "forward" not in vars(model.get_base_model().model.layers[-1])  # the patch is undone


def test_length_groups_minimise_padded_tokens_plus_a_cost_per_group():
    from opct.backends.cpu.prefill import length_groups

    lengths = [127, 9, 126, 12, 10, 127, 64, 4]
    # one group costs 8 x 127 + 32 = 1048 token rows; these three cost 4x12 + 3x127 + 64 + 3 x 32 = 589
    assert length_groups(lengths, 32) == [[7, 1, 4, 3], [6], [2, 0, 5]]
    assert length_groups(lengths, 0) == [[7], [1], [4], [3], [6], [2], [0, 5]]  # every distinct length alone
    assert length_groups(lengths, 10_000) == [list(range(8))]  # one group: the rows in their own order
    assert length_groups([5, 5, 5], 0) == [[0, 1, 2]]


def test_grouped_response_forward_equals_the_padded_one_with_gradients(tiny_model_dir):
    """Rows run in length groups on their slices of the prompt cache: the same hidden states at every real position
    (zeros past each response) and the same gradients into the adapter through the cache."""
    from opct.backends.cpu.prefill import prefill, response_hidden_after_prefill

    model, tok = lora_model(tiny_model_dir, std=0.1)
    ps = prompts(tok) + [render_prompt(tok, [{"role": "user", "content": "Name three colours, please."}])]
    rs = [[100, 200, 300, 400, 500, 2], [5, 2], [7, 8, 9, 10, 11, 12, 13, 14]]
    params = [p for p in model.parameters() if p.requires_grad]
    w_H = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    out = {}
    for cost in (None, 0):
        h_BTH = response_hidden_after_prefill(model, prefill(model, ps, tok.pad_token_id), rs, tok.pad_token_id, cost)
        real = sum((h_BTH[i, :len(r)] @ w_H).sum() for i, r in enumerate(rs))
        out[cost] = (h_BTH.detach(), torch.autograd.grad(real, params))
    (padded, g_padded), (grouped, g_grouped) = out[None], out[0]
    assert padded.shape == grouped.shape == (3, 8, model.config.hidden_size)
    for i, r in enumerate(rs):
        assert torch.allclose(padded[i, :len(r)], grouped[i, :len(r)], atol=1e-5)
        assert not grouped[i, len(r):].any()
    for a, b in zip(g_padded, g_grouped):
        assert (a - b).norm() <= 1e-5 * a.norm()


def test_response_logprobs_on_real_tokens_only_equal_the_padded_ones(tiny_model_dir):
    from opct.backends.cpu.logprobs import response_logprobs
    from opct.backends.hf import response_hidden

    model, tok = lora_model(tiny_model_dir, std=0.1)
    b = build_batch(prompts(tok), [[100, 200, 300, 2], [5, 2]], tok.pad_token_id)
    params = [p for p in model.parameters() if p.requires_grad]
    got = {}
    for mask in (None, b.mask_BT):
        logp_BT = response_logprobs(model, response_hidden(model, b), b.response_BT, mask) * b.mask_BT
        got[mask is None] = (logp_BT.detach(), torch.autograd.grad(logp_BT.sum(), params))
    (all_rows, g_all), (real_only, g_real) = got[True], got[False]
    assert torch.equal(real_only[1, 2:], torch.zeros(2)) and torch.allclose(all_rows, real_only, atol=1e-6)
    for a, c in zip(g_all, g_real):
        assert (a - c).norm() <= 1e-5 * a.norm()
