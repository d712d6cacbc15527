"""One run directory's report: report.md, report.html and PNG plots from its results.json (opct.report.render
writes them).

Inputs (under `run_dir`):
  results.json             written by the demo / eval (required), read through opct.experiment.read_results
  <method>-seed<S>/metrics.jsonl   one JSON object per training step of each method's run of the first training
                           seed (optional; opct.experiment.first_runs); its tokens/*.parquet, the token logs that
                           tokens.html shows with samples/*.jsonl (opct.lens.report)

The report only presents the numbers: every table cell comes straight from results.json, and the intervals are the
ones the evaluator computed. The shared sections (header, seeds, controls, capability, plots, training logs, what
was run) are here; each axis renders its own results section (Axis.report_blocks).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from matplotlib.figure import Figure

from opct.data.io import atomic_write, read_jsonl
from opct.experiment import (BASE, METHODS, ON_POLICY, TRAINED, entry, first_runs, methods_view, on_disk, pairs,
                             tests_control)
from opct.experiment import key as pair_key
from opct.experiment import read_results as read_schema
from opct.report.render import (COLORS, DASH, METHOD_ORDER, OTHER_COLORS, axis_metrics, direction, flatten, fmt_cell,
                                fmt_n, fmt_num, fmt_seconds, is_number, label, ordered, plot_line, render_html,
                                render_markdown, save_figure, series)
from opct.stats import is_cell
from opct.axes import AXES, get_axis
from opct.config import CPU, DemoConfig, EXEC
from opct.evals.capability import plot_capability
from opct.inspect_log import write_logs
from opct.lens.report import write_page as lens_page


INTERVAL_NOTE = ("Intervals are 95% Wilson score intervals over prompts; n is the number of prompts in the "
                 "split. Ratios are ratios of point estimates and carry no interval of their own.")


UNCLOSED_GRADED = ("the judges graded each reply's answer after its reasoning. Replies whose reasoning did not "
                   "close within --think-max-tokens have no answer: they were not graded, are counted with the "
                   "unparsed ones")


def unclosed_block(methods: dict, names: list[str], what: str = UNCLOSED_GRADED):
    """A paragraph for a thinking model's results (an evaluation that has `unclosed_reasoning`): how its answers
    were read (`what`, the axis' sentence) and how many replies had none, by method; None for a model without
    reasoning."""
    counts = {m: (methods[m].get("counts") or {}).get("unclosed_reasoning") for m in names}
    if not any(c is not None for c in counts.values()):
        return None
    shown = "; ".join(f"{label(m)} {sum((c or {}).values())} ({', '.join(f'{s} {n}' for s, n in (c or {}).items())})"
                      for m, c in counts.items())
    return ("p", f"A thinking model: {what}, and number: {shown}.")


def read_metrics(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl; [] when the file is missing; a partial last line (a run killed mid-write) is
    skipped, so the report still shows everything before it."""
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


def per_split_metrics(methods: dict) -> list[str]:
    """Metric names stored as {split: cell} (each evaluation's "metrics"), in the order the evaluation wrote
    them."""
    names = [name for m in methods.values() for name, v in (m.get("metrics") or {}).items()
             if isinstance(v, dict) and not is_cell(v) and any(is_cell(c) for c in v.values())]
    return ordered(names, ())


def scalar_metrics(methods: dict) -> list[str]:
    """Metric names stored as a single cell (clean_accuracy)."""
    return ordered([name for m in methods.values() for name, v in (m.get("metrics") or {}).items() if is_cell(v)], ())


def splits_of(methods: dict, metrics: list[str]) -> list[str]:
    names = [s for m in methods.values() for metric in metrics
             for s, c in entry(m, "metrics", metric).items() if is_cell(c)]
    return ordered(names, ())


def cell(methods: dict, method: str, metric: str, split: str | None = None) -> dict | None:
    """The {value, lo, hi, n} for one method/metric(/split), or None when absent or null."""
    c = entry(methods.get(method, {}), "metrics", metric)
    if split is not None:
        c = c.get(split) if isinstance(c, dict) else None
    return c if is_cell(c) and is_number(c["value"]) else None


def training_panels(logs: dict[str, list[dict]]) -> list[tuple]:
    """[(title, [(kind, xs, ys, legend name, style), ...], last step), ...] for whatever the logs contain. `logs`:
    each trained method's metrics.jsonl rows. Per method that is not a control (opct.experiment.METHODS), its
    trainer's curves: on-policy KL and loss, and KL by token position, then each control's KL beside it (the controls
    compared with it); offline, the loss. Then the probes of those methods."""
    rows_of = {m: rows for m, rows in logs.items() if rows}
    mains = sorted((m for m in rows_of if m in METHODS and not METHODS[m].control),
                   key=lambda m: (METHODS[m].trainer != ON_POLICY, TRAINED.index(m)))
    panels, probes, last_step = [], [], 0
    for m in mains:
        rows = rows_of[m]
        if METHODS[m].trainer != ON_POLICY:
            xs, ys = series(rows, "loss")
            if ys:
                panels.append((f"{label(m)}: loss vs step", [("line", xs, ys, "loss", "#4c72b0")], None))
            continue
        lines = [("line", *series(rows, k), label(k), c) for k, c in (("kl", "#dd8452"), ("loss", "#c44e52"))]
        lines = [line for line in lines if line[2]]
        if lines:
            panels.append((f"{label(m)}: {' and '.join(line[3] for line in lines)} vs step", lines, None))
        position = [("line", *series(rows, k), name, c) for k, name, c in
                    (("kl_head", "first 8 tokens", "#c44e52"), ("kl_tail", "later tokens", "#4c72b0"))]
        position = [line for line in position if line[2]]
        if position:
            panels.append((f"{label(m)}: KL per token by position", position, None))
        others = [("line", *series(rows_of[c], "kl"), label(c), COLORS.get(c, "#555555")) for c in rows_of
                  if c in METHODS and METHODS[c].control and m in METHODS[c].compared_with]
        others = [line for line in others if line[2]]
        if others and lines:
            panels.append((f"KL vs step: {label(m)} and its controls",
                           [("line", *series(rows, "kl"), label(m), COLORS[m]), *others], None))
    for m in mains:
        rows, marker = rows_of[m], "o" if METHODS[m].trainer == ON_POLICY else "s"
        keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith("probe_")))
        for j, key in enumerate(keys):
            shown = axis_metrics().get(key)
            color = shown.colour if shown and shown.colour else OTHER_COLORS[j % len(OTHER_COLORS)]
            xs, ys = series(rows, key)
            if ys:
                name = f"{label(m)} {key.removeprefix('probe_')}"
                probes.append(("probe", xs, ys, name, (color, marker)))
                last_step = max([last_step, *series(rows, "step")[1], len(rows)])
    if probes:
        # Probes run on a few steps only; span the whole run so their timing within it is visible.
        panels.append(("Probe metrics vs step", probes, last_step))
    return panels


