"""`opct check`: whether a pairs file carries a signal for OPCT on a model, before any training.

On a seeded sample of the file's pairs, with the model that would be trained (no LoRA: the student and the frozen
teacher are the same weights, so the only difference between them is the prompt):
  1. render   both sides as training renders them (ChatFormat.sides) and diff the tokens (lens/diff.py): pairs whose
              sides render identically train nothing; pairs whose perturbed side is not the clean side with text
              added (`added_only`) also reword or drop part of the clean prompt; a pair that declares its cue
              (CTM's mcq-bias "biasing_text", or "cue") has it in the perturbed prompt and not in the clean one;
  2. answers  the greedy answer to each side: for multiple-choice pairs the answer read from "(B)" or "The answer
              is ...", else the normalised text; the share that changes between the two prompts;
  3. gap      one sample per pair from the perturbed prompt (as the student samples at the start of training),
              each token scored after both prompts: log p(y_t | perturbed) - log p(y_t | clean), the sampled-token
              estimate of the reverse KL that OPCT's first step minimises (its default loss); its mean per token,
              its spread over pairs, the share in each response's first HEAD tokens, the pairs with the most and
              least of it;
  4. verdict  one line: no signal (nothing differs, or no gap and no answer changes), concentrated (the top tenth of
              the pairs carry more than half the gap) or ready; exit status 0 whatever it says.
Written to --out: check.json (the figures and every sampled pair's row) and check.html (the verdict, the table and
the token viewer: both prompts with their difference marked, each response token coloured by its gap).
"""

from __future__ import annotations

import html
import json
import math
import random
import re
import time
from pathlib import Path

import torch

from opct import backends, models
from opct.backends.sampling import SamplingSettings
from opct.data.chat import ChatFormat
from opct.data.formats import read_pairs
from opct.data.io import write_json
from opct.lens import viewer
from opct.lens.diff import added_only, token_diff
from opct.stats import rate_cell, wilson

DECLARED = ("biasing_text", "cue")  # a pair's own statement of its cue: CTM's mcq-bias rows, or a pairs file's "cue"
HEAD = 8  # "the first tokens": a response's first 8 (as training's kl_head)
NO_GAP = 0.01  # nats per token: below this mean gap, with no answer changing, a file carries no signal
TOP_SHARE = 0.5  # concentrated: the top tenth of the pairs carry more than this share of the summed gap
# an option letter: "(B)", "The answer is B." / "answer is (B)", or a reply that is "B" or starts "B." / "B)"
LETTERS = (re.compile(r"\(([A-J])\)"), re.compile(r"(?i:answer is):?\s*\(?([A-J])(?=\)|[.,:;]|\s*$)"),
           re.compile(r"^\s*([A-J])(?=[.):]|\s*$)"))
ANSWER_IS = re.compile(r"answer is:?\s*(.+?)\s*(?:[.\n]|$)", re.IGNORECASE)


def answer_key(text: str) -> str | None:
    """A multiple-choice answer read from a reply: its option letter (LETTERS), else what follows "The answer is",
    normalised (quotes and case dropped); None when neither is there."""
    for form in LETTERS:
        m = form.search(text)
        if m:
            return m.group(1)
    m = ANSWER_IS.search(text)
    return normalised(m.group(1).strip("\"'“”‘’ ")) if m else None


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def declared_cue(meta: dict, student_text: str, teacher_text: str) -> tuple[str | None, bool | None]:
    """The cue a pair declares (DECLARED), and whether it is where a cue goes: in the perturbed prompt and not in
    the clean one (None: no cue declared)."""
    cue = next((meta[k].strip() for k in DECLARED if isinstance(meta.get(k), str) and meta[k].strip()), None)
    return cue, None if cue is None else (cue in student_text and cue not in teacher_text)


def sample_indices(n_pairs: int, n: int, seed: int) -> list[int]:
    """`n` pair indices drawn with `seed` (all of them when the file has no more), in file order."""
    return sorted(random.Random(f"check:{seed}").sample(range(n_pairs), min(n, n_pairs)))


def answers(policy, fmt: ChatFormat, prompts: list[list[int]], settings: SamplingSettings, seed: int,
            batch_size: int) -> tuple[list[list[int]], list[str]]:
    """Each prompt's reply (token ids) and its answer text (after a thinking model's reasoning; "" unclosed)."""
    got = policy.generate(prompts, settings, torch.Generator().manual_seed(seed), batch_size=batch_size)
    texts = []
    for p, r in zip(prompts, got):
        s = fmt.split(p, r)
        texts.append(policy.tok.decode(s.answer, skip_special_tokens=True).strip() if s.closed else "")
    return got, texts


