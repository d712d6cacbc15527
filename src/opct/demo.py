"""`opct demo`: the sycophancy experiment end to end, sized for a 2-core CPU.

  1. questions   a fixed-seed mix of multiple-choice items, split into disjoint train / eval questions
  2. base        evaluate the initial model (sycophancy rate, BRR, consistency, accuracy per cue split)
  3. sft         the offline baseline: SFT on (cued prompt -> the frozen model's clean-prompt answer)
  4. opct        on-policy consistency training on the same pairs, same LoRA/optimizer/steps
  5. evaluate    both trained models, loaded back from their saved directories (what `opct eval` does)
  6. report      results.json, report.md / report.html with plots
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opct.config import SFTConfig, TrainConfig, opt, to_yaml


# The demo's question mix: the generated families on which SmolLM2-135M-Instruct knows the answer in text mode
# (opct.data.mcq.DEFAULT_DEMO_SOURCE, 207 items) plus "kinds" (category membership, unlimited) so that 300
# evaluation questions exist; weights roughly follow each family's size.
DEMO_SOURCE = "capitals@55+countries@55+languages@30+past@36+plurals@15+kinds@229"


@dataclass
class EvalConfig:
    model: str = opt("smollm2-135m-instruct", "model: alias, .gguf, dir (incl. an opct output's model/), Hub id")
    axis: str = opt("sycophancy", "what to evaluate", choices=["sycophancy"])
    mode: str = opt("text", "how answers are asked for and read: letter (first reply token is the option letter) or "
                    "text (reply \"The answer is <option>\"; first token of each option's text)",
                    choices=["letter", "text"])
    source: str = opt(DEMO_SOURCE, "question source (see opct.data.mcq.load_mcq); default: the demo's mix")
    n_train: int = opt(100, "questions reserved for training (excluded from eval; same split as the demo)")
    n_eval: int = opt(300, "evaluation questions (clean accuracy uses all of them)")
    cued_n: int = opt(100, "of those, how many each cue split uses (cued prompts dominate the cost)")
    seed: int = opt(0, "seed for the question split, wrong options and cue choice")
    batch_size: int = opt(32, "prompts per forward pass")
    out: str = opt("", "write the metrics as JSON here (default: print only)")
    threads: int = opt(0, "torch CPU threads (0 = torch default)")


@dataclass
class DemoConfig:
    model: str = opt("smollm2-135m-instruct", "model to make consistent")
    out: str = opt("runs/demo", "output directory")
    source: str = opt(DEMO_SOURCE, "question source (see opct.data.mcq.load_mcq)")
    mode: str = opt("text", "answer format: letter or text (see `opct eval --help`)", choices=["letter", "text"])
    n_train: int = opt(100, "training questions (one cued/clean pair each; steps reuse them with fresh samples)")
    n_eval: int = opt(300, "evaluation questions (disjoint from training); clean accuracy uses all of them")
    cued_n: int = opt(100, "of those, how many each cue split uses (cued prompts dominate the eval cost)")
    steps: int = opt(40, "optimizer steps for both SFT and OPCT")
    prompts_per_step: int = opt(8, "pairs per step")
    max_new_tokens: int = opt(16, "response tokens (OPCT samples, SFT targets)")
    lr: float = opt(2e-4, "AdamW learning rate (both methods)")
    lora_rank: int = opt(32, "LoRA rank (both methods)")
    probe_every: int = opt(15, "quick held-out probe every N training steps (0 = off)")
    probe_n: int = opt(32, "questions in the probe")
    methods: str = opt("sft,opct", "which trained methods to run (base is always evaluated)")
    seed: int = opt(0, "seed")
    batch_size: int = opt(32, "eval batch size")
    threads: int = opt(0, "torch CPU threads (0 = torch default)")


def split_questions_for(source: str, n_train: int, n_eval: int, seed: int, mode: str, tok):
    """The demo's fixed train/eval questions; `opct eval` calls this too, so it reproduces the demo's numbers.
    In text mode, items whose options share a first token cannot be read from one position and are dropped."""
    from opct.axes.sycophancy import text_readable
    from opct.data.mcq import load_mcq, split_questions

    qs = load_mcq(source or DEMO_SOURCE, n=n_train + n_eval, seed=seed)
    if mode == "text":
        qs = [q for q in qs if text_readable(tok, q)]
    train, ev = split_questions(qs, n_eval=n_eval, seed=seed)
    return train[:n_train], ev


def to_results(ev: dict) -> dict:
    """evaluate_sycophancy's output -> the results.json shape (metric -> split -> {value, lo, hi, n})."""
    from opct.axes.sycophancy import SPLITS

    splits = [s for s in SPLITS if s in ev]
    return {"sycophancy_rate": {s: ev[s]["sycophancy"] for s in splits},
            "brr": {s: ev[s]["brr"] for s in splits},
            "consistency": {s: ev[s]["consistency"] for s in splits},
            "cued_accuracy": {s: ev[s]["accuracy"] for s in splits},
            "clean_accuracy": ev["clean_accuracy"],
            "n": {s: ev[s]["n"] for s in splits}}


