import gc
import weakref

import pytest
import torch

from opct.backends.cpu.lora import speed_up
from opct.models import add_lora, load_model


def _grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids).logits
    out.pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_linear_equals_peft(tiny_model_dir, dropout):
    torch.manual_seed(0)
    model, _ = load_model(str(tiny_model_dir))
    model = add_lora(model, 4, 8.0, dropout=dropout)
    speed_up(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.eval()  # dropout inactive but present: its layers must still take PEFT's path (checked below)
    ids = torch.randint(3, 100, (2, 9))
    fast_y, fast_g = _grads(model, ids)
    from peft.tuners.lora.layer import Linear
    layers = [m for m in model.modules() if type(m) is Linear]
    assert layers and all("forward" in vars(m) for m in layers)
    for m in layers:
        del m.forward  # back to PEFT's class forward
    peft_y, peft_g = _grads(model, ids)
    assert torch.allclose(fast_y, peft_y, atol=1e-5)
    assert fast_g.keys() == peft_g.keys() and len(fast_g) == 2 * len(layers)
    for n in fast_g:
        assert (fast_g[n] - peft_g[n]).norm() <= 1e-5 * peft_g[n].norm() + 1e-8, n
    assert speed_up(model) == len(layers)


def test_disabled_adapters_give_the_base_model_and_a_fresh_adapter_changes_nothing(tiny_model_dir):
    base, _ = load_model(str(tiny_model_dir))
    ids = torch.randint(3, 100, (1, 7))
    with torch.no_grad():
        want = base(input_ids=ids).logits
    model = add_lora(base, 4, 8.0)
    with torch.no_grad():
        fresh = model(input_ids=ids).logits  # B = 0: the student before its first update
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
        with model.disable_adapter():
            got = model(input_ids=ids).logits
        lora = model(input_ids=ids).logits
    # The teacher's linears run through gemm (oneDNN), the plain model's through torch.matmul: rounding apart, equal.
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(lora, want, atol=1e-3)
    # A fresh student and its teacher compute the same products: bit for bit equal, so identical prompts give KL 0.
    assert torch.equal(fresh, got)


def test_gemm_matches_torch_and_can_be_switched_off(monkeypatch):
    from opct.backends.cpu import gemm

    torch.manual_seed(0)
    x, w, b = torch.randn(5, 7), torch.randn(3, 7), torch.randn(3)
    assert torch.allclose(gemm.linear(x, w, b), x @ w.T + b, atol=1e-6)
    assert torch.allclose(gemm.mm(x, w.T), x @ w.T, atol=1e-6)
    assert torch.allclose(gemm.mm(x.T.contiguous().T, w.T), x @ w.T, atol=1e-6)  # strided operands
    gemm.configure("torch")
    assert not gemm.onednn(x, w) and torch.equal(gemm.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert not gemm.onednn(x.double(), w.double())
    with pytest.raises(ValueError, match="cpu_gemm='fast'"):
        gemm.configure("fast")


def test_gemm_auto_picks_by_cpu_vendor_and_avx512(monkeypatch):
    from opct.backends.cpu import gemm

    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    assert gemm.auto_kernel("GenuineIntel", avx512=True) == "torch"
    assert gemm.auto_kernel("GenuineIntel", avx512=False) == "torch"
    assert gemm.auto_kernel("AuthenticAMD", avx512=True) == "onednn"  # MKL's AVX-512 code is Intel's only
    assert gemm.auto_kernel("AuthenticAMD", avx512=False) == "torch"  # AVX2 on both sides: MKL measured faster
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: None)
    assert gemm.auto_kernel() == "onednn"  # vendor unreadable: the default kernel
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert gemm.auto_kernel("GenuineIntel", avx512=True) == "onednn"  # no MKL in this build: torch's are not MKL's
    assert gemm.auto_kernel("AuthenticAMD", avx512=False) == "onednn"
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(gemm, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    assert gemm.configure("auto") == "torch" and gemm.SETTINGS["kernel"] == "torch"
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: "AuthenticAMD")
    assert gemm.configure("auto", pack=False) == "onednn" and gemm.SETTINGS == {"kernel": "onednn", "pack": False}
    monkeypatch.setattr(gemm, "cpu_has_avx512", lambda: False)
    assert gemm.configure("auto") == "torch"


def test_packed_weights_are_bit_identical_kept_while_unchanged_and_only_for_frozen_weights(monkeypatch):
    from opct.backends.cpu import gemm

    if not gemm.onednn(torch.zeros(1)):
        pytest.skip("no oneDNN in this PyTorch build")
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24).requires_grad_(False)
    p1 = gemm.packed_weight(lin)
    assert p1 is not None and gemm.packed_weight(lin) is p1  # kept
    for rows in (1, 2, 7, 300):
        x = torch.randn(rows, 40)
        got, want = gemm.linear(x, lin.weight, lin.bias, p1), gemm.linear(x, lin.weight, lin.bias)
        # bit for bit from 2 rows on with torch 2.13's oneDNN; a single row takes another kernel unpacked (a
        # matrix-vector product), and torch 2.11's takes other kernels below 300 rows (2 ulp apart, measured)
        exact = rows > 1 and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
        assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-6, rtol=0)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # changed in place: repacked
    p2 = gemm.packed_weight(lin)
    assert p2 is not p1 and torch.equal(gemm.linear(x, lin.weight, None, p2), gemm.linear(x, lin.weight))
    assert gemm.packed_weight(torch.nn.Linear(4, 4)) is None  # trainable
    gemm.configure(pack=False)
    assert gemm.packed_weight(torch.nn.Linear(4, 4).requires_grad_(False)) is None


def test_kept_copies_stay_within_their_share_of_physical_memory(monkeypatch):
    """`gemm.kept` keeps copies while all of them together fit KEEP_FRACTION of physical memory; past that it
    returns None (the caller makes a throwaway copy) and keeps nothing new, and a copy freed with its owner frees
    its share."""
    from opct.backends.cpu import gemm

    monkeypatch.setattr(gemm, "_KEPT", weakref.WeakKeyDictionary())
    monkeypatch.setattr(gemm, "physical_memory", lambda: 1000)
    monkeypatch.setattr(gemm, "KEEP_FRACTION", 1 / 4)  # a budget of 250 bytes
    w1, w2 = torch.zeros(50), torch.zeros(20)  # 200 and 80 bytes
    owner1, owner2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    c1 = gemm.kept(owner1, "packed", [w1], lambda: "copy1")
    assert c1 == "copy1" and gemm.kept(owner1, "packed", [w1], None) == "copy1"
    assert gemm.kept(owner2, "packed", [w2], lambda: "copy2") is None  # 280 > 250 bytes
    assert gemm.kept(owner2, "packed", [w2], None) is None  # and nothing was kept
    monkeypatch.setattr(gemm, "KEEP_FRACTION", 1 / 2)
    assert gemm.kept(owner2, "packed", [w2], lambda: "copy2") == "copy2"  # 280 <= 500
    del owner1
    gc.collect()
    monkeypatch.setattr(gemm, "KEEP_FRACTION", 1 / 4)
    assert gemm.kept(torch.nn.Linear(1, 1), "packed", [torch.zeros(40)], lambda: "copy3") == "copy3"  # 80 + 160


def test_adding_an_adapter_does_not_pass_on_the_libraries_deprecation_warning(tiny_model_dir):
    """PEFT reads a property transformers deprecates; the FutureWarning it raises reaches no user of opct."""
    import warnings

    base, _ = load_model(str(tiny_model_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        add_lora(base, 4, 8.0)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
