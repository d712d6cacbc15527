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

MIN_INTERVAL_S = 0.5  # shorter intervals are too noisy to judge; keep the count and wait for a longer one


def cpu_busy_seconds(cpus: set[int] | None = None) -> float | None:
    """Seconds the given cores (default: all) spent busy (neither idle nor waiting for I/O) since boot, from
    /proc/stat; None where it cannot be read. (This module imports torch only where it sets a count, so the
    benchmarks' driver can read the load without loading torch.)"""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    # user nice system irq softirq steal (guest time is already inside user and nice)
    ticks = sum(sum(int(p[i]) for i in (1, 2, 3, 6, 7, 8) if i < len(p))
                for p in lines if cpus is None or int(p[0][3:]) in cpus)
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float | None:
    """CPU seconds of this process and every live descendant (utime + stime from /proc/<pid>/stat)."""
    me = os.getpid()
    parent, cpu = {}, {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"; comm may hold spaces
        except OSError:
            continue  # exited meanwhile
        parent[pid] = int(fields[1])
        cpu[pid] = int(fields[11]) + int(fields[12])
    if me not in cpu:
        return None
    total = 0
    for pid in cpu:
        p = pid
        while p > 1 and p != me:
            p = parent.get(p, 0)
        if p == me:
            total += cpu[pid]
    return total / os.sysconf("SC_CLK_TCK")


class Threads:
    """torch's intra-op thread count for this process. `adjust()` between steps (of training, or batches of
    generation) applies the policy above and returns the count in use."""

    def __init__(self, requested: int = 0, default: int | None = None):
        import torch

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
        busy, own = cpu_busy_seconds(self.cpus), _own_cpu_seconds()
        return None if busy is None or own is None else (time.monotonic(), busy, own)

    def others_busy(self, now) -> float | None:
        """Cores other processes kept busy between the last mark and `now` (None if the interval is too short)."""
        if self._mark is None or now is None or now[0] - self._mark[0] < MIN_INTERVAL_S:
            return None
        wall, busy, own = (b - a for a, b in zip(self._mark, now))
        return max(0.0, (busy - own) / wall)

    def adjust(self) -> int:
        import torch

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
    import torch

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
    import torch

    return _active.adjust() if _active is not None else torch.get_num_threads()