def plot_training(panels: list, path: Path) -> None:
    fig = Figure(figsize=(5.0 * len(panels), 3.8))
    for k, (title, lines, last_step) in enumerate(panels, 1):
        ax = fig.add_subplot(1, len(panels), k)
        for kind, xs, ys, name, style in lines:
            if kind == "line":
                plot_line(ax, xs, ys, name, style)
            else:  # probes run on some steps only: a marker at each, a thin dashed guide between them
                color, marker = style
                ax.plot(xs, ys, color=color, marker=marker, linestyle="--", linewidth=0.8, label=name)
        if lines[0][0] == "probe":  # probe metrics are rates: keep the full 0..1 scale
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlim(0, last_step * 1.03)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def method_table(results: dict) -> tuple[dict, list[str]]:
    """{method: evaluation} of base and each method's run of the first training seed (opct.experiment
    .methods_view: malformed entries left out), and the method names in display order."""
    methods = methods_view(results)
    return methods, ordered(methods, METHOD_ORDER)


def results_blocks(results: dict, note: str = INTERVAL_NOTE, scalars_title: str = "Other metrics") -> list:
    """The generic results tables: one table per metric stored as {split: cell} (rows = splits, columns =
    methods), then the metrics stored as one cell (under `scalars_title`); warnings an evaluation recorded
    (details "degenerate") first."""
    methods, names = method_table(results)
    split_metrics = per_split_metrics(methods)
    splits = splits_of(methods, split_metrics)
    blocks = []
    for m in names:
        warning = entry(methods[m], "details", "degenerate")
        if isinstance(warning, str):
            blocks.append(("p", f"WARNING ({label(m)}): {warning}."))
    blocks.append(("p", note))
    header = ["Split"] + [label(m) for m in names] + ["n"]
    for metric in split_metrics:
        title = label(metric) + direction(metric)
        blocks.append(("h3", title))
        rows = []
        for s in splits:
            cells = [cell(methods, m, metric, s) for m in names]
            if any(cells):
                fallbacks = [entry(methods[m], "counts", "n").get(s) for m in names]
                rows.append([s] + [fmt_cell(c) for c in cells] + [fmt_n(cells, fallbacks)])
        blocks.append(("table", header, rows))
    scalars = scalar_metrics(methods)
    if scalars:
        blocks.append(("h3", scalars_title))
        rows = []
        for metric in scalars:
            cells = [cell(methods, m, metric) for m in names]
            name = label(metric) + direction(metric)
            rows.append([name] + [fmt_cell(c) for c in cells] + [fmt_n(cells, [None] * len(cells))])
        blocks.append(("table", ["Metric"] + [label(m) for m in names] + ["n"], rows))
    return blocks


