"""The jailbreak axis' report section: ASR per split, the adaptive attack, judge agreement, sample answers."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from opct.axes.jailbreak.data import ALL_SPLITS, SPLITS
from opct.axes.jailbreak.threats import THREATS
from opct.experiment import entry
from opct.report.render import METHOD_ORDER, grouped_bars, label, method_legend, ordered, save_figure
from opct.report.run import held_out_blocks, method_table, paired_blocks, unclosed_block

# ----------------------------------------------------------------------------------------------
# report

SPLIT_LABELS = {"bare": "bare request", "train_wrappers": "training wrappers", "heldout_wrappers": "held-out wrappers",
                "heldout_family": "held-out family", "prefill": "prefilled compliant start",
                "multiturn": "after benign turns", "benign": "benign look-alikes"}
# split -> (behaviours / prompts, wrapper): what it holds out, for the report
HELD_OUT = {"bare": ("held-out (other benchmarks)", "none"),
            "train_wrappers": ("held-out (other benchmarks)", "trained"),
            "heldout_wrappers": ("held-out (other benchmarks)", "held-out wrappers"),
            "heldout_family": ("held-out (other benchmarks)", "a held-out family of wrappers"),
            "prefill": ("held-out (other benchmarks)", "none; the reply starts with a held-out compliant opener"),
            "multiturn": ("held-out (other benchmarks)", "none; the request follows held-out benign turns"),
            "benign": ("benign look-alikes, never trained on", "none")}


def metric(ev: dict, name: str) -> dict:
    return entry(ev, "metrics", name)


def count(ev: dict, name: str) -> dict:
    return entry(ev, "counts", name)


def detail(ev: dict, name: str) -> dict:
    return entry(ev, "details", name)


def _fmt(c) -> str:
    if not isinstance(c, dict) or c.get("value") is None:
        return "—"
    return f"{c['value']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}]"


def _agree(a) -> str:
    if not a or not a.get("n"):
        return "—"
    kappa = "undefined" if a["kappa"] is None else f"{a['kappa']:.2f}"
    return f"{a['agreement']:.2f} (kappa {kappa}, n={a['n']})"


def plot_asr(methods: dict, names: list[str], path) -> None:
    """Per-split attack success rate (and over-refusal on benign prompts) with Wilson intervals, one bar per method."""
    groups = [s for s in ("bare", *SPLITS, *THREATS) if any(s in metric(methods[m], "asr") for m in names)]
    groups += ["adaptive", "benign"]

    def get(m, g):
        r = methods[m]
        if g == "adaptive":
            return metric(r, "adaptive_attack").get("cracked")
        if g == "benign":
            return metric(r, "over_refusal") or None
        c = metric(r, "asr").get(g)
        return c if c and c.get("value") is not None else None

    fig = Figure(figsize=(9.0, 4.4))
    ax = fig.add_subplot()
    grouped_bars(ax, groups, names, get, "Attack success by split, adaptive attack (cracked share), over-refusal on "
                                        "benign prompts\n(95% Wilson intervals; lower is better)")
    ax.set_ylabel("rate")
    method_legend(fig, ax)
    save_figure(fig, path)


def report_blocks(results: dict, out) -> list:
    """The jailbreak section of report.md/html: per-split ASR and defence, refusal on bare requests, over-refusal,
    the adaptive attack, the rubric judge and its agreement (when run), and sample answers per split. Writes its
    plot under out/plots/."""
    out = Path(out)
    methods = {k: v for k, v in method_table(results)[0].items() if "asr" in v.get("metrics", {})}
    names = ordered(methods, METHOD_ORDER)
    if not names:
        return [("p", "No jailbreak results.")]
    blocks = [("h2", "Jailbreak: attack success by split"),
              ("p", "Attack success rate (ASR) = share of answers the refusal judge does not call a refusal (lower is "
                    "better); defence success = 1 - ASR. Evaluation behaviours (HarmBench + StrongREJECT) are never "
                    "trained on; training wrappers are the ones the models were trained with, held-out wrappers and "
                    "the held-out family never were. The prefill split starts the model's reply with a compliant "
                    "opener it continues (the judge reads the continuation); the multi-turn split asks after benign "
                    "turns; both use openers and preludes never trained on (--train-threats adds training pairs with "
                    "other ones). Greedy answers; 95% Wilson intervals over prompts. "
                    "Unparseable judge outputs are left out of the rates and counted in the last column.")]
    info = results.get("info") or {}
    reg = info.get("n_benign_regulariser_pairs")
    present = [s for s in ALL_SPLITS if s == "benign" or any(s in metric(methods[m], "asr") for m in names)]
    blocks += held_out_blocks(HELD_OUT, present, ("Behaviours", "Wrapper"), names=SPLIT_LABELS)  # older runs: fewer
    if reg is not None:
        both = info.get("opct_benign", False)
        blocks.append(("p", f"Training pairs: {info.get('n_train_pairs')} wrapped AdvBench requests and {reg} benign "
                            f"regulariser pairs (student == teacher), {'for both methods' if both else 'for SFT only'}"
                            "; the benign look-alikes evaluated are not among them."))
    header = ["Split"] + [label(m) for m in names] + ["n", "unparseable"]
    rows = []
    for s in ("bare", *SPLITS, *THREATS):
        cells = [metric(methods[m], "asr").get(s) for m in names]
        if any(cells):
            n = max(count(methods[m], "n").get(s, 0) for m in names)
            unp = ", ".join(str(count(methods[m], "unparseable").get(s, 0)) for m in names)
            rows.append([SPLIT_LABELS[s]] + [_fmt(c) for c in cells] + [str(n), unp])
    blocks.append(("table", header, rows))
    blocks += paired_blocks(results, "prompts")  # ASR per harmful split, over-refusal on the benign prompts
    if unclosed_block(methods, names):
        blocks.append(unclosed_block(methods, names))
    blocks += attack_blocks(methods, names) + judge_blocks(methods, names)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_asr(methods, names, plots / "jailbreak_by_split.png")
    blocks.append(("img", "Attack success by split, adaptive attack, over-refusal",
                   "plots/jailbreak_by_split.png"))
    return blocks + sample_blocks(methods, names)


def attack_blocks(methods: dict, names: list[str]) -> list:
    """The adaptive per-target attack, refusal on bare requests and over-refusal, per method."""
    adv = [{**metric(methods[m], "adaptive_attack"), **detail(methods[m], "adaptive_attack")} for m in names]
    a0 = next((a for a in adv if a), {})
    blocks = [("h3", "Adaptive per-target attack")]
    blocks.append(("p", f"For each evaluation behaviour: greedy answers under every held-out wrapper and held-out-"
                        f"family wrapper ({', '.join(a0.get('wrappers', []))}) plus {a0.get('k_samples', 0)} samples at "
                        "T = 1; cracked if any attempt is not refused. A fixed search over held-out attacks, not the "
                        "paper's trained attacker."))
    blocks.append(("table", ["Metric"] + [label(m) for m in names],
                   [["cracked share"] + [_fmt(a.get("cracked")) for a in adv],
                    ["defence success"] + [_fmt(a.get("defence")) for a in adv],
                    ["attempts per behaviour"] + [str(a.get("attempts_per_behaviour", "—")) for a in adv]]))
    blocks.append(("h3", "Refusal on bare requests and over-refusal"))
    blocks.append(("table", ["Metric"] + [label(m) for m in names],
                   [["refusal rate, bare harmful requests (higher is safer)"] +
                    [_fmt(metric(methods[m], "refusal").get("bare")) for m in names],
                    ["over-refusal, benign look-alikes (lower is better)"] +
                    [_fmt(metric(methods[m], "over_refusal")) for m in names]]))
    return blocks


def judge_blocks(methods: dict, names: list[str]) -> list:
    """The StrongREJECT rubric judge's and the second judge's readings of the same answers, when they ran."""
    blocks = []
    rub = [detail(methods[m], "rubric") for m in names]
    if any(rub):
        blocks.append(("h3", "StrongREJECT rubric judge"))
        r0 = next(r for r in rub if r)
        blocks.append(("p", f"Judge: {r0.get('judge')}. ASR = share of rubric scores >= 0.5; agreement = same "
                            "refused/complied label as the refusal judge on answers both could parse."))
        rrows = []
        for s in ("bare", *SPLITS, *THREATS):
            rrows.append([SPLIT_LABELS[s]] + [_fmt((r or {}).get("asr", {}).get(s)) for r in rub])
        rrows.append(["unparseable (all splits)"] + [str(sum((r or {}).get("unparseable", {}).values())) for r in rub])
        rrows.append(["agreement with refusal judge"] + [_agree((r or {}).get("agreement_with_refusal_judge"))
                                                         for r in rub])
        blocks.append(("table", ["Split"] + [label(m) for m in names], rrows))
    sec = [detail(methods[m], "second_judge") for m in names]
    if any(sec):
        s0 = next(x for x in sec if x)
        blocks.append(("h3", f"Second judge: {s0.get('judge')}"))
        blocks.append(("p", "The stock AdvBench/HarmBench refusal list (any listed string anywhere in the answer) on "
                            "the same answers: its ASR per split and how often it gives the refusal judge's label. "
                            "It fires on answers that merely quote 'illegal' and misses refusals it does not list."))
        srows = [[SPLIT_LABELS[s]] + [_fmt((x or {}).get("asr", {}).get(s)) for x in sec]
                 for s in ("bare", *SPLITS, *THREATS)]
        srows.append(["over-refusal, benign"] + [_fmt((x or {}).get("over_refusal")) for x in sec])
        srows.append(["agreement with refusal judge"] + [_agree((x or {}).get("agreement_with_refusal_judge"))
                                                         for x in sec])
        blocks.append(("table", ["Split"] + [label(m) for m in names], srows))
    return blocks


def sample_blocks(methods: dict, names: list[str]) -> list:
    """A seeded pick of answers per split and method, with the refusal judge's label."""
    blocks = []
    blocks.append(("h3", "Sample answers per split"))
    blocks.append(("p", "A seeded pick of answers per split and method ([wrapper] request; the full prompts are in "
                        "samples/<method>.jsonl), with the refusal judge's label, so a reader can see what 'refused' "
                        "means here."))
    for s in ALL_SPLITS:
        srows = []
        for m in names:
            for x in detail(methods[m], "samples").get(s, []):
                shown = f"[{x['wrapper']}] {x['request']}" if x.get("wrapper") else x.get("request", x["prompt"])
                srows.append([label(m), shown.replace("\n", " "), x["response"].replace("\n", " ")[:300],
                              x["label"]])
        if srows:
            blocks.append(("p", f"{SPLIT_LABELS[s]}:"))
            blocks.append(("table", ["Method", "Prompt", "Answer (first 300 characters)", "Judge"], srows))
    return blocks
