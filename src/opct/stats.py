"""Rates and their 95 % intervals: one definition each, for every axis, judge and capability table.

A results cell is {"value", "lo", "hi", "n"}: a rate k/n and its interval ("value" None when n = 0: nothing was
measured, and the interval is then all of [0, 1]). Statistics of per-unit values (per fact, per question) get a
seeded percentile bootstrap over the units (`rate_cell`), and two models measured on the same units a paired one
(`paired_change`). Several training runs (seeds) of a method, each read on the same units, get a two-way bootstrap
over seeds and units (`crossed_cell`).
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


def crossed_cell(runs: list[dict[str, float]]) -> dict | None:
    """The mean over seeds and units of per-unit values, runs[k] = {unit: value} for training seed k, as a cell with
    "per_seed" (each seed's mean over the units) and a 95 % percentile interval from a two-way bootstrap.

    Every seed's model is read on every unit (a crossed design), so both are random: another training run would give
    another model, other items another test. Each resample draws K seeds and U units with replacement, independently
    (Owen 2007, "the pigeonhole bootstrap"), and takes the mean of the K x U values they select; its spread carries
    the seed-to-seed and the item-to-item variance (slightly more than both: it counts the residual twice, which
    errs wide). With one seed it is the bootstrap over units of `rate_cell`. Pass per-unit differences of two
    methods trained with the same seeds (`seed_differences`) for a paired comparison. Units: those every run has;
    None when they share none."""
    import torch

    units = [u for u in runs[0] if all(u in r for r in runs[1:])] if runs else []
    if not units:
        return None
    m_KU = torch.tensor([[r[u] for u in units] for r in runs], dtype=torch.float64)
    K, U = m_KU.shape
    g = torch.Generator().manual_seed(BOOT_SEED)

    def draws(n):  # per resample, how often each of n things is drawn (n draws with replacement)
        return torch.zeros(N_BOOT, n, dtype=torch.float64).scatter_add_(
            1, torch.randint(n, (N_BOOT, n), generator=g), torch.ones(N_BOOT, n, dtype=torch.float64))
    w_BK, w_BU = draws(K), draws(U)
    lo, hi = percentile_interval(torch.einsum("bk,ku,bu->b", w_BK, m_KU, w_BU).div(K * U).tolist())
    return {"value": m_KU.mean().item(), "lo": lo, "hi": hi, "n": U, "seeds": K, "per_seed": m_KU.mean(1).tolist()}


def seed_differences(a_runs: list[dict[str, float]], b_runs: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per seed, a - b on each unit both runs of that seed have (methods trained with the same seed paired)."""
    return [{u: a[u] - b[u] for u in a if u in b} for a, b in zip(a_runs, b_runs, strict=True)]
