"""A model directory with the architecture and tokenizer of another and seeded random weights, for timing runs on a
machine the real weights cannot reach (a lent GPU machine takes 64 MiB of files; the 0.5B model is 2.5 GB).

    python benchmarks/random_weights.py --like qwen2.5-coder-0.5b-instruct --out /tmp/qwen-random [--seed 0]
        [--dtype bfloat16] [--device cuda] [--set hidden_size=3584 --set num_hidden_layers=28 ...]

`--like` is an alias, a model directory or a directory holding only its small files (config.json, the tokenizer
files, chat_template.jinja, generation_config.json): every file but the weights (and opct-source.json, the real weights' provenance) is copied, and the model is built
with `AutoModelForCausalLM.from_config` under `torch.manual_seed(seed)` and saved as safetensors (float32 unless
`--dtype`). `--set` changes config values first: another size of the same architecture and tokenizer.

What it changes for a timing: nothing in the work per token (same shapes, same kernels), but the responses' lengths.
Randomly initialised logits are nearly uniform over the vocabulary, so a sample almost never draws an end-of-turn
token and runs to `max_new_tokens`; each side's JSON reports `response_tokens` and `decode_steps`, which show it.
A file `opct-random-weights.json` in the output says where the architecture came from and the seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def make(like: str, out: str, seed: int = 0, dtype: str = "float32", device: str = "cpu",
         sets: dict | None = None) -> Path:
    """`sets`: config.json values to change (an architecture of another size with the same tokenizer, e.g. 8B-class
    dimensions on the 0.5B's config); `dtype`, `device`: the weights' dtype and where they are drawn (a GPU draws
    an 8B model in seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from opct.models import resolve

    src, dst = Path(resolve(like)), Path(out)
    if not (src / "config.json").is_file():
        sys.exit(f"{src}: no config.json (--like needs a model directory or an alias)")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES + (".index.json",)) and f.name != "opct-source.json":
            shutil.copy2(f, dst / f.name)
    config = AutoConfig.from_pretrained(src)
    for k, v in (sets or {}).items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(dst)
    (dst / "opct-random-weights.json").write_text(json.dumps(
        {"architecture_of": str(like), "changed": sets or {}, "seed": seed, "dtype": dtype,
         "parameters": sum(p.numel() for p in model.parameters()),
         "weights": "random (from_config under torch.manual_seed)"}, indent=2) + "\n")
    return dst


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--like", required=True, help="alias or directory whose config and tokenizer to copy")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: fast for large models)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config.json value to change, read as JSON (e.g. num_hidden_layers=28; repeatable)")
    a = p.parse_args(argv)
    sets = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        sets[k] = json.loads(v)
    print(make(a.like, a.out, a.seed, a.dtype, a.device, sets))


if __name__ == "__main__":
    main()
