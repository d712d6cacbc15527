"""Consistency axes: how each axis builds its (student, teacher) pairs and how it is evaluated.

Every axis follows `opct.axes.interface.Axis` (prepare -> AxisData, evaluate, probe, report_blocks). `AXES` maps a
name to "module:class"; the module is imported only when the axis is asked for. Add an axis by adding a line.
"""

from __future__ import annotations

import importlib

from opct.axes.interface import MEMBERS
from opct.errors import UserError

AXES = {
    "sycophancy": "opct.axes.sycophancy:SycophancyAxis",
    "safety": "opct.axes.safety:SafetyAxis",
    "jailbreak": "opct.axes.jailbreak:JailbreakAxis",
}
FIRST_AXIS = "sycophancy"  # the axis of every results.json written before opct had axes (they name none)


class AxisError(UserError, ValueError):
    """An unknown axis name, or an axis class that lacks a member of the interface."""


def get_axis(name: str):
    """The axis registered as `name` (an instance of its class), with every member of `opct.axes.interface.Axis`."""
    if name not in AXES:
        raise AxisError(f"unknown axis {name!r}; known axes: {', '.join(AXES)}")
    module, cls = AXES[name].split(":")
    axis = getattr(importlib.import_module(module), cls)()
    missing = [m for m in MEMBERS if not hasattr(axis, m)]
    if missing:
        raise AxisError(f"axis {name!r} ({AXES[name]}) lacks {', '.join(missing)} (opct.axes.interface.Axis)")
    return axis


def metrics() -> dict:
    """Every registered axis' {metric: Metric} (opct.axes.interface.Metric), merged: how a report labels a metric and
    says which way is better wherever it meets one, also across axes (the summary of `opct demo --axis all`)."""
    out: dict = {}
    for name in AXES:
        out.update(get_axis(name).metrics)
    return out


def axis_names(value: str) -> list[str]:
    """The axes an `--axis` value names: one name, a comma-separated list, or `all` (every axis in AXES)."""
    if value.strip() == "all":
        return list(AXES)
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    for n in names:
        if n not in AXES:
            raise AxisError(f"unknown axis {n!r} in --axis {value!r}; known axes: {', '.join(AXES)} (or all)")
    if not names:
        raise AxisError(f"--axis {value!r} names no axis; known axes: {', '.join(AXES)} (or all)")
    return names


def axis_defaults(values: dict) -> dict:
    """The defaults of the axis that `values` (the options the user set) selects; for config.build."""
    return dict(get_axis(values.get("axis") or "sycophancy").defaults)
