"""Outputs that belong together written as one unit: an evaluation's result file, its per-example samples and its
Inspect log are either all this run's or (on failure) none of them are.

    with Staged(out_dir) as stage:            # a staging directory beside the final files, on the same file system
        write(stage.dir / "X.samples.jsonl")  # every output is made there under its final name
        write(stage.dir / "X.json")
        stage.commit(last="X.json", replaces=["X.samples.shifted.jsonl"])

`commit` moves each staged file or directory into `out_dir` (a directory of the same name there is replaced), the
`last` one at the end, so that the result file appearing means the rest is in place; a name in `replaces` that this
run did not write is removed from `out_dir` (an earlier run's side file that a reader would otherwise take for this
run's). Leaving the block without `commit` (an error, Ctrl-C) removes the staging directory: nothing of the run is
left, and an earlier run's complete outputs stay as they were.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class Staged:
    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir)
        self.dir: Path | None = None

    def __enter__(self) -> "Staged":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=".opct-staging-", dir=self.out_dir))
        return self

    def commit(self, last: str, replaces: tuple[str, ...] | list[str] = ()) -> list[Path]:
        """Move the staged outputs into place (`last` at the end); remove the names of `replaces` this run did not
        write. Returns the final paths."""
        staged = sorted(self.dir.iterdir(), key=lambda p: p.name == last)
        for old in (self.out_dir / n for n in replaces if not (self.dir / n).exists()):
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            elif old.exists() or old.is_symlink():
                old.unlink()
        moved = []
        for p in staged:
            final = self.out_dir / p.name
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            os.replace(p, final)
            moved.append(final)
        return moved

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