def read_results(path: Path) -> dict:
    """A demo's results.json, in this opct's schema whichever opct wrote it (opct.experiment.read_results)."""
    return read_schema(json.loads(path.read_text(encoding="utf-8")), str(path))


def axis_blocks(results: dict, run_dir: Path) -> list:
    """The section of the axis that wrote results.json; an axis this opct does not know gets the generic tables."""
    name = results["axis"]
    if name not in AXES:
        return [("p", f"Axis {name!r} is not known to this opct; its metrics as generic tables.")] + \
            results_blocks(results)
    return get_axis(name).report_blocks(results, run_dir)


def build_blocks(results: dict, logs: dict[str, list[dict]], plots: dict[str, Path], run_dir: Path,
                 dirs: dict[str, str] | None = None) -> list:
    """The whole report: header, what was run, the axis' section, capability, shared plots, training logs (`dirs`:
    each method's run directory, `log_blocks`)."""
    _, names = method_table(results)
    return (header_blocks(results, names, run_dir) + seeds_blocks(results, run_dir) + controls_blocks(results)
            + capability_blocks(results.get("capability")) + [("h2", "Results")] + axis_blocks(results, run_dir)
            + plot_blocks(plots, run_dir) + log_blocks(logs, dirs) + run_blocks(results))


def header_blocks(results: dict, names: list[str], run_dir: Path) -> list:
    """The title, the model, axis, wall time and methods, the headline figures, where each model's answers are."""
    model = results.get("model", "unknown model")
    blocks = [("h1", f"OPCT report: {model}")]
    intro = [f"Model: {model}"]
    if results.get("axis"):
        intro.append(f"Axis: {results['axis']}")
    if is_number(results.get("wall_seconds")):
        intro.append(f"Wall time: {fmt_seconds(results['wall_seconds'])}")
    intro.append(f"Methods: {', '.join(label(m) for m in names) or 'none'}")
    blocks.append(("list", intro))
    head = headline_rows(results)
    if head:
        blocks.append(("h2", "Headline"))
        blocks.append(("table", ["Metric", "Split"] + [label(m) for m in names],
                       [[label(r["metric"]) + f" ({r['better']} is better)", r["split"] or DASH]
                        + [fmt_cell(r["methods"].get(m)) for m in names] for r in head]))
    runs = {m: on_disk(run_dir, r, results) for m, r in first_runs(results).items()}
    answers = [f"{label(m)}: samples/{runs[m]}.jsonl" for m in names
               if m in runs and (run_dir / "samples" / f"{runs[m]}.jsonl").is_file()]
    if answers:
        blocks.append(("p", "Each model's answer to every evaluation prompt, with its verdict: " + "; ".join(answers)
                       + "."))
    return blocks


