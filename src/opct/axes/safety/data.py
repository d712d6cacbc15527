"""The safety axis' prompt selection: which prompts of each fact each split evaluates (the facts, prompts and
pairs themselves: opct.axes.safety.facts)."""

from __future__ import annotations

import random

from opct.axes.safety.facts import SafetyPrompt

SPLITS = ("heldout", "heldout_variants", "train", "contrast", "oracle")
RATE_SPLITS = ("heldout", "heldout_variants", "train", "oracle")
HELD_OUT = {  # split -> (facts, surface variants): what it holds out, for the report
    "heldout": ("held-out", "trained variants"),
    "heldout_variants": ("held-out", "held-out variants (--heldout-variants)"),
    "train": ("trained (prompts not trained on)", "trained variants"),
    "contrast": ("all (the fact does not apply)", "every variant"),
    "oracle": ("held-out, the fact in the system prompt", "trained variants"),
}


def seeded_rng(seed: int, key: str) -> random.Random:
    return random.Random(f"safety:{seed}:{key}")


def per_fact(prompts: list[SafetyPrompt], k: int, seed: int, split: str, avoid: set[str] = frozenset()) -> list:
    """Up to k prompts of each fact: its prompts shuffled (seeded), those in `avoid` last, then taken round-robin
    over prompt types so that one fact's k prompts differ in type as well as in surface variant."""
    by_fact: dict[str, list[SafetyPrompt]] = {}
    for p in prompts:
        by_fact.setdefault(p.fact_id, []).append(p)
    out = []
    for fid, ps in by_fact.items():
        ps = sorted(ps, key=lambda p: p.id)
        seeded_rng(seed, f"{split}/{fid}").shuffle(ps)
        ps.sort(key=lambda p: p.id in avoid)  # stable: untrained prompts first, shuffled within
        by_type: dict[str, list[SafetyPrompt]] = {}
        for p in ps:
            by_type.setdefault(p.prompt_type if not p.contrast else p.id.split("/")[1], []).append(p)
        queues, picked = list(by_type.values()), []
        while len(picked) < k and any(queues):
            for q in queues:
                if q and len(picked) < k:
                    picked.append(q.pop(0))
        out += picked
    return out


def minor_count(n_eval: int) -> int:
    """Prompts per fact for the training-fact and contrast splits: a third of the held-out count, at least 1 (the
    held-out split is the axis' main result; the others are checks)."""
    return max(1, -(-n_eval // 3))
