"""Same-process A/B of long attention inside real opct steps: transformers' sdpa path vs `attention.flash_attention`.

    python dev/attention_in_step.py MODEL PROMPT_TOKENS NEW_TOKENS STEPS
    python dev/attention_in_step.py qwen2.5-coder-0.5b-instruct 400 128 6

Runs STEPS steps of the benchmark workload (`benchmarks/step.py`'s) in one process, alternating the two paths for
attention calls past `attention.MAX_SCORES` (shorter ones keep the matmul form); each prompt batch and sampling seed
runs once under each. Every such call is timed, forward and backward (the backward through torch.autograd.grad on
the call's own graph), and each step prints one JSON line: step seconds, the attention seconds, the calls.
Used for dev/LOG.md (2026-11-26, evening).
"""
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from step import step_config, workload_pairs  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from opct.algo.opct import opct_step  # noqa: E402
from opct.backends.cpu import attention  # noqa: E402
from opct.train import loop  # noqa: E402

name, P, T, n_steps = sys.argv[1], int(sys.argv[2]) or None, int(sys.argv[3]), int(sys.argv[4])
pairs, _ = workload_pairs(name, 8 * n_steps, P)
cfg = step_config(tempfile.mkdtemp() + "/r", name, 8, n_steps, T, 32)
run = loop.start_run(cfg, pairs)
pol = run.policy
MODE = {"new": True}
acc = {"fwd": 0.0, "bwd": 0.0, "calls": 0}


class Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fn):
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            t0 = time.perf_counter(); out = fn(qq, kk, vv); acc["fwd"] += time.perf_counter() - t0
        ctx.saved = (qq, kk, vv, out)
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        qq, kk, vv, out = ctx.saved
        ins = [t for t in (qq, kk, vv) if t.requires_grad]
        t0 = time.perf_counter(); grads = torch.autograd.grad(out, ins, g); acc["bwd"] += time.perf_counter() - t0
        it = iter(grads)
        return tuple(next(it) if t.requires_grad else None for t in (qq, kk, vv)) + (None,)


def timed_attention(module, query, key, value, attention_mask, **kw):
    if query.shape[2] * key.shape[2] <= attention.MAX_SCORES:
        return attention.short_attention(module, query, key, value, attention_mask, **kw)
    acc["calls"] += 1
    if MODE["new"]:
        fn = lambda q, k, v: attention.short_attention(module, q, k, v, attention_mask, **kw)[0]
    else:
        fn = lambda q, k, v: sdpa_attention_forward(module, q, k, v, attention_mask, **kw)[0]
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return Timed.apply(query, key, value, fn), None
    t0 = time.perf_counter(); out = fn(query, key, value); acc["fwd"] += time.perf_counter() - t0
    return out, None


AttentionInterface.register(attention.NAME, timed_attention)
for step in range(n_steps):
    MODE["new"] = step % 2 == 1
    idx = loop.data_order(len(run.rendered), cfg.seed, (step // 2) * 8, 8)  # each prompt batch twice: old then new
    batch, gen = loop.share(run, [run.rendered[i] for i in idx], 1)
    gen.manual_seed(1000 + step // 2)
    acc.update(fwd=0.0, bwd=0.0, calls=0)
    t0 = time.perf_counter()
    r = opct_step(pol, run.fmt, batch, run.cfg, gen)
    step_s = time.perf_counter() - t0
    pol.model.zero_grad(set_to_none=True)
    print(json.dumps({"mode": "new" if MODE["new"] else "old", "step_s": step_s, **acc,
                      "response_tokens": r["response_tokens"], "sample": r["time_sample"],
                      "teacher": r["time_teacher"], "student": r["time_student"]}), flush=True)
