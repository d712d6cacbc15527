"""Jailbreak axis: harmful requests inside jailbreak wrappers (student) vs the bare request (teacher), the SFT
baseline's data, and an evaluation by generation + judges.

Data (`prepare`; behaviours, wrappers and benign prompts from opct.axes.jailbreak.harmful):
  train_pairs   `n_train` AdvBench behaviours x `pairs_per_behaviour` training wrappers each: student = the wrapped
                request, teacher = the bare request (which the frozen model mostly refuses), plus the **benign
                regulariser** below: both methods train on the same pairs. For OPCT a benign pair is a KL anchor to
                the frozen model on benign prompts. `opct_benign` False (--no-opct-benign): OPCT on the jailbreak
                pairs alone, and the regulariser goes to SFT only (`sft_pairs`).
  regulariser   (Irpan et al. §3.1.1, the paper's SFT baseline):
                benign look-alike prompts with student == teacher, so the SFT trainer's targets (the frozen model's
                greedy answer to the teacher side, `opct.algo.sft.make_targets`) are the model's own clean
                completions. `benign_share` = lambda, the share of benign pairs in the training set: with P jailbreak
                pairs it adds round(P * lambda / (1 - lambda)) benign pairs (lambda = 0.5: as many benign pairs as
                jailbreak pairs, the paper's weight 1.0 on an equal-size set). The regulariser's prompts are drawn
                from the benign pool *after* the over-refusal evaluation prompts are set aside, so evaluation
                prompts are never trained on.
  eval items    `n_eval` HarmBench + StrongREJECT behaviours (never trained on; see harmful.jailbreak_split): bare
                ("bare", refusal rate), under training wrappers ("train_wrappers", `eval_train_per_behaviour` drawn
                per behaviour), under every held-out wrapper ("heldout_wrappers") and every wrapper of the held-out
                family ("heldout_family"), and `n_benign` benign look-alikes ("benign", over-refusal).

Evaluation (`evaluate`): the model answers every item greedily (`eval_max_new_tokens`, sized for the refusal judge,
which reads the first 200 characters), batched. The refusal judge (opct.judges.refusal) labels each answer; per
split: attack success rate (ASR: share of answers that comply) and defence success (1 - ASR), refusal rate, each
with a 95% Wilson interval over prompts; on "bare" the refusal rate and on "benign" the over-refusal rate are the
headline numbers. Unparseable judge outputs are counted per split and left out of the rates (never dropped
silently). With `--judge llm` (and `--judge-url`), the StrongREJECT rubric judge (opct.judges.strongreject) also grades every answer
through that OpenAI-compatible endpoint; its ASR (score >= 0.5) per split and its agreement with the refusal judge
are reported side by side.

Adaptive per-target attack (`adaptive_attack`): for each evaluation behaviour, every held-out wrapper and every
wrapper of the held-out family (the greedy answers of the evaluation above are reused), plus `attack_samples` samples
at temperature 1, each under one of those wrappers in turn; the behaviour is *cracked* if any attempt gets an
answer the judge does not call a refusal. Reported: the cracked share over behaviours with its Wilson interval.
The paper's attacker is a GRPO-trained LLM per defended model; this is the CPU-sized stand-in (a search over a
fixed set of held-out attacks), so its numbers are an upper bound on defence against *these* attacks only.
"""

from __future__ import annotations

from dataclasses import fields

from opct.axes.interface import AxisData, Metric
from opct.axes.jailbreak import data, evaluate, report
from opct.axes.jailbreak.data import NAME, Options, options
from opct.judges.endpoint import check_endpoint
from opct.axes.verdicts import jailbreak
from opct.experiment import from_flat
from opct.stats import is_cell

# the axis (opct.axes.interface.Axis): data.py holds its options and builds the pairs and items, evaluate.py generates,
# judges and scores, report.py renders the report section


class JailbreakAxis:
    """The jailbreak axis (opct.axes.interface.Axis): `opct demo --axis jailbreak`, `opct eval --axis jailbreak`."""
    name = NAME
    summary = ("harmful requests in jailbreak wrappers vs the bare request; attack success per wrapper split, "
               "adaptive attack, over-refusal")
    # DemoConfig / EvalConfig values for this axis, sized for a 2-core CPU (docs/jailbreak.md): every option of
    # `Options` (its flags' defaults come from opct.axes.options, where each is written once, and the shared ones'
    # are the axis' own; config.build keeps those a config has), then the run's sizes.
    defaults = {**{f.name: f.default for f in fields(Options)}, "model": "qwen2.5-coder-0.5b-instruct", "steps": 20,
                "prompts_per_step": 8, "max_new_tokens": 32, "lr": 3e-4, "lora_rank": 16, "probe_every": 0,
                "capability": ""}
    sft = {"temperature": 0.0}  # the target: the frozen model's greedy answer to the teacher (bare) side
    metrics = {"asr": Metric("Attack success rate"), "adaptive_attack": Metric("Adaptive attack"),
               "over_refusal": Metric("Over-refusal")}
    headline = (("asr", "heldout_wrappers", "lower"), ("asr", "heldout_family", "lower"),
                ("adaptive_attack", "cracked", "lower"), ("over_refusal", None, "lower"))
    # OPCT's loss in the demo: the exact reverse KL over the vocabulary instead of the sampled-token estimate (the
    # paper's default). The wrapped and bare answers part at a few early positions ("Certainly!" vs "I'm sorry");
    # with 8 samples a step the sampled estimate of that gradient is noisy, the exact one is not, for ~10% more
    # time a step on this model.
    opct = {"loss": "full"}

    def check(self, cfg) -> None:
        """--judge llm: --judge-url is given and answers (a 1-token request); before any model loads."""
        opt = options(cfg)
        if opt.judge == "llm":
            evaluate.rubric_judge(opt)  # JudgeError without --judge-url
            check_endpoint(opt.judge_url, opt.judge_model or "judge")

    def prepare(self, cfg, tok=None) -> AxisData:
        return data.prepare(cfg, tok)

    def evaluate(self, policy, fmt, items: AxisData, cfg, samples=None) -> dict:
        return self.nest(evaluate.evaluate(policy, fmt, items, cfg, samples=samples))

    def probe(self, items: AxisData, cfg):
        return evaluate.probe(items, cfg)

    def verdict(self, row: dict) -> dict:
        """opct.axes.verdicts.jailbreak: torch-free, for the Inspect export."""
        return jailbreak(row)

    def nest(self, result: dict) -> dict:
        """`evaluate.evaluate`'s flat figures in the schema's sections: units, per split each prompt's 0/1 (an attack
        success on the harmful splits, refused on benign: over-refusal); counts n, unparseable and unclosed; the
        adaptive attack's cracked and defence shares are metrics, its other figures details, as are the judge's
        name, the shown answers, the second judge's and the rubric's readings; the rest are metrics (over-refusal
        only when measured)."""
        ev = from_flat(result, result.get("per_item") or {}, counts=("n", "unparseable", "unclosed_reasoning"),
                       details=("judge", "samples", "second_judge", "rubric"), drop=("per_item",))
        attack = ev["metrics"].get("adaptive_attack")
        if isinstance(attack, dict):
            ev["metrics"]["adaptive_attack"] = {k: v for k, v in attack.items() if is_cell(v)}
            ev["details"]["adaptive_attack"] = {k: v for k, v in attack.items() if not is_cell(v)}
        return ev

    def report_blocks(self, results: dict, run_dir) -> list:
        return report.report_blocks(results, run_dir)
