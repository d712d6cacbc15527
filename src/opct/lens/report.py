"""A demo's lens page, tokens.html beside its report: the token viewer (lens/viewer.py) over what the demo wrote.

Training: each on-policy run of the first seed (OPCT and its controls) with token logs (<run>/tokens, lens/tokens.py),
every logged step's samples, both prompts with their token difference marked and each response token's two
log-probs. Evaluations: every evaluated prompt of the first seed's runs (samples/<run>.jsonl), the answers of base,
SFT, OPCT, ... side by side with their verdicts (the rows' "verdict", axes.base.write_samples).
"""

from __future__ import annotations

import json
from pathlib import Path

from opct.lens import tokens, viewer
from opct.lens.diff import token_diff

MAX_STEPS = 40  # logged steps shown per run (evenly spaced over the run when it logged more)
MAX_EVALS = 400  # evaluation prompts shown (their first ones in the base model's sample order)


def training_steps(run_dir: Path, runs: dict[str, str]) -> list[dict]:
    """The viewer's steps: {method: its run's directory name} -> [{"label", "samples"}] per logged step."""
    out = []
    for method, name in runs.items():
        logged = tokens.logged_steps(run_dir / name)
        if len(logged) > MAX_STEPS:
            logged = [logged[round(i * (len(logged) - 1) / (MAX_STEPS - 1))] for i in range(MAX_STEPS)]
        for step in logged:
            tok_t, prompts = tokens.read_step(run_dir / name, step)
            by_sample: dict[int, dict] = {}
            for r in tok_t.to_pylist():
                by_sample.setdefault(r["sample"], []).append(r)
            samples = []
            for p in prompts.to_pylist():
                rows = sorted(by_sample.get(p["sample"], []), key=lambda r: r["position"])
                d = token_diff(p["student_ids"], p["teacher_ids"])
                samples.append({"pair": p["pair"], "label": f"sample {p['sample']}, pair {p['pair']}",
                                "student_prompt": p["student_tokens"], "teacher_prompt": p["teacher_tokens"],
                                "student_diff": d.student, "teacher_diff": d.teacher,
                                "response": [r["token"] for r in rows],
                                "logp_student": [r["logp_student"] for r in rows],
                                "logp_teacher": [r["logp_teacher"] for r in rows],
                                "in_loss": [r["in_loss"] for r in rows],
                                "reasoning": [r["reasoning"] for r in rows] if any(r["reasoning"] for r in rows)
                                else None})
            out.append({"label": f"{method} · step {step}", "samples": samples})
    return out


def prompt_text(row: dict) -> str:
    if "prompt" in row:
        return row["prompt"]
    return "\n\n".join(f"[{m['role']}] {m['content']}" for m in row.get("messages", []))


def answer_text(row: dict) -> str:
    for key in ("response", "answer"):
        if key in row:
            return str(row[key])
    return ""


def evaluation_rows(run_dir: Path, axis: str, runs: dict[str, str]) -> list[dict]:
    """The viewer's evals: each prompt of the base model's samples files with every run's answer to it."""
    by_run: dict[str, dict] = {}
    folder = run_dir / "samples"
    for method, name in runs.items():
        files = sorted(p for p in folder.glob("*.jsonl") if p.name == f"{name}.jsonl" or p.name.startswith(f"{name}."))
        for path in files:  # <run>.jsonl and, e.g., <run>.shifted.jsonl: a row is (file, split, id)
            part = path.name[len(name):]
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            by_run.setdefault(method, {}).update({(part, r.get("split"), str(r.get("id"))): r for r in rows})
    if not by_run:
        return []
    first = next(iter(by_run.values()))
    out = []
    for key, row in list(first.items())[:MAX_EVALS]:
        out.append({"axis": axis, "split": str(key[1]), "id": key[2], "prompt": prompt_text(row),
                    "answers": [{"method": m, "text": answer_text(rows[key]), "verdict": rows[key].get("verdict", {})}
                                for m, rows in by_run.items() if key in rows]})
    return out


def write_page(run_dir: Path, axis: str, trained: dict[str, str], evaluated: dict[str, str]) -> Path | None:
    """tokens.html under run_dir (None when there is nothing to show): `trained` {method: run dir name} of the runs
    whose token logs to show, `evaluated` {method: run name} of the runs whose evaluations to show side by side."""
    steps = training_steps(run_dir, trained)
    evals = evaluation_rows(run_dir, axis, evaluated)
    if not steps and not evals:
        return None
    return viewer.write(run_dir / "tokens.html", f"opct lens: {run_dir.name} ({axis})", steps, evals)
