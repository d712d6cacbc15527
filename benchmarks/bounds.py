"""What this machine could do at best, measured now: the yardsticks for each phase of a training step.

    python benchmarks/bounds.py --model /tmp/smol --lora-rank 32 --threads 2

Prints one JSON object:
  matmul     fp32 GEMM peak (GFLOP/s): best over a few large square sizes and over torch.mm and oneDNN's
             linear (`by_kernel`), best of several runs each;
             the ceiling for the compute-bound phases (teacher prefill, student forward+backward).
             Also one GEMM at the model's own shapes (hidden 576 x MLP 1536 over ~800 rows): a more
             realistic ceiling for a 135M model's thin matrices (`model_shaped_gflops`).
  bandwidth  memory bandwidth (GB/s): best of large-tensor sum, copy, add_ and addcmul_ (`best_gbs`);
             plus `skinny_gemm_gbs`, what a batch-8 lm_head GEMM actually streams (not a bound).
  model      parameter counts, weight bytes and FLOPs per token (see `flops_per_token`).
  decode     bytes of weights streamed per decode step and the resulting lower bound on seconds per step,
             keyed by LoRA rank ("0" = plain model): batch-8 decoding is memory-bound, every step must read
             every weight once. Also the weights' time at one read stream's rate (`sum_gbs`:
             `s_per_step_weights_one_stream`), nearer to what a skinny product can reach than the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first call pays for allocation and thread start-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _gemms(a, b):
    """The fp32 GEMM kernels a training step can use, each computing a @ b: torch.mm (MKL/BLAS) and, where this
    PyTorch has it, oneDNN's linear (what opct.backends.cpu.gemm calls; the faster of the two on the AMD EPYC VMs we measure on)."""
    from opct.backends.cpu import gemm

    kernels = {"torch": lambda: torch.mm(a, b)}
    if gemm.onednn_works():  # oneDNN runs here (the op exists and gives torch's result)
        bt = b.t()
        kernels["onednn"] = lambda: gemm._OP(a, bt, None, "none", [], "")
    return kernels


def matmul_peak_flops(threads: int = 2, sizes=(1024, 2048, 3072), repeats: int = 5) -> dict:
    """fp32 GEMM peak in GFLOP/s: best of `repeats` runs at each square size (2 n^3 FLOPs per n x n GEMM), for
    each kernel in `_gemms`; the peak is the best of all."""
    torch.set_num_threads(threads)
    by_kernel: dict = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for name, fn in _gemms(a, b).items():
            by_kernel.setdefault(name, {})[str(n)] = 2 * n**3 / _best_seconds(fn, repeats) / 1e9
    by_size = {str(n): max(k[str(n)] for k in by_kernel.values()) for n in sizes}
    return {"gflops": max(by_size.values()), "by_size": by_size, "by_kernel": by_kernel, "threads": threads}


def model_shaped_gemm_flops(hidden: int, intermediate: int, rows: int = 832, threads: int = 2, repeats: int = 10) -> float:
    """GFLOP/s of one MLP-projection GEMM at the model's shapes: (rows x hidden) @ (hidden x intermediate), best
    of the kernels in `_gemms`.

    rows = 832 is batch 8 x ~104 tokens (prompt + response), the size of a teacher or student forward.
    """
    torch.set_num_threads(threads)
    x, w = torch.randn(rows, hidden), torch.randn(hidden, intermediate)
    s = min(_best_seconds(fn, repeats) for fn in _gemms(x, w).values())
    return 2 * rows * hidden * intermediate / s / 1e9


def memory_bandwidth(threads: int = 2, mbytes: int = 1024, repeats: int = 5) -> dict:
    """DRAM bandwidth in GB/s from three streaming kernels over tensors far larger than any cache.

    `sum` reads one stream, `copy_` reads one and writes one, in-place `add_` reads two and writes one,
    `addcmul_` reads three and writes one; each counts the bytes it must move. One stream alone does not
    saturate memory here (sum reached ~18 GB/s where addcmul_ reached ~29 on the idle 2-core box), so the
    best of them (`best_gbs`) is the bound used for decode and the optimizer.
    """
    torch.set_num_threads(threads)
    n = mbytes * 2**20 // 4
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)
    nbytes = a.numel() * a.element_size()
    rates = {
        "sum_gbs": nbytes / _best_seconds(lambda: a.sum(), repeats) / 1e9,
        "copy_gbs": 2 * nbytes / _best_seconds(lambda: b.copy_(a), repeats) / 1e9,
        "add_gbs": 3 * nbytes / _best_seconds(lambda: a.add_(b), repeats) / 1e9,
        "addcmul_gbs": 4 * nbytes / _best_seconds(lambda: a.addcmul_(b, c, value=1e-3), repeats) / 1e9,
    }
    return {**rates, "best_gbs": max(rates.values()), "mbytes": mbytes}


def skinny_gemm_gbs(hidden: int, vocab: int, batch: int = 8, threads: int = 2, repeats: int = 10) -> float:
    """Weight bytes per second actually streamed by a decode-shaped GEMM: (batch x hidden) @ lm_head^T.

    Not a bound: it shows how far BLAS itself falls short of `best_gbs` on a batch-8 matrix-vector-like
    product, which is what every decode step is made of.
    """
    torch.set_num_threads(threads)
    x, w = torch.randn(batch, hidden), torch.randn(vocab, hidden)
    return w.numel() * w.element_size() / _best_seconds(lambda: x @ w.T, repeats) / 1e9


