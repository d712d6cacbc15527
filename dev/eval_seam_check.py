"""Before/after check for moving evaluation behind the Policy seam (issue 48): every axis' `opct eval --axis`
result and per-example samples on a tiny random model, on the hf and cpu backends, written as one JSON file.
Run it on two commits and compare the files (`cmp`): identical means the move changed no evaluation.

    python dev/eval_seam_check.py OUT.json [--model DIR]   (a tiny random Llama is made when --model is absent)
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
torch.set_num_threads(2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="")
    a = ap.parse_args()
    from conftest import make_tiny_model

    from opct.config import EvalConfig
    from opct.evaluate import config_for_axis, run_eval

    tmp = Path(tempfile.mkdtemp())
    model = a.model or str(make_tiny_model(tmp / "tiny"))
    sizes = {"sycophancy": dict(n_train=8, n_eval=24, cued_n=24),
             "safety": dict(n_train=8, n_eval=12, max_new_tokens=12),
             "jailbreak": dict(n_train=8, n_eval=12, eval_max_new_tokens=12, max_new_tokens=12)}
    out = {}
    for axis, kw in sizes.items():
        for backend in ("hf", "cpu"):
            path = tmp / f"{axis}-{backend}.json"
            cfg = config_for_axis(EvalConfig, axis=axis, model=model, backend=backend, out=str(path), **kw)
            res = run_eval(cfg)
            res.pop("model", None)
            samples = path.with_suffix(".samples.jsonl")
            out[f"{axis}/{backend}"] = {"result": res, "samples": samples.read_text().splitlines()
                                        if samples.is_file() else None}
            print(axis, backend, "done", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
