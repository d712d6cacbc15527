"""The shape every axis follows: data + perturbation + eval, behind one small interface (the contract only; the
helpers axes share are in opct.axes.base).

An axis turns its source data into consistency pairs (student = the perturbed prompt, teacher = the clean or
contrastive prompt the frozen model answers well) and knows how to evaluate a model on its held-out set. The demo,
`opct eval --axis` and the report call only what is below; nothing else about an axis is shared.

    axis = get_axis("safety")                          # opct.axes registry
    data = axis.prepare(cfg, tok)                       # -> AxisData
    res  = axis.evaluate(policy, fmt, data, cfg, samples=path)   # -> results.json section of one model
    probe = axis.probe(data, cfg)                       # -> probe(policy, fmt) -> {name: number}, or None
    blocks = axis.report_blocks(results, run_dir)       # -> this axis' report section (plots saved under run_dir)
    axis.nest(flat)                                     # -> a flat evaluation (how evaluate computes it; what an
                                                        #    earlier opct wrote) in the schema's sections

`cfg` is a DemoConfig or an EvalConfig: both carry every axis option (config.AxisOptions), so `prepare` and
`evaluate` read the same fields under `opct demo` and `opct eval` and select the same evaluation items.

An evaluation result is opct.experiment.evaluation's four sections: "metrics" (metric -> split -> {"value", "lo",
"hi", "n"}, a 95 % interval, or metric -> such a cell for a metric without splits), "units" (metric -> split ->
{unit id: value}: a question's 0/1, a fact's pass rate, what opct.experiment.compare pairs to compare two methods),
"counts" (name -> split -> a count) and "details" (anything else the axis' report reads: a per-fact table, its
judge's name, a warning). `report.py` renders the shared parts (config, timings, training curves, capability, the
metrics as tables) and asks the axis for its own section.

An axis evaluates a `Policy` (opct.backends.base), never a model: `policy.generate` and
`policy.next_token_logprobs` run it on whatever backend and device it was built for, and `policy.tok` decodes text.
Prompts are rendered and replies split into reasoning and answer by the model's `ChatFormat` (opct.data.chat, `fmt`:
built once by whoever built the policy, with the chat-template options and reasoning tags), handed to every call
next to the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from opct.data.pairs import ConsistencyPair

if TYPE_CHECKING:  # annotations only: this module is read by `opct --help` (opct.axes.get_axis), which loads no torch
    from opct.data.chat import ChatFormat


@dataclass
class AxisData:
    """What `Axis.prepare` returns.

    train_pairs  OPCT's pairs: student = perturbed prompt, teacher = clean / contrastive prompt
    sft_pairs    the pairs whose TEACHER side the frozen model answers to make SFT targets (None = train_pairs; an
                 axis may add e.g. benign regulariser pairs)
    eval_set     whatever the axis' `evaluate` needs (questions, prompts per split, ...)
    info         sizes and splits, recorded under results.json "info"
    """
    train_pairs: list[ConsistencyPair]
    eval_set: Any
    sft_pairs: list[ConsistencyPair] | None = None
    info: dict = field(default_factory=dict)

    def pairs_for_sft(self) -> list[ConsistencyPair]:
        return self.train_pairs if self.sft_pairs is None else self.sft_pairs


@dataclass(frozen=True)
class Metric:
    """How a report shows one of an axis' metrics (or probe keys): its label, which way is better where the name
    makes it unambiguous ("lower", "higher"; None: not stated), and a probe's colour in the training plot."""
    label: str
    better: str | None = None
    colour: str | None = None


class Axis(Protocol):
    """One consistency axis. Class attributes:

    name      the registry key (`--axis NAME`)
    summary   one line for `--help` and the report
    defaults  DemoConfig / EvalConfig values for this axis (model, n_train, steps, max_new_tokens, ...), applied
              only to options the user did not set (flags or --config YAML)
    sft       SFTConfig overrides for the demo's SFT baseline (e.g. {"samples_per_prompt": 3, "temperature": 1.0})
    opct      TrainConfig overrides for the demo's OPCT run (e.g. {"loss": "full"}; {} = none)
    metrics   {metric or probe key: Metric}: its label and direction in every report (opct.report.render.label)
    headline  the few figures a run over several axes (`opct demo --axis all`) puts side by side: (metric, split or
              None for a metric without splits, "lower" or "higher" is better) per row, read from `evaluate`'s result

    Every member is required (`opct.axes.get_axis` checks): an axis with nothing to check says so in a
    one-line method, and nothing calling an axis probes for optional members.
    """
    name: str
    summary: str
    defaults: dict
    sft: dict
    opct: dict
    metrics: dict
    headline: tuple

    def check(self, cfg) -> None:
        """What the axis needs from outside (a judge endpoint that answers), checked by `opct eval` and `opct demo`
        before any model loads; raises a user error (exit 2) naming the options. Nothing to check: return."""
        ...

    def prepare(self, cfg, tok) -> AxisData:
        """Build the training pairs and the evaluation set; deterministic in cfg (seed)."""
        ...

    def evaluate(self, policy, fmt: ChatFormat, data: AxisData, cfg, samples: Path | None = None) -> dict:
        """Evaluate one model (an inference `Policy`, its prompts rendered and replies split by `fmt`) on
        data.eval_set: the results.json section for it (see the module docstring). With `samples`, also write
        per-example records (prompt, response, verdict) there as JSONL for inspection."""
        ...

    def probe(self, data: AxisData, cfg) -> Callable | None:
        """A quick in-training eval, probe(policy, fmt) -> {name: number} on the policy being trained (`fmt`: the
        run's student format), logged with the step; None = none. Asked only by a demo that probes (`cfg`: its
        DemoConfig, --probe-every > 0)."""
        ...

    def nest(self, result: dict) -> dict:
        """An evaluation in the flat layout this axis' figures come in (its metrics, per-item tables and counts side
        by side: what `evaluate` computes, and what an earlier opct wrote to results.json), filed into the schema's
        four sections (opct.experiment.evaluation, usually through opct.experiment.from_flat). `evaluate` returns
        it; opct.experiment.read_evaluation reads an earlier opct's results through it."""
        ...

    def verdict(self, row: dict) -> dict:
        """One per-example sample row's verdict, {name: {"value": 0 or 1, "answer", "explanation" (optional)}}: what
        `write_samples` stores in the row and an Inspect log scores it as (opct.inspect_log); {} where there is none
        (reasoning that never closed, a judge output that could not be parsed)."""
        ...

    def report_blocks(self, results: dict, run_dir: Path) -> list:
        """This axis' report section as report blocks (see opct.report.render); plots go under run_dir / "plots"."""
        ...


# every member of the interface, read off the Protocol above (get_axis checks an axis has them all)
MEMBERS = (*Axis.__annotations__, *(n for n, v in vars(Axis).items() if callable(v) and not n.startswith("_")))
