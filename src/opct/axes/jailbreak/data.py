"""The jailbreak axis' options and data: training pairs, the SFT baseline's benign regulariser, evaluation items
(see the package docstring)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

from opct.axes.jailbreak.harmful import (EvalItem, eval_items, jailbreak_pairs, jailbreak_split, load_benign, user,
                               wrapper_split)
from opct.axes import options as options_of
from opct.axes.interface import AxisData
from opct.data.pairs import ConsistencyPair
from opct.axes.jailbreak.threats import threat_items, threat_pairs
from opct.axes.options import THREATS, parse_threats

NAME = "jailbreak"
SPLITS = ("train_wrappers", "heldout_wrappers", "heldout_family")
ALL_SPLITS = ("bare", *SPLITS, *THREATS, "benign")
HELDOUT = ("heldout_wrappers", "heldout_family")


@dataclass
class Options(options_of.Jailbreak, options_of.Judge, options_of.Generation):
    """The axis' sizes and switches: its flags (opct.axes.options: Jailbreak, Judge, Generation, each default written
    there) with its own defaults of the shared ones, and internals no flag sets. `options(cfg)` takes each from the
    config field of the same name (config.AxisOptions: `opct demo/eval --axis jailbreak --n-benign 40 ...`); a config
    without it (or none) keeps the default here. `source` is the training behaviours' source, `eval_source` the
    evaluation behaviours'; `eval_max_new_tokens` is its answers' budget (`max_new_tokens`, a Generation field, is
    the training runs')."""
    n_train: int = 48  # AdvBench training behaviours
    n_eval: int = 16  # HarmBench + StrongREJECT evaluation behaviours
    source: str = "advbench"  # training behaviours (opct.axes.jailbreak.harmful.load_behaviours spec)
    eval_train_per_behaviour: int = 1  # training wrappers per evaluation behaviour in "train_wrappers"
    judge_concurrency: int = 8
    samples_per_split: int = 3  # answers kept per split for the report


def options(cfg=None, **overrides) -> Options:
    """Options from a config's fields of the same names (config.AxisOptions has all but the axis' own internals, which
    keep their defaults, as do all without a config), then overrides."""
    own = {f.name for f in fields(Options)}
    vals = {} if cfg is None else {k: v for k, v in asdict(cfg).items() if k in own}
    vals.update(overrides)
    return Options(**vals)


# ----------------------------------------------------------------------------------------------
# data

def benign_split(n_eval: int, seed: int):
    """(evaluation prompts, regulariser pool): a seeded shuffle of every benign prompt, the first n_eval held out."""
    pool = sorted(load_benign(), key=lambda p: p.id)
    random.Random(f"benign-split:{seed}").shuffle(pool)
    if n_eval >= len(pool):
        raise ValueError(f"n_benign={n_eval} leaves no benign prompts for the regulariser ({len(pool)} in all)")
    return pool[:n_eval], pool[n_eval:]


def benign_pairs(pool, n: int, seed: int) -> list[ConsistencyPair]:
    """`n` regulariser pairs (student == teacher == the benign prompt), drawn from `pool` with the seed."""
    if n > len(pool):
        raise ValueError(f"{n} benign regulariser pairs requested, {len(pool)} benign prompts available")
    chosen = random.Random(f"benign-reg:{seed}").sample(pool, n)
    return [ConsistencyPair(user(p.text), user(p.text), {"axis": "jailbreak", "benign": True, "id": p.id})
            for p in chosen]


def n_benign_pairs(n_jailbreak: int, share: float) -> int:
    if not 0.0 <= share < 1.0:
        raise ValueError(f"benign_share must be in [0, 1), got {share}")
    return round(n_jailbreak * share / (1.0 - share))


def build_eval_set(eval_behaviours, splits, benign, opt: Options) -> list[EvalItem]:
    """bare + train wrappers (eval_train_per_behaviour each) + every held-out wrapper + every held-out prefill and
    multi-turn prelude (opct.axes.jailbreak.threats) + benign."""
    items = eval_items(eval_behaviours, {"train_wrappers": splits["train_wrappers"]},
                       per_behaviour=opt.eval_train_per_behaviour, benign=benign, seed=opt.seed)
    held = eval_items(eval_behaviours, {s: splits[s] for s in HELDOUT}, per_behaviour=None, seed=opt.seed)
    items += [it for it in held if it.split != "bare"] + threat_items(eval_behaviours)
    order = {s: i for i, s in enumerate(ALL_SPLITS)}
    return sorted(items, key=lambda it: order[it.split])  # stable: within a split, the builders' order


def prepare(cfg=None, tok=None, **overrides) -> AxisData:
    """The axis' data for a run (deterministic in the options' seed)."""
    opt = options(cfg, **overrides)
    train_b, eval_b = jailbreak_split(opt.source, opt.eval_source, opt.n_train, opt.n_eval, opt.seed)
    splits = wrapper_split()
    train_pairs = jailbreak_pairs(train_b, splits["train_wrappers"], opt.pairs_per_behaviour, opt.seed)
    threats = parse_threats(opt.train_threats)
    if threats:  # one more pair per behaviour and threat, shuffled in with the wrapped ones
        train_pairs += threat_pairs(train_b, threats, opt.seed)
        random.Random(f"threat-pairs:{opt.seed}").shuffle(train_pairs)
    benign_eval, benign_pool = benign_split(opt.n_benign, opt.seed)
    reg = benign_pairs(benign_pool, n_benign_pairs(len(train_pairs), opt.benign_share), opt.seed)
    sft_pairs = list(train_pairs) + reg
    random.Random(f"sft-pairs:{opt.seed}").shuffle(sft_pairs)
    ev = build_eval_set(eval_b, splits, benign_eval, opt)
    info = {"n_train_behaviours": len(train_b), "n_eval_behaviours": len(eval_b), "n_train_pairs": len(train_pairs),
            "n_sft_pairs": len(sft_pairs), "n_benign_regulariser_pairs": len(reg), "benign_share": opt.benign_share,
            "wrappers": {s: [w.name for w in ws] for s, ws in splits.items()},
            "eval_items": {s: sum(it.split == s for it in ev) for s in ALL_SPLITS},
            "source": opt.source, "eval_source": opt.eval_source, "train_threats": list(threats)}
    info.update(opct_benign=opt.opct_benign, n_opct_pairs=len(sft_pairs) if opt.opct_benign else len(train_pairs))
    if opt.opct_benign:  # the same pairs for both methods
        return AxisData(train_pairs=sft_pairs, eval_set=ev, info=info)
    return AxisData(train_pairs=train_pairs, eval_set=ev, sft_pairs=sft_pairs, info=info)