def evaluate_model(model_name: str, questions, seed: int, batch_size: int, mode: str, cued_n: int,
                   loaded=None) -> dict:
    from opct.axes.sycophancy import evaluate_sycophancy
    from opct.models import load_model

    model, tok = loaded or load_model(model_name)
    with torch.no_grad():
        return to_results(evaluate_sycophancy(model, tok, questions, seed=seed, batch_size=batch_size, mode=mode,
                                              cued_n=cued_n))


def run_eval(cfg: EvalConfig) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from opct.models import load_model

    model, tok = load_model(cfg.model)
    _, ev = split_questions_for(cfg.source, cfg.n_train, cfg.n_eval, cfg.seed, cfg.mode, tok)
    res = {"model": cfg.model, "mode": cfg.mode, "n_questions": len(ev),
           **evaluate_model(cfg.model, ev, cfg.seed, cfg.batch_size, cfg.mode, cfg.cued_n, loaded=(model, tok))}
    if cfg.out:
        write_json(Path(cfg.out), res)
    return res


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def make_probe(questions, seed: int, batch_size: int, mode: str):
    """A quick in-training eval on a few held-out questions: held-out-phrasing sycophancy and clean accuracy."""
    from opct.axes.sycophancy import evaluate_sycophancy

    def probe(model, tok):
        with torch.no_grad():
            ev = evaluate_sycophancy(model, tok, questions, seed=seed, batch_size=batch_size, splits=("heldout_cues",),
                                     mode=mode)
        return {"probe_sycophancy": ev["heldout_cues"]["sycophancy"]["value"],
                "probe_accuracy": ev["clean_accuracy"]["value"]}
    return probe


def run_demo(cfg: DemoConfig) -> Path:
    from opct.axes.sycophancy import build_train_pairs
    from opct.opct import RunError, train
    from opct.pairs import save_pairs
    from opct.report import write_report
    from opct.sft import train_sft

    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()):
        raise RunError(f"{out}: already holds a run; choose another --out or remove it")
    methods = [m.strip() for m in cfg.methods.split(",") if m.strip()]
    if set(methods) - {"sft", "opct"}:
        raise RunError(f"--methods takes sft and/or opct, got {cfg.methods!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        t = time.perf_counter()
        r = fn(*a, **kw)
        timings[name] = round(time.perf_counter() - t, 1)
        return r

    stages = tqdm(total=2 + 2 * len(methods) + 1, desc="demo", unit="stage")
    from opct.models import load_model

    base = load_model(cfg.model)
    train_q, eval_q = timed("questions", split_questions_for, cfg.source, cfg.n_train, cfg.n_eval, cfg.seed, cfg.mode,
                            base[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.yaml").write_text(to_yaml(cfg))
    pairs = build_train_pairs(train_q, seed=cfg.seed, mode=cfg.mode)
    save_pairs(pairs, out / "pairs.jsonl")
    stages.update()

    results = {"model": cfg.model, "config": dataclasses.asdict(cfg), "methods": {}, "timings": timings,
               "n_train_questions": len(train_q), "n_eval_questions": len(eval_q)}
    stages.set_postfix_str("evaluating base")
    results["methods"]["base"] = timed("eval_base", evaluate_model, cfg.model, eval_q, cfg.seed, cfg.batch_size,
                                       cfg.mode, cfg.cued_n, loaded=base)
    del base
    stages.update()

    probe = make_probe(eval_q[:cfg.probe_n], cfg.seed, cfg.batch_size, cfg.mode) if cfg.probe_every else None
    common = dict(model=cfg.model, steps=cfg.steps, prompts_per_step=cfg.prompts_per_step,
                  micro_batch=cfg.prompts_per_step, max_new_tokens=cfg.max_new_tokens, lr=cfg.lr,
                  lora_rank=cfg.lora_rank, lora_alpha=2.0 * cfg.lora_rank, seed=cfg.seed, save_every=0)
    for m in methods:
        stages.set_postfix_str(f"training {m}")
        if m == "sft":
            timed("train_sft", train_sft, SFTConfig(out=str(out / "sft"), **common), pairs=pairs, probe=probe,
                  probe_every=cfg.probe_every)
        else:
            timed("train_opct", train, TrainConfig(out=str(out / "opct"), **common), pairs=pairs, probe=probe,
                  probe_every=cfg.probe_every)
        stages.update()
        stages.set_postfix_str(f"evaluating {m}")
        results["methods"][m] = timed(f"eval_{m}", evaluate_model, str(out / m / "model"), eval_q, cfg.seed,
                                      cfg.batch_size, cfg.mode, cfg.cued_n)
        stages.update()
    results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(out / "results.json", results)
    write_report(out)
    stages.update()
    stages.close()
    return out
