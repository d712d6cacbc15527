"""What each `opct` command does once cli.py has built and checked its config: one library call, and the line that
says where its output went.

cli.py imports this module only when a command runs, after `before_torch`: importing it loads torch and the models'
stack (through the modules below), so `opct --help` and a refused option stay light and the process settings that
torch reads at its first allocation come first. Each call looks its function up on its module when it runs
(`evaluate.run_eval(...)`), so a test's replacement of it is what runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opct import demo, evaluate, report
from opct.algo import opct as on_policy
from opct.algo import sft as offline
from opct.evals import capability
from opct.experiment import parse_methods, run_name
from opct.lens import check as lens_check
from opct.stats import result_rows


def rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 speaks for all


def train(cfg) -> None:
    out = on_policy.train(cfg)
    if rank0():
        print(f"opct: done -> {out}/model (metrics: {out}/metrics.jsonl)")


def sft(cfg) -> None:
    out = offline.train_sft(cfg)
    if rank0():
        print(f"opct: done -> {out}/model (targets: {out}/targets.jsonl, metrics: {out}/metrics.jsonl)")


def eval_tasks(cfg) -> None:
    print(capability.format_results(evaluate.run_capability_eval(cfg)))
    if cfg.out:
        print(f"opct: wrote {cfg.out}")


def eval_axis(cfg) -> None:
    res = evaluate.run_eval(cfg)
    for metric, split, c in result_rows(res):  # value None: nothing measured (n = 0)
        value = "  -  " if c["value"] is None else f"{c['value']:.3f}"
        print(f"{metric:16s} {split:20s} {value}  [{c['lo']:.3f}, {c['hi']:.3f}]  n={c['n']}")
    if cfg.out:
        print(f"opct: wrote {cfg.out}")
    else:
        print(json.dumps(res))


def run_demo(cfg) -> None:
    out = demo.run_demo(cfg)
    models = ", ".join(f"{out}/{run_name(m, cfg.seed)}/model" for m in parse_methods(cfg.methods))
    more = "; the other seeds' beside them as <method>-seed<S>" if cfg.seeds > 1 else ""
    print(f"opct: demo done -> {out}/report.md  ({out}/results.json, models in {models}{more})")


def run_demos(cfgs: list, top: Path, names: list[str]) -> None:
    out = demo.run_demos(cfgs, top)
    print(f"opct: demo done -> {out}/report.md  (summary.json; one demo per axis: "
          f"{', '.join(f'{out}/{n}' for n in names)})")


def check(cfg) -> None:
    lens_check.print_summary(lens_check.run_check(cfg))
    print(f"opct: wrote {cfg.out}/check.json and {cfg.out}/check.html")


def write_summary(run_dir: str, axes: list[str], wall) -> None:
    for name in axes:
        report.write_report(Path(run_dir) / name)
    paths = report.write_summary(run_dir, axes, wall_seconds=wall)
    print(f"opct: wrote {paths['markdown']} and {paths['html']} (and each axis' report)")


def write_report(run_dir: str) -> None:
    paths = report.write_report(run_dir)
    print(f"opct: wrote {paths['markdown']} and {paths['html']}")