def capability_blocks(cap) -> list:
    """results.json "capability" as a table; nothing when it was not run."""
    if not isinstance(cap, dict) or not cap:
        return []
    names = capability_methods(cap)
    return [("h2", "Capability retention (lm-evaluation-harness)"),
            ("p", "Each task's headline metric with its 95% interval, and the change from the base model "
                  "(Newcombe interval, conservative: it ignores that the items are the same)."),
            ("table", ["Task", "Metric"] + [label(m) for m in names] + ["Chance"], capability_rows(cap, names))]


def plot_blocks(plots: dict[str, Path], run_dir: Path) -> list:
    """The shared plots (training curves, capability), each with its caption."""
    if not plots:
        return []
    captions = {"training": "Training curves", "capability": "Capability retention by task"}
    return [("h2", "Plots")] + [("img", captions.get(name, name), path.relative_to(run_dir).as_posix())
                                for name, path in plots.items()]


def log_blocks(logs: dict[str, list[dict]], dirs: dict[str, str] | None = None) -> list:
    """Per trained run (`logs`: method -> its metrics.jsonl rows; `dirs`: method -> its run directory, e.g.
    opct-seed0), each logged key's count, first, last, min, max and mean over its steps."""
    blocks = [("h2", "Training logs")]
    for method, rows in logs.items():
        if not rows:
            continue
        keys = ordered([k for r in rows for k, v in r.items() if k != "step" and is_number(v)], ())
        table = []
        for k in keys:
            _, ys = series(rows, k)
            table.append([k, str(len(ys)), fmt_num(ys[0]), fmt_num(ys[-1]),
                          fmt_num(min(ys)), fmt_num(max(ys)), fmt_num(sum(ys) / len(ys))])
        where = (dirs or {}).get(method, method)
        blocks.append(("p", f"{label(method)}: {len(rows)} logged steps ({where}/metrics.jsonl)."))
        blocks.append(("table", ["Key", "Steps logged", "First", "Last", "Min", "Max", "Mean"], table))
    if len(blocks) == 1:
        blocks.append(("p", "No training logs found (<method>-seed<S>/metrics.jsonl)."))
    return blocks


def run_blocks(results: dict) -> list:
    """What was run: the settings (less other axes' and execution settings at their defaults), data, timings."""
    blocks = [("h2", "What was run")]
    config = results.get("config")
    if isinstance(config, dict) and config:
        blocks.append(("table", ["Setting", "Value"], settings_rows(config, results["axis"])))
        blocks.append(("p", "Settings of other axes are left out, and execution settings at their defaults."))
    else:
        blocks.append(("p", "results.json records no config."))
    info = results.get("info")
    if isinstance(info, dict) and info:
        blocks.append(("p", "Data:"))
        blocks.append(("table", ["Item", "Value"], [list(kv) for kv in flatten(info)]))
    timings = {k: v for k, v in (results.get("timings") or {}).items() if is_number(v)}
    if timings:
        blocks.append(("p", "Time per stage:"))
        blocks.append(("table", ["Stage", "Seconds"], [[k, f"{v:.1f}"] for k, v in timings.items()]))
    return blocks


def held_out_blocks(held_out: dict, splits, columns: tuple[str, str], note: str = "",
                    names: dict | None = None) -> list:
    """An axis' table of what each of `splits` holds out along its two dimensions (`held_out`: split -> the two
    columns' texts; `names`: how a split is shown), after `note`; nothing when no split has an entry."""
    rows = [[(names or {}).get(s, s), *held_out[s]] for s in splits if s in held_out]
    if not rows:
        return []
    return [("h3", "What each split holds out"), *([("p", note)] if note else []),
            ("table", ["Split", *columns], rows)]


def compared(results: dict, controls: bool = False) -> list[tuple[str, str, dict]]:
    """results "comparison" (opct.experiment.compare) as (a, b, metric -> split -> cell) in the table's order: the
    pairs of a control and the method it tests (`controls`), or all the others."""
    comp = results.get("comparison") or {}
    return [(a, b, comp[pair_key(a, b)]) for a, b in pairs(methods_view(results))
            if tests_control(a, b) == controls and pair_key(a, b) in comp]


