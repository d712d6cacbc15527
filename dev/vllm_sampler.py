"""The vLLM sampler on SmolLM2, in-process: seconds per sampling step (N prompts x T tokens) without and with LoRA,
seconds per LoRA sync, and the sampler-vs-transformers log-prob gap on the sampled tokens.

Run in the vLLM venv (.ci/vllm builds it):  nice -n 10 .venv-vllm/bin/python dev/vllm_sampler.py
Each step samples with a new seed; LoRA steps take a real optimizer step on the adapter and sync before sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def hf_logprobs(model, seqs_N, starts_N):
    """transformers' fp32 log-probs of seqs_N[i][starts_N[i]:], one sequence at a time (no padding)."""
    out = []
    with torch.no_grad():
        for s, st in zip(seqs_N, starts_N):
            ids_1T = torch.tensor([s])
            logp_TV = model(input_ids=ids_1T).logits[0].float().log_softmax(-1)
            out.append([logp_TV[t - 1, s[t]].item() for t in range(st, len(s))])
    return out


def gap(a, b):
    d = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return max(d), statistics.fmean(d), len(d)


def student(model_dir, rank, seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opct.backends.vllm_engine import VLLMSampler
    from opct.models import resolve
    from opct.backends.sampling import SamplingSettings

    model_dir = resolve("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = {tok.eos_token_id}
    texts = ["The capital of France is", "Write a haiku about rain.", "2 + 2 =", "Name three colours:",
             "Why is the sky blue?", "Translate 'hello' to Spanish:", "A good breakfast is", "Once upon a time"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                       add_generation_prompt=True, tokenize=True) for i in range(a.prompts)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    settings = SamplingSettings(max_new_tokens=a.tokens, temperature=1.0, top_p=1.0, top_k=0)
    res = {"prompts": a.prompts, "tokens": a.tokens, "steps": a.steps, "loadavg_start": os.getloadavg()}

    def run(sampler, model, lora):
        times, syncs, gaps = [], [], []
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3) if lora else None
        if lora:
            sampler.sync(model, 0)
        for step in range(a.steps + 1):  # step 0 is the warm-up (first-call compiles), not counted
            t0 = time.perf_counter()
            resp, lp = sampler.sample(prompts, settings, seed=step)
            dt = time.perf_counter() - t0
            seqs = [p + r for p, r in zip(prompts, resp)]
            starts = [len(p) for p in prompts]
            ref = hf_logprobs(model, seqs, starts)
            if step:
                times.append(dt)
                gaps.append(gap(lp, ref))
            if lora:  # a real update: maximise the sampled tokens' log-probs, then sync
                model.train()
                loss = -sum(model(input_ids=torch.tensor([s])).logits[0, st - 1:-1].log_softmax(-1)
                            .gather(-1, torch.tensor(s[st:])[:, None]).sum() for s, st in zip(seqs, starts))
                loss = loss / sum(len(r) for r in resp)
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.eval()
                s = sampler.sync(model, step + 1)
                if step:
                    syncs.append(s)
        n_tok = [len(r) for r in resp]
        out = {"sample_s_per_step": times, "sample_s_median": statistics.median(times),
               "gap_max": max(g[0] for g in gaps), "gap_mean": statistics.fmean(g[1] for g in gaps),
               "gap_tokens": sum(g[2] for g in gaps), "last_step_tokens": n_tok}
        if lora:
            out.update(sync_s_per_step=syncs, sync_s_median=statistics.median(syncs))
        return out

    t0 = time.perf_counter()
    s = VLLMSampler(model_dir, eos)
    res["engine_start_s_base"] = time.perf_counter() - t0
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    res["base"] = run(s, base, lora=False)
    s.close()
    del base
    print(json.dumps(res, indent=1), flush=True)

    t0 = time.perf_counter()
    s = VLLMSampler(model_dir, eos, lora_rank=8)
    res["engine_start_s_lora"] = time.perf_counter() - t0
    res["lora"] = run(s, student(model_dir, 8).eval(), lora=True)
    s.close()
    res["loadavg_end"] = os.getloadavg()
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
