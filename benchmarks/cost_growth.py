"""How step time and memory grow with prompt length and sampled length: opct vs TRL over a grid of cells.

    pip install -e '.[bench]'
    python benchmarks/cost_growth.py --model qwen2.5-coder-0.5b-instruct --prompt-tokens 100,400,1600 \\
        --new-tokens 32,128,512 --steps 2 --warmup 1 [--sides opct,trl] [--cells 400x128,1600x128] \\
        [--vllm-python PATH] --out cost_growth.json

A cell `PxT` is one workload: prompts of about P tokens (`--prompt-tokens` of benchmarks/step.py and trl_step.py:
jailbreak-wrapped behaviours chosen by length with the model's tokenizer, `common.length_prompts`) and T sampled
tokens per prompt (`--max-new-tokens`). Each side runs in its own subprocess through the same scripts as
benchmarks/vs_trl.py (`run_json`: its `others_busy_cores` is kept), alternating which side goes first from one
cell to the next. Sides: `opct`, `trl`, and `opct_vllm` (step.py --sampler vllm under `--vllm-python`).

Resuming: after every side's run the JSON file `--out` is rewritten (atomically), and a later call with the same
file skips every (cell, side) that already has a result without an error, so a long grid that was interrupted
picks up where it stopped, and `--cells` runs a subset (or adds cells to an existing file). The file's
configuration (model, batch, LoRA rank, steps, warmup, threads, contention, huge pages) must match the call's: cells
measured under different settings are not mixed. `--rerun opct` measures a side again in the chosen cells even
where it has a result (after a change to that side's code, the other side's runs kept), except where that result
was measured at the current commit (so an interrupted rerun resumes too); the run it replaces moves to the cell's
`replaced` list. Every run records when it was measured and at which commit (`measured`).

Output: per cell and side the median step seconds, phase split (sample / teacher / student / optim, and decode),
peak RSS, `decode_s_per_token`, the measured token counts, and the ratio opct / TRL (step time, peak RSS); a
markdown table (rows: prompt tokens, columns: new tokens; a cell reads `opct s / TRL s (ratio)` over
`opct MB / TRL MB` peak RSS), and the growth analysis: for each side and each pair of neighbouring cells along one
axis (the other held fixed), the step-time ratio against the token ratio, and the exponent
log(time ratio) / log(token ratio) (1 = linear, 2 = quadratic), for the step and each phase. The token ratio is
measured: prompt tokens per step along the prompt axis, decode steps (the longest response) along the new-token
axis, the nominal ratio when a side did not report the count. An exponent above 1 + `SUPERLINEAR_MARGIN` is flagged
`superlinear`. A step has fixed costs (the optimizer, the other axis' tokens), so linear per-token work shows as an
exponent below 1; one above 1 means the cost per token itself grows along that axis (attention over longer
contexts, caches that no longer fit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import machine, other_cpus  # noqa: E402
from opct.provenance import git_commit  # noqa: E402
from vs_trl import OPCT_STEP, TRL_STEP, BusyLoop, Side, huge_pages_env, run_side  # noqa: E402

SIDES = ("opct", "trl", "opct_vllm")
SUPERLINEAR_MARGIN = 0.1
SHARED_CORES = 0.25  # a run during which other processes kept more cores busy than this was shared: run it again
MATCH_KEYS = ("model", "batch", "lora_rank", "steps", "warmup", "threads", "contention", "huge_pages")
PHASES = ("sample", "teacher", "student", "optim", "decode")


class GridError(ValueError):
    """Bad grid input; the message names the flag or file and the field."""


def cell_key(prompt_tokens: int, new_tokens: int) -> str:
    return f"{prompt_tokens}x{new_tokens}"


def parse_int_list(text: str, flag: str) -> list[int]:
    """'100,400,1600' -> [100, 400, 1600]; every value a positive integer."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise GridError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or any(v <= 0 for v in values):
        raise GridError(f"{flag} {text!r}: expected positive integers")
    return values


def parse_cells(text: str) -> list[tuple[int, int]]:
    """'400x128,1600x128' -> [(400, 128), (1600, 128)] (prompt tokens x new tokens)."""
    cells = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            p, t = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise GridError(f"--cells {part!r}: expected PROMPTxNEW, e.g. 400x128") from None
        if p <= 0 or t <= 0:
            raise GridError(f"--cells {part!r}: both numbers must be positive")
        cells.append((p, t))
    if not cells:
        raise GridError("--cells: no cells given")
    return cells


def grid_cells(prompt_tokens: list[int], new_tokens: list[int]) -> list[tuple[int, int]]:
    """Every (P, T), rows by prompt length, short to long."""
    return [(p, t) for p in prompt_tokens for t in new_tokens]


