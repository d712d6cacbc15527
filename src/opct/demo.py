"""`opct demo --axis NAME`: one axis end to end, sized for a 2-core CPU (default axis: sycophancy).

  1. prepare     the axis builds its training pairs and evaluation set (opct.axes.interface.Axis.prepare)
  2. base        evaluate the initial model on the axis' evaluation set
  3. sft         the offline baseline: SFT on (student prompt -> the frozen model's answers to the teacher prompt)
  4. opct        on-policy consistency training on the same pairs, same LoRA/optimizer/steps
  5. evaluate    both trained models, loaded back from their saved directories (what `opct eval --axis` does:
                 opct.evaluate)
  6. capability  lm-eval tasks on base / SFT / OPCT (optional)
  7. report      results.json (one schema for every axis), report.md / report.html with plots

Every training run is named "<method>-seed<S>" (opct.experiment.run_name: opct-seed0, sft-seed0, ...; S the
training seed): its directory <out>/<method>-seed<S>, its stages and its samples file samples/<method>-seed<S>.jsonl;
the base model's are "base".

results.json: {"axis", "model", "config", "runs": {"base" and each "<method>-seed<S>" (methods from
opct.experiment.METHODS): the axis' evaluation result}, "info" (the axis' sizes and splits), "timings" (seconds per
stage), "comparison" (opct.experiment.compare over the first seed's runs: methods against each other, item by item:
"<a>_minus_<b>" -> metric -> split -> cell), "capability" (when run; the first seed's runs, by method),
"wall_seconds"}. "The first seed" (--seed) is a view, opct.experiment.methods_view: {method: evaluation}.

`--seeds N` trains and evaluates each method N times, with training seeds --seed, --seed + 1, ... (its sampling,
data order and LoRA init; the pairs and evaluation items stay --seed's), and results "seeds" holds, per metric and
split, each seed's value, the mean over seeds with a two-way bootstrap interval over seeds and items, and OPCT - SFT
paired item by item within each seed (`across_seeds`).

`opct demo --axis all` (or a comma-separated list) runs one such demo per axis into <out>/<axis>/, each with its
axis' own defaults where the user set nothing; every axis' pre-flight runs before the first model loads. Then
<out>/summary.json and <out>/report.md / .html put each axis' headline figures (`Axis.headline`) and capability
side by side.

A stopped demo (Ctrl-C, a killed job, a full disk) continues with the same command and --resume: every stage that
finished is kept (evaluations and capability runs saved under <out>/stages/, trained models with their run.json,
axes with their results.json), a training run that did not finish continues from its last checkpoint
(`SAVE_EVERY`), and settings that differ from the stopped demo's are refused, as is a demo an earlier opct stopped
whose first seed's runs are named after their method (<out>/opct: `refuse_old_layout`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

import opct.algo.opct
import opct.algo.sft
from opct import backends, extras, threads
from opct.train import trackers
from opct.config import DemoConfig, ExecConfig, SFTConfig, TrainConfig, chat_settings, exec_settings
from opct.options import read_yaml, resumable_fields, to_yaml
from opct.data.io import atomic_write, write_json
from opct.evaluate import capability_run, check_eval_engine
from opct.errors import UserError
from opct.experiment import (BASE, METHODS, ON_POLICY, TRAINED, compare, parse_methods, read_evaluation,
                             run_name)
from opct.across_seeds import compare_seeds
from opct.axes import get_axis
from opct.backends.vllm import check_sleep
from opct.data.pairs import save_pairs
from opct.evals import capability as capability_tasks
from opct.report import write_report, write_summary
from opct.train.loop import RunError


SAVE_EVERY = 10  # the demo's training runs checkpoint every 10 steps: a stopped demo loses at most that much


class Stages:
    """A demo's stage results, each saved under <out>/stages/<name>.json as soon as it exists, so that a stopped
    demo continued with --resume reuses what finished instead of computing it again."""

    def __init__(self, out: Path):
        self.dir = out / "stages"
        self.kept: list[str] = []

    def get(self, name: str, compute):
        path = self.dir / f"{name}.json"
        if path.is_file():
            try:
                kept = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                kept = e
            if not isinstance(kept, dict):
                why = f"damaged ({kept})" if isinstance(kept, Exception) else "not a stage's result (a JSON object)"
                raise RunError(f"{path}: {why}; delete it and --resume runs that stage again")
            self.kept.append(name)
            return kept
        result = compute()
        write_json(path, result)
        return result


def capability(cfg: DemoConfig, out: Path, methods: list[str], stages: Stages) -> dict:
    """lm-eval tasks on the base model and each trained one (`capability_run`: through an inference policy, as the
    axes evaluate them): per task, each method's score with its interval and the change from base. Each model's run
    is a stage (kept on --resume)."""
    s = capability_tasks.resolve_suite(cfg.capability, cfg.capability_limit or None)
    first = {BASE: BASE, **{m: run_name(m, cfg.seed) for m in methods}}  # each method's run of the first seed
    models = {BASE: cfg.model, **{m: str(out / first[m] / "model") for m in methods}}
    runs = {m: stages.get(f"capability_{first[m]}", lambda: capability_run(cfg, path, s))
            for m, path in models.items()}
    return capability_tasks.capability_block(runs)


def sft_config(cfg: DemoConfig, axis, base: SFTConfig) -> SFTConfig:
    """The SFT baseline's config: the shared settings with the axis' overrides (`Axis.sft`). With k targets per
    teacher prompt (samples_per_prompt), a step takes ceil(prompts_per_step / k) prompts' examples, so an SFT step
    trains on about as many sequences as an OPCT step (the same budget in steps and sequences)."""
    sft = dataclasses.replace(base, **axis.sft)
    k = sft.samples_per_prompt
    if k > 1 and "prompts_per_step" not in axis.sft:
        per = -(-cfg.prompts_per_step // k)
        sft = dataclasses.replace(sft, prompts_per_step=per, micro_batch=per * k)
    return sft


def train_seeds(cfg: DemoConfig) -> list[int]:
    """The training seeds of `--seeds N`: --seed, --seed + 1, ... (the pairs and evaluation items stay --seed's)."""
    return [cfg.seed + k for k in range(cfg.seeds)]


def across_seeds(cfg: DemoConfig, methods: list[str], every: dict) -> dict:
    """results.json "seeds": per metric and split (the evaluations' per-unit values, "units"), base's mean over units
    (one model: a bootstrap over units), each method's mean over seeds and units with each seed's value, and each
    pair of trained methods (opct.experiment.pairs) paired unit by unit within each seed; the methods' intervals come
    from the two-way bootstrap over seeds and units (`opct.across_seeds.compare_seeds`); `every`: results "runs"."""
    seeds = train_seeds(cfg)
    units = {m: [every[run_name(m, s)]["units"] for s in seeds] for m in methods}
    base = every[BASE]["units"] if BASE in every else {}
    return {"train_seeds": seeds, "runs": {m: [run_name(m, s) for s in seeds] for m in methods},
            "table": compare_seeds(units, base)}


def preflight(cfg: DemoConfig):
    """What a demo can check before any model loads: the methods, the axis' own check (a judge endpoint that
    answers), the capability tasks. Returns (axis, methods)."""
    axis = get_axis(cfg.axis)
    try:
        methods = parse_methods(cfg.methods)
    except ValueError as e:
        raise RunError(str(e)) from None
    axis.check(cfg)  # its own pre-flight (a judge endpoint that answers), before any model loads
    trackers.check(cfg.report_to)  # the training runs' trackers, which would otherwise stop it after base's eval
    check_eval_engine(cfg)
    if cfg.sampler == "vllm" and any(METHODS[m].trainer == ON_POLICY for m in methods):  # it samples through vLLM
        extras.require("vllm", "--sampler vllm")
    if cfg.vllm_sleep:  # for OPCT's sampler as the training runs will resolve it
        device = backends.resolve_device(cfg.device)
        check_sleep(cfg.vllm_sleep, backends.resolve_sampler(cfg, device), device)
    if cfg.capability:  # an unknown task would otherwise stop the demo after all its training
        capability_tasks.check_tasks(capability_tasks.resolve_suite(cfg.capability)["tasks"], option="--capability")
    return axis, methods


SUMMARY_FILES = {"summary.json", "report.md", "report.html", "plots"}
# What may differ between a demo and the command that continues it: where it writes and reports (its token logs too),
# and where and how fast it runs (the execution settings a resumed training run may change, opct.options.opt(resumable=...)).
NOT_SETTINGS = {"out", "resume", "report_to", "token_log_every"} | resumable_fields(ExecConfig)


# settings added after demos were first written whose default changes what a demo does: a demo.yaml without one
# ran as this value (so --resume of an older demo with the newer defaults is refused, naming the setting)
ADDED_LATER = {"shift_source": "", "heldout_variants": "", "opct_benign": False}


def demo_state(cfg: DemoConfig) -> tuple[str, list[str]]:
    """A demo's output directory against this config: ("new", []) absent or empty; ("done", []) results.json
    written with these settings; ("unfinished", []) these settings, no results.json (stopped: --resume continues
    it); ("other", changed settings) another command's run (changed = [] when it is no demo)."""
    d = Path(cfg.out)
    if not d.exists() or not any(d.iterdir()):
        return "new", []
    if not (d / "demo.yaml").is_file():
        return "other", []
    recorded, _ = read_yaml(d / "demo.yaml")
    # a setting an older opct did not have is recorded as what that opct did: its default, or where a new setting's
    # default changed what a demo does, the value that keeps the old behaviour (ADDED_LATER)
    recorded = {**{f.name: f.default for f in dataclasses.fields(cfg)}, **ADDED_LATER, **recorded}
    now = dataclasses.asdict(cfg)
    changed = sorted(k for k in {*recorded, *now} - NOT_SETTINGS if recorded.get(k) != now.get(k))
    if changed:
        return "other", [f"--{k.replace('_', '-')} {recorded.get(k)!r} -> {now.get(k)!r}" for k in changed]
    return ("done" if (d / "results.json").is_file() else "unfinished"), []


def refuse_unless_resumable(cfg: DemoConfig, state: str, changed: list[str]) -> None:
    """The demo in cfg.out may run: new, or unfinished with --resume; anything else is a RunError naming why."""
    out = cfg.out
    if state == "other":
        raise RunError(f"{out}: holds a demo with other settings ({', '.join(changed)}); choose another --out"
                       if changed else f"{out}: already holds a run; choose another --out or remove it")
    if state == "done" and cfg.resume:
        raise RunError(f"{out}: this demo already finished (results.json); choose another --out")
    if state != "new" and not cfg.resume:
        raise RunError(f"{out}: already holds a demo; pass --resume to continue it (stages that finished are "
                       "kept) or choose another --out")


def refuse_old_layout(cfg: DemoConfig) -> None:
    """A stopped demo an earlier opct wrote, whose first seed's training runs are named after their method
    (<out>/sft, <out>/opct), cannot be continued: this opct names every run "<method>-seed<S>" and would train the
    first seed again beside the old runs. A UserError naming the folder and what to do."""
    old = [m for m in TRAINED if (Path(cfg.out) / m).is_dir()]
    if old:
        raise UserError(f"{cfg.out}: a demo stopped by an earlier opct, whose runs are named after their method "
                        f"({', '.join(old)}); this opct names every run <method>-seed<S> (e.g. "
                        f"{run_name(old[0], cfg.seed)}) and cannot continue it: run the demo again into another "
                        "--out (or remove this one), or finish it with the opct that started it")


def run_demos(cfgs: list[DemoConfig], out: Path) -> Path:
    """One demo per axis config (each with out = <out>/<axis>), then the summary across axes (module docstring).
    With --resume, axes that finished are kept and an unfinished one continues (`run_demo`)."""
    out = Path(out)
    names = [c.axis for c in cfgs]
    if out.exists():
        stray = sorted(p.name for p in out.iterdir() if p.name not in {*names, *SUMMARY_FILES})
        if stray:
            raise RunError(f"{out}: already holds something other than the axes' runs ({', '.join(stray[:3])}); "
                           "choose another --out or remove it")
    states = {}
    for c in cfgs:
        states[c.axis], changed = demo_state(c)
        if not (states[c.axis] == "done" and c.resume):
            refuse_unless_resumable(c, states[c.axis], changed)
            refuse_old_layout(c)
            preflight(c)  # run_demo checks again when its turn comes: an endpoint may stop answering meanwhile
    t_start = time.perf_counter()
    for i, c in enumerate(cfgs, 1):
        if states[c.axis] == "done":
            print(f"opct: axis {c.axis} ({i}/{len(cfgs)}) already done in {c.out}; kept")
            continue
        print(f"opct: axis {c.axis} ({i}/{len(cfgs)}) {'continues' if states[c.axis] == 'unfinished' else '->'} "
              f"{c.out}")
        run_demo(c)
    write_summary(out, names, wall_seconds=round(time.perf_counter() - t_start, 1))
    return out


def run_config(cfg: DemoConfig, axis, method: str, seed: int, out: Path) -> TrainConfig | SFTConfig:
    """The config of one method's training run with one seed, from its row of the methods table: the demo's shared
    settings, then the axis' overrides for its trainer (`Axis.opct`, `Axis.sft`), then a control's changed
    settings, which win (opct-fixed's sampled loss over the jailbreak axis' exact one). --vllm-sleep is the
    on-policy runs' (their vLLM sampler's): SFT's runs get 0."""
    common = dict(model=cfg.model, steps=cfg.steps, prompts_per_step=cfg.prompts_per_step,
                  micro_batch=cfg.prompts_per_step, max_new_tokens=cfg.max_new_tokens, lr=cfg.lr,
                  lora_rank=cfg.lora_rank, lora_alpha=2.0 * cfg.lora_rank, seed=seed, out=str(out),
                  save_every=SAVE_EVERY, report_to=cfg.report_to, **exec_settings(cfg), **chat_settings(cfg))
    row = METHODS[method]
    if row.trainer == ON_POLICY:  # OPCT, or a control: OPCT with the settings of its row changed
        return dataclasses.replace(TrainConfig(sampler=cfg.sampler, token_log_every=cfg.token_log_every, **common),
                                   **{**axis.opct, **row.overrides})
    # SFT's targets come from the backend, never from a vLLM sampler: nothing of its runs sleeps
    return sft_config(cfg, axis, SFTConfig(**{**common, "vllm_sleep": 0}))


class DemoRun:
    """One demo's state between its stages (`run_demo`): its config, axis and data, the stages kept from a stopped
    run or saved as they finish (`Stages`), their timings and the progress bar."""

    def __init__(self, cfg: DemoConfig, axis, bar):
        self.cfg, self.axis, self.bar = cfg, axis, bar
        self.out = Path(cfg.out)
        self.stages = Stages(self.out)
        self.timings: dict[str, float] = {}
        self.data = None

    def timed(self, name: str, fn, *a, **kw):
        t = time.perf_counter()
        r = fn(*a, **kw)
        self.timings[name] = round(time.perf_counter() - t, 1)
        return r

    def prepare(self, tok, methods: list[str]):
        """The axis' pairs and evaluation set, and the demo's own record of them (demo.yaml, pairs.jsonl)."""
        cfg, out = self.cfg, self.out
        data = self.data = self.timed("prepare", self.axis.prepare, cfg, tok)
        if methods and not data.train_pairs:
            raise RunError(f"axis {self.axis.name}: no training pairs from --source {cfg.source!r} (an "
                           "evaluation-only source?); `opct eval --axis` evaluates on it")
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "demo.yaml", to_yaml(cfg))
        save_pairs(data.train_pairs, out / "pairs.jsonl")
        if data.sft_pairs is not None:
            save_pairs(data.sft_pairs, out / "sft_pairs.jsonl")
        self.bar.update()
        return data

    def evaluate(self, run: str, loaded: tuple | None = None) -> dict:
        """A run's evaluation (its samples to samples/<run>.jsonl), unless a stopped demo kept it. `loaded`: the
        (policy, ChatFormat) of a model loaded already (the base); else the run's model is loaded and its format
        built from its tokenizer and the demo's chat settings."""
        def compute():
            policy, fmt = loaded or backends.inference_model(str(self.out / run / "model"), self.cfg)
            try:
                return self.axis.evaluate(policy, fmt, self.data, self.cfg,
                                          samples=self.out / "samples" / f"{run}.jsonl")
            finally:
                policy.close()
        kept = self.timed(f"eval_{run}", self.stages.get, f"eval_{run}", compute)
        return read_evaluation(kept, self.axis.name)  # a stage an earlier opct wrote flat

    def train(self, method: str, seed: int, run: str, probe) -> None:
        """One method's training run with one seed: its trainer and config from its row of the methods table (the
        demo's shared settings, the axis' overrides, a control's changed settings); kept when it finished before
        (run.json), continued from its last checkpoint when it did not (--resume)."""
        self.bar.set_postfix_str(f"training {run}")
        run_cfg = run_config(self.cfg, self.axis, method, seed, self.out / run)
        if METHODS[method].trainer == ON_POLICY:
            fn, pairs = opct.algo.opct.train, self.data.train_pairs
        else:  # the offline baseline
            fn, pairs = opct.algo.sft.train_sft, self.data.pairs_for_sft()
        if (self.out / run / "run.json").is_file():
            self.stages.kept.append(f"train_{run}")
        else:
            self.timed(f"train_{run}", fn, dataclasses.replace(run_cfg, resume=(self.out / run).exists()),
                       pairs=pairs, probe=probe, probe_every=self.cfg.probe_every)
        self.bar.update()

    def compared(self, methods: list[str], every: dict) -> dict:
        """results.json "comparison" (the first seed's runs: base and each method's run of --seed) and, with
        --seeds, "seeds"; `every`: results "runs"."""
        out = {}
        first = {m: every[run_name(m, self.cfg.seed)] for m in [BASE, *methods]}
        comparison = compare({m: r["units"] for m, r in first.items()})
        if comparison:
            out["comparison"] = comparison
        if self.cfg.seeds > 1:
            out["seeds"] = across_seeds(self.cfg, methods, every)
        return out


