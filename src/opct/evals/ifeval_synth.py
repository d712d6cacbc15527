"""An IFEval-style instruction-following set written by lm-eval's own IFEval checkers.

Google's 541 IFEval prompts ship in no package we can reach, but their checkers do (`lm_eval/tasks/ifeval`,
Apache-2.0). Each checker class writes its own instruction text: `build_description()` draws its arguments
(a word count, keywords, a postscript marker, ...) from Python's global `random` and returns the sentence, and
`get_instruction_args()` returns those arguments. An item here is an ordinary request from `BASE_PROMPTS` plus one
or two such sentences, in IFEval's own record format (`key`, `prompt`, `instruction_id_list`, `kwargs`), so the
stock `ifeval` `process_results` scores it: it rebuilds each checker from `kwargs` and runs `check_following`
on the response (strict, and loose after stripping the first/last line and asterisks).

A drawn instruction is kept only if rebuilding it from its arguments, as the scorer does, gives the same text:
`length_constraints:nth_paragraph_first_word` sometimes draws a paragraph number past the paragraph count, which
the rebuild then replaces by a fresh random one; such draws are redrawn.

Determinism: item i draws everything from `random.Random(f"ifeval_synth:{seed}:{i}")`; the global `random` state
the checkers read is seeded from that generator for each instruction and restored afterwards. Instructions that
conflict (lm-eval's `INSTRUCTION_CONFLICTS`) are never combined.

Left out, so that every instruction is checkable offline and with the same result on every run:
`length_constraints:number_sentences` and `change_case:capital_word_frequency` need NLTK's punkt model, which
no package registry ships; `language:response_language` asks for a non-English reply and is graded by
`langdetect`, whose guesses on short text vary from run to run unless seeded.

NLTK: importing lm-eval's `instructions_util` calls `nltk.download("punkt_tab")` when punkt is missing.
`prepare_nltk()` makes that lookup succeed without a network by appending an empty `tokenizers/punkt_tab`
folder under $OPCT_CACHE to the *end* of `nltk.data.path` (a real punkt install still wins), and seeds
langdetect (used by the two `change_case:english_*` checkers) so their verdicts repeat.
"""

from __future__ import annotations

import random
from pathlib import Path

import langdetect

from opct.data.mcq import cache_dir

EXCLUDED = ("length_constraints:number_sentences", "change_case:capital_word_frequency",
            "language:response_language")
DEFAULT_N = 200
DEFAULT_SEED = 0

BASE_PROMPTS = [  # written for opct; plain requests with no constraints of their own
    "Write a short story about a cat who learns to swim.",
    "Describe your ideal weekend.",
    "Explain why the sky is blue to a ten-year-old.",
    "Write a letter to a friend you have not seen in years.",
    "Give some advice to a student starting university.",
    "Describe how to make a cup of tea.",
    "Write a product description for a reusable water bottle.",
    "Explain what a computer does.",
    "Write a poem about the ocean.",
    "Describe a busy market in the morning.",
    "Write a review of a restaurant you enjoyed.",
    "Explain how plants grow from seeds.",
    "Write a short speech for a school graduation.",
    "Describe the four seasons.",
    "Write an email asking your manager for a day off.",
    "Explain why exercise is good for your health.",
    "Write a story about a robot that wants to be a chef.",
    "Describe your favorite book and why you like it.",
    "Give tips for saving money each month.",
    "Explain how a bicycle works.",
    "Write a blog post about learning a new language.",
    "Describe a walk through a forest.",
    "Write a thank-you note to a teacher.",
    "Explain the water cycle.",
    "Write a short biography of a fictional inventor.",
    "Describe the city you would most like to visit.",
    "Give instructions for planting a small vegetable garden.",
    "Write an advertisement for a new bakery.",
    "Explain why sleep is important.",
    "Write a story about two friends lost in a museum.",
    "Describe what makes a good team leader.",
    "Write a short essay about the importance of reading.",
    "Explain how to prepare for a job interview.",
    "Describe a rainy day in a small town.",
    "Write a diary entry from the point of view of a dog.",
    "Explain what recycling is and why it matters.",
    "Write a limerick about a clumsy giraffe.",
    "Describe how you would plan a birthday party.",
    "Write a news report about a town festival.",
    "Explain the difference between weather and climate.",
]