def paired_blocks(results: dict, over: str) -> list:
    """Every comparison but the controls' (`compared`) as one table: comparison, metric, split, paired change with
    its 95 % bootstrap interval over `over` (the axis' units: "facts", "prompts"); nothing without comparisons."""
    rows = [[f"{label(a)} - {label(b)}", label(metric), s, fmt_cell(c) if c else DASH]
            for a, b, table in compared(results) for metric, per_split in table.items() for s, c in per_split.items()]
    if not rows:
        return []
    return [("h3", "Paired changes"),
            ("p", f"Mean over {over} of the per-{over.removesuffix('s')} difference, with a paired 95% bootstrap "
                  f"interval over {over}: an interval that excludes 0 is a change beyond resampling noise."),
            ("table", ["Comparison", "Metric", "Split", "Change"], rows)]


def seeds_blocks(results: dict, run_dir: Path) -> list:
    """`opct demo --seeds N`: per metric and split, base, each method's mean over seeds (each seed's value after it)
    and each pair of trained methods paired within each seed, from results "seeds" (opct.demo.across_seeds);
    nothing for a one-seed run."""
    seeds = results.get("seeds")
    if not isinstance(seeds, dict) or not seeds.get("table"):
        return []
    runs = seeds.get("runs") or {}
    names = [m for m in ordered(runs, METHOD_ORDER) if m != BASE]
    diffs = pairs(names, trained_only=True)

    def per_seed(c):
        return DASH if c is None else " / ".join(f"{v:.2f}" for v in c.get("per_seed", []))
    rows = []
    for metric, splits in seeds["table"].items():
        for split, row in splits.items():
            rows.append([label(metric), split, fmt_cell(row.get(BASE))]
                        + [x for m in names for x in (fmt_cell(row.get(m)), per_seed(row.get(m)))]
                        + [fmt_cell(row.get(pair_key(a, b))) for a, b in diffs])
    head = ["Metric", "Split", label(BASE)] + [x for m in names for x in (f"{label(m)} (mean)", f"{label(m)} per seed")]
    head += [f"{label(a)} − {label(b)}" for a, b in diffs]
    files = [f"samples/{r}.jsonl" for m in names for r in runs[m][1:] if (run_dir / "samples" / f"{r}.jsonl").is_file()]
    samples = f" The other seeds' answers: {', '.join(files)}." if files else ""
    return [("h2", f"Across {len(seeds.get('train_seeds', []))} training seeds"),
            ("p", f"Each method trained with seeds {', '.join(map(str, seeds.get('train_seeds', [])))} on the same "
                  "pairs and read on the same items; values are means over the items (each question's 0/1, each "
                  "fact's rate). A method's interval is a two-way bootstrap over seeds and items (95 %); a "
                  "difference (e.g. OPCT − SFT) pairs the two methods item by item within each seed. Base is one "
                  "model: its interval is over items only. The other sections show the first seed's runs."
                  + samples),
            ("table", head, rows)]


def controls_blocks(results: dict) -> list:
    """The attribution controls against the method each tests (results "comparison", opct.experiment.compare): per
    metric and split, each control's paired change; nothing without a control."""
    diffs = compared(results, controls=True)
    keys = list(dict.fromkeys((metric, split) for *_, table in diffs for metric, splits in table.items()
                              for split in splits))
    if not keys:
        return []
    rows = [[label(metric), split] + [fmt_cell(table.get(metric, {}).get(split)) for *_, table in diffs]
            for metric, split in keys]
    return [("h2", "Controls against OPCT"),
            ("p", "Each control is OPCT with one setting changed (docs/controls.md): shuffled context = the teacher "
                  "reads another example's clean prompt; fixed advantage = a constant negative advantage, no "
                  "teacher in the update; KL clipped = each token's KL term capped. Control − OPCT per item, on the "
                  "same items, with a 95 % bootstrap interval over items (one training run each; --seeds adds the "
                  "seeds). A control level with OPCT says that part of OPCT's update is not what carries its effect."),
            ("table", ["Metric", "Split"] + [f"{label(a)} − {label(b)}" for a, b, _ in diffs], rows)]


def settings_rows(config: dict, axis: str) -> list[list[str]]:
    """The demo config as (setting, value) rows, less what does not apply to `axis`: other axes' options
    (opct.options.opt(axes=...)) and execution settings at their defaults."""
    meta = {f.name: f for f in fields(DemoConfig)}
    rows = []
    for key, value in flatten(config):
        f = meta.get(key)
        if f is not None:
            if axis not in (f.metadata.get("axes") or (axis,)):
                continue
            if f.metadata.get("group") in (CPU, EXEC) and flatten({key: f.default}) == [(key, value)]:
                continue
        rows.append([key, value])
    return rows


