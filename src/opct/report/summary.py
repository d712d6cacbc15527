"""Several axes (`opct demo --axis all`): one page that puts each axis' headline figures side by side,
<out>/summary.json, report.md and report.html."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from opct.data.io import atomic_write, write_json
from opct.report.render import (DASH, METHOD_ORDER, fmt_cell, fmt_seconds, grouped_bars, is_number, label,
                                method_legend, ordered, render_html, render_markdown, save_figure)
from opct.report.run import capability_methods, capability_rows, headline_rows, read_results


def plot_headlines(summary: dict, path: Path) -> None:
    """One panel per axis: its headline figures by method, with their intervals."""
    axes = [(name, run) for name, run in summary["runs"].items() if run["headline"]]
    fig = Figure(figsize=(sum(max(4.0, 1.4 * len(r["headline"]) + 1.5) for _, r in axes), 4.4))
    for k, (name, run) in enumerate(axes, 1):
        ax = fig.add_subplot(1, len(axes), k)
        rows = {f"{label(r['metric'])}\n{r['split'] or ''} ({r['better']})": r for r in run["headline"]}
        names = ordered([m for r in run["headline"] for m in r["methods"]], METHOD_ORDER)
        grouped_bars(ax, list(rows), names, lambda m, g: rows[g]["methods"].get(m), f"{name}: {run['model']}")
        ax.tick_params(axis="x", labelsize=7)
    method_legend(fig, ax)
    save_figure(fig, path)


def summary_blocks(summary: dict) -> list:
    runs = summary["runs"]
    blocks = [("h1", "OPCT across axes"),
              ("list", [f"{name}: {run['model']} ({name}/report.md)" for name, run in runs.items()] +
               ([f"Wall time: {fmt_seconds(summary['wall_seconds'])}"] if is_number(summary.get("wall_seconds"))
                else []))]
    names = ordered([m for run in runs.values() for r in run["headline"] for m in r["methods"]], METHOD_ORDER)
    blocks += [("h2", "Headline figures"),
               ("p", "A few figures per axis, with the 95% intervals its evaluation computed; each axis' report "
                     "has all of them, how each is computed, and per-example samples.")]
    rows = [[name, label(r["metric"]), r["split"] or DASH, f"{r['better']} is better"] +
            [fmt_cell(r["methods"].get(m)) for m in names] for name, run in runs.items() for r in run["headline"]]
    blocks.append(("table", ["Axis", "Metric", "Split", "Direction"] + [label(m) for m in names], rows))
    if summary.get("plot"):
        blocks.append(("img", "Headline figures by axis and method", summary["plot"]))
    caps = {name: run["capability"] for name, run in runs.items() if run.get("capability")}
    if caps:
        blocks += [("h2", "Capability retention (lm-evaluation-harness)"),
                   ("p", "Per axis, the tasks run after its models were trained (change from that axis' base model "
                         "with a Newcombe interval).")]
        names_c = ordered([m for cap in caps.values() for m in capability_methods(cap)], METHOD_ORDER)
        rows = [[name] + row for name, cap in caps.items() for row in capability_rows(cap, names_c)]
        blocks.append(("table", ["Axis", "Task", "Metric"] + [label(m) for m in names_c] + ["Chance"], rows))
    return blocks


def write_summary(out: str | Path, axes: list[str], wall_seconds: float | None = None) -> dict:
    """summary.json, report.md, report.html and plots/headlines.png for a run over several axes, from each
    <out>/<axis>/results.json (missing or unreadable: an error naming the file). Returns the paths written."""
    out = Path(out)
    runs = {}
    for name in axes:
        path = out / name / "results.json"
        try:
            results = read_results(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read this axis' results ({e})") from None
        runs[name] = {"model": results.get("model"), "dir": name, "wall_seconds": results.get("wall_seconds"),
                      "headline": headline_rows(results), "capability": results.get("capability") or None}
    summary = {"axes": list(axes), "runs": runs, "wall_seconds": wall_seconds}
    if any(run["headline"] for run in runs.values()):
        summary["plot"] = "plots/headlines.png"
        plot_headlines(summary, out / summary["plot"])
    blocks = summary_blocks(summary)
    atomic_write(out / "report.md", render_markdown(blocks))
    atomic_write(out / "report.html", render_html(blocks))
    write_json(out / "summary.json", summary)  # last: its presence marks the run over all axes finished
    return {"summary": out / "summary.json", "markdown": out / "report.md", "html": out / "report.html"}
