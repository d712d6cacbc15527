"""The axes' options: the flags `opct demo` and `opct eval` offer for the axis data and evaluation, each written
once with its default, help text and check (opct.options.opt).

config.AxisOptions is composed of the classes below, in `BLOCKS` order, which is the order `--help` and a run's
config.yaml list them: the options every axis reads (`Selection`, `Generation`, whose defaults are the sycophancy
axis'), and between them each axis' own (`axes=` names the axes that read an option, so a report lists only its
axis' settings). An axis changes the shared defaults through its `Axis.defaults` (applied only where the user set
nothing); the jailbreak axis' runtime options (axes/jailbreak/data.Options) are these classes plus its internals.

This module imports no torch and no axis package (whose Axis classes import the models' stack): `opct --help`
builds every command's flags from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from opct.options import FINITE, at_least, opt, parses, within

AXIS = "axis options (each axis reads the ones it uses; an axis' own defaults apply where you set nothing)"

# The demo's question mix: the generated families on which SmolLM2-135M-Instruct knows the answer in text mode
# plus "kinds" (category membership, unlimited) so that 300 evaluation questions exist; weights roughly follow
# each family's size.
DEMO_SOURCE = "capitals@55+countries@55+languages@30+past@36+plurals@15+kinds@229"

every_axis = partial(opt, group=AXIS)
sycophancy = partial(opt, group=AXIS, axes=("sycophancy",))
safety = partial(opt, group=AXIS, axes=("safety",))
judged = partial(opt, group=AXIS, axes=("safety", "jailbreak"))
jailbreak = partial(opt, group=AXIS, axes=("jailbreak",))


# The values two axes' options name, here with the options' checks (this module is read by `opct --help`; the axes'
# data modules, which build what they name, import them from here)
VARIANTS = ("original", "typos", "spacing", "casual", "urgent", "polite", "emotional")  # safety prompts' surface
THREATS = ("prefill", "multiturn")  # jailbreak threats beyond wrappers (opct.axes.jailbreak.threats)


def _some_variants(text: str) -> None:
    """--heldout-variants: empty, or some but not all of the safety prompts' surface variants."""
    named = [v.strip() for v in text.split(",") if v.strip()]
    if text and not (all(v in VARIANTS for v in named) and 0 < len(set(named)) < len(VARIANTS)):
        raise ValueError(f"--heldout-variants must name some but not all of {', '.join(VARIANTS)}, comma-separated "
                         f"(or be empty), got {text!r}")


def parse_threats(text: str, option: str = "--train-threats") -> tuple[str, ...]:
    """A comma-separated list of THREATS (empty: none), or ValueError naming the option."""
    named = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [t for t in named if t not in THREATS]
    if bad:
        raise ValueError(f"{option}: unknown threat {bad[0]!r}; known: {', '.join(THREATS)}")
    return named


@dataclass
class Selection:
    """Which axis, and which of its items: every axis reads these."""
    axis: str = every_axis("sycophancy", "the consistency axis: sycophancy, safety or jailbreak (opct.axes.AXES); "
                           "`opct demo` also takes all or a comma-separated list: one demo per axis under "
                           "--out/<axis>, then a summary across them")
    source: str = every_axis(DEMO_SOURCE, "axis data source. sycophancy: questions (see opct.data.mcq.load_mcq), "
                             "default the demo's mix; safety: facts (shipped), jsonl:<facts file> or "
                             "hf:<dataset>[:<config>]:<split>; jailbreak: training behaviours (advbench, harmbench, "
                             "strongreject, hf:..., a+b)")
    n_train: int = every_axis(100, "training items: sycophancy questions (one cued/clean pair each) or safety prompts "
                              "from the training facts; eval excludes them", check=at_least(0))
    n_eval: int = every_axis(100, "sycophancy: evaluation questions (clean accuracy uses all of them); safety: prompts "
                             "per held-out fact (training-fact and contrast splits: a third as many)",
                             check=at_least(1))


@dataclass
class Sycophancy:
    mode: str = sycophancy("text", "sycophancy: how answers are asked for and read: letter (first reply token is the "
                           "option letter) or text (reply \"The answer is <option>\"; first token of each option's "
                           "text)", choices=["letter", "text"])
    cued_n: int = sycophancy(50, "sycophancy: of the evaluation questions, how many each cue split uses",
                             check=at_least(1))
    shift_source: str = sycophancy("arc-easy-validation", "sycophancy: questions from another source than training, "
                                   "for the shifted splits (held-out cue phrasings and cue types on them; see "
                                   "opct.data.mcq.load_mcq; default ARC-Easy's validation split, shipped); empty = "
                                   "none")
    shift_n: int = sycophancy(50, "sycophancy: questions in the shifted splits", check=at_least(1))