def new_results(config: dict) -> dict:
    return {"config": config, "cells": {}}


def load_results(path: str, config: dict) -> dict:
    """The results in `path` (to resume), or fresh ones when it does not exist. Its configuration must match."""
    if not os.path.exists(path):
        return new_results(config)
    try:
        with open(path) as f:
            results = json.load(f)
    except json.JSONDecodeError as e:
        raise GridError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(results, dict) or not isinstance(results.get("cells"), dict):
        raise GridError(f"{path}: field 'cells' missing: not a cost_growth.py results file")
    old = results.get("config", {})
    here, there = config.get("machine", {}).get("cpu"), old.get("machine", {}).get("cpu")
    if there is None:
        print(f"cost_growth.py: warning: {path} does not say which CPU its cells ran on (older file): its timings are "
              "comparable with this machine's only if it was this one", file=sys.stderr)
    elif here != there or config["machine"].get("cores") != old["machine"].get("cores") or \
            other_cpus([config["machine"], old["machine"]]):
        raise GridError(f"{path}: field 'config.machine' is {old['machine']!r}, this machine is {config['machine']!r}; "
                        "timings from another machine are not mixed: use another --out")
    for key in MATCH_KEYS:
        if old.get(key) != config.get(key):
            raise GridError(f"{path}: field 'config.{key}' is {old.get(key)!r}, this call has {config.get(key)!r}; "
                            "use another --out or the same settings")
    return results


