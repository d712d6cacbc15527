"""A report's presentation, shared by every report: how methods and metrics are named and coloured (the methods
table's labels and colours, each axis' Metric rows), how cells and numbers are written, the figure helpers, and the
one list of blocks rendered as Markdown and as HTML, so the two always carry the same content.

Blocks: ("h1"|"h2"|"h3", text), ("p", text), ("list", [text]), ("table", header, rows), ("img", caption, path).
"""

from __future__ import annotations

import html
import io
import json
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from opct.data.io import atomic_write
from opct.experiment import METHODS
from opct.axes import metrics


# Display order (the methods table's); anything else found in results.json follows in the order it first appears.
METHOD_ORDER = tuple(METHODS)


# The methods' labels and colours are the methods table's; the axes' metrics' labels and directions their own
# (Axis.metrics); a training log's keys are shown as they are, but for these.
LABELS = {**{m.name: m.label for m in METHODS.values()}, "kl": "KL"}


COLORS = {m.name: m.colour for m in METHODS.values()}


OTHER_COLORS = ("#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")


DASH = "—"


def axis_metrics() -> dict:
    """The registered axes' metrics (Axis.metrics), read when a label is asked for (a test's axis included)."""
    return metrics()


def label(key: str) -> str:
    """A method's or a metric's name as reports show it."""
    if key in LABELS:
        return LABELS[key]
    m = axis_metrics().get(key)
    return m.label if m else key.replace("_", " ")


def direction(metric: str) -> str:
    """" (lower is better)" where the axis states it for the metric, else ""."""
    m = axis_metrics().get(metric)
    return f" ({m.better} is better)" if m and m.better else ""


def ordered(keys, preferred) -> list:
    """`preferred` keys that are present, then the rest in first-seen order."""
    seen = list(dict.fromkeys(keys))
    return [k for k in preferred if k in seen] + [k for k in seen if k not in preferred]


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_cell(c: dict | None) -> str:
    """"0.62 [0.57, 0.67]", or just "0.62" without an interval, or a dash when missing."""
    if c is None:
        return DASH
    text = f"{c['value']:.2f}"
    if is_number(c.get("lo")) and is_number(c.get("hi")):
        text += f" [{c['lo']:.2f}, {c['hi']:.2f}]"
    return text


def fmt_ratio(c: dict | None, base: dict | None) -> str:
    if c is None or base is None or base["value"] == 0:
        return DASH
    return f"×{c['value'] / base['value']:.2f}"


def fmt_n(cells: list[dict | None], fallbacks: list) -> str:
    """The prompt count; normally identical across methods, but shown per method if not."""
    ns = [c["n"] if c is not None and is_number(c.get("n")) else fb for c, fb in zip(cells, fallbacks)]
    ns = [int(n) for n in ns if is_number(n)]
    if not ns:
        return DASH
    return str(ns[0]) if len(set(ns)) == 1 else " / ".join(map(str, ns))


def fmt_num(x) -> str:
    return f"{x:.4g}" if is_number(x) else str(x)


def fmt_seconds(s: float) -> str:
    return f"{s:.0f} s ({s / 60:.1f} min)" if s >= 60 else f"{s:.1f} s"


def flatten(d: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested config -> [("opct.lr", "0.0001"), ...]; long values are shortened for the table."""
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += flatten(v, key + ".")
            continue
        text = v if isinstance(v, str) else json.dumps(v)
        out.append((key, text if len(text) <= 80 else text[:77] + "..."))
    return out


def method_color(method: str, i: int) -> str:
    return COLORS.get(method, OTHER_COLORS[i % len(OTHER_COLORS)])


def grouped_bars(ax, groups: list[str], methods: list[str], get, title: str) -> None:
    """One bar per (group, method) with asymmetric lo/hi error bars; `get(method, group)` -> cell|None."""
    width = 0.8 / len(methods)
    top = 1.0
    for i, m in enumerate(methods):
        xs, vals, below, above = [], [], [], []
        for j, g in enumerate(groups):
            c = get(m, g)
            if c is None or not is_number(c.get("value")):  # no cell, or a rate over no graded item (n = 0)
                continue
            v = c["value"]
            lo = c["lo"] if is_number(c.get("lo")) else v
            hi = c["hi"] if is_number(c.get("hi")) else v
            xs.append(j - 0.4 + width * (i + 0.5))
            vals.append(v)
            below.append(max(0.0, v - lo))
            above.append(max(0.0, hi - v))
            top = max(top, hi)
        if not xs:
            continue
        ax.bar(xs, vals, width * 0.92, yerr=[below, above], capsize=3, label=label(m),
               color=method_color(m, i), error_kw={"elinewidth": 1, "ecolor": "#333333"})
        for x, v, a in zip(xs, vals, above):
            ax.text(x, v + a + 0.01 * top, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups])
    ax.set_ylim(0, top * 1.12)  # headroom for the value labels above the error bars
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def method_legend(fig: Figure, ax) -> None:
    """One legend under the plot area, so it can never cover a bar near 1.0."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncols=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))


def save_figure(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    if not fig.legends:  # method_legend already laid the figure out around its legend
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write(path, buf.getvalue())


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) for the rows that have a numeric `key`; the line number stands in for a missing step."""
    xs, ys = [], []
    for i, row in enumerate(rows, 1):
        if is_number(row.get(key)):
            xs.append(row["step"] if is_number(row.get("step")) else i)
            ys.append(row[key])
    return xs, ys


def plot_line(ax, xs, ys, name: str, color: str) -> None:
    """Per-step values are noisy: with many steps, draw them faintly under a trailing moving average."""
    if len(ys) < 50:
        ax.plot(xs, ys, color=color, label=name, linewidth=1.2)
        return
    window = len(ys) // 25
    ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
    total, smooth = 0.0, []
    for i, y in enumerate(ys):
        total += y - (ys[i - window] if i >= window else 0.0)
        smooth.append(total / min(i + 1, window))
    ax.plot(xs, smooth, color=color, label=f"{name} (mean of {window} steps)", linewidth=1.5)


def md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list) -> str:
    out = []
    for kind, *args in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + args[0])
        elif kind == "p":
            out.append(args[0])
        elif kind == "list":
            out.append("\n".join(f"- {item}" for item in args[0]))
        elif kind == "table":
            header, rows = args
            lines = ["| " + " | ".join(md_cell(h) for h in header) + " |",
                     "|" + "|".join(["---"] * len(header)) + "|"]
            lines += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{args[0]}]({args[1]})")
    return "\n\n".join(out) + "\n"


HTML_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.2em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
figcaption { color: #555; font-size: 0.9em; margin-bottom: 1.5em; }
"""


def render_html(blocks: list) -> str:
    e = html.escape
    title = next((args[0] for kind, *args in blocks if kind == "h1"), "OPCT report")
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{e(title)}</title>", f"<style>{HTML_STYLE}</style>", "</head>", "<body>"]
    for kind, *args in blocks:
        if kind in ("h1", "h2", "h3", "p"):
            out.append(f"<{kind}>{e(args[0])}</{kind}>")
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in args[0]) + "</ul>")
        elif kind == "table":
            header, rows = args
            out.append("<table>")
            out.append("<tr>" + "".join(f"<th>{e(str(h))}</th>" for h in header) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in rows]
            out.append("</table>")
        elif kind == "img":
            out.append(f'<figure><img src="{e(args[1])}" alt="{e(args[0])}">'
                       f"<figcaption>{e(args[0])}</figcaption></figure>")
    out += ["</body>", "</html>"]
    return "\n".join(out) + "\n"