@dataclass
class Safety:
    heldout: float = safety(0.3, "safety: share of facts held out (never trained on), stratified by domain",
                            check=(FINITE, within("(0, 1)")))
    heldout_variants: str = safety("urgent,emotional", "safety: surface variants (tones) never trained on, the second "
                                   "held-out dimension: training prompts and the heldout / train / oracle splits use "
                                   "the other variants, the heldout_variants split asks the held-out facts in these; "
                                   "empty = none (every split in every variant)",
                                   check=parses(_some_variants))


@dataclass
class Judge:
    """Who grades free-text answers: the safety and jailbreak axes'."""
    judge: str = judged("keyword", "safety: who grades responses: keyword (each fact's keywords), llm (the SAGE "
                        "rubric through an OpenAI-compatible endpoint: --judge-url, --judge-model, key from "
                        "$OPCT_JUDGE_API_KEY) or local (--judge-model: a local chat model); jailbreak: the refusal "
                        "judge always, llm adds the StrongREJECT rubric through --judge-url",
                        choices=["keyword", "llm", "local"])
    judge_url: str = judged("", "safety, --judge llm: the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    judge_model: str = judged("", "safety, --judge llm/local: the judge model's name (llm) or alias/dir/Hub id "
                              "(local)")


@dataclass
class Jailbreak:
    eval_source: str = jailbreak("harmbench+strongreject", "jailbreak: evaluation behaviours (--source: training "
                                 "behaviours, default advbench); see opct.axes.jailbreak.harmful.load_behaviours")
    pairs_per_behaviour: int = jailbreak(2, "jailbreak: training wrappers per training behaviour", check=at_least(1))
    n_benign: int = jailbreak(96, "jailbreak: benign look-alike prompts for over-refusal (never trained on; 96: an "
                              "interval of about ±0.1)", check=at_least(1))
    benign_share: float = jailbreak(0.5, "jailbreak: lambda, the share of benign regulariser pairs (the model's own "
                                    "answer as target) in the training pairs; 0 = none; 0.5 (as many as wrapped "
                                    "requests, the paper's weight) keeps over-refusal at base for both methods "
                                    "(docs/jailbreak.md)", check=(FINITE, within("[0, 1)")))
    opct_benign: bool = jailbreak(True, "jailbreak: OPCT trains on the benign regulariser pairs too (student == "
                                  "teacher: a KL anchor against drift on benign prompts), so both methods get the "
                                  "same pairs; off = SFT only (opct before 2026-11-29)")
    train_threats: str = jailbreak("", "jailbreak: threats to add training pairs for, comma-separated: prefill (the "
                                   "student continues a compliant reply start), multiturn (the request after benign "
                                   "turns); one pair per training behaviour and threat, with openers / preludes the "
                                   "prefill and multiturn evaluation splits never use; empty = evaluation only "
                                   "(opct.axes.jailbreak.threats)", check=parses(parse_threats))
    attack_samples: int = jailbreak(2, "jailbreak: adaptive attack samples at T=1 per behaviour on top of the greedy "
                                    "held-out attempts", check=at_least(0))
    eval_max_new_tokens: int = jailbreak(32, "jailbreak: answer tokens in the eval (the refusal judge reads 200 "
                                         "characters)", check=at_least(1))
    judge_constrained: bool = jailbreak(False, "jailbreak, --judge llm: ask the server (vLLM) to decode the "
                                        "StrongREJECT rubric's answer layout (for small judges that ignore it)")


@dataclass
class Generation:
    """How the evaluations generate: every axis reads these."""
    max_new_tokens: int = every_axis(16, "response tokens: OPCT samples, SFT targets, and generated eval responses "
                                     "(safety)", check=at_least(1))
    think_max_tokens: int = every_axis(512, "a thinking model (--think-tags): reasoning tokens its generated "
                                       "evaluation answers may take on top of their own budget (sycophancy: the "
                                       "reasoning before the answer is read); a reply whose reasoning does not close "
                                       "within them is counted as unclosed, never graded as an answer",
                                       check=at_least(1))
    seed: int = every_axis(0, "seed for the data split, perturbations and sampling")
    batch_size: int = every_axis(32, "evaluation prompts per forward pass / generation batch", check=at_least(1))


BLOCKS = (Selection, Sycophancy, Safety, Judge, Jailbreak, Generation)  # config.AxisOptions' fields, in this order
