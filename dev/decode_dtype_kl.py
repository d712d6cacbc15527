"""How far decode_dtype=bfloat16 moves the sampling distribution: per-token KL between the lean decoder's float32
and bfloat16 next-token distributions on the same token sequences (sampled from the float32 decoder), for a LoRA
model whose adapter is nonzero. Prints one JSON line.

  python dev/decode_dtype_kl.py --model smollm2-135m-instruct --tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=None, help="jailbreak-wrapped prompts of about N tokens")
    p.add_argument("--lora-std", type=float, default=0.01, help="std of the random LoRA B (A as PEFT initialises it)")
    a = p.parse_args()

    from step import workload_pairs

    from opct.backends.cpu import decoder, patch_model
    from opct.backends.cpu.decoder import LeanDecoder
    from opct.backends.cpu.prefill import prefill
    from opct.config import ExecConfig
    from opct.data.chat import render_prompt
    from opct.models import add_lora, load_model

    model, tok = load_model(a.model)
    model = add_lora(model, 32, 64.0)
    patch_model(model, ExecConfig())
    torch.manual_seed(0)
    with torch.no_grad():
        for n, w in model.named_parameters():
            if "lora_B" in n:
                w.normal_(0, a.lora_std)
    pairs, _ = workload_pairs(a.model, 8, a.prompt_tokens)
    prompts = [render_prompt(tok, pr.student) for pr in pairs]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pre = prefill(model, prompts, tok.pad_token_id)
        B, P = pre.mask_BL.shape
        decs = {}
        for dt in ("float32", "bfloat16"):
            decoder.configure("onednn", dt)
            decs[dt] = LeanDecoder.build(model, B)
        caches = {dt: d.new_cache(B, P + a.tokens) for dt, d in decs.items()}
        for dt in decs:
            for (k, v), layer in zip(caches[dt], pre.cache.layers):
                k[:, :, :P], v[:, :, :P] = layer.keys, layer.values
        att = torch.zeros(B, 1, 1, P + a.tokens, dtype=torch.bool)
        att[:, 0, 0, :P] = pre.mask_BL.bool()
        logits = {dt: d.head(pre.last_hidden_BH) for dt, d in decs.items()}
        pos, kls, maxdiff, same_argmax = pre.last_pos_B, [], [], []
        for t in range(a.tokens):
            lp32, lp16 = (logits[dt].float().log_softmax(-1) for dt in ("float32", "bfloat16"))
            kls.append((lp32.exp() * (lp32 - lp16)).sum(-1))  # KL(fp32 || bf16) per row
            maxdiff.append((logits["float32"] - logits["bfloat16"]).abs().amax(-1))
            same_argmax.append(logits["float32"].argmax(-1) == logits["bfloat16"].argmax(-1))
            tok_B = torch.multinomial(lp32.exp(), 1, generator=gen)[:, 0]
            pos = pos + 1
            att[:, 0, 0, P + t] = True
            logits = {dt: d.step(tok_B, pos, caches[dt], P + t, att[..., :P + t + 1]) for dt, d in decs.items()}
    kl = torch.stack(kls)
    print(json.dumps({"model": a.model, "tokens": a.tokens, "prompt_tokens": P, "lora_std": a.lora_std,
                      "kl_fp32_bf16_mean": kl.mean().item(), "kl_fp32_bf16_max": kl.max().item(),
                      "logit_absdiff_max_mean": torch.stack(maxdiff).mean().item(),
                      "argmax_agreement": torch.stack(same_argmax).float().mean().item()}))


if __name__ == "__main__":
    main()
