"""Methods compared across training seeds (`opct demo --seeds N`): results.json "seeds" "table" (`compare_seeds`),
from a two-way bootstrap over seeds and units (`crossed_cell`). Within one seed methods are compared by
opct.experiment.compare, whose pairs (`pairs`) and keys (`key`) this table shares.

The bootstrap draws with torch's seeded generator, so this module imports torch; opct.experiment and opct.stats, which
the Inspect export and `opct --help` read, need only the standard library.
"""

from __future__ import annotations

import torch

from opct.experiment import BASE, key, pairs
from opct.stats import BOOT_SEED, N_BOOT, percentile_interval


def compare_seeds(units: dict[str, list[dict]], base: dict) -> dict:
    """results.json "seeds" "table": metric -> split -> {method: mean over seeds and units (two-way bootstrap),
    "base": base's mean over units, "<a>_minus_<b>": a - b paired unit by unit within each seed} for the methods of
    `units` (method -> each seed's evaluation "units", seeds in the same order for every method) and `base` (the base
    model's units: one model)."""
    names = list(units)
    table: dict = {}
    for metric, splits in (units[names[0]][0] if names else {}).items():
        for split in splits:
            def per_seed(m):
                return [r.get(metric, {}).get(split, {}) for r in units[m]]
            row = {m: crossed_cell(per_seed(m)) for m in names}
            if split in base.get(metric, {}):
                row[BASE] = crossed_cell([base[metric][split]])
            for a, b in pairs(names, trained_only=True):
                row[key(a, b)] = crossed_cell(seed_differences(per_seed(a), per_seed(b)))
            table.setdefault(metric, {})[split] = {k: v for k, v in row.items() if v is not None}
    return table


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
