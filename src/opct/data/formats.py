"""Pair datasets in the community's formats, read into ConsistencyPairs, so pairs built for CTM or AttCT train here
as they are (docs/pairs.md; `opct train --pairs FILE --pairs-format auto|opct|ctm|attct`).

  opct   JSONL, {"student": [messages], "teacher": [messages], ...}: opct.data.pairs.load_pairs
  ctm    CTM's `ctm.prompt_pairs` JSONL (sohaibimran7/consistency-training-methods, ctm/pairs.py): "variant_messages"
         (student), "reference_messages" (teacher), "pair_id" (a unique string); other fields become metadata. Its
         native mcq-bias rows (and the CTM fork's `vdct.paired_prompts`) carry "biased_messages" (student) and
         "unbiased_messages" (teacher) instead. Each side is cut after its last user turn, as CTM's own loaders do
         (a trailing assistant turn there is a completion, not a reply prefix). A `<file>.manifest.json` beside the
         file, as CTM writes one, is checked: its row_count and the file's sha256 (content_sha256) must match.
         Refused, each with a message saying what the file is: are_you_sure rows (staged turns CTM itself refuses
         for training), CTM prompt-family files (a reference and several variants per row) and CTM BCT target files
         (one prompt view and the frozen model's answer per row).
  attct  AttCT's sycophancy pool (c-wei/AttCT, datasets/sycophancy_bct/): row-aligned files bct_<split>.jsonl
         (the cued question) and control_<split>.jsonl (the clean one), each row {"messages": [user, assistant]};
         pass the bct_ file, its control_ file is read beside it; student = the bct row's user turn, teacher = the
         control row's (the assistant turns, BCT targets, are not used). Or AttCT's prefill CSV (columns prompt,
         prefill[, prefill_type], or AdvBench's goal,target): student = the prompt with the prefill as a started
         reply, teacher = the prompt (a prefill pair); read with the csv module as AttCT's loader reads it
         (data/prefill_dataset.py: quoted newlines kept, both fields stripped). AttCT's code adds the system prompt
         "You are a helpful assistant." to both sides; the files do not carry it and neither do the pairs read here.
         Refused: AttCT's per-model BCT targets (fresh_bct_<model>/, no clean side) and its list of prefills
         without prompts (attacks.csv).
Every field read from a peer's file or manifest is checked for its JSON type; a wrong one is a PairsError naming the
file, line and field.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import re
from pathlib import Path

from opct.data.io import jsonl_objects
from opct.data.pairs import ConsistencyPair, PairsError, check_messages, load_pairs

FORMATS = ("auto", "opct", "ctm", "attct")
CTM_KEYS = (("variant_messages", "reference_messages"), ("biased_messages", "unbiased_messages"))
PREFILL_COLUMNS = (("prompt", "prefill"), ("goal", "target"))  # AttCT's prefill CSVs; AdvBench's harmful_behaviors
HINT = ("expected student/teacher (opct), variant_messages/reference_messages or biased_messages/unbiased_messages "
        "(CTM), messages (AttCT's bct_/control_ files) or a CSV with prompt,prefill columns (AttCT's prefills); "
        "docs/pairs.md")
SHA256 = re.compile(r"[0-9a-f]{64}")


def json_type(value) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def wrong_type(where: str, field: str, want: str, value) -> PairsError:
    return PairsError(f"{where}: field '{field}' must be {want}, not {json_type(value)} ({json.dumps(value)[:60]})")


def peer_shape(row: dict, where: str) -> str | None:
    """The refusal for a row of a peer's file that is not a pair (what the file is, and the way on), or None."""
    if "student" in row or "teacher" in row:
        return None
    if "variants" in row and ("reference_messages" in row or "source_id" in row):
        return (f"{where}: a CTM prompt-family row (`ctm.prompt_families`, ctm/settings/families.py: one "
                "'reference_messages' and a list of 'variants' per source item), not a pair; which variants a CTM run "
                "trains on is a setting of the run (its first n_variants), not of the file. Write one pair per variant "
                "you want (student: the variant's messages, teacher: reference_messages) as opct or CTM prompt pairs "
                "(docs/pairs.md, 'CTM prompt families')")
    if "messages" in row and "source_id" in row and not any(k in row for ks in CTM_KEYS for k in ks):
        return (f"{where}: a CTM BCT target row ('messages' ending with the frozen model's answer, and 'source_id'; "
                "written by CTM's scripts/prepare_bct_targets.py, ctm/training/bct_targets.py), not a pair: each such "
                "file holds one prompt view. Pass the CTM prompt-pair file the targets were built from (the "
                "'source_files' of their manifest): `opct train` pairs it, `opct sft` makes its own targets")
    return None