def _unique_params(model):
    """Parameters counted once each: tied weights (embedding = lm_head) share storage."""
    seen, params = set(), []
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            params.append(p)
    return params


def param_counts(model) -> dict:
    params = _unique_params(model)
    total = sum(p.numel() for p in params)
    embedding = model.get_input_embeddings().weight.numel()
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "trainable": trainable}


def flops_per_token(model) -> dict:
    """Forward FLOPs per token ~ 2 x non-embedding params + 2 x hidden x vocab.

    Each weight takes part in one multiply-add per token (2 FLOPs). The embedding lookup is a gather (no
    FLOPs), but the lm_head multiplies by the full (tied) vocab x hidden matrix, counted separately because
    trainers compute logits only at the positions they need (`logits_to_keep`), not at every token.
    Attention's own score/value products (4 x layers x context x hidden per token) are left out: at the
    ~100-token contexts benchmarked they add about 2% for SmolLM2-135M.
    Backward costs 2x forward for activation gradients plus 2x for weight gradients; with LoRA the frozen
    weights need no weight gradients, so forward+backward ~ 4x forward instead of 6x.
    """
    counts = param_counts(model)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    body = 2 * counts["non_embedding"]
    head = 2 * hidden * vocab
    return {"body": body, "lm_head": head, "total": body + head}


def decode_bound(model, bandwidth_gbs: float, batch: int = 8, context: int = 88,
                 stream_gbs: float | None = None) -> dict:
    """Bytes streamed per decode step and the lower bound on seconds per step at `bandwidth_gbs`; with
    `stream_gbs` (one read stream's rate, `sum_gbs`) also the time to read the weights at that rate. A decode
    product at batch 8 reads its weight as about one stream a thread, which need not reach the best multi-stream
    rate (on the 2-core Xeon: 25 GB/s for `sum`, 42 for `add_`), so the weights' time at `stream_gbs` is a
    nearer target than the bound, not a bound.

    Every step reads every weight once: all unique parameters (tied embedding counted once; the lm_head
    reads the full embedding matrix, the lookup only a few rows). With unmerged LoRA the adapters are
    read too, so pass the PEFT-wrapped model to include them. The KV cache read at `context` tokens
    (mean context while decoding, ~prompt + new/2) is reported separately; it grows with batch and length.
    """
    weight_bytes = sum(p.numel() * p.element_size() for p in _unique_params(model))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    bytes_per_value = next(model.parameters()).element_size()
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * context * batch * bytes_per_value
    out = {
        "weight_bytes": weight_bytes,
        "kv_cache_bytes": kv_bytes,
        "bandwidth_gbs": bandwidth_gbs,
        "s_per_step_weights": weight_bytes / (bandwidth_gbs * 1e9),
        "s_per_step_weights_and_kv": (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9),
        "batch": batch,
        "context": context,
    }
    if stream_gbs:
        out.update(stream_gbs=stream_gbs, s_per_step_weights_one_stream=weight_bytes / (stream_gbs * 1e9))
    return out


def measure(model_path: str, lora_rank: int = 32, threads: int = 2, batch: int = 8, context: int = 88) -> dict:
    """All the bounds for one model, measured in this process."""
    from transformers import AutoModelForCausalLM

    load_before = os.getloadavg()
    matmul = matmul_peak_flops(threads)
    bandwidth = memory_bandwidth(threads)
    from opct.models import resolve

    model = AutoModelForCausalLM.from_pretrained(resolve(model_path), dtype=torch.float32)
    base_counts, fpt = param_counts(model), flops_per_token(model)
    shaped = model_shaped_gemm_flops(model.config.hidden_size, model.config.intermediate_size, threads=threads)
    bandwidth["skinny_gemm_gbs"] = skinny_gemm_gbs(model.config.hidden_size, model.config.vocab_size, batch, threads)
    # Keyed by LoRA rank: "0" is the plain model (full fine-tune); a LoRA run also streams its adapters.
    stream = bandwidth["sum_gbs"]
    decode = {"0": decode_bound(model, bandwidth["best_gbs"], batch=batch, context=context, stream_gbs=stream)}
    lora_params = 0
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear", task_type="CAUSAL_LM"))
        lora_params = param_counts(model)["trainable"]
        decode[str(lora_rank)] = decode_bound(model, bandwidth["best_gbs"], batch=batch, context=context,
                                              stream_gbs=stream)
    return {
        "matmul": {**matmul, "model_shaped_gflops": shaped},
        "bandwidth": bandwidth,
        "model": {
            "path": model_path,
            "params": base_counts,
            "lora_rank": lora_rank,
            "lora_params": lora_params,
            "flops_per_token": fpt,
            "hidden": model.config.hidden_size,
            "vocab": model.config.vocab_size,
        },
        "decode": decode,
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "torch": torch.__version__,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description="Measure matmul peak, memory bandwidth and the decode bound.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, dir or Hub id (resolved by opct.models.resolve)")
    p.add_argument("--lora-rank", type=int, default=32, help="count unmerged LoRA adapter bytes in the decode bound; 0 = none")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=88, help="mean context length while decoding, for the KV-cache bytes")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.lora_rank, args.threads, args.batch, args.context)))


if __name__ == "__main__":
    main()
