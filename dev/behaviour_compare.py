"""Compare two folders written by dev/behaviour_check.sh (old code, new code): exit 0 when they agree.

What must agree: dev/eval_seam_check.py's file (each result's evaluation read through this opct's reader,
opct.experiment.read_evaluation; the samples row for row); each demo's results.json read through this opct's
reader (opct.experiment.read_results), less its timings; every logged per-step value of every training run (less
wall-clock times); every run's adapter weights; every per-example samples file; each Inspect log's samples and
its result scores.
Differences a change intends (e.g. a comparison an axis did not have before) are listed with --allow KEY (a
results.json top-level key, "comparison.<pair>", or "inspect.scores": the Inspect logs' result scores) and printed,
not failed.

Runs are matched by name through an explicit mapping (`renames`): an OLD folder written before every run was named
"<method>-seed<S>" has its first seed's runs under the method's name (<demo>/opct, samples/opct.jsonl, the Inspect
log of run opct, whose samples name the model "<model>+opct"); each is compared with the NEW folder's
"<method>-seed<first seed>" and the renames are printed as intended differences, not failed.

    python dev/behaviour_compare.py OLD NEW [--allow comparison.opct_minus_base ...]
"""

import argparse
import filecmp
import json
import sys
from pathlib import Path

from opct.axes.verdicts import VERDICTS
from opct.experiment import TRAINED, first_seed, read_evaluation, read_results, run_name

TIME_KEYS = ("time_", "_seconds", "tok_s", "tokens_per_s", "threads", "peak_mem")  # the machine's, not the run's


def load(path: Path, root: Path):
    """A JSON file with its folder's own path written as <dir> (the two folders' paths differ)."""
    return json.loads(path.read_text().replace(str(root.resolve()), "<dir>"))


def steps(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIME_KEYS)} for r in rows]


def eval_result(res: dict | None, axis: str):
    """An `opct eval --axis` result ({"axis", "info", **its evaluation}) with its evaluation read through this opct's
    reader (opct.experiment.read_evaluation: one written flat, before 2026-12-04, in the schema's sections)."""
    if not isinstance(res, dict):
        return res
    head = {k: res[k] for k in ("axis", "model", "info") if k in res}
    return {**head, **read_evaluation({k: v for k, v in res.items() if k not in head}, axis)}


def results(path: Path, root: Path) -> dict:
    r = read_results(load(path, root), str(path))
    return {k: v for k, v in r.items() if k not in ("timings", "wall_seconds")}


def inspect_samples(d: Path, root: Path, renames: dict | None = None) -> dict:
    """{run: the samples of its Inspect log}; `renames` (new name -> old name): a run's log is keyed by its old name
    and the model its samples name ("<model>+<run>") written with it."""
    out = {}
    for p in sorted(d.glob("*.json")):
        run = p.name.split("_", 2)[2].rsplit("_", 1)[0]  # <created>_<axis>_<run>_<id>.json
        samples = load(p, root).get("samples")
        if run in (renames or {}):
            samples = json.loads(json.dumps(samples).replace(f'+{run}"', f'+{renames[run]}"'))
            run = renames[run]
        out[run] = samples
    return out


def inspect_scores(d: Path) -> dict:
    """{run: {score name: its metrics}} of a demo's Inspect logs (the log's results, from its evaluation's metrics)."""
    return {p.name.split("_", 2)[2].rsplit("_", 1)[0]: {s["name"]: s["metrics"] for s in
                                                        json.loads(p.read_text())["results"]["scores"]}
            for p in sorted(d.glob("*.json"))}


def same_rows(old_lines: list[str], new_lines: list[str], axis: str) -> str:
    """"same": the same sample rows; "verdicts": the same rows, where each new row also carries "verdict", its axis'
    own verdict of the rest of the row (what opct.axes.base.write_samples adds since issue 64); "" otherwise."""
    if old_lines == new_lines:
        return "same"
    old, new = [json.loads(x) for x in old_lines], [json.loads(x) for x in new_lines]
    bare = [{k: v for k, v in r.items() if k != "verdict"} for r in new]
    if bare == old and all("verdict" not in r for r in old) and \
            all(r.get("verdict") == VERDICTS[axis](b) for r, b in zip(new, bare)):
        return "verdicts"
    return ""


def renames(old_demo: Path, results_old: dict) -> dict[str, str]:
    """{old run name: new run name} for an OLD demo folder that named its first seed's runs after their method:
    <method> -> <method>-seed<first seed> (opct.experiment.run_name); {} for a folder already in the new layout."""
    first = first_seed(results_old)
    return {m: run_name(m, first) for m in TRAINED if (old_demo / m).is_dir()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--allow", action="append", default=[])
    a = ap.parse_args()
    bad, allowed, checked = [], [], 0
    eo, en = load(a.old / "eval_seam.json", a.old), load(a.new / "eval_seam.json", a.new)
    for key in sorted(set(eo) | set(en)):  # "<axis>/<backend>": {"result", "samples"}
        checked += 1
        o, n = eo.get(key, {}), en.get(key, {})
        rows = same_rows(o.get("samples") or [], n.get("samples") or [], key.split("/")[0])
        axis = key.split("/")[0]
        if eval_result(o.get("result"), axis) != eval_result(n.get("result"), axis) or not rows:
            bad.append(f"eval_seam.json {key} differs")
        elif rows == "verdicts":
            allowed.append(f"eval_seam.json {key}: every sample row also carries its verdict")
    for demo in sorted(p for p in a.old.iterdir() if (p / "results.json").is_file()):
        new = a.new / demo.name
        ro, rn = results(demo / "results.json", a.old), results(new / "results.json", a.new)
        renamed = renames(demo, ro)
        for o, n in renamed.items():
            allowed.append(f"{demo.name}: run {o} is {n} (its directory, samples and Inspect log)")
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
            other = new / renamed.get(run.name, run.name)
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
            stem, dot, rest = p.name.partition(".")  # <run>.jsonl, <run>.shifted.jsonl
            q = new / "samples" / (renamed.get(stem, stem) + dot + rest)
            rows = q.is_file() and same_rows(p.read_text().splitlines(), q.read_text().splitlines(), ro["axis"])
            if not rows:
                bad.append(f"{demo.name}: samples/{p.name} differs")
            elif rows == "verdicts":
                allowed.append(f"{demo.name}: samples/{p.name}: every row also carries its verdict")
        checked += 1
        back = {n: o for o, n in renamed.items()}
        if inspect_samples(demo / "inspect", a.old) != inspect_samples(new / "inspect", a.new, back):
            bad.append(f"{demo.name}: Inspect logs' samples differ")
        so, sn = inspect_scores(demo / "inspect"), inspect_scores(new / "inspect")
        sn = {back.get(r, r): s for r, s in sn.items()}
        for run in sorted(set(so) | set(sn)):
            checked += 1
            o, n = so.get(run, {}), sn.get(run, {})
            if o != n:
                what = ", ".join([f"-{k}" for k in o if k not in n] + [f"+{k}" for k in n if k not in o] +
                                 [f"{k} values" for k in o if k in n and o[k] != n[k]])
                (allowed if "inspect.scores" in a.allow else bad).append(
                    f"{demo.name}: the Inspect log of {run} scores differently ({what})")
    for line in allowed:
        print(f"intended: {line}")
    for line in bad:
        print(f"DIFFERS: {line}")
    print(f"{checked} comparisons, {len(bad)} differ, {len(allowed)} intended differences")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
