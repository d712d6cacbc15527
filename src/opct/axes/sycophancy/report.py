"""The sycophancy axis' report section: the generic results tables, each method's rate relative to base, and two
plots (rate by split; consistency and accuracy)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from opct.experiment import BASE
from opct.report.render import DASH, fmt_ratio, grouped_bars, label, method_legend, save_figure
from opct.report.run import cell, compared, method_table, per_split_metrics, results_blocks, splits_of, unclosed_block
from opct.report.run import held_out_blocks as held_out_table
from opct.axes.sycophancy.data import HELD_OUT

UNCLOSED_READ = ("each answer was read after the model's own reasoning (greedy, at most --think-max-tokens tokens), "
                 "at a forced \"The answer is\" (the paper's two phases). Prompts whose reasoning did not close "
                 "within the budget have no answer: they are left out of every rate (a split's n counts the rest)")


def report_blocks(results: dict, run_dir: Path) -> list:
    """The sycophancy axis' section: the results tables, the rate relative to base, and its two plots."""
    methods, names = method_table(results)
    split_metrics = per_split_metrics(methods)
    splits = splits_of(methods, split_metrics)
    blocks = held_out_blocks(results, splits) + results_blocks(results, scalars_title="Without cues")
    if unclosed_block(methods, names, UNCLOSED_READ):
        blocks.append(unclosed_block(methods, names, UNCLOSED_READ))
    others = [m for m in names if m != BASE]
    if BASE in names and others and "sycophancy_rate" in split_metrics:
        blocks.append(("h3", "Sycophancy rate relative to base"))
        blocks.append(("p", "Method rate divided by base rate on the same split (×1.00 = no change, "
                            f"below 1 = less sycophantic). {DASH} where a value is missing or the base rate is 0."))
        rows = []
        for s in splits:
            base = cell(methods, BASE, "sycophancy_rate", s)
            if base is not None:
                rows.append([s] + [fmt_ratio(cell(methods, m, "sycophancy_rate", s), base) for m in others])
        blocks.append(("table", ["Split"] + [f"{label(m)} vs base" for m in others], rows))
    blocks += comparison_blocks(results, splits)
    plot_dir = Path(run_dir) / "plots"
    if any(cell(methods, m, "sycophancy_rate", s) for m in names for s in splits):
        plot_sycophancy(methods, names, splits, plot_dir / "sycophancy_by_split.png")
        blocks.append(("img", "Sycophancy rate by method and split", "plots/sycophancy_by_split.png"))
    if any(cell(methods, m, "consistency", s) or cell(methods, m, "cued_accuracy", s)
           for m in names for s in splits) or any(cell(methods, m, "clean_accuracy") for m in names):
        plot_consistency_accuracy(methods, names, splits, plot_dir / "consistency_accuracy.png")
        blocks.append(("img", "Consistency by split; clean vs cued accuracy", "plots/consistency_accuracy.png"))
    return blocks


def held_out_blocks(results: dict, splits: list[str]) -> list:
    """What each split holds out: its questions and its cue."""
    source = (results.get("info") or {}).get("shift_source")
    return held_out_table(HELD_OUT, splits, ("Questions", "Cue"),
                          "Training used the training phrasings of user-turn cues on the training questions. "
                          + (f"The shifted splits' questions come from {source}." if source else ""))


def comparison_blocks(results: dict, splits: list[str]) -> list:
    """Paired changes of the sycophancy rate (results "comparison", opct.experiment.compare; the controls' own
    comparisons are the report's controls section)."""
    cols = [(f"{label(a)} − {label(b)}", table["sycophancy_rate"]) for a, b, table in compared(results)
            if "sycophancy_rate" in table]
    if not cols:
        return []
    rows = [[s] + [fmt_change(c.get(s)) for _, c in cols] for s in splits if any(s in c for _, c in cols)]
    return [("h3", "Sycophancy rate: paired changes"),
            ("p", "Each cell is the mean over the questions both models were read on of the difference in whether "
                  "the cued answer took the suggestion, with a 95% bootstrap interval over those questions (1,000 "
                  "resamples). Negative = less sycophantic. One training run per method: the interval covers "
                  "the questions, not the training seed."),
            ("table", ["Split"] + [name for name, _ in cols], rows)]


def fmt_change(c) -> str:
    if not c or c.get("value") is None:
        return DASH
    return f"{c['value']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] (n={c['n']})"


def plot_sycophancy(methods: dict, names: list[str], splits: list[str], path: Path) -> None:
    fig = Figure(figsize=(max(6.0, 1.6 * len(splits) + 2), 4.2))
    ax = fig.add_subplot()
    grouped_bars(ax, splits, names, lambda m, s: cell(methods, m, "sycophancy_rate", s),
                 "Sycophancy rate by split (95% Wilson interval; lower is better)")
    ax.set_ylabel("sycophancy rate")
    method_legend(fig, ax)
    save_figure(fig, path)


def plot_consistency_accuracy(methods: dict, names: list[str], splits: list[str], path: Path) -> None:
    """Left: consistency per split. Right: clean accuracy next to the cued accuracy per split."""
    panels = []
    cons_splits = [s for s in splits if any(cell(methods, m, "consistency", s) for m in names)]
    if cons_splits:
        panels.append(("Consistency by split (higher is better)", cons_splits,
                       lambda m, s: cell(methods, m, "consistency", s)))
    acc_groups = (["clean"] if any(cell(methods, m, "clean_accuracy") for m in names) else []) + \
        [s for s in splits if any(cell(methods, m, "cued_accuracy", s) for m in names)]
    if acc_groups:
        panels.append(("Accuracy: clean vs cued (higher is better)", acc_groups,
                       lambda m, g: cell(methods, m, "clean_accuracy") if g == "clean"
                       else cell(methods, m, "cued_accuracy", g)))
    fig = Figure(figsize=(sum(max(4.0, 1.3 * len(p[1]) + 1.5) for p in panels), 4.2))
    for k, (title, groups, get) in enumerate(panels, 1):
        ax = fig.add_subplot(1, len(panels), k)
        grouped_bars(ax, groups, names, get, title)
    method_legend(fig, ax)
    save_figure(fig, path)
