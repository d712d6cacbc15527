"""How busy the CPU is, read from /proc with the standard library only: the cores' busy seconds (/proc/stat) and
this process tree's own CPU seconds (/proc/<pid>/stat). opct.threads turns the two into a thread count; the
benchmarks' driver reads the load with them without loading torch."""

from __future__ import annotations

import os


def cpu_busy_seconds(cpus: set[int] | None = None) -> float | None:
    """Seconds the given cores (default: all) spent busy (neither idle nor waiting for I/O) since boot, from
    /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    # user nice system irq softirq steal (guest time is already inside user and nice)
    ticks = sum(sum(int(p[i]) for i in (1, 2, 3, 6, 7, 8) if i < len(p))
                for p in lines if cpus is None or int(p[0][3:]) in cpus)
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float | None:
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