def answer_changes(student: list[str], teacher: list[str]) -> dict:
    """How often the greedy answer changes between the two prompts: multiple-choice where an answer is read from
    both sides of at least half the pairs (`answer_key`), else free text compared whole (`normalised`)."""
    keys = [(answer_key(s), answer_key(t)) for s, t in zip(student, teacher)]
    read = [(a, b) for a, b in keys if a is not None and b is not None]
    if len(read) * 2 >= len(keys):
        changed = [a != b for a, b in read]
        return {"kind": "multiple-choice", "changed": wilson(sum(changed), len(changed)),
                "unread": len(keys) - len(read), "keys": keys}
    changed = [normalised(s) != normalised(t) for s, t in zip(student, teacher)]
    return {"kind": "free text", "changed": wilson(sum(changed), len(changed)), "unread": 0,
            "keys": [(normalised(s)[:60], normalised(t)[:60]) for s, t in zip(student, teacher)]}


def gap_summary(per_pair: list[list[float]]) -> dict:
    """The per-token gaps of each pair's sample -> mean per token, spread over pairs, head share, top share."""
    flat = [k for ks in per_pair for k in ks]
    means = [sum(ks) / len(ks) if ks else 0.0 for ks in per_pair]
    sums = sorted((max(sum(ks), 0.0) for ks in per_pair), reverse=True)
    head = [k for ks in per_pair for k in ks[:HEAD]]
    tail = [k for ks in per_pair for k in ks[HEAD:]]
    top = max(1, math.ceil(len(sums) / 10))
    q = sorted(means)
    return {"mean_per_token": sum(flat) / max(len(flat), 1), "tokens": len(flat),
            "pair_mean": rate_cell(means) if means else None,
            "pair_quantiles": {"p10": q[int(0.1 * (len(q) - 1))], "median": q[(len(q) - 1) // 2],
                               "p90": q[int(0.9 * (len(q) - 1))]} if q else None,
            "head_mean": sum(head) / len(head) if head else None, "tail_mean": sum(tail) / len(tail) if tail else None,
            "head_share": sum(head) / sum(flat) if flat and sum(flat) > 0 else None,
            "top_pairs": top, "top_share": sum(sums[:top]) / sum(sums) if sum(sums) > 0 else None}


def verdict(n: int, identical: int, gap: dict, changed: dict) -> tuple[str, str]:
    """(word, the line a researcher acts on)."""
    if identical == n:
        return "no signal", f"no signal: both sides of all {n} sampled pairs render to the same tokens"
    rate = changed["changed"]["value"] or 0.0
    if gap["mean_per_token"] < NO_GAP and rate == 0:
        return "no signal", (f"no signal: the teacher-student gap is {gap['mean_per_token']:.4f} nats per token "
                             f"(under {NO_GAP}) and no greedy answer changes with the perturbation")
    if gap["top_share"] is not None and gap["top_share"] > TOP_SHARE and n >= 10:
        return "concentrated", (f"signal concentrated in a few pairs: the top {gap['top_pairs']} of {n} carry "
                                f"{gap['top_share']:.0%} of the gap; look at them before training on the rest")
    return "ready", (f"ready: a gap of {gap['mean_per_token']:.3f} nats per token, {rate:.0%} of greedy answers "
                     f"change with the perturbation")


def viewer_sample(tok, i: int, where: str, ids_s, ids_t, d, resp, ls, lt, fmt: ChatFormat) -> dict:
    start = fmt.answer_start(ids_s, resp) if fmt.thinks else 0
    start = len(resp) if start is None else start
    return {"pair": i, "label": f"pair {i} ({where})", "student_prompt": tok.batch_decode([[t] for t in ids_s]),
            "teacher_prompt": tok.batch_decode([[t] for t in ids_t]), "student_diff": d.student,
            "teacher_diff": d.teacher, "response": tok.batch_decode([[t] for t in resp]), "logp_student": ls,
            "logp_teacher": lt, "in_loss": [True] * len(resp),
            "reasoning": [j < start for j in range(len(resp))] if fmt.thinks else None}


def run_check(cfg) -> dict:
    """The check (module docstring) of cfg.pairs on cfg.model: writes check.json and check.html under cfg.out and
    returns the summary."""
    t0 = time.perf_counter()
    pairs = read_pairs(cfg.pairs, cfg.pairs_format)
    idx = sample_indices(len(pairs), cfg.n, cfg.seed)
    chosen = [pairs[i] for i in idx]
    device, dtype, backend = backends.resolve(cfg)
    model, tok = models.load_model(cfg.model, device=device, dtype=dtype)
    fmt_s, fmt_t = ChatFormat.sides(tok, cfg)
    policy = backends.make_policy(backend, model, tok, models.eos_ids(model, tok), cfg, train=False)
    # 1. the two rendered prompts and their difference
    ids_s = [fmt_s.prompt(p.student) for p in chosen]
    ids_t = [fmt_t.prompt(p.teacher) for p in chosen]
    diffs = [token_diff(s, t) for s, t in zip(ids_s, ids_t)]
    texts = [(tok.decode(s), tok.decode(t)) for s, t in zip(ids_s, ids_t)]
    added = [added_only(s, t) for s, t in texts]
    cues = [declared_cue(p.meta, s, t) for p, (s, t) in zip(chosen, texts)]
    # 2. the greedy answers to each side
    greedy = SamplingSettings(cfg.max_new_tokens, 0.0)
    _, ans_s = answers(policy, fmt_s, ids_s, greedy, cfg.seed, cfg.batch_size)
    _, ans_t = answers(policy, fmt_t, ids_t, greedy, cfg.seed, cfg.batch_size)
    changed = answer_changes(ans_s, ans_t)
    # 3. one sample per pair from the perturbed prompt, scored after both
    samples = policy.generate(ids_s, SamplingSettings(cfg.max_new_tokens, cfg.temperature),
                              torch.Generator().manual_seed(cfg.seed), batch_size=cfg.batch_size)
    ls = [lp.tolist() for lp, _ in policy.continuation_logprobs(ids_s, samples, batch_size=cfg.batch_size)]
    lt = [lp.tolist() for lp, _ in policy.continuation_logprobs(ids_t, samples, batch_size=cfg.batch_size)]
    policy.close()
    gaps = [[a - b for a, b in zip(x, y)] for x, y in zip(ls, lt)]
    rows = [{"pair": i, "where": chosen[k].meta.get("_where", f"pair {i}"), "identical": diffs[k].identical,
             "differing_tokens": {"student": diffs[k].n_student, "teacher": diffs[k].n_teacher},
             "first_difference": diffs[k].first(), "added_only": added[k][0], "changed_text": added[k][1],
             "declared_cue": cues[k][0], "cue_in_place": cues[k][1],
             "answer": {"student": ans_s[k], "teacher": ans_t[k]},
             "answer_key": {"student": changed["keys"][k][0], "teacher": changed["keys"][k][1]},
             "gap_mean": sum(gaps[k]) / len(gaps[k]) if gaps[k] else 0.0, "gap_tokens": len(gaps[k])}
            for k, i in enumerate(idx)]
    # 4. the verdict, and the files
    summary = summarise(cfg, len(pairs), rows, gap_summary(gaps), changed, time.perf_counter() - t0)
    views = [viewer_sample(tok, r["pair"], r["where"], ids_s[k], ids_t[k], diffs[k], samples[k], ls[k], lt[k], fmt_s)
             for k, r in enumerate(rows)]
    asked = [next(m["content"] for m in reversed(p.student) if m["role"] == "user") for p in chosen]
    write_outputs(Path(cfg.out), f"opct check: {Path(cfg.pairs).name} on {cfg.model}", summary, rows, views, asked)
    return summary


def summarise(cfg, n_file: int, rows: list[dict], gap: dict, changed: dict, seconds: float) -> dict:
    """The check's figures, its verdict and its warnings."""
    n, identical = len(rows), sum(r["identical"] for r in rows)
    word, line = verdict(n, identical, gap, changed)
    beyond = [r for r in rows if not r["added_only"]]
    warnings = []
    if identical and identical < n:
        warnings.append(f"{identical} of {n} pairs render identically: no gap at the start (benign regularisers, "
                        "if meant; with LoRA they hold the student near the teacher on those prompts)")
    if beyond:
        warnings.append(f"{len(beyond)} of {n} pairs differ beyond added text: the clean prompt is also reworded or "
                        f"cut (pair {beyond[0]['pair']}: its clean side's {beyond[0]['changed_text']!r}), so the "
                        "student also learns to answer those differences")
    misplaced = [r for r in rows if r["cue_in_place"] is False]
    if misplaced:
        warnings.append(f"{len(misplaced)} of {n} pairs declare a cue that is not in the perturbed prompt alone (pair "
                        f"{misplaced[0]['pair']}: {misplaced[0]['declared_cue'][:60]!r})")
    ranked = sorted(rows, key=lambda r: r["gap_mean"], reverse=True)
    return {"verdict": word, "line": line, "pairs_file": str(cfg.pairs), "model": cfg.model, "pairs_in_file": n_file,
            "sampled": n, "seed": cfg.seed, "identical": identical, "beyond_cue": len(beyond),
            "declared_cues": sum(r["declared_cue"] is not None for r in rows), "cues_misplaced": len(misplaced),
            "warnings": warnings,
            "answers": {k: v for k, v in changed.items() if k != "keys"}, "gap": gap,
            "most_signal": [r["pair"] for r in ranked[:3]], "least_signal": [r["pair"] for r in ranked[-3:][::-1]],
            "wall_seconds": round(seconds, 1)}


def write_outputs(out: Path, title: str, summary: dict, rows: list[dict], views: list[dict], asked: list[str]) -> None:
    """check.html (the viewer, the pairs with the most signal first; each pair's greedy answers under its perturbed
    side's last user turn, `asked`) and check.json, each written whole."""
    out.mkdir(parents=True, exist_ok=True)
    rank = {r["pair"]: -r["gap_mean"] for r in rows}
    views = sorted(views, key=lambda v: rank[v["pair"]])
    evals = [{"axis": "check", "split": "greedy", "id": r["where"], "prompt": q,
              "answers": [{"method": "perturbed prompt", "text": r["answer"]["student"], "verdict": {}},
                          {"method": "clean prompt", "text": r["answer"]["teacher"], "verdict": {}}]}
             for r, q in zip(rows, asked)]
    viewer.write(out / "check.html", title, [{"label": "one sample per pair from the perturbed prompt",
                                               "samples": views}], evals, header_html(summary, rows))
    write_json(out / "check.json", {**summary, "pairs": rows})


def header_html(summary: dict, rows: list[dict]) -> str:
    """The check page's top: the verdict, the figures and one row per sampled pair."""
    g, a = summary["gap"], summary["answers"]
    e = html.escape
    figures = [f"{summary['sampled']} of {summary['pairs_in_file']} pairs sampled (seed {summary['seed']})",
               f"{summary['identical']} render identically; {summary['beyond_cue']} differ beyond added text",
               f"greedy answer changes ({a['kind']}): {a['changed']['value'] or 0:.0%} of {a['changed']['n']}"
               + (f", {a['unread']} unread" if a["unread"] else ""),
               f"gap per token {g['mean_per_token']:.4f} nats over {g['tokens']} tokens"
               + (f"; first {HEAD} tokens {g['head_mean']:.4f}, rest {g['tail_mean']:.4f}"
                  if g["head_mean"] is not None and g["tail_mean"] is not None else "")
               + (f"; the first {HEAD} tokens carry {g['head_share']:.0%} of it" if g["head_share"] is not None else "")]
    body = "".join(
        f"<tr><td>{r['pair']}</td><td>{e(r['where'])}</td><td>{r['differing_tokens']['student']} / "
        f"{r['differing_tokens']['teacher']}</td><td>{'yes' if r['added_only'] else e(repr(r['changed_text']))}</td>"
        f"<td>{e(str(r['answer_key']['student']))} / {e(str(r['answer_key']['teacher']))}</td>"
        f"<td>{r['gap_mean']:.3f}</td></tr>" for r in rows)
    return (f"<p class='check-verdict'><b>{e(summary['line'])}</b></p>"
            + "".join(f"<p class='warning'>warning: {e(w)}</p>" for w in summary["warnings"]) + "<ul>"
            + "".join(f"<li>{e(x)}</li>" for x in figures) + "</ul><details><summary>every sampled pair</summary>"
            "<table><tr><th>pair</th><th>where</th><th>tokens differing (perturbed / clean)</th>"
            "<th>only text added?</th><th>answer (perturbed / clean)</th><th>gap per token</th></tr>"
            f"{body}</table></details>")


def print_summary(summary: dict) -> None:
    g, a = summary["gap"], summary["answers"]
    print(f"opct check: {summary['sampled']} of {summary['pairs_in_file']} pairs of {summary['pairs_file']} on "
          f"{summary['model']} ({summary['wall_seconds']} s)")
    print(f"  prompts: {summary['identical']} render identically, {summary['beyond_cue']} differ beyond added text"
          + (f"; {summary['declared_cues']} declare their cue, {summary['cues_misplaced']} not where a cue goes"
             if summary["declared_cues"] else ""))
    print(f"  greedy answers ({a['kind']}): {a['changed']['value'] or 0:.1%} change with the perturbation "
          f"[{a['changed']['lo']:.1%}, {a['changed']['hi']:.1%}]" + (f", {a['unread']} unread" if a["unread"] else ""))
    spread = g["pair_quantiles"]
    print(f"  gap log p_student - log p_teacher: {g['mean_per_token']:.4f} nats per token"
          + (f"; per pair p10 {spread['p10']:.3f} median {spread['median']:.3f} p90 {spread['p90']:.3f}" if spread else "")
          + (f"; first {HEAD} tokens {g['head_mean']:.4f}, rest {g['tail_mean']:.4f}" if g["tail_mean"] is not None
             else "")
          + (f"; the first {HEAD} tokens carry {g['head_share']:.0%} of it" if g["head_share"] is not None else ""))
    print(f"  most signal: pairs {summary['most_signal']}; least: {summary['least_signal']}")
    for w in summary["warnings"]:
        print(f"  warning: {w}")
    print(f"opct check: {summary['line']}")
    print(json.dumps({"verdict": summary["verdict"]}))
