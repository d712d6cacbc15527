"""Check that opct's capability numbers are lm-eval's: run `run_capability` and the `lm_eval` CLI on the same model,
tasks, limit and task configs, and print every metric side by side (full precision) with the wall time of each.

    python dev/capability_check.py --model smollm2-135m-instruct --tasks small --out benchmarks/results/x.json

`--tasks` takes a suite name (opct.evals.capability.SUITES) or comma-separated lm-eval task names. With a suite,
tasks with their own limit get their own lm_eval call (the CLI has one --limit per call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tasks", default="small")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-gen-toks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from opct.data.mcq import cache_dir
    from opct.evals.capability import lm_eval_command, resolve_suite, run_capability

    suite = resolve_suite(a.tasks, a.limit)
    tasks, limit, limits = suite["tasks"], suite["limit"], suite["limits"]
    a.max_gen_toks = a.max_gen_toks or suite["max_gen_toks"]
    t = time.perf_counter()
    ours = run_capability(a.model, tasks, limit=limit, limits=limits, batch_size=a.batch_size, offline=True,
                          max_gen_toks=a.max_gen_toks)
    ours_s = time.perf_counter() - t
    report = {"model": a.model, "tasks": tasks, "limit": limit, "limits": limits, "threads": a.threads,
              "run_capability": {k: v for k, v in ours.items()}, "run_capability_wall_s": round(ours_s, 1)}
    if not a.skip_cli:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads)}
        if not (Path(os.environ.get("NLTK_DATA", "/nonexistent")) / "tokenizers/punkt_tab").exists():
            env["NLTK_DATA"] = str(cache_dir() / "nltk_stub")  # see opct.evals.ifeval_synth.prepare_nltk
        groups: dict = {}
        for task in tasks:
            groups.setdefault(limits.get(task, limit), []).append(task)
        cli, cli_s, cmds = {}, 0.0, []
        for lim, names in groups.items():
            outp = Path(a.out).with_suffix("") / f"lm_eval_limit{lim}"
            argv = lm_eval_command(a.model, names, limit=lim, batch_size=a.batch_size, offline=True,
                                   max_gen_toks=a.max_gen_toks, output_path=str(outp))
            cmds.append(" ".join(argv))
            t = time.perf_counter()
            r = subprocess.run(argv, env=env, capture_output=True, text=True)
            cli_s += time.perf_counter() - t
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            print(r.stdout[-3000:])
            res_file = max(outp.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
            cli.update(json.loads(res_file.read_text())["results"])
        report.update(lm_eval_cli={t: cli[t] for t in tasks}, lm_eval_cli_wall_s=round(cli_s, 1), lm_eval_commands=cmds)
        rows, same = [], True
        for task in tasks:
            for m, v in ours[task]["metrics"].items():
                c = cli[task].get(m)
                eq = v == c
                same &= eq
                rows.append({"task": task, "metric": m, "run_capability": v, "lm_eval_cli": c, "equal": eq})
                print(f"{task:28s} {m:36s} {v!s:>22s} {c!s:>22s} {'==' if eq else '!='}")
        report.update(comparison=rows, all_equal=same)
        print("all equal:", same)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {a.out}; run_capability {ours_s:.0f} s" + ("" if a.skip_cli else f", lm_eval CLI {cli_s:.0f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
