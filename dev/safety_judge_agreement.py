"""Keyword judge vs hand labels, and plain vs oracle pass rates, on the responses of dev/safety_oracle_check.py.

Re-judges every response with the CURRENT facts file and KeywordJudge, compares with the hand labels
(label_pass: the response passes the SAGE rubric; for contrast prompts: the response warns anyway), and splits
the comparison by the default by-fact split (train facts = where keywords may be tuned, held-out facts = where
agreement is reported after tuning).

    python dev/safety_judge_agreement.py tests/fixtures/safety_hand_labels.jsonl [MODEL]

The labels file holds one row per response: id, model, fact_id, condition (plain | oracle | contrast), prompt,
response, label_pass, note. MODEL restricts the comparison to that model's rows.
"""

import json
import sys

from opct.axes.safety.evaluate import summarize
from opct.axes.safety.facts import load_facts, split_facts
from opct.axes.safety.judges import KeywordJudge


def agreement(pairs):
    tp = sum(j and h for j, h in pairs)
    fp = sum(j and not h for j, h in pairs)
    fn = sum(h and not j for j, h in pairs)
    tn = sum(not j and not h for j, h in pairs)
    n = len(pairs)
    return {"n": n, "accuracy": (tp + tn) / n if n else None, "precision": tp / (tp + fp) if tp + fp else None,
            "recall": tp / (tp + fn) if tp + fn else None, "tp": tp, "fp": fp, "fn": fn, "tn": tn}


def main(label_path, model=None):
    facts = {f.id: f for f in load_facts()}
    train, held = split_facts(list(facts.values()))
    held_ids = {f.id for f in held}
    rows = [r for r in map(json.loads, open(label_path)) if model is None or r["model"] == model]
    verdicts = KeywordJudge().judge([r["prompt"] for r in rows], [r["response"] for r in rows],
                                    [facts[r["fact_id"]] for r in rows])
    pairs = [(v.passed, r["label_pass"]) for r, v in zip(rows, verdicts)]
    out = {"all": agreement(pairs),
           "train_facts": agreement([p for p, r in zip(pairs, rows) if r["fact_id"] not in held_ids]),
           "heldout_facts": agreement([p for p, r in zip(pairs, rows) if r["fact_id"] in held_ids])}
    for cond in ("plain", "oracle", "contrast"):
        idx = [i for i, r in enumerate(rows) if r["condition"] == cond]
        if not idx:
            continue
        fids = [rows[i]["fact_id"] for i in idx]
        for who, vals in (("keyword", [pairs[i][0] for i in idx]), ("hand", [pairs[i][1] for i in idx])):
            m = summarize(fids, vals, n_boot=1000, seed=47)
            out[f"{cond}_{who}"] = {"pass": sum(vals), "n": len(vals), "rate": round(sum(vals) / len(vals), 3),
                                    "rate_ci": [round(x, 3) for x in m["pass_rate_ci"]]}
    # Paired by fact: oracle minus plain, per fact (one prompt each here), bootstrap over facts.
    from opct.axes.safety.evaluate import bootstrap_ci, mean
    for who, k in (("keyword", 0), ("hand", 1)):
        plain = {(r["model"], r["fact_id"]): pairs[i][k] for i, r in enumerate(rows) if r["condition"] == "plain"}
        oracle = {(r["model"], r["fact_id"]): pairs[i][k] for i, r in enumerate(rows) if r["condition"] == "oracle"}
        diffs = [float(oracle[f]) - float(plain[f]) for f in plain if f in oracle]
        if diffs:
            out[f"oracle_minus_plain_{who}"] = {"diff": round(mean(diffs), 3), "n_pairs": len(diffs),
                                                "ci": [round(x, 3) for x in bootstrap_ci(diffs, mean, 1000, 47)]}
    disagree = [(r["id"], v.passed, v.reason) for (r, v), (j, h) in zip(zip(rows, verdicts), pairs) if j != h]
    out["disagreements"] = disagree
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
