"""Where a lean-decoder token goes: the whole step, its matrix products alone, and everything but the products.

    python dev/decode_split.py [--model smollm2-135m-instruct] [--batch 8] [--out FILE.json]

Builds the `LeanDecoder` for the model with a LoRA adapter (r=32, random B, merged as in training) and times,
best of 3 x `--tokens` decode steps each:
  full          `LeanDecoder.step` as sampling runs it (fixed tokens, a prompt-length KV cache);
  products      the step's packed products alone, in the order a step runs them (every layer's q/k/v, o,
                gate/up, down, then the LM head), each on a fixed input: the weight bytes streamed once a token;
  no_products   the step with every product replaced by a preallocated output: norms, rotary, KV-cache writes,
                attention, activations, residuals and Python.
full - products - no_products is what the two cost together beyond their sum. Also the weight bytes a token and the
rate the products read them at, and a single-stream read rate (`sum` over 1 GiB) as the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import machine  # noqa: E402

from opct.backends.cpu.decoder import LeanDecoder, _Packed  # noqa: E402
from opct.models import add_lora, load_model  # noqa: E402


def best_ms(fn, n: int, repeats: int = 3) -> float:
    fn(3)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=70, help="KV-cache columns already filled")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = add_lora(load_model(args.model)[0], 32, 64)
    for name, w in model.named_parameters():
        if "lora_B" in name:
            w.data.normal_(0, 0.01)
    B, P = args.batch, args.prompt
    dec = LeanDecoder.build(model, B)
    cache = dec.new_cache(B, P + args.tokens + 3)
    mask = torch.ones(B, 1, 1, P + args.tokens + 3, dtype=torch.bool)
    tok_B = torch.randint(0, 1000, (B,))

    def steps(n):
        for i in range(n):
            dec.step(tok_B, torch.full((B,), P + i), cache, P + i, mask[..., :P + i + 1])

    prods = [d[k] for d in dec.layers for k in ("qkv", "o", "gate_up", "down")] + [dec.head]
    shapes = [(p.packed if p.packed is not None else p.w).shape for p in prods]
    xs = [torch.randn(B, s[1]) for s in shapes]

    def products(n):
        for _ in range(n):
            for prod, x in zip(prods, xs):
                prod(x)

    full = best_ms(steps, args.tokens)
    prod_ms = best_ms(products, args.tokens)
    outs = {id(prod): torch.randn(B, s[0]) for prod, s in zip(prods, shapes)}
    call = _Packed.__call__
    _Packed.__call__ = lambda self, x: outs[id(self)]
    try:
        rest = best_ms(steps, args.tokens)
    finally:
        _Packed.__call__ = call
    weight_bytes = sum(s[0] * s[1] for s in shapes) * 4
    big = torch.randn(256 * 2**20)
    read_s = min(_t(big.sum) for _ in range(5))
    result = {
        "model": args.model, "batch": B, "threads": args.threads, "lora_rank": 32,
        "ms_per_token": {"full": full, "products": prod_ms, "no_products": rest,
                         "interaction": full - prod_ms - rest},
        "weight_mb": weight_bytes / 1e6,
        "products_read_gbs": weight_bytes / prod_ms / 1e6,
        "single_stream_read_gbs": big.numel() * 4 / read_s / 1e9,
        "machine": machine(), "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
