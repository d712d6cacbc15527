"""Attention forward + backward for left-padded prompts: the explicit-mask SDPA call transformers makes, against
each row's unpadded part with `is_causal=True` (the CPU flash kernel then skips blocks above the diagonal), and
`short_attention`'s matmul form. Prints median milliseconds of 5 and the largest difference on non-padding rows.

    python dev/attention_causal_ab.py [--positions 470] [--heads 9 --kv-heads 3 --head-dim 64]

Figures in dev/LOG.md (2026-11-24 evening).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--positions", type=int, default=470)
p.add_argument("--heads", type=int, default=9)
p.add_argument("--kv-heads", type=int, default=3)
p.add_argument("--head-dim", type=int, default=64)
args = p.parse_args()
torch.manual_seed(0)
H, K, D, T = args.heads, args.kv_heads, args.head_dim, args.positions
G = H // K
pads = [0, 20, 40, 60, 80, 30, 10, 50]  # left padding of each row
B = len(pads)
mask_B1TS = torch.ones(T, T, dtype=torch.bool).tril().repeat(B, 1, 1, 1)
valid_B1T1 = torch.ones(B, 1, T, 1, dtype=torch.bool)
for b, n in enumerate(pads):
    mask_B1TS[b, 0, :, :n] = False
    valid_B1T1[b, 0, :n] = False


def explicit_mask(q, k, v):  # transformers' sdpa path: key/value heads repeated, boolean mask
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask_B1TS)


def explicit_mask_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, enable_gqa=True)


def causal_rows(q, k, v):
    return torch.cat([F.pad(F.scaled_dot_product_attention(q[b:b + 1, :, n:], k[b:b + 1, :, n:], v[b:b + 1, :, n:],
                                                           is_causal=True, enable_gqa=True), (0, 0, n, 0))
                      for b, n in enumerate(pads)])


def matmul_form(q, k, v):  # short_attention's arithmetic
    bias = torch.zeros(mask_B1TS.shape).masked_fill_(~mask_B1TS, torch.finfo(torch.float32).min)[:, :, None]
    s = torch.matmul(q.reshape(B, K, G * T, D), k.transpose(-1, -2)).view(B, K, G, T, T)
    return torch.matmul(torch.add(bias, s, alpha=D ** -0.5).softmax(-1).view(B, K, G * T, T), v).view(B, H, T, D)


q = torch.randn(B, H, T, D, requires_grad=True)
k = torch.randn(B, K, T, D, requires_grad=True)
v = torch.randn(B, K, T, D, requires_grad=True)
ref = explicit_mask(q, k, v).detach()
for name, f in [("explicit mask", explicit_mask), ("explicit mask, enable_gqa", explicit_mask_gqa),
                ("per row, is_causal", causal_rows), ("matmul form", matmul_form)]:
    err = ((f(q, k, v).detach() - ref).abs() * valid_B1T1).max().item()
    fwd, bwd = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        out = f(q, k, v)
        t1 = time.perf_counter()
        out.sum().backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        q.grad = k.grad = v.grad = None
    print(f"{name:28s} max diff {err:.1e}  forward {statistics.median(fwd) * 1e3:6.1f} ms  "
          f"backward {statistics.median(bwd) * 1e3:6.1f} ms")
