"""All of one SmolLM2 decode step's matmuls (30 layers of q/k/v, o, gate/up, down, and the LM head) at batch 8 on
random weights packed by oneDNN, in float32 and in bfloat16: milliseconds a token for the products alone.

  python dev/decode_products_dtype.py
"""

import time

import torch

B = 8
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def ms_per_token(dtype: torch.dtype, reps: int = 20) -> float:
    torch.manual_seed(0)
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(O, I).to(dtype), B) for O, I in SHAPES]
    xs = [torch.randn(B, I).to(dtype) for _, I in SHAPES]

    def token():
        for p, x in zip(packed, xs):
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    for _ in range(3):
        token()
    t0 = time.perf_counter()
    for _ in range(reps):
        token()
    return (time.perf_counter() - t0) / reps * 1e3


if __name__ == "__main__":
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        print(f"{str(dtype):16s} {ms_per_token(dtype):.1f} ms a token")