def prepare_nltk(cache: Path | None = None) -> None:
    """Make lm-eval's import-time punkt check pass offline (see the module docstring); seed langdetect."""
    import nltk  # slow to import (times: dev/LOG.md): only an IFEval run pays it

    langdetect.DetectorFactory.seed = 0
    try:
        nltk.data.find("tokenizers/punkt_tab")
        return
    except LookupError:
        pass

    root = (cache or cache_dir()) / "nltk_stub"
    (root / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    if str(root) not in nltk.data.path:
        nltk.data.path.append(str(root))


def registry():
    prepare_nltk()
    from lm_eval.tasks.ifeval import instructions_registry

    return instructions_registry


def instruction_ids() -> list[str]:
    """The checker ids this set draws from: lm-eval's registry less EXCLUDED, in registry order."""
    return [i for i in registry().INSTRUCTION_DICT if i not in EXCLUDED]


def _seeded(rng: random.Random, fn):
    """fn() with Python's global random seeded from rng; the caller's global state is restored."""
    state = random.getstate()
    random.seed(rng.getrandbits(64))
    try:
        return fn()
    finally:
        random.setstate(state)


def build_item(i: int, seed: int = DEFAULT_SEED) -> dict:
    """Item i of the set for `seed`, in the IFEval record format."""
    reg = registry()
    ids = instruction_ids()
    rng = random.Random(f"ifeval_synth:{seed}:{i}")
    base = rng.choice(BASE_PROMPTS)
    want = rng.choice((1, 1, 2))
    chosen: list[str] = []
    while len(chosen) < want:  # some checkers conflict with every other one: then the item keeps just that one
        fits = [c for c in ids if c not in chosen and not any(
            c in reg.INSTRUCTION_CONFLICTS[x] or x in reg.INSTRUCTION_CONFLICTS[c] for x in chosen)]
        if not fits:
            break
        chosen.append(rng.choice(fits))
    texts, kwargs = [], []
    for iid in chosen:
        extra = {"prompt_to_repeat": base} if iid == "combination:repeat_prompt" else {}
        for _ in range(100):  # redraw until the scorer's rebuild from kwargs reproduces the text (see below)
            checker = reg.INSTRUCTION_DICT[iid](iid)
            text = _seeded(rng, lambda: checker.build_description(**extra))
            args = checker.get_instruction_args() or {}
            if _seeded(random.Random(0), lambda: _rebuild(reg, iid, args)[1]) == text:
                break
        else:
            raise RuntimeError(f"ifeval_synth: {iid} never rebuilds to the same text from its arguments")
        texts.append(text)
        kwargs.append(args)
    return {"key": i, "prompt": " ".join([base, *texts]), "instruction_id_list": chosen, "kwargs": kwargs}


def build_items(n: int = DEFAULT_N, seed: int = DEFAULT_SEED) -> list[dict]:
    """n items; every kwargs dict carries the same keys (absent ones None), as in Google's IFEval file, so the
    JSON loader infers one schema for the column."""
    items = [build_item(i, seed) for i in range(n)]
    keys = sorted({k for it in items for kw in it["kwargs"] for k in kw})
    for it in items:
        it["kwargs"] = [{k: kw.get(k) for k in keys} for kw in it["kwargs"]]
    return items


def _rebuild(reg, iid: str, kwargs: dict):
    """What lm-eval's ifeval scorer does: a fresh checker, build_description from the truthy kwargs."""
    checker = reg.INSTRUCTION_DICT[iid](iid)
    return checker, checker.build_description(**{k: v for k, v in kwargs.items() if v})


def rebuild(item: dict, index: int):
    """The checker for instruction `index` of `item`, rebuilt as the scorer does: (checker, description)."""
    return _rebuild(registry(), item["instruction_id_list"][index], item["kwargs"][index])
