"""Rates and their 95 % intervals: one definition each, for every axis, judge and capability table.

A results cell is {"value", "lo", "hi", "n"}: a rate k/n and its interval ("value" None when n = 0: nothing was
measured, and the interval is then all of [0, 1]). Statistics of per-unit values (per fact, per question) get a
seeded percentile bootstrap over the units (`rate_cell`), and two models measured on the same units a paired one
(`paired_change`). Several training runs (seeds) of a method get a two-way bootstrap over seeds and units
(opct.across_seeds.crossed_cell). This module needs only the standard library (the Inspect export reads it).
"""

from __future__ import annotations

import math
import random

Z95 = 1.959964  # the two-sided 95 % quantile of the normal distribution


def wilson(k: int, n: int) -> dict:
    """The rate k/n with its 95 % Wilson score interval, as a results cell."""
    if n == 0:
        return {"value": None, "lo": 0.0, "hi": 1.0, "n": 0}
    p, z = k / n, Z95
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact ends, not 0.9999999999999999
    hi = 1.0 if k == n else min(1.0, centre + half)
    return {"value": p, "lo": lo, "hi": hi, "n": n}


def is_cell(x) -> bool:
    """A results cell: a {value, lo, hi, n} estimate."""
    return isinstance(x, dict) and "value" in x


def result_rows(res: dict) -> list[tuple[str, str, dict]]:
    """(metric, split, cell) rows of an evaluation's "metrics" (opct.experiment.evaluation; "" for a metric without
    splits): metrics without splits first, in their order."""
    metrics = res.get("metrics") or {}
    single = [(k, "", v) for k, v in metrics.items() if is_cell(v)]
    split = [(k, s, c) for k, v in metrics.items() if isinstance(v, dict) and not is_cell(v)
             for s, c in v.items() if is_cell(c)]
    return single + split


def diff_interval(a: dict, b: dict) -> dict:
    """a - b for two Wilson cells, with Newcombe's (1998, method 10) interval for the difference; value None when
    either was not measured."""
    if a["value"] is None or b["value"] is None:
        return {"value": None, "lo": -1.0, "hi": 1.0, "n": a["n"]}
    d = a["value"] - b["value"]
    lo = d - math.sqrt((a["value"] - a["lo"]) ** 2 + (b["hi"] - b["value"]) ** 2)
    hi = d + math.sqrt((a["hi"] - a["value"]) ** 2 + (b["value"] - b["lo"]) ** 2)
    return {"value": d, "lo": lo, "hi": hi, "n": a["n"]}


def mean(rates: list[float]) -> float:
    return sum(rates) / len(rates)


N_BOOT, BOOT_SEED = 1000, 47


def bootstrap_ci(rates: list[float], stat=mean, n: int = 1000, seed: int = 47, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of `stat` over `n` resamples of the units (with replacement), seeded."""
    rng = random.Random(seed)
    k = len(rates)
    return percentile_interval([stat([rates[rng.randrange(k)] for _ in range(k)]) for _ in range(n)], level)


def percentile_interval(resampled: list[float], level: float = 0.95) -> tuple[float, float]:
    """The (lo, hi) percentile interval of a bootstrap's resampled statistics."""
    vals, n = sorted(resampled), len(resampled)
    return vals[int((1 - level) / 2 * n)], vals[min(n - 1, int((1 + level) / 2 * n))]


def rate_cell(rates: list[float], stat=mean) -> dict:
    """A statistic of per-unit values (per fact, per question) as a cell: value, 95 % bootstrap interval over the
    units, n = units."""
    lo, hi = bootstrap_ci(rates, stat, N_BOOT, BOOT_SEED)
    return {"value": stat(rates), "lo": lo, "hi": hi, "n": len(rates)}


def paired_change(a: dict[str, float], b: dict[str, float]) -> dict | None:
    """Mean over the units both have of (a - b) per unit, with a paired 95 % bootstrap interval over those units;
    None when they share none."""
    common = [u for u in a if u in b]
    if not common:
        return None
    return rate_cell([a[u] - b[u] for u in common])
