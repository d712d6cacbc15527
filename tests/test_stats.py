"""opct.stats' two-way bootstrap over seeds and units (what `opct demo --seeds` reports)."""

import pytest

from opct.across_seeds import crossed_cell, seed_differences
from opct.stats import paired_change


def units(values):
    return {f"q{i}": v for i, v in enumerate(values)}


def test_crossed_cell_mean_and_per_seed_values():
    runs = [units([1, 0, 1, 0]), units([1, 1, 1, 0]), units([0, 0, 0, 0])]
    c = crossed_cell(runs)
    assert c["value"] == pytest.approx(5 / 12) and c["per_seed"] == [0.5, 0.75, 0.0]
    assert c["n"] == 4 and c["seeds"] == 3 and c["lo"] <= c["value"] <= c["hi"]
    assert crossed_cell(runs) == c  # seeded


def test_seed_to_seed_variance_widens_the_interval():
    """Seeds that disagree while every item within a seed agrees: a bootstrap over items alone would give a zero-width
    interval; over seeds too, the mean of three draws from {0, 0, 1} has 2.5 % / 97.5 % quantiles 0 and 1."""
    runs = [units([0] * 50), units([0] * 50), units([1] * 50)]
    c = crossed_cell(runs)
    assert c["value"] == pytest.approx(1 / 3) and (c["lo"], c["hi"]) == (0.0, 1.0)
    one = crossed_cell(runs[:1])
    assert one["lo"] == one["hi"] == 0.0


def test_item_variance_alone_matches_the_bootstrap_over_items():
    """Identical seeds: only items vary, so the interval is about the one-seed bootstrap's (±0.1 at n = 100, p = 0.5)."""
    run = units([i % 2 for i in range(100)])
    c, alone = crossed_cell([run, run, run]), paired_change(run, units([0] * 100))
    assert c["value"] == alone["value"] == 0.5
    assert abs((c["hi"] - c["lo"]) - (alone["hi"] - alone["lo"])) < 0.04 and 0.15 < c["hi"] - c["lo"] < 0.25


def test_seed_differences_pair_methods_item_by_item_within_each_seed():
    a = [{"x": 1, "y": 1}, {"x": 0, "y": 1, "z": 1}]
    b = [{"x": 0, "y": 1}, {"x": 0, "y": 0}]
    assert seed_differences(a, b) == [{"x": 1, "y": 0}, {"x": 0, "y": 1}]
    with pytest.raises(ValueError):
        seed_differences(a, b[:1])
    # units every seed has: z is missing from seed 0's differences, so the cell is over x and y
    assert crossed_cell(seed_differences(a, b))["n"] == 2 and crossed_cell([{}, {"x": 1}]) is None
