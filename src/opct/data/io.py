"""Small file helpers shared by every loader and writer: the cache directory, sha256, atomic writes, and a
line-validated JSONL reader whose errors name the file and line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from opct.errors import MachineError


def cache_dir() -> Path:
    """Where opct keeps downloaded wheels, extracted data and dense model copies: $OPCT_CACHE or ~/.cache/opct
    (a leading ~ in $OPCT_CACHE is expanded)."""
    return Path(os.environ.get("OPCT_CACHE", "~/.cache/opct")).expanduser()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class WriteError(MachineError, RuntimeError):
    """An output could not be written (disk full, quota, read-only file system, ...). The message names the path;
    the writers that raise it leave nothing partial in that path's place."""


def write_failure(path: Path, e: BaseException, left_behind: str = "nothing partial was left in its place"
                  ) -> WriteError | None:
    """The WriteError for `e`, raised while writing `path`, or None when `e` is not a failed write: any OSError is
    one; so is another library's error (torch.save and safetensors report a full disk without an errno) when the
    file system is then (nearly) full."""
    try:
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
    except (OSError, StopIteration):
        free = None
    if isinstance(e, OSError):
        reason = e.strerror or str(e)
    elif isinstance(e, Exception) and free is not None and free < FULL_BELOW:
        reason = f"the file system is full: {(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}"
    else:
        return None
    left = f"; {free / 2**20:.1f} MiB free there" if free is not None else ""
    return WriteError(f"{path}: could not be written ({reason}{left}); {left_behind}")


FULL_BELOW = 1 << 20  # bytes free under which a failed write is taken to be a full disk


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it into place: a reader (or a run killed
    mid-write) never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are meant to be read by others
        os.replace(tmp, path)
    except BaseException as e:
        failed = write_failure(path, e)
        Path(tmp).unlink(missing_ok=True)
        if failed:
            raise failed from e
        raise
    return path


def write_json(path: str | Path, obj) -> Path:
    return atomic_write(path, json.dumps(obj, indent=2))


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"duplicate key {dup!r}")
    return dict(pairs)


def jsonl_objects(path: str | Path, error: Callable[[str], Exception]) -> Iterator[tuple[str, dict]]:
    """Yield (where, object) for each non-blank line of a JSONL file, `where` = 'file:line'. A line that is not
    UTF-8, not JSON, not an object, or an object with a duplicate key raises error(message naming file and line);
    so does a path that is a directory or unreadable. A UTF-8 byte-order mark at the start is accepted."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a directory, not a JSONL file")
    if not path.is_file():
        raise error(f"{path}: no such file")
    try:
        f = path.open("rb")
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark some editors write
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_no_duplicate_keys)
            except json.JSONDecodeError as e:
                raise error(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            except ValueError as e:
                raise error(f"{where}: {e}") from None
            if not isinstance(row, dict):
                raise error(f"{where}: each line must be a JSON object")
            yield where, row


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file we wrote ourselves (metrics): [] when missing; a truncated last line (a run killed
    mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
