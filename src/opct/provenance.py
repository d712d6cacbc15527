"""Which code a run ran: the git commit of the source checkout opct is imported from, when it is one; and what
/proc/cpuinfo says of the CPU it ran on.

Only the directory that holds opct's own `pyproject.toml` is asked (never a repository that merely encloses an
installed copy, e.g. a project with its virtual environment inside it); a copy installed from a wheel, or a
machine without git, has no commit.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import opct


def source_root() -> Path | None:
    """The checkout opct runs from (src/opct/.. /..), or None for an installed copy."""
    root = Path(opct.__file__).resolve().parents[2]
    if (root / ".git").exists() and (root / "pyproject.toml").is_file():
        return root
    return None


def cpu_info() -> dict[str, str]:
    """/proc/cpuinfo's fields, the first value of each ("vendor_id", "model name", "flags", ...); {} where it cannot
    be read (not Linux). Read once a process; each call gets its own dict."""
    return dict(_cpu_info())


@functools.cache
def _cpu_info() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    info.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    return info


def git_commit(root: Path | None = None, paths: tuple[str, ...] = ()) -> dict | None:
    """{"commit": full hash, "dirty": uncommitted changes to tracked files (only under `paths`, git pathspecs, when
    given)} of the checkout at `root` (default: opct's own, see source_root), or None when it is not a git checkout
    or git cannot tell."""
    root = source_root() if root is None else Path(root)
    if root is None or not (root / ".git").exists():
        return None

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}
