"""fused.py: same forward values as the Hugging Face modules, the same gradients, fewer kept activations."""

import torch

from opct.backends.cpu import norms as fused
from tests.conftest import cpu_model


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward pass while running fn() (each storage counted once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def run_both(module, x, params):
    """Output, kept bytes and gradients of the module's own forward and of the fused one, on the same input."""
    res = {}
    g = torch.randn(x.shape[:-1] + module(x).shape[-1:], generator=torch.Generator().manual_seed(1))
    for name in ("hf", "fused"):
        if name == "fused":
            assert fused.use(module) == 1
        xi = x.clone().requires_grad_(True)
        out, kept = saved_bytes(lambda: module(xi))
        grads = torch.autograd.grad((out * g).sum(), [xi, *params])
        res[name] = (out, kept, grads)
        if name == "fused":
            del module.forward
    return res["hf"], res["fused"]


def test_rms_norm_matches_hf_and_keeps_less(tiny_model_dir):
    model, _ = cpu_model(tiny_model_dir)
    norm = model.model.layers[0].input_layernorm
    del norm.forward  # the cpu backend patched it: start from Hugging Face's own
    norm.weight.requires_grad_(True)  # as in full fine-tuning, so the weight's gradient is checked too
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = torch.randn(3, 7, norm.weight.shape[0], generator=torch.Generator().manual_seed(0)) * 2
    (y0, kept0, g0), (y1, kept1, g1) = run_both(norm, x, [norm.weight])
    assert torch.equal(y0, y1)  # bit for bit
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert kept0 - kept1 == x.numel() * 4  # the normalised x (N x C floats) is no longer kept


def test_silu_mul_matches_hf_and_keeps_less(tiny_model_dir):
    model, _ = cpu_model(tiny_model_dir)
    mlp = model.model.layers[1].mlp
    del mlp.forward
    mlp.requires_grad_(True)
    x = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    params = list(mlp.parameters())
    (y0, kept0, g0), (y1, kept1, g1) = run_both(mlp, x, params)
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert kept0 - kept1 == 2 * 5 * model.config.intermediate_size * 4  # silu(gate) is no longer kept


def test_cpu_backend_patches_norms_and_mlps_and_leaves_no_grad_runs_alone(tiny_model_dir):
    model, _ = cpu_model(tiny_model_dir)
    layers = model.config.num_hidden_layers
    patched = [m for m in model.modules() if "forward" in vars(m)]
    assert len(patched) == 3 * layers + 1  # two norms and the MLP per layer, the final norm
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = model(input_ids=ids).logits
    for m in patched:
        del m.forward
    with torch.no_grad():
        assert torch.equal(out, model(input_ids=ids).logits)