def user_turns(messages: list[dict]) -> list[dict]:
    """The transcript up to and with its last user turn (CTM and AttCT store completions after it)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    return messages[:last + 1]


def detect(path: Path) -> str:
    """The format of a pairs file from its name and first row, or PairsError naming the file and line (also for a
    peer's file that is not pairs: peer_shape)."""
    if path.suffix.lower() == ".csv":
        return "attct"
    for where, row in jsonl_objects(path, PairsError):
        refused = peer_shape(row, where)
        if refused:
            raise PairsError(refused)
        if "student" in row or "teacher" in row:
            return "opct"
        if any(s in row or t in row for s, t in CTM_KEYS):
            return "ctm"
        if "messages" in row:
            return "attct"
        raise PairsError(f"{where}: cannot tell the pairs format from the fields {sorted(row)[:8]}: {HINT}")
    raise PairsError(f"{path}: file has no pairs (empty)")


def key_line(text: str, key: str) -> int:
    """The line of a JSON text where `"key":` first appears (1 if nowhere)."""
    m = re.search(f'"{re.escape(key)}"\\s*:', text)
    return text.count("\n", 0, m.start()) + 1 if m else 1


def check_manifest(path: Path) -> None:
    """CTM's sidecar manifest, where there is one: the rows and bytes it was written for."""
    manifest = path.with_name(path.name + ".manifest.json")
    if not manifest.is_file():
        return
    try:
        text = manifest.read_text(encoding="utf-8")
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise PairsError(f"{manifest}:{e.lineno}: not a readable JSON manifest ({e.msg} at column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PairsError(f"{manifest}: not a readable JSON manifest ({e})") from None
    if not isinstance(m, dict):
        line = text[:len(text) - len(text.lstrip())].count("\n") + 1
        raise PairsError(f"{manifest}:{line}: CTM's manifest must be a JSON object, not {json_type(m)}")
    if "row_count" in m and (not isinstance(m["row_count"], int) or isinstance(m["row_count"], bool)):
        raise wrong_type(f"{manifest}:{key_line(text, 'row_count')}", "row_count", "an integer", m["row_count"])
    if "content_sha256" in m and not (isinstance(m["content_sha256"], str) and SHA256.fullmatch(m["content_sha256"])):
        raise wrong_type(f"{manifest}:{key_line(text, 'content_sha256')}", "content_sha256",
                         "a SHA-256 digest (a string of 64 lowercase hex digits)", m["content_sha256"])
    data = path.read_bytes()
    if "content_sha256" in m and hashlib.sha256(data).hexdigest() != m["content_sha256"]:
        raise PairsError(f"{path}: its bytes do not match {manifest.name}'s content_sha256 (the file changed since "
                         "the manifest was written)")
    rows = sum(1 for line in data.splitlines() if line.strip())
    if "row_count" in m and m["row_count"] != rows:
        raise PairsError(f"{path}: {rows} rows, {manifest.name} says row_count {m['row_count']}")


def are_you_sure(row: dict, where: str, student_key: str) -> None:
    """Refuse CTM's are_you_sure rows (their bias_type, at the top as in mcq-bias rows or in 'metadata' as in prompt
    pairs); check the JSON type of the fields read on the way."""
    meta = row.get("metadata")
    if "metadata" in row and not isinstance(meta, dict):
        raise wrong_type(where, "metadata", "an object", meta)
    for field, value, present in (("bias_type", row.get("bias_type"), "bias_type" in row),
                                  ("metadata.bias_type", (meta or {}).get("bias_type"), "bias_type" in (meta or {}))):
        if present and not isinstance(value, str):
            raise wrong_type(where, field, "a string", value)
        if value == "are_you_sure":
            raise PairsError(
                f"{where}: field '{field}' is 'are_you_sure': its '{student_key}' are staged turns (the question, "
                "the user's challenge, the final ask), each to follow the model's own answer to the turn before, "
                "answers the row does not hold. CTM itself refuses these rows for training (\"are_you_sure requires "
                "staged multi-turn generation\", ctm_data/adapters/mcq_bias/data.py), and opct cannot pair them "
                "faithfully either: leave them out of the file (CTM's other bias types read)")


def read_ctm(path: Path) -> list[ConsistencyPair]:
    check_manifest(path)
    pairs, ids = [], {}
    for where, row in jsonl_objects(path, PairsError):
        refused = peer_shape(row, where)
        if refused:
            raise PairsError(refused)
        keys = next(((s, t) for s, t in CTM_KEYS if s in row or t in row), None)
        if keys is None:
            raise PairsError(f"{where}: missing field 'variant_messages' / 'reference_messages' (CTM's prompt pairs) "
                             "or 'biased_messages' / 'unbiased_messages' (its mcq-bias rows)")
        for k in keys:
            if k not in row:
                raise PairsError(f"{where}: missing field '{k}'")
        are_you_sure(row, where, keys[0])
        student = user_turns(check_messages(row.pop(keys[0]), where, keys[0]))
        teacher = user_turns(check_messages(row.pop(keys[1]), where, keys[1]))
        if "pair_id" in row:  # CTM requires a non-empty string, unique in the file (ctm/settings/pairs.py)
            pid = row["pair_id"]
            if not isinstance(pid, str) or not pid.strip():
                raise wrong_type(where, "pair_id", "a non-empty string", pid)
            if pid in ids:
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
    if not control.is_file() and path.parent.name.startswith("fresh_bct_"):
        raise PairsError(
            f"{path}: AttCT's per-model BCT targets ({path.parent.name}/, scripts/generate_fresh_bct_data.py: each "
            "row the cued prompt with that model's answer to the clean one, for AttCT's BCT baseline), not pairs: no "
            "control_ file ships beside them, and their rows need not be row-aligned with datasets/sycophancy_bct/ "
            "(the generator skips failed rows and appends refilled ones at the end). Pass "
            f"datasets/sycophancy_bct/{path.name}, whose control_ file is their clean side")
    if not control.is_file():
        raise PairsError(f"{path}: its clean side {control} is missing (AttCT's row-aligned control_ file)")
    cued = list(jsonl_objects(path, PairsError))
    clean = list(jsonl_objects(control, PairsError))
    if len(cued) != len(clean):
        raise PairsError(f"{path}: {len(cued)} rows, but {control.name} has {len(clean)}; the two are row-aligned")
    pairs = []
    for (where, s), (where_t, t) in zip(cued, clean):
        for w, row in ((where, s), (where_t, t)):
            refused = peer_shape(row, w)
            if refused:
                raise PairsError(refused)
            if "messages" not in row:
                raise PairsError(f"{w}: missing field 'messages'")
        student = user_turns(check_messages(s["messages"], where, "messages"))
        teacher = user_turns(check_messages(t["messages"], where_t, "messages"))
        pairs.append(ConsistencyPair(student, teacher, {"format": "attct", "clean": where_t, "_where": where}))
    return pairs


def csv_records(path: Path) -> list[tuple[int, list[str]]]:
    """The records of a CSV file, each with the physical line it starts on, read as AttCT reads its CSVs (the csv
    module over the text with newline='': a newline, CRLF or form feed inside a quoted field is kept as it is); a
    UTF-8 byte-order mark is dropped. Bad quoting, undecodable bytes and blank files are PairsErrors naming the line."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise PairsError(f"{path}: cannot read it ({e.strerror})") from None
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, column = raw[:e.start].count(b"\n") + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise PairsError(f"{path}:{line}: not UTF-8 text (byte {column} of the line)") from None
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    records, end = [], 0
    while True:
        start = end + 1
        try:
            record = next(reader)
        except StopIteration:
            return records
        except csv.Error as e:  # named by the line the record starts on, and the line the parser stopped at
            at = f", at line {reader.line_num}" if reader.line_num > start else ""
            hint = ": a quote left open?" if "unexpected end of data" in str(e) else ""
            raise PairsError(f"{path}:{start}: malformed CSV record ({e}{at}{hint})") from None
        end = reader.line_num
        if record:  # a blank line is no record (csv.DictReader skips it too)
            records.append((start, record))


def read_attct_prefills(path: Path) -> list[ConsistencyPair]:
    records = csv_records(path)
    if not records:
        raise PairsError(f"{path}: file has no pairs (empty)")
    head_line, header = records[0]
    dup = next((c for c in header if header.count(c) > 1), None)
    if dup is not None:
        raise PairsError(f"{path}:{head_line}: column '{dup}' appears twice in the header")
    cols = next(((p, f) for p, f in PREFILL_COLUMNS if p in header and f in header), None)
    if cols is None:
        if "prefill" in header and "prompt" not in header:
            raise PairsError(f"{path}:{head_line}: missing column 'prompt': a CSV of prefills without prompts is "
                             "AttCT's list of attack prefixes (datasets/attacks.csv), which AttCT crosses with prompts "
                             "it downloads (WildJailbreak); opct needs each prefill beside its prompt: a CSV with "
                             "columns prompt,prefill")
        missing = next(c for c in ("prompt", "prefill") if c not in header)
        raise PairsError(f"{path}:{head_line}: missing column '{missing}' (AttCT's prefill CSV: "
                         "prompt,prefill[,prefill_type]; or goal,target as in AdvBench's harmful_behaviors)")
    i, j = header.index(cols[0]), header.index(cols[1])
    kind = header.index("prefill_type") if "prefill_type" in header else None
    pairs = []
    for line, record in records[1:]:
        where = f"{path}:{line}"
        if len(record) != len(header):
            raise PairsError(f"{where}: {len(record)} fields, but the header has {len(header)} (a comma outside "
                             "quotes, or a missing one?)")
        prompt, prefill = record[i].strip(), record[j].strip()  # as AttCT's loaders strip them
        for col, value in ((cols[0], prompt), (cols[1], prefill)):
            if not value:
                raise PairsError(f"{where}: column '{col}' is empty")
        request = [{"role": "user", "content": prompt}]
        pairs.append(ConsistencyPair([*request, {"role": "assistant", "content": prefill}], request,
                                     {"format": "attct", "threat": "prefill",
                                      "prefill_type": record[kind] if kind is not None else "", "_where": where}))
    return pairs


def read_pairs(path: str | Path, fmt: str = "auto") -> list[ConsistencyPair]:
    """Pairs from `path` in format `fmt` (module docstring; auto: `detect`)."""
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