def run_demo(cfg: DemoConfig) -> Path:
    """One axis end to end (module docstring). With --resume in a stopped demo's directory (same settings), every
    stage that finished is kept: evaluations and capability runs (<out>/stages/), trained models (their run.json);
    a training run that did not finish continues from its last checkpoint."""
    out = Path(cfg.out)
    refuse_unless_resumable(cfg, *demo_state(cfg))
    refuse_old_layout(cfg)
    axis, methods = preflight(cfg)
    threads.use(cfg.threads)
    t_start = time.perf_counter()
    bar = tqdm(total=2 + 2 * len(methods) * cfg.seeds + 1, desc=f"demo ({axis.name})", unit="stage")
    demo = DemoRun(cfg, axis, bar)
    try:  # closed before the CLI prints why a stopped demo stopped, so that message is the last line
        base, base_fmt = backends.inference_model(cfg.model, cfg)  # base_fmt: how it renders prompts, answers start
        data = demo.prepare(base.tok, methods)
        results = {"axis": axis.name, "model": cfg.model, "config": dataclasses.asdict(cfg), "runs": {},
                   "info": data.info, "timings": demo.timings}
        bar.set_postfix_str("evaluating base")
        results["runs"][BASE] = demo.evaluate(BASE, loaded=(base, base_fmt))
        del base, base_fmt
        bar.update()
        probe = axis.probe(data, cfg) if cfg.probe_every else None
        for seed in train_seeds(cfg):
            for m in methods:
                name = run_name(m, seed)  # <method>-seed<S>
                demo.train(m, seed, name, probe)
                bar.set_postfix_str(f"evaluating {name}")
                results["runs"][name] = demo.evaluate(name)
                bar.update()
        results.update(demo.compared(methods, results["runs"]))
        if cfg.capability:
            bar.set_postfix_str("capability")
            results["capability"] = demo.timed("capability", capability, cfg, out, methods, demo.stages)
        if demo.stages.kept:  # continued with --resume: these stages ran before, their timings are not here
            results["kept_from_before"] = demo.stages.kept
            for name in demo.stages.kept:
                demo.timings.pop(name, None)
        results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
        write_json(out / "results.json", results)
        write_report(out)
        bar.update()
    finally:
        bar.close()
    return out
