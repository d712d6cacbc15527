"""`opct eval`: one model on an axis' evaluation set (`run_eval`, the same items `opct demo` evaluates with the
same options) or on lm-eval tasks (`run_capability_eval`), through an inference policy of the configured backend
(or lm-eval's own vLLM model where --eval-engine resolves to vllm); with --out X.json the result and its
per-example files are written as one unit (opct.outputs.Staged). `capability_run` is also the demo's capability
stage.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from opct import backends, extras, threads
from opct.config import DemoConfig, EvalConfig, validate
from opct.data.io import write_json
from opct.axes import axis_defaults, get_axis
from opct.backends import resolve_inference
from opct.backends.select import resolve_vllm_dtype
from opct.evals import capability
from opct.inspect_log import remove_stale, write_log
from opct.options import ConfigError
from opct.outputs import Staged


def config_for_axis(cls=DemoConfig, **options):
    """A DemoConfig / EvalConfig for the Python API, with the axis' defaults where `options` sets nothing (what the
    CLI does with flags)."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = {**{k: v for k, v in axis_defaults(options).items() if k in known}, **options}
    return validate(cls(**values))


def eval_outputs(cfg: EvalConfig) -> dict[str, Path]:
    """The files `opct eval --out X.json` writes, by role: the result X.json and, for an axis, its samples
    X.samples.jsonl (the sycophancy axis' shifted splits: X.samples.shifted.jsonl) and an Inspect log beside them;
    for --tasks, lm-eval's per-example samples in the directory X/ (X.json without its suffix). Checked before any
    model loads (`check_eval_outputs`)."""
    out = Path(cfg.out)
    if cfg.tasks:
        return {"result": out, "samples_dir": out.with_suffix("")}
    return {"result": out, "samples": out.with_suffix(".samples.jsonl"),
            "shifted": out.with_suffix(".samples.shifted.jsonl")}


def check_eval_outputs(cfg: EvalConfig) -> None:
    """`opct eval --out`'s files can all be written where they go (ConfigError otherwise): a result name with a
    suffix where the samples go to a directory of the name without it (--tasks); no directory where a file goes; a
    samples directory that holds only lm-eval samples (*.jsonl) of an earlier run, which this run replaces."""
    if not cfg.out:
        return
    files = eval_outputs(cfg)
    if cfg.tasks:
        d = files["samples_dir"]
        if d == files["result"]:
            raise ConfigError(f"--out {cfg.out}: name the results file with a suffix, e.g. {cfg.out}.json: the "
                              f"per-example samples go to the directory of its name without the suffix ({d}/)")
        if d.exists() and not d.is_dir():
            raise ConfigError(f"--out {cfg.out}: its per-example samples go to the directory {d}/, and {d} is a file")
        other = sorted(p.name for p in d.iterdir() if p.suffix != ".jsonl") if d.is_dir() else []
        if other:
            raise ConfigError(f"--out {cfg.out}: its per-example samples go to {d}/, which holds other files than "
                              f"an earlier run's samples ({', '.join(other[:3])}); choose another --out")
    for role in ("samples", "shifted"):
        if role in files and files[role].is_dir():
            raise ConfigError(f"--out {cfg.out}: its per-example samples go to {files[role]}, which is a directory")


def check_eval_engine(cfg) -> None:
    """--eval-engine vllm needs vllm (an evaluation's engine, lm-eval's vLLM model): checked before any model loads."""
    if cfg.eval_engine == "vllm":
        extras.require("vllm", "--eval-engine vllm", "or --eval-engine policy")