def capability_methods(cap: dict) -> list[str]:
    return [m for m in METHOD_ORDER if any(m in t.get("methods", {}) for t in cap.values())]


def capability_rows(cap: dict, names: list[str]) -> list[list[str]]:
    """results.json "capability" as rows: task, metric, each method's score (and change from base), chance."""
    rows = []
    for task, t in cap.items():
        row = [task, t.get("metric", "")]
        for m in names:
            c = t.get("methods", {}).get(m)
            d = t.get("delta", {}).get(m)
            txt = fmt_cell(c) if c else DASH
            if d and m != BASE:
                txt += f" ({d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}])"
            row.append(txt)
        ch = t.get("chance")
        rows.append(row + [f"{ch:.2f}" if is_number(ch) else DASH])
    return rows


def write_report(run_dir: str | Path) -> dict:
    """Write report.md, report.html and plots/*.png for a run directory.

    Returns {"markdown": Path, "html": Path, "plots": {name: Path}}; a plot is left out when the
    run has nothing to draw in it (e.g. no training logs -> no training.png). Also writes the per-example answers as
    Inspect logs, <run_dir>/inspect/<created>_<axis>_<run>_<id>.json (opct.inspect_log)."""
    run_dir = Path(run_dir)
    results_path = run_dir / "results.json"
    if not results_path.is_file():
        raise FileNotFoundError(f"{results_path}: no such file (the report is built from the eval results)")
    results = read_results(results_path)
    dirs = {m: on_disk(run_dir, r, results) for m, r in first_runs(results).items()}  # the first seed's training runs
    logs = {m: read_metrics(run_dir / dirs[m] / "metrics.jsonl") for m in TRAINED if m in dirs}

    plot_dir = run_dir / "plots"
    plot_dir.mkdir(exist_ok=True)
    plots = {}
    panels = training_panels(logs)
    if panels:
        plots["training"] = plot_dir / "training.png"
        plot_training(panels, plots["training"])

    if isinstance(results.get("capability"), dict) and results["capability"]:
        plots["capability"] = plot_dir / "capability.png"
        plot_capability(results["capability"], plots["capability"])

    inspect = write_logs(run_dir, results)  # the per-example evaluations as Inspect logs (opct.inspect_log)
    blocks = build_blocks(results, logs, plots, run_dir, dirs)
    if inspect:
        at = next(i for i, b in enumerate(blocks) if b[0] == "h2" and b[1] == "Results")
        names = ", ".join(p.relative_to(run_dir).as_posix() for p in inspect)
        blocks.insert(at, ("p", f"The same answers as Inspect logs, one per model ({names}): "
                                f"`inspect view --log-dir {run_dir / 'inspect'}` opens them."))
    if lens_page(run_dir, results["axis"], dirs, dirs):  # tokens.html: the token viewer (opct.lens.report)
        blocks.insert(1, ("p", "Token by token, the training samples' teacher-student gap and the evaluated answers "
                               "side by side: [tokens.html](tokens.html)."))
    for kind, *args in blocks:  # the axis' own plots
        if kind == "img" and Path(args[1]).parts[0] == "plots":
            plots.setdefault(Path(args[1]).stem, run_dir / args[1])
    md_path, html_path = run_dir / "report.md", run_dir / "report.html"
    atomic_write(md_path, render_markdown(blocks))
    atomic_write(html_path, render_html(blocks))
    return {"markdown": md_path, "html": html_path, "plots": plots}


def headline_rows(results: dict) -> list[dict]:
    """The axis' `headline` figures from one demo's results.json: [{"metric", "split", "better", "methods":
    {method: cell or None}}]; [] for an axis this opct does not know or one without a headline."""
    name = results["axis"]
    methods, names = method_table(results)
    rows = []
    for metric, split, better in (get_axis(name).headline if name in AXES else ()):
        rows.append({"metric": metric, "split": split, "better": better,
                     "methods": {m: cell(methods, m, metric, split) for m in names}})
    return rows
