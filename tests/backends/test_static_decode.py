"""Static-cache decoding (backends/static_decode.py): on the CPU its eager step gives the hf backend's dynamic-cache
logits and tokens; on a GPU (tests marked gpu) the replayed CUDA graph gives the same as the launch-by-launch decode."""

from types import SimpleNamespace

import pytest
import torch

from opct.backends import make_policy, static_decode
from opct.backends.batching import left_pad
from opct.backends.sampling import SamplingSettings, decode_loop
from opct.config import TrainConfig

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = [[1, 17, 300, 41, 9], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 77, 78]]  # left-padded to 9: 0, 4 and 6 pads
FED_NT = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]])


def lora_model(model_dir, device):
    from opct.models import add_lora, load_model

    model, tok = load_model(str(model_dir), device=device, dtype=torch.float32)
    model = add_lora(model, 4, 8.0)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    return model.eval(), tok


def forced_loop(record: list):
    """A decode_loop that feeds FED_NT instead of sampling and records every logits_NV it is given."""
    def loop(first_NV, step, settings, eos_ids, pad_id, gen):
        record.append(first_NV.float().cpu().clone())
        for i in range(FED_NT.shape[1]):
            record.append(step(FED_NT[:, i].to(first_NV.device), i).float().cpu().clone())
        return [[] for _ in range(first_NV.shape[0])]
    return loop


def policy_logits(policy, monkeypatch) -> torch.Tensor:
    """logits_NTV the policy's own decode produces when fed FED_NT (its _generate with a forced loop)."""
    record = []
    monkeypatch.setattr("opct.backends.hf.decode_loop", forced_loop(record))
    policy.sample(PROMPTS, SamplingSettings(max_new_tokens=FED_NT.shape[1] + 1), torch.Generator().manual_seed(0))
    monkeypatch.undo()
    return torch.stack(record, 1)


def test_eager_static_step_gives_the_dynamic_cache_logits_and_tokens(tiny_model_dir, monkeypatch):
    model, tok = lora_model(tiny_model_dir, "cpu")
    policy = make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy", cuda_graphs=False))
    want_NTV = policy_logits(policy, monkeypatch)

    ids_NL, mask_NL, pos_NL = left_pad(PROMPTS, tok.pad_token_id)
    settings = SamplingSettings(max_new_tokens=FED_NT.shape[1] + 1)
    with torch.no_grad():
        first_NV, step = static_decode.prefill(model, model.config, ids_NL, mask_NL, pos_NL, settings.max_new_tokens,
                                               torch.float32, graphs=True)  # no CUDA here: runs eagerly
        record = []
        forced_loop(record)(first_NV, step, settings, set(), tok.pad_token_id, None)
    got_NTV = torch.stack(record, 1)
    assert got_NTV.shape == want_NTV.shape == (3, 5, model.config.vocab_size)
    # float rounding only: the two caches' attention sums in another order (up to 1.4e-5 measured on an Intel Xeon
    # after the cpu backend's tests ran; 5e-6 alone)
    assert torch.allclose(got_NTV, want_NTV, atol=1e-4, rtol=1e-5)

    greedy = SamplingSettings(max_new_tokens=6, temperature=0.0)
    want = policy.sample(PROMPTS, greedy, None).responses
    with torch.no_grad():
        first_NV, step = static_decode.prefill(model, model.config, ids_NL, mask_NL, pos_NL, 6, torch.float32, False)
        got = decode_loop(first_NV, step, greedy, {tok.eos_token_id}, tok.pad_token_id, None)
    assert got == want and all(len(r) == 6 for r in got)


def test_models_it_cannot_decode_are_named():
    def fake(impl, layer_types=None):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl, layer_types=layer_types))

    assert static_decode.unsupported_reason(fake("sdpa", ["full_attention"] * 2)) is None
    assert static_decode.unsupported_reason(fake("eager")) is None
    assert "sliding" in static_decode.unsupported_reason(fake("sdpa", ["full_attention", "sliding_attention"]))
    assert "flash_attention_2" in static_decode.unsupported_reason(fake("flash_attention_2"))


def test_the_setting_reaches_the_hf_policy(tiny_model_dir):
    model, tok = lora_model(tiny_model_dir, "cpu")

    def policy(**kw):
        return make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy", **kw))

    assert policy().cuda_graphs is True  # the default
    assert policy(cuda_graphs=False).cuda_graphs is False


@gpu
@pytest.mark.gpu
def test_cuda_graph_decode_gives_the_launch_by_launch_logits_and_tokens(tiny_model_dir, monkeypatch):
    model, tok = lora_model(tiny_model_dir, "cuda")
    graphs = make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy", cuda_graphs=True))
    plain = make_policy("hf", model, tok, {tok.eos_token_id}, TrainConfig(sampler="policy", cuda_graphs=False))
    assert graphs.cuda_graphs
    want_NTV = policy_logits(plain, monkeypatch)
    for _ in range(2):  # a second call captures a graph of its own
        assert torch.allclose(policy_logits(graphs, monkeypatch), want_NTV, atol=1e-4, rtol=1e-4)
    greedy = SamplingSettings(max_new_tokens=8, temperature=0.0)
    assert graphs.sample(PROMPTS, greedy, None).responses == plain.sample(PROMPTS, greedy, None).responses
    # Weights changed between calls (an optimizer step) reach the next call's graph.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.0)
    assert torch.allclose(policy_logits(graphs, monkeypatch), policy_logits(plain, monkeypatch), atol=1e-4, rtol=1e-4)


def test_prefill_mask_leaves_no_row_fully_masked(tiny_model_dir):
    """Real positions see exactly their row's earlier real positions; a pad position sees only itself, so no row of
    the mask is all minimum (a fully masked softmax can give NaN in float16, and NaN keys at pad positions would
    reach the real rows)."""
    from opct.models import load_model

    model, tok = load_model(str(tiny_model_dir), device="cpu", dtype=torch.float16)
    seen = []

    def lm(**kw):
        seen.append(kw["attention_mask"])
        return model(**kw)

    ids_NL, mask_NL, pos_NL = left_pad(PROMPTS, tok.pad_token_id)
    with torch.no_grad():
        first_NV, _ = static_decode.prefill(lm, model.config, ids_NL, mask_NL, pos_NL, 3, torch.float16, False)
    open_NLS = seen[0][:, 0] == 0
    N, L = ids_NL.shape
    assert open_NLS.shape == (N, L, L + 3) and open_NLS.any(-1).all()
    real_NL = mask_NL.bool()
    q, k = torch.arange(L)[:, None], torch.arange(L + 3)[None, :]
    want_NLS = (k <= q)[None] & torch.cat([real_NL, torch.zeros(N, 3, dtype=torch.bool)], 1)[:, None, :]
    want_NLS |= (~real_NL)[:, :, None] & (k == q)[None]
    assert torch.equal(open_NLS, want_NLS) and torch.isfinite(first_NV).all()
