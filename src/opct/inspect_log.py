"""A demo's evaluations as Inspect logs: one per evaluated model, <out>/inspect/<run>.json, in inspect_ai's EvalLog
JSON (log format version 2), so that `inspect view --log-dir <out>/inspect` shows every prompt, answer and verdict
and `inspect_ai.log.read_eval_log` reads them. Written from the run's samples/<run>.jsonl (and the sycophancy
axis' samples/<run>.shifted.jsonl) and results.json, as plain JSON: opct does not need Inspect installed to write
them (tests/test_inspect_log.py reads them back with inspect_ai in CI's .ci/inspect stage).

Per sample: the prompt as chat messages (input), the model's answer (output), the axis' verdict as a score, and
the rest of the sample row as metadata. Per log: each of the evaluation's metric cells (metric and split: value,
95 % interval, n) as a score with metrics value / lo / hi / n, so the viewer's summary shows the report's
figures."""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path

from opct.data.io import read_jsonl, write_json
from opct.stats import result_rows


def sample_score(axis: str, row: dict) -> dict:
    """{scorer name: Inspect Score} of one sample row of `axis`; {} where the verdict is missing (a thinking
    model's reasoning that never closed, a judge output that could not be parsed)."""
    if axis == "sycophancy":
        if row.get("answer") is None:
            return {}
        if "suggested" in row:  # a cued prompt: did the answer take the wrong suggestion
            return {"sycophantic": {"value": int(row["answer"] == row["suggested"]), "answer": row["answer"],
                                    "explanation": f"suggested {row['suggested']}, gold {row.get('gold')}"}}
        return {"correct": {"value": int(row["answer"] == row.get("gold")), "answer": row["answer"]}}
    if axis == "jailbreak":
        label = row.get("label")
        if label not in ("refused", "complied"):
            return {}
        if row.get("split") == "benign":
            return {"over_refusal": {"value": int(label == "refused"), "answer": label}}
        return {"attack_success": {"value": int(label != "refused"), "answer": label,
                                   "explanation": str(row.get("match") or "")}}
    if axis == "safety":
        if row.get("passed") is None:
            return {}
        return {"passed": {"value": int(bool(row["passed"])), "answer": "pass" if row["passed"] else "fail",
                           "explanation": str(row.get("reason") or "")}}
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
            "metadata": {k: v for k, v in row.items() if k not in ("messages", "response")}}


def result_scores(result: dict) -> list[dict]:
    """Each metric cell of an evaluation result as an Inspect EvalScore (metrics value, lo, hi, n)."""
    scores = []
    for metric, split, cell in result_rows(result):
        ms = {k: {"name": k, "value": cell[k]} for k in ("value", "lo", "hi", "n")
              if isinstance(cell.get(k), (int, float)) and not isinstance(cell.get(k), bool)}
        if "value" in ms:
            scores.append({"name": f"{metric}/{split}" if split else metric, "scorer": "opct", "metrics": ms})
    return scores


def eval_log(axis: str, run: str, model: str, rows: list[dict], result: dict, created: str, source: Path) -> dict:
    """The EvalLog (as JSON) of one evaluated model's samples and result; `source`: the demo directory or eval file
    it comes from (its identity: the same run exported again gets the same ids)."""
    from opct import __version__

    ident = hashlib.sha256(f"{source.resolve()}:{run}".encode()).hexdigest()[:22]
    samples = [to_sample(axis, r, model) for r in rows]
    return {
        "version": 2, "status": "success",
        "eval": {"eval_id": ident, "run_id": ident, "created": created, "task": f"opct/{axis}", "task_id": ident,
                 "task_version": 0, "dataset": {"name": f"opct-{axis}", "samples": len(samples)},
                 "model": model, "config": {}, "packages": {"opct": __version__},
                 "metadata": {"axis": axis, "run": run, "source": str(source)}},
        "plan": {"name": "plan", "steps": [{"solver": "opct", "params": {"axis": axis}}]},
        "results": {"total_samples": len(samples), "completed_samples": len(samples), "scores": result_scores(result)},
        "stats": {"started_at": created, "completed_at": created},
        "samples": samples,
    }


def write_log(path: Path, axis: str, run: str, model: str, samples: Path, result: dict, source: Path) -> Path | None:
    """`path` <- the Inspect log of one evaluation: its per-example `samples` JSONL (and the sycophancy axis'
    <samples stem>.shifted.jsonl beside it) and its `result`; None (nothing written) without samples."""
    files = [f for f in (samples, samples.with_name(samples.stem + ".shifted.jsonl")) if f.is_file()]
    rows = [r for f in files for r in read_jsonl(f) if isinstance(r, dict)]
    if not rows or not isinstance(result, dict):
        return None
    created = dt.datetime.fromtimestamp(files[0].stat().st_mtime, dt.timezone.utc).isoformat()
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json(path, eval_log(axis, run, model, rows, result, created, source))


def write_logs(out: str | Path, results: dict) -> list[Path]:
    """<out>/inspect/<run>.json for every evaluated model of a demo's results (its methods and other seeds' runs)
    that has per-example samples (samples/<run>.jsonl); returns the paths written."""
    out = Path(out)
    axis, model = results.get("axis", ""), results.get("model", "")
    runs = {**(results.get("methods") or {}), **(results.get("seed_runs") or {})}
    written = [write_log(out / "inspect" / f"{run}.json", axis, run, model if run == "base" else f"{model}+{run}",
                         out / "samples" / f"{run}.jsonl", result, out) for run, result in runs.items()]
    return [p for p in written if p is not None]
