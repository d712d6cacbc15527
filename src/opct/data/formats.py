"""Pair datasets in the community's formats, read into ConsistencyPairs, so pairs built for CTM or AttCT train here
as they are (docs/pairs.md; `opct train --pairs FILE --pairs-format auto|opct|ctm|attct`).

  opct   JSONL, {"student": [messages], "teacher": [messages], ...}: opct.data.pairs.load_pairs
  ctm    CTM's `ctm.prompt_pairs` JSONL (sohaibimran7/consistency-training-methods, ctm/pairs.py): "variant_messages"
         (student), "reference_messages" (teacher), "pair_id" (unique); other fields become metadata. Its native
         mcq-bias rows (and the CTM fork's `vdct.paired_prompts`) carry "biased_messages" (student) and
         "unbiased_messages" (teacher) instead. Each side is cut after its last user turn, as CTM's own loaders do
         (a trailing assistant turn there is a completion, not a reply prefix). A `<file>.manifest.json` beside the
         file, as CTM writes one, is checked: its row_count and the file's sha256 (content_sha256) must match.
  attct  AttCT's sycophancy pool (c-wei/AttCT, datasets/sycophancy_bct/): row-aligned files bct_<split>.jsonl
         (the cued question) and control_<split>.jsonl (the clean one), each row {"messages": [user, assistant]};
         pass the bct_ file, its control_ file is read beside it; student = the bct row's user turn, teacher = the
         control row's (the assistant turns, BCT targets, are not used). Or AttCT's prefill CSV (columns prompt,
         prefill[, prefill_type]): student = the prompt with the prefill as a started reply, teacher = the prompt
         (a prefill pair). AttCT's code adds the system prompt "You are a helpful assistant." to both sides; the
         files do not carry it and neither do the pairs read here.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

from opct.data.io import jsonl_objects
from opct.data.pairs import ConsistencyPair, PairsError, check_messages

FORMATS = ("auto", "opct", "ctm", "attct")
CTM_KEYS = (("variant_messages", "reference_messages"), ("biased_messages", "unbiased_messages"))
HINT = ("expected student/teacher (opct), variant_messages/reference_messages or biased_messages/unbiased_messages "
        "(CTM), messages (AttCT's bct_/control_ files) or a CSV with prompt,prefill columns (AttCT's prefills); "
        "docs/pairs.md")


def detect(path: Path) -> str:
    """The format of a pairs file from its name and first row, or PairsError naming the file and line."""
    if path.suffix.lower() == ".csv":
        return "attct"
    for where, row in jsonl_objects(path, PairsError):
        if "student" in row or "teacher" in row:
            return "opct"
        if any(s in row or t in row for s, t in CTM_KEYS):
            return "ctm"
        if "messages" in row:
            return "attct"
        raise PairsError(f"{where}: cannot tell the pairs format from the fields {sorted(row)[:8]}: {HINT}")
    raise PairsError(f"{path}: file has no pairs (empty)")


def user_turns(messages: list[dict]) -> list[dict]:
    """The transcript up to and with its last user turn (CTM and AttCT store completions after it)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    return messages[:last + 1]


def check_manifest(path: Path) -> None:
    """CTM's sidecar manifest, where there is one: the rows and bytes it was written for."""
    manifest = path.with_name(path.name + ".manifest.json")
    if not manifest.is_file():
        return
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PairsError(f"{manifest}: not a readable JSON manifest ({e})") from None
    data = path.read_bytes()
    if "content_sha256" in m and hashlib.sha256(data).hexdigest() != m["content_sha256"]:
        raise PairsError(f"{path}: its bytes do not match {manifest.name}'s content_sha256 (the file changed since "
                         "the manifest was written)")
    rows = sum(1 for line in data.splitlines() if line.strip())
    if "row_count" in m and m["row_count"] != rows:
        raise PairsError(f"{path}: {rows} rows, {manifest.name} says row_count {m['row_count']}")


