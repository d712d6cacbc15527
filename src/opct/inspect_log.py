"""A demo's evaluations as Inspect logs: one per evaluated model, <out>/inspect/<created>_<axis>_<run>_<id>.json
(e.g. inspect/2026-11-29T10-04-31-00-00_sycophancy_opct-seed0_3f9a...json), in inspect_ai's EvalLog JSON (log format
version 2), so that `inspect view --log-dir <out>/inspect` and `inspect log list --log-dir <out>/inspect` list them
and show every prompt, answer and verdict, and `inspect_ai.log.read_eval_log` / `read_eval_log_samples` read them.
Written from the run's samples/<run>.jsonl (and the sycophancy axis' samples/<run>.shifted.jsonl) and results.json,
as plain JSON: opct does not need Inspect installed to write them (tests/test_inspect_log.py reads them back with
inspect_ai, over `inspect view`'s HTTP API too, in CI's .ci/inspect stage).

The name is Inspect's own shape: Inspect lists a .json file as a log only when its name starts with an ISO time
(inspect_ai/log/_file.py, `log_file_pattern` and `is_log_file`, 0.3.285) and reads task and task id from the rest,
{created}_{task}_{model}_{id} (INSPECT_EVAL_LOG_FILE_PATTERN={task}_{model}_{id}, inspect_ai/_util/log_layout.py),
here with the run (base, sft-seed0, opct-seed0, opct-seed4, ...) in the model's place. Created is the samples
file's time (to the second) and the id a hash of the run's source and name, so exporting the same run again
overwrites its log; a log this writes replaces the logs opct wrote before for the same run in that directory (an older time's, and the
<run>.json / X.inspect.json names earlier opct wrote), and no other file.

Per sample: the prompt as chat messages (input), the model's answer (output), the axis' verdict as a score, and
the rest of the sample row as metadata. Per log: each of the evaluation's metric cells (metric and split: value,
95 % interval, n) as a score with metrics value / lo / hi / n, so the viewer's summary shows the report's
figures."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path

from opct.data.io import read_jsonl, write_json
from opct.experiment import BASE, on_disk, runs
from opct.stats import result_rows
from opct import __version__
from opct.axes import AXES, get_axis
from opct.axes.verdicts import VERDICTS


def sample_score(axis: str, row: dict) -> dict:
    """{scorer name: Inspect Score} of one sample row of `axis`: the verdict the row carries (opct.axes.base.
    write_samples), or for a row an earlier opct wrote the axis' own (Axis.verdict; opct's axes' from
    opct.axes.verdicts, which needs no torch); {} where there is none, or for an axis this opct does not know."""
    if isinstance(row.get("verdict"), dict):
        return row["verdict"]
    if axis in VERDICTS:
        return VERDICTS[axis](row)
    if axis in AXES:  # an axis registered beside opct's own
        return get_axis(axis).verdict(row)
    return {}


def sample_input(row: dict) -> list[dict]:
    """The prompt as Inspect chat messages: the sample's own transcript, or its prompt as one user turn (plus a
    prefill item's started reply)."""
    messages = row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}]
    if "prefill" in row and messages[-1]["role"] != "assistant":
        messages = [*messages, {"role": "assistant", "content": row["prefill"]}]
    return [{"role": m["role"], "content": m["content"], "source": "input"} for m in messages]


def answer_text(row: dict) -> str:
    got = row.get("response", row.get("answer"))
    return "" if got is None else str(got)


def to_sample(axis: str, row: dict, model: str) -> dict:
    inp = sample_input(row)
    out = answer_text(row)
    reply = {"role": "assistant", "content": out, "source": "generate", "model": model}
    return {"id": f"{row.get('split', 'all')}/{row.get('id', '')}", "epoch": 1, "input": inp,
            "target": str(row.get("gold") or ""), "messages": [*inp, reply],
            "output": {"model": model, "choices": [{"message": reply, "stop_reason": "stop"}], "completion": out},
            "scores": sample_score(axis, row) or None,
            "metadata": {k: v for k, v in row.items() if k not in ("messages", "response", "verdict")}}


def result_scores(result: dict) -> list[dict]:
    """Each metric cell of an evaluation result as an Inspect EvalScore (metrics value, lo, hi, n)."""
    scores = []
    for metric, split, cell in result_rows(result):
        ms = {k: {"name": k, "value": cell[k]} for k in ("value", "lo", "hi", "n")
              if isinstance(cell.get(k), (int, float)) and not isinstance(cell.get(k), bool)}
        if "value" in ms:
            scores.append({"name": f"{metric}/{split}" if split else metric, "scorer": "opct", "metrics": ms})
    return scores


def log_id(source: Path, run: str) -> str:
    """The ids (eval, run, task) of the log of `run` from `source`: the same run exported again gets the same."""
    return hashlib.sha256(f"{Path(source).resolve()}:{run}".encode()).hexdigest()[:22]


INSPECT_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}[:-]\d{2}[:-]\d{2}")  # inspect_ai's log_file_pattern


def name_part(text: str) -> str:
    """One '_'-separated part of an Inspect log file name: Inspect's clean_filename_component (_ / : + -> -), and
    any other character but letters, digits, '.' and '-' too."""
    return re.sub(r"[^A-Za-z0-9.-]", "-", str(text)) or "-"