def run_eval(cfg: EvalConfig) -> dict:
    """`opct eval --axis NAME`: one model on the axis' evaluation set (the same items `opct demo` evaluates with the
    same options). Returns {"axis", "model", "info", **the axis' result}; with --out X.json, per-example samples go
    next to it (X.samples.jsonl), and an Inspect log beside them (<created>_<axis>_X_<id>.json, opct.inspect_log):
    written as one unit (opct.outputs.Staged), replacing an earlier run's, or, on failure, not at all."""
    axis = get_axis(cfg.axis)
    check_eval_outputs(cfg)
    check_eval_engine(cfg)
    axis.check(cfg)  # its own pre-flight (a judge endpoint that answers), before any model loads
    threads.use(cfg.threads)
    if not cfg.out:
        return evaluate_axis(cfg, axis, None)

    out = Path(cfg.out)
    files = eval_outputs(cfg)
    with Staged(out.parent) as stage:
        samples = stage.dir / files["samples"].name
        res = evaluate_axis(cfg, axis, samples)
        write_json(stage.dir / out.name, res)
        log = write_log(stage.dir, axis.name, "eval", cfg.model, samples, res, out, out.stem)
        stage.commit(last=out.name, replaces=[files["samples"].name, files["shifted"].name])
    if log is not None:  # an earlier opct log of this evaluation (another time's, or the old X.inspect.json name)
        remove_stale(out.parent / log.name, "eval", out.stem, [out.with_suffix(".inspect.json")])
    return res


def evaluate_axis(cfg: EvalConfig, axis, samples: Path | None) -> dict:
    """The axis' evaluation of cfg.model (its samples to `samples`), the model's policy closed after."""
    # fmt: its prompts and reasoning (--chat-template-kwargs, --think-tags)
    policy, fmt = backends.inference_model(cfg.model, cfg)
    try:
        data = axis.prepare(cfg, policy.tok)
        return {"axis": axis.name, "model": cfg.model, "info": data.info,
                **axis.evaluate(policy, fmt, data, cfg, samples=samples)}
    finally:
        policy.close()


OFFLINE = {"auto": None, "on": True, "off": False}


def run_capability_eval(cfg: EvalConfig) -> dict:
    """`opct eval --tasks`: lm-eval tasks on one model (`capability_run`); with --out X.json the result and its
    per-example samples (X/<task>.jsonl) written as one unit (opct.outputs.Staged)."""
    check_eval_outputs(cfg)
    check_eval_engine(cfg)
    s = capability.resolve_suite(cfg.tasks, cfg.limit or None)
    capability.check_tasks(s["tasks"], OFFLINE[cfg.offline], option="--tasks")  # an unknown task before the model loads
    if not cfg.out:
        return capability_run(cfg, cfg.model, s, offline=OFFLINE[cfg.offline])
    out, samples_dir = Path(cfg.out), eval_outputs(cfg)["samples_dir"]
    with Staged(out.parent) as stage:
        res = capability_run(cfg, cfg.model, s, offline=OFFLINE[cfg.offline],
                             log_samples_dir=stage.dir / samples_dir.name)
        write_json(stage.dir / out.name, res)
        stage.commit(last=out.name, replaces=[samples_dir.name])
    return res


def capability_run(cfg, model: str, suite: dict, **kw) -> dict:
    """lm-eval's tasks of `suite` (resolve_suite) on `model` (a name or a trained run's model/ directory): through an
    inference policy of the configured backend, device and dtype (opct.evals.policy_lm: the seam every evaluation
    uses), or, where --eval-engine resolves to vllm, lm-eval's own vLLM model in `vllm_dtype` with
    `vllm_gpu_memory` of the GPU."""
    args = dict(limit=suite["limit"], limits=suite["limits"], max_gen_toks=suite["max_gen_toks"],
                batch_size=cfg.batch_size, **kw)
    resolved = resolve_inference(cfg)
    device, dtype, _, engine = resolved
    if engine == "vllm":
        return capability.run_capability(model, suite["tasks"], engine="vllm", vllm_args={
            "gpu_memory_utilization": cfg.vllm_gpu_memory, "seed": cfg.seed},
            dtype=str(resolve_vllm_dtype(cfg.vllm_dtype, device, dtype)).removeprefix("torch."), **args)
    policy, fmt = backends.inference_model(model, cfg, resolved)
    try:
        res = capability.run_capability(policy, suite["tasks"], fmt=fmt, **args)
    finally:
        policy.close()
    res["_meta"]["model"] = model
    return res
