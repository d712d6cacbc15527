"""Consistency pairs: what the student sees, what the teacher sees, and how both become token ids.

A pair is two chat transcripts that should get the same answer: the *student* side carries the
perturbation (a wrong hint, a jailbreak wrapper, ...), the *teacher* side is the clean or contrastive
prompt. Both are rendered with the tokenizer's own chat template and a generation prompt (each side's
`opct.data.chat.ChatFormat`), and the *same* response token ids are appended to both (never re-tokenised
text), so the teacher scores exactly the tokens the student sampled.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from opct.data.io import atomic_write, jsonl_objects
from opct.errors import UserError

ROLES = ("system", "user", "assistant")


class PairsError(UserError, ValueError):
    """Bad pairs input. The message names the file, line and field."""


@dataclass
class ConsistencyPair:
    student: list[dict]  # chat messages [{"role": ..., "content": ...}, ...] with the perturbation
    teacher: list[dict]  # the clean / contrastive messages
    meta: dict = field(default_factory=dict)


def check_messages(messages, where: str, side: str) -> list[dict]:
    """Validate one side of a pair; `where` is e.g. 'pairs.jsonl:12'."""
    if not isinstance(messages, list) or not messages:
        raise PairsError(f"{where}: field '{side}' must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        f = f"{side}[{i}]"
        if not isinstance(m, dict):
            raise PairsError(f"{where}: field '{f}' must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise PairsError(f"{where}: field '{f}.role' is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise PairsError(f"{where}: field '{f}.content' must be a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise PairsError(f"{where}: field '{side}' has no user turn (a chat transcript to answer needs one)")
    return out


def check_response_prefix(student: list[dict], teacher: list[dict], where: str) -> None:
    """A side may end with a partial assistant turn (e.g. "The answer is (") that the response continues. Either both
    sides end with the same one, so the same response tokens follow the same text, or only the student's does: a
    *prefill* pair (a compliant reply start as the perturbation, opct.axes.jailbreak.threats), where the teacher scores the
    student's continuation as the start of its own reply to its prompt. A prefix on the teacher's side only, or two
    different ones, is refused."""
    s_pre = student[-1]["content"] if student[-1]["role"] == "assistant" else None
    t_pre = teacher[-1]["content"] if teacher[-1]["role"] == "assistant" else None
    if t_pre is not None and s_pre != t_pre:
        raise PairsError(f"{where}: field 'teacher' ends with an assistant response prefix {t_pre!r}; the student's "
                         f"side must end with the same one (student: {s_pre!r}); a prefix on the student's side "
                         "only is a prefill pair")


def load_pairs(path: str | Path) -> list[ConsistencyPair]:
    """Read a JSONL file of {"student": [...], "teacher": [...], ...}; other keys go to `meta`."""
    pairs = []
    for where, row in jsonl_objects(path, PairsError):
        for side in ("student", "teacher"):
            if side not in row:
                raise PairsError(f"{where}: missing field '{side}'")
        student = check_messages(row.pop("student"), where, "student")
        teacher = check_messages(row.pop("teacher"), where, "teacher")
        check_response_prefix(student, teacher, where)
        pairs.append(ConsistencyPair(student, teacher, {**row, "_where": where}))
    if not pairs:
        raise PairsError(f"{path}: file has no pairs (empty)")
    same = [p.meta["_where"].rsplit(":", 1)[1] for p in pairs if _normalised(p.student) == _normalised(p.teacher)]
    if same:
        print(f"opct: warning: {path}: {len(same)} of {len(pairs)} pairs have the same student and teacher side "
              f"(up to whitespace), so they teach nothing (lines {', '.join(same[:10])}"
              f"{', ...' if len(same) > 10 else ''})", file=sys.stderr)
    return pairs


def _normalised(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], " ".join(m["content"].split())) for m in messages]


def save_pairs(pairs: list[ConsistencyPair], path: str | Path) -> None:
    lines = []
    for p in pairs:
        meta = {k: v for k, v in p.meta.items() if not k.startswith("_")}  # "_where" etc. are runtime-only
        lines.append(json.dumps({"student": p.student, "teacher": p.teacher, **meta}) + "\n")
    atomic_write(path, "".join(lines))
