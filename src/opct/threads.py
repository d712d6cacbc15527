"""How many CPU threads torch uses: a fixed count, or (the default) as many as other processes leave free.

Why adapt: torch's CPU kernels split each operation over its OpenMP threads and wait at a barrier for all of them,
spinning rather than sleeping. When another process keeps a core busy and competes on equal terms (on Linux any
process outside this one's session: the scheduler's autogroups share the CPU between sessions, whatever their nice
value), one of the threads is descheduled for whole time slices while its peers spin at the barrier, and a step
can run many times slower than on one thread. So with `threads: 0` (auto) the thread count starts at torch's
default and, between steps, becomes the number of cores the other processes left free over the last interval:

    others = (busy time of this process's cores - CPU time of this process and its children) / wall time
    threads = clamp(floor(cores - others + 0.25), 1, torch's default)

It drops to 1 while a core is taken and comes back when it is free again. Busy time comes from /proc/stat (only the
cores this process may run on), own time from /proc/<pid>/stat of this process and its descendants (a vLLM engine
or a data worker is not "another process"). Where /proc is missing the count stays at torch's default.
A fixed `threads: N` is used as given.

The count is process-wide (torch's is), so is the policy: `use(requested)` sets it (the training harness and the
evaluation commands do), `adjust()` applies it between steps or generation batches (a no-op before `use`). Thread
counts can change float rounding in reductions, so a run under `auto` on a loaded machine is not bit-identical to
one on an idle machine; metrics.jsonl records each step's count.
"""

from __future__ import annotations

import math
import os
import time

import torch

from opct.cpu_load import cpu_busy_seconds, own_cpu_seconds

MIN_INTERVAL_S = 0.5  # shorter intervals are too noisy to judge; keep the count and wait for a longer one


class Threads:
    """torch's intra-op thread count for this process. `adjust()` between steps (of training, or batches of
    generation) applies the policy above and returns the count in use."""

    def __init__(self, requested: int = 0, default: int | None = None):
        self.auto = requested <= 0
        self.cap = requested if requested > 0 else (default or torch.get_num_threads())
        try:
            self.cpus = os.sched_getaffinity(0)
        except AttributeError:  # not Linux
            self.cpus = set(range(os.cpu_count() or 1))
        torch.set_num_threads(self.cap)
        self.others: float | None = None  # the last interval's reading, for the metrics
        self._mark = self._now()

    def _now(self):
        if not self.auto:
            return None
        busy, own = cpu_busy_seconds(self.cpus), own_cpu_seconds()
        return None if busy is None or own is None else (time.monotonic(), busy, own)

    def others_busy(self, now) -> float | None:
        """Cores other processes kept busy between the last mark and `now` (None if the interval is too short)."""
        if self._mark is None or now is None or now[0] - self._mark[0] < MIN_INTERVAL_S:
            return None
        wall, busy, own = (b - a for a, b in zip(self._mark, now))
        return max(0.0, (busy - own) / wall)

    def adjust(self) -> int:
        now = self._now()
        others = self.others_busy(now)
        if others is not None:
            self.others = others
            n = max(1, min(self.cap, math.floor(len(self.cpus) - others + 0.25)))
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
            self._mark = now
        elif self._mark is None:
            self._mark = now
        return torch.get_num_threads()


_active: Threads | None = None
_default: int | None = None  # torch's own count before any policy lowered it


def use(requested: int) -> Threads:
    """Make `requested` (0 = auto) this process's thread policy and apply its starting count."""
    global _active, _default
    if _default is None:
        _default = torch.get_num_threads()
    _active = Threads(requested, _default)
    return _active


def others_busy() -> float | None:
    """Cores other processes kept busy in the active policy's last judged interval (None under a fixed count)."""
    return _active.others if _active is not None else None


def adjust() -> int:
    """Apply the active policy (see the module docstring); returns the thread count now in use."""
    return _active.adjust() if _active is not None else torch.get_num_threads()
