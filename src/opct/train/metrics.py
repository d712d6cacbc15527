"""Per-step metrics to metrics.jsonl (one JSON object per step) and the run's trackers (train/trackers.py),
resume-safe."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from opct.data.io import atomic_write, read_jsonl, write_failure


def peak_rss_mb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


class MetricsLog:
    """metrics.jsonl, and every row sent on to `trackers` (objects with log(row) and close())."""

    def __init__(self, out: Path, resume_step: int = 0, trackers: list = ()):
        self.path = Path(out) / "metrics.jsonl"
        # On resume, drop rows logged after the checkpoint we restart from: they will be recomputed.
        rows = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in rows))  # a kill here keeps the old rows
        self.trackers = list(trackers)

    def log(self, row: dict) -> None:
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:  # a full disk
            raise write_failure(self.path, e, "a cut-off last row is dropped by --resume") from e
        for t in self.trackers:
            t.log(row)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.close()