def read_ctm(path: Path) -> list[ConsistencyPair]:
    check_manifest(path)
    pairs, ids = [], {}
    for where, row in jsonl_objects(path, PairsError):
        keys = next(((s, t) for s, t in CTM_KEYS if s in row or t in row), None)
        if keys is None:
            raise PairsError(f"{where}: missing field 'variant_messages' / 'reference_messages' (CTM's prompt pairs) "
                             "or 'biased_messages' / 'unbiased_messages' (its mcq-bias rows)")
        for k in keys:
            if k not in row:
                raise PairsError(f"{where}: missing field '{k}'")
        student = user_turns(check_messages(row.pop(keys[0]), where, keys[0]))
        teacher = user_turns(check_messages(row.pop(keys[1]), where, keys[1]))
        pid = row.get("pair_id", row.get("question_id"))
        if pid is not None and pid in ids:
            raise PairsError(f"{where}: field 'pair_id' {pid!r} repeats line {ids[pid]}")
        ids[pid] = where.rsplit(":", 1)[1]
        pairs.append(ConsistencyPair(student, teacher, {**row, "format": "ctm", "_where": where}))
    return pairs


def read_attct(path: Path) -> list[ConsistencyPair]:
    if path.suffix.lower() == ".csv":
        return read_attct_prefills(path)
    if not path.name.startswith("bct_"):
        hint = (" (this is the clean side; pass its bct_ file)" if path.name.startswith("control_") else "")
        raise PairsError(f"{path}: AttCT's sycophancy pairs are two row-aligned files, bct_<split>.jsonl and "
                         f"control_<split>.jsonl; pass the bct_ one{hint}")
    control = path.with_name("control_" + path.name.removeprefix("bct_"))
    if not control.is_file():
        raise PairsError(f"{path}: its clean side {control} is missing (AttCT's row-aligned control_ file)")
    cued = list(jsonl_objects(path, PairsError))
    clean = list(jsonl_objects(control, PairsError))
    if len(cued) != len(clean):
        raise PairsError(f"{path}: {len(cued)} rows, but {control.name} has {len(clean)}; the two are row-aligned")
    pairs = []
    for (where, s), (where_t, t) in zip(cued, clean):
        for w, row in ((where, s), (where_t, t)):
            if "messages" not in row:
                raise PairsError(f"{w}: missing field 'messages'")
        student = user_turns(check_messages(s["messages"], where, "messages"))
        teacher = user_turns(check_messages(t["messages"], where_t, "messages"))
        pairs.append(ConsistencyPair(student, teacher, {"format": "attct", "clean": where_t, "_where": where}))
    return pairs


def read_attct_prefills(path: Path) -> list[ConsistencyPair]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise PairsError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in ("prompt", "prefill") if c not in (reader.fieldnames or [])]
    if missing:
        raise PairsError(f"{path}:1: missing column '{missing[0]}' (AttCT's prefill CSV: prompt,prefill[,prefill_type])")
    pairs = []
    for line, row in enumerate(reader, 2):
        where = f"{path}:{line}"
        for col in ("prompt", "prefill"):
            if not (row.get(col) or "").strip():
                raise PairsError(f"{where}: column '{col}' is empty")
        request = [{"role": "user", "content": row["prompt"]}]
        pairs.append(ConsistencyPair([*request, {"role": "assistant", "content": row["prefill"]}], request,
                                     {"format": "attct", "threat": "prefill",
                                      "prefill_type": row.get("prefill_type", ""), "_where": where}))
    return pairs


def read_pairs(path: str | Path, fmt: str = "auto") -> list[ConsistencyPair]:
    """Pairs from `path` in format `fmt` (module docstring; auto: `detect`)."""
    from opct.data.pairs import load_pairs

    path = Path(path)
    if fmt not in FORMATS:
        raise PairsError(f"--pairs-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if not path.is_file():
        raise PairsError(f"{path}: {'is a directory, not a pairs file' if path.is_dir() else 'no such file'}")
    fmt = detect(path) if fmt == "auto" else fmt
    pairs = {"opct": load_pairs, "ctm": read_ctm, "attct": read_attct}[fmt](path)
    if not pairs:
        raise PairsError(f"{path}: file has no pairs (empty)")
    return pairs
