"""Compare two folders written by dev/behaviour_check.sh (old code, new code): exit 0 when they agree.

What must agree: dev/eval_seam_check.py's file (byte for byte); each demo's results.json read through this opct's
reader (opct.experiment.read_results), less its timings; every logged per-step value of every training run (less
wall-clock times); every run's adapter weights; every per-example samples file; each Inspect log's samples.
Differences a change intends (e.g. a comparison an axis did not have before) are listed with --allow KEY (a
results.json top-level key or "comparison.<pair>") and printed, not failed.

    python dev/behaviour_compare.py OLD NEW [--allow comparison.opct_minus_base ...]
"""

import argparse
import filecmp
import json
import sys
from pathlib import Path

from opct.experiment import read_results

TIME_KEYS = ("time_", "_seconds", "tok_s", "tokens_per_s", "threads", "peak_mem")  # the machine's, not the run's


def load(path: Path, root: Path):
    """A JSON file with its folder's own path written as <dir> (the two folders' paths differ)."""
    return json.loads(path.read_text().replace(str(root.resolve()), "<dir>"))


def steps(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)} for r in rows]


def results(path: Path, root: Path) -> dict:
    r = read_results(load(path, root), str(path))
    return {k: v for k, v in r.items() if k not in ("timings", "wall_seconds")}


def inspect_samples(d: Path, root: Path) -> dict:
    out = {}
    for p in sorted(d.glob("*.json")):
        run = p.name.split("_", 2)[2].rsplit("_", 1)[0]  # <created>_<axis>_<run>_<id>.json
        out[run] = load(p, root).get("samples")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--allow", action="append", default=[])
    a = ap.parse_args()
    bad, allowed, checked = [], [], 0
    if not filecmp.cmp(a.old / "eval_seam.json", a.new / "eval_seam.json", shallow=False):
        bad.append("eval_seam.json differs")
    checked += 1
    for demo in sorted(p for p in a.old.iterdir() if (p / "results.json").is_file()):
        new = a.new / demo.name
        ro, rn = results(demo / "results.json", a.old), results(new / "results.json", a.new)
        for k in sorted(set(ro) | set(rn)):
            if k == "comparison":
                co, cn = ro.get(k) or {}, rn.get(k) or {}
                for pair in sorted(set(co) | set(cn)):
                    checked += 1
                    if co.get(pair) != cn.get(pair):
                        what = "values differ" if pair in co and pair in cn else \
                            ("new" if pair in cn else "gone")
                        (allowed if f"comparison.{pair}" in a.allow else bad).append(
                            f"{demo.name}: results comparison.{pair}: {what}")
                continue
            checked += 1
            if ro.get(k) != rn.get(k):
                (allowed if k in a.allow else bad).append(f"{demo.name}: results.json {k!r} differs")
        for run in sorted(p.parent for p in demo.glob("*/metrics.jsonl")):
            other = new / run.name
            checked += 3
            if not (other / "metrics.jsonl").is_file():
                bad.append(f"{demo.name}/{run.name}: no run in the new folder")
                continue
            if steps(run / "metrics.jsonl") != steps(other / "metrics.jsonl"):
                bad.append(f"{demo.name}/{run.name}: logged per-step values differ")
            w = "model/adapter_model.safetensors"
            if not filecmp.cmp(run / w, other / w, shallow=False):
                bad.append(f"{demo.name}/{run.name}: adapter weights differ")
            if (run / "targets.jsonl").is_file() and not filecmp.cmp(run / "targets.jsonl", other / "targets.jsonl",
                                                                     shallow=False):
                bad.append(f"{demo.name}/{run.name}: SFT targets differ")
        for p in sorted((demo / "samples").glob("*.jsonl")):
            checked += 1
            q = new / "samples" / p.name
            if not q.is_file() or not filecmp.cmp(p, q, shallow=False):
                bad.append(f"{demo.name}: samples/{p.name} differs")
        checked += 1
        if inspect_samples(demo / "inspect", a.old) != inspect_samples(new / "inspect", a.new):
            bad.append(f"{demo.name}: Inspect logs' samples differ")
    for line in allowed:
        print(f"intended: {line}")
    for line in bad:
        print(f"DIFFERS: {line}")
    print(f"{checked} comparisons, {len(bad)} differ, {len(allowed)} intended differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