def log_name(created: str, axis: str, label: str, ident: str) -> str:
    """{created}_{task}_{label}_{id}.json, as Inspect names a log (its task without the package: `sycophancy`
    for opct/sycophancy), e.g. 2026-11-29T10-04-31-00-00_sycophancy_opct-seed0_<id>.json."""
    return "_".join(name_part(x) for x in (created, axis, label, ident)) + ".json"


def opct_log_run(path: Path) -> tuple[str, str] | None:
    """(run, label) of an Inspect log that opct wrote (its eval.packages name opct; label: the run where the log
    names none, as before labels); None for any other file."""
    try:
        log = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    spec = log.get("eval") if isinstance(log, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("packages"), dict) or "opct" not in spec["packages"]:
        return None
    meta = spec.get("metadata") if isinstance(spec.get("metadata"), dict) else {}
    return (meta.get("run"), meta.get("label", meta.get("run"))) if isinstance(meta.get("run"), str) else None


def remove_stale(path: Path, run: str, label: str, legacy: list[Path]) -> list[Path]:
    """Remove the other logs opct wrote of `run` under `label` beside `path`: an Inspect-named one with the label
    in the run's place (another time's, or another id's: the directory moved), and those of `legacy`'s names (the
    names earlier opct gave them) of the same run. Files opct did not write are left. Returns the paths removed."""
    same = [p for p in path.parent.iterdir()
            if p.suffix == ".json" and INSPECT_NAME.match(p.name) and p.stem.split("_")[2:3] == [name_part(label)]]
    removed = []
    for old in sorted({*same, *(p for p in legacy if p.is_file() and p.parent.resolve() == path.parent.resolve())}):
        got = opct_log_run(old) if old != path else None
        if got is not None and got[0] == run and (old in legacy or got[1] == label):
            old.unlink()
            removed.append(old)
    return removed


def eval_log(axis: str, run: str, model: str, rows: list[dict], result: dict, created: str, source: Path,
             label: str | None = None) -> dict:
    """The EvalLog (as JSON) of one evaluated model's samples and result; `source`: the demo directory or eval file
    it comes from (its identity: the same run exported again gets the same ids); `label`: the name in the log's file
    name (the run unless given)."""
    ident = log_id(source, run)
    samples = [to_sample(axis, r, model) for r in rows]
    return {
        "version": 2, "status": "success",
        "eval": {"eval_id": ident, "run_id": ident, "created": created, "task": f"opct/{axis}", "task_id": ident,
                 "task_version": 0,
                 "dataset": {"name": f"opct-{axis}", "samples": len(samples),
                             "sample_ids": [s["id"] for s in samples], "shuffled": False},
                 "model": model, "config": {}, "packages": {"opct": __version__},
                 "metadata": {"axis": axis, "run": run, "label": label or run, "source": str(source)}},
        "plan": {"name": "plan", "steps": [{"solver": "opct", "params": {"axis": axis}}]},
        "results": {"total_samples": len(samples), "completed_samples": len(samples), "scores": result_scores(result)},
        "stats": {"started_at": created, "completed_at": created},
        "samples": samples,
    }


def write_log(log_dir: Path, axis: str, run: str, model: str, samples: Path, result: dict, source: Path,
              label: str | None = None) -> Path | None:
    """<log_dir>/<created>_<axis>_<label>_<id>.json (label: `run` unless given) <- the Inspect log of one
    evaluation: its per-example `samples` JSONL (and the sycophancy axis' <samples stem>.shifted.jsonl beside it)
    and its `result`; created: the samples file's time, id: log_id(source, run). The logs opct wrote before of the
    same run and label in log_dir (another time's, <run>.json, <source stem>.inspect.json) are removed. Returns the
    path; None (nothing written, nothing removed) without samples."""
    files = [f for f in (samples, samples.with_name(samples.stem + ".shifted.jsonl")) if f.is_file()]
    rows = [r for f in files for r in read_jsonl(f) if isinstance(r, dict)]
    if not rows or not isinstance(result, dict):
        return None
    stamp = dt.datetime.fromtimestamp(int(files[0].stat().st_mtime), dt.timezone.utc)
    created, ident, log_dir = stamp.isoformat(), log_id(source, run), Path(log_dir)
    path = log_dir / log_name(created, axis, label or run, ident)
    log_dir.mkdir(parents=True, exist_ok=True)
    write_json(path, eval_log(axis, run, model, rows, result, created, source, label))
    remove_stale(path, run, label or run, [log_dir / f"{run}.json", Path(source).with_suffix(".inspect.json")])
    return path


def write_logs(out: str | Path, results: dict) -> list[Path]:
    """<out>/inspect/<created>_<axis>_<run>_<id>.json for every evaluated model of a demo's results (results "runs":
    base and each "<method>-seed<S>") that has per-example samples (samples/<run>.jsonl; in a demo an earlier opct
    wrote, the first seed's are samples/<method>.jsonl: opct.experiment.on_disk); returns the paths written."""
    out = Path(out)
    axis, model = results.get("axis", ""), results.get("model", "")
    written = [write_log(out / "inspect", axis, run, model if run == BASE else f"{model}+{run}",
                         out / "samples" / f"{on_disk(out, run, results)}.jsonl", result, out)
               for run, result in runs(results).items()]
    return [p for p in written if p is not None]