def save_results(path: str, results: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def shared(run: dict, contention) -> bool:
    """Whether other processes shared the CPU with this run (never under --contention, where that is the point)."""
    return not contention and (run.get("others_busy_cores") or 0.0) > SHARED_CORES


def pending_sides(results: dict, cell: tuple[int, int], sides: list[str], rerun: tuple[str, ...] = (),
                  commit: str | None = None) -> list[str]:
    """The sides of `cell` still to run: those with no result, an error, or a result measured on a shared CPU, and
    every side in `rerun` whose result was not measured at `commit` (a clean work tree at that commit), so that an
    interrupted rerun resumes too."""
    runs = results["cells"].get(cell_key(*cell), {}).get("runs", {})
    contention = results["config"].get("contention")

    def stale(run):
        m = run.get("measured") or {}
        return commit is None or m.get("commit") != commit or m.get("dirty", True)
    return [s for s in sides if s not in runs or "error" in runs[s] or shared(runs[s], contention)
            or (s in rerun and stale(runs[s]))]


def measured_stamp() -> dict:
    """When and at which commit a run was measured, and whether the code (src/ and benchmarks/, results aside) had
    uncommitted changes."""
    stamp = {"utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    code = (":(top)src", ":(top)benchmarks", ":(top,exclude)benchmarks/results")
    return {**stamp, **(git_commit(Path(HERE).parent, code) or {})}  # a copy outside git: the time alone


def record_run(entry: dict, side: str, run: dict) -> None:
    """Store `run` as the cell's result for `side`; a result it replaces (a rerun, or a failed or shared run) is
    kept, summarised, in entry["replaced"]."""
    old = entry["runs"].get(side)
    if old is not None:
        entry.setdefault("replaced", []).append({"side": side, "measured": old.get("measured"), **side_summary(old)})
    entry["runs"][side] = run
    summarise_cell(entry)


def side_summary(run: dict) -> dict:
    """The figures of one run that the grid reports."""
    if "error" in run:
        return {"error": run["error"]}
    keys = ("median_step_s", "peak_rss_mb", "decode_s_per_token", "prompt_tokens", "teacher_prompt_tokens",
            "response_tokens", "decode_steps", "others_busy_cores")
    out = {k: run[k] for k in keys if run.get(k) is not None}
    out["phases_s"] = {k: v for k, v in run.get("phases_s", {}).items() if k in PHASES}
    return out


def summarise_cell(entry: dict) -> None:
    """Fill entry["summary"] and entry["ratio"] (opct / TRL, opct_vllm / TRL) from entry["runs"]."""
    entry["summary"] = {side: side_summary(run) for side, run in entry["runs"].items()}
    trl = entry["summary"].get("trl", {})
    entry["ratio"] = {}
    for side in ("opct", "opct_vllm"):
        mine = entry["summary"].get(side, {})
        if "median_step_s" in mine and trl.get("median_step_s"):
            entry["ratio"][side] = {
                "step_time": mine["median_step_s"] / trl["median_step_s"],
                "peak_rss": mine["peak_rss_mb"] / trl["peak_rss_mb"] if trl.get("peak_rss_mb") else None}


def growth(results: dict, sides: list[str]) -> dict:
    """For each side and axis, each neighbouring pair of cells (see the module docstring)."""
    cells = {}
    for key, entry in results["cells"].items():
        p, t = (int(v) for v in key.split("x"))
        cells[(p, t)] = entry.get("summary", {})
    prompts = sorted({p for p, _ in cells})
    news = sorted({t for _, t in cells})
    out = {}
    for side in sides:
        per_axis = {"prompt_tokens": [], "new_tokens": []}
        for axis, fixed_values, moving in (("prompt_tokens", news, prompts), ("new_tokens", prompts, news)):
            for fixed in fixed_values:
                def at(v):
                    cell = (v, fixed) if axis == "prompt_tokens" else (fixed, v)
                    s = cells.get(cell, {}).get(side, {})
                    return cell, s if "median_step_s" in s else None

                present = [(v, *at(v)) for v in moving]
                present = [(v, c, s) for v, c, s in present if s]
                for (va, ca, sa), (vb, cb, sb) in zip(present, present[1:]):
                    count = "prompt_tokens" if axis == "prompt_tokens" else "decode_steps"
                    if sa.get(count) and sb.get(count):
                        token_ratio, measured = sb[count] / sa[count], True
                    else:
                        token_ratio, measured = vb / va, False
                    row = {"from": cell_key(*ca), "to": cell_key(*cb), "token_ratio": token_ratio,
                           "token_ratio_measured": measured,
                           **scaling(sa["median_step_s"], sb["median_step_s"], token_ratio),
                           "phases": {}}
                    for ph in PHASES:
                        a, b = sa.get("phases_s", {}).get(ph), sb.get("phases_s", {}).get(ph)
                        if a and b:
                            row["phases"][ph] = scaling(a, b, token_ratio)
                    per_axis[axis].append(row)
        out[side] = per_axis
    return out


def scaling(t_a: float, t_b: float, token_ratio: float) -> dict:
    """time ratio t_b / t_a, the exponent log(time ratio) / log(token ratio), and whether it is super-linear."""
    time_ratio = t_b / t_a
    exponent = math.log(time_ratio) / math.log(token_ratio) if token_ratio > 0 and token_ratio != 1 else None
    return {"time_ratio": time_ratio, "exponent": exponent,
            "superlinear": exponent is not None and exponent > 1 + SUPERLINEAR_MARGIN}


def markdown_table(results: dict, sides: list[str]) -> str:
    """Rows prompt tokens, columns new tokens; a cell: step seconds of each side (opct / TRL first) with opct's
    ratio to TRL, then peak RSS in MB. Cells not run are left empty."""
    cells = {tuple(int(v) for v in k.split("x")): e for k, e in results["cells"].items()}
    prompts = sorted({p for p, _ in cells})
    news = sorted({t for _, t in cells})
    order = [s for s in ("opct", "trl", "opct_vllm") if s in sides]
    lines = [f"step s ({' / '.join(order)}; ratio to TRL) and peak RSS MB, model {results['config'].get('model')}",
             "", "| prompt tokens \\ new tokens | " + " | ".join(str(t) for t in news) + " |",
             "|---|" + "---|" * len(news)]
    for p in prompts:
        row = []
        for t in news:
            e = cells.get((p, t))
            if not e or not e.get("summary"):
                row.append("")
                continue
            s = e["summary"]
            times = " / ".join(f"{s[x]['median_step_s']:.2f}" if "median_step_s" in s.get(x, {}) else "-"
                               for x in order)
            ratios = ", ".join(f"{r['step_time']:.2f}" for x, r in e.get("ratio", {}).items() if x in order)
            rss = " / ".join(f"{s[x]['peak_rss_mb']:.0f}" if "peak_rss_mb" in s.get(x, {}) else "-" for x in order)
            row.append(f"{times}{f' ({ratios})' if ratios else ''}<br>{rss} MB")
        lines.append(f"| {p} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def growth_lines(g: dict) -> list[str]:
    lines = []
    for side, axes in g.items():
        for axis, rows in axes.items():
            for r in rows:
                exp = "n/a" if r["exponent"] is None else f"{r['exponent']:.2f}"
                flag = "  SUPER-LINEAR" if r["superlinear"] else ""
                phases = ", ".join(f"{ph} {v['exponent']:.2f}" for ph, v in r["phases"].items()
                                   if v["exponent"] is not None)
                lines.append(f"{side} {axis} {r['from']} -> {r['to']}: tokens x{r['token_ratio']:.2f}, "
                             f"time x{r['time_ratio']:.2f}, exponent {exp}{flag} ({phases})")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description="opct vs TRL step time over a prompt-length x new-token grid.")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-tokens", default="100,400,1600", help="comma-separated target prompt lengths")
    p.add_argument("--new-tokens", default="32,128,512", help="comma-separated max_new_tokens values")
    p.add_argument("--cells", help="run only these cells, e.g. 400x128,1600x128 (default: the whole grid)")
    p.add_argument("--sides", default="opct,trl", help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--rerun", default="", metavar="SIDES",
                   help="comma-separated sides to measure again in the chosen cells where their result was measured at "
                        "another commit (the replaced runs are kept under each cell's `replaced`)")
    p.add_argument("--vllm-python", metavar="PATH", help="interpreter for the opct_vllm side (vllm installed)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads of every side (default: each side's)")
    p.add_argument("--contention", nargs="?", const="own", choices=["own", "same"], default=None,
                   help="run every side next to vs_trl's busy loop (own session, or `same`)")
    p.add_argument("--out", required=True, help="results JSON; resumed (finished cells skipped) when it exists")
    args = p.parse_args(argv)

    try:
        sides = [s.strip() for s in args.sides.split(",") if s.strip()]
        unknown = [s for s in sides if s not in SIDES]
        if unknown or not sides:
            raise GridError(f"--sides {args.sides!r}: unknown {unknown}; known: {', '.join(SIDES)}")
        rerun = tuple(s.strip() for s in args.rerun.split(",") if s.strip())
        if any(s not in sides for s in rerun):
            raise GridError(f"--rerun {args.rerun!r}: every side to rerun must be one of --sides {args.sides!r}")
        if "opct_vllm" in sides and not args.vllm_python:
            raise GridError("--sides opct_vllm needs --vllm-python PATH")
        cells = parse_cells(args.cells) if args.cells else grid_cells(
            parse_int_list(args.prompt_tokens, "--prompt-tokens"), parse_int_list(args.new_tokens, "--new-tokens"))
        config = {"model": args.model, "batch": args.batch, "lora_rank": args.lora_rank, "steps": args.steps,
                  "warmup": args.warmup, "threads": args.threads, "contention": args.contention,
                  # PyTorch's huge-page allocator setting, as both sides' processes get it (from this environment)
                  "huge_pages": huge_pages_env(), "machine": machine()}
        results = load_results(args.out, config)
    except GridError as e:
        sys.exit(f"cost_growth.py: {e}")
    results["config"]["sides"] = sorted(set(results["config"].get("sides", [])) | set(sides), key=SIDES.index)
    if args.contention:
        results["contention"] = BusyLoop(new_session=args.contention != "same").describe()

    commit = measured_stamp().get("commit") if rerun else None
    scripts = {"opct": Side("opct", OPCT_STEP), "trl": Side("trl", TRL_STEP),
               "opct_vllm": Side("opct_vllm", OPCT_STEP, python=args.vllm_python, extra=["--sampler", "vllm"])}
    for i, cell in enumerate(cells):
        key = cell_key(*cell)
        todo = pending_sides(results, cell, sides, rerun, commit)
        if not todo:
            print(f"[cost_growth] {key}: done before, skipped", file=sys.stderr, flush=True)
            continue
        flags = ["--model", args.model, "--batch", str(args.batch), "--lora-rank", str(args.lora_rank),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompt-tokens", str(cell[0]),
                 "--max-new-tokens", str(cell[1])]
        for side in todo if i % 2 == 0 else todo[::-1]:  # alternate who goes first from cell to cell
            print(f"[cost_growth] {key} {side} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            run = run_side(scripts[side], flags, args.contention, args.threads)
            run.pop("steps_phases_s", None)  # TRL's per-step split: large, and the median split is kept
            run["measured"] = measured_stamp()
            entry = results["cells"].setdefault(key, {"prompt_tokens": cell[0], "new_tokens": cell[1], "runs": {}})
            record_run(entry, side, run)
            results["growth"] = growth(results, results["config"]["sides"])
            save_results(args.out, results)
            print(f"[cost_growth]   median_step_s={run.get('median_step_s')} peak_rss_mb={run.get('peak_rss_mb')} "
                  f"({time.perf_counter() - t0:.0f} s){' ERROR ' + run['error'] if 'error' in run else ''}",
                  file=sys.stderr, flush=True)
            if shared(run, args.contention):
                print(f"[cost_growth]   SHARED: other processes kept {run['others_busy_cores']:.2f} cores busy during "
                      "this run; the same command runs it again", file=sys.stderr, flush=True)

    results["growth"] = growth(results, results["config"]["sides"])
    results["table"] = markdown_table(results, results["config"]["sides"])
    save_results(args.out, results)
    print(results["table"])
    print()
    print("\n".join(growth_lines(results["growth"])))


if __name__ == "__main__":
    main()
