"""`opct` command line: parse a config, call one function. Errors in user input exit with status 2.

This is the one place that sets process-wide state before torch is imported: transparent huge pages for the CPU
backend (`huge_pages`), which PyTorch reads at its first allocation. Nothing is set on `import opct`.
"""

from __future__ import annotations

import argparse
import os
import sys

from opct import __version__, config


def before_torch(cfg) -> None:
    """Process settings that must precede torch's first allocation (see opct.backends.cpu.process)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg, _ = config.apply_env_overrides(cfg)
    if cfg.huge_pages and cfg.backend in ("auto", "cpu") and cfg.device in ("auto", "cpu"):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

def cmd_train(args) -> None:
    cfg = config.build(config.TrainConfig, args)
    before_torch(cfg)
    from opct.algo.opct import train

    out = train(cfg)
    print(f"opct: done -> {out}/model (metrics: {out}/metrics.jsonl)")


def cmd_sft(args) -> None:
    cfg = config.build(config.SFTConfig, args)
    before_torch(cfg)
    from opct.algo.sft import train_sft

    out = train_sft(cfg)
    print(f"opct: done -> {out}/model (targets: {out}/targets.jsonl, metrics: {out}/metrics.jsonl)")


def cmd_eval(args) -> None:
    import json

    from opct.axes import axis_defaults

    cfg = config.build(config.EvalConfig, args, defaults=axis_defaults)
    before_torch(cfg)
    if cfg.tasks:
        from opct.demo import run_capability_eval
        from opct.evals.capability import format_results

        print(format_results(run_capability_eval(cfg)))
        if cfg.out:
            print(f"opct: wrote {cfg.out}")
        return
    from opct.axes.base import result_rows
    from opct.demo import run_eval

    res = run_eval(cfg)
    for metric, split, c in result_rows(res):
        print(f"{metric:16s} {split:13s} {c['value']:.3f}  [{c['lo']:.3f}, {c['hi']:.3f}]  n={c['n']}")
    if cfg.out:
        print(f"opct: wrote {cfg.out}")
    else:
        print(json.dumps(res))


def cmd_demo(args) -> None:
    from opct.axes import axis_defaults

    cfg = config.build(config.DemoConfig, args, defaults=axis_defaults)
    before_torch(cfg)
    from opct.demo import run_demo

    out = run_demo(cfg)
    print(f"opct: demo done -> {out}/report.md  ({out}/results.json, models in {out}/sft/model, {out}/opct/model)")


def cmd_report(args) -> None:
    from opct.report import write_report

    paths = write_report(args.run_dir)
    print(f"opct: wrote {paths['markdown']} and {paths['html']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opct", description="On-Policy Consistency Training of language models.")
    parser.add_argument("--version", action="version", version=f"opct {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="OPCT on a JSONL of consistency pairs",
                       description=config.TrainConfig.__doc__ + " Options may also come from --config YAML.")
    config.add_arguments(p, config.TrainConfig)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="the offline baseline: SFT on the frozen model's clean-prompt answers (BCT)",
                       description=config.SFTConfig.__doc__)
    config.add_arguments(p, config.SFTConfig)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="evaluate a model on an axis (--axis sycophancy, safety) or on lm-eval tasks",
                       description="Evaluate one model on an axis' evaluation set; with the same axis options it is "
                                   "the set `opct demo --axis` evaluates. sycophancy: no generation; --mode text "
                                   "(default): the prompt asks for a reply \"The answer is <option>\" and the answer "
                                   "is the option whose first token is most probable after that prefix; --mode letter: "
                                   "the most probable option letter at the first response position. safety: greedy "
                                   "responses graded by --judge on held-out facts, training facts, contrast prompts "
                                   "(over-warning) and, for reference, with the fact in the system prompt (oracle).")
    config.add_arguments(p, config.EvalConfig)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("demo", help="an axis end to end: eval base -> SFT -> OPCT -> eval -> report",
                       description="Evaluate the base model, train the SFT baseline and OPCT on the same consistency "
                                   "pairs of an axis (--axis sycophancy by default, or safety), evaluate both, and "
                                   "write results.json + report.md/html with plots. Each axis sets its own defaults "
                                   "(model, sizes, steps) for the options you do not set.")
    config.add_arguments(p, config.DemoConfig)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("report", help="(re)write report.md/html + plots from a demo's results.json")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_report)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except user_errors() as e:
        print(f"opct: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("opct: interrupted (a run continues from its last checkpoint with --resume)", file=sys.stderr)
        return 130
    return 0


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean bad input (reported in one line, exit status 2), not a bug."""
    from opct.axes import AxisError
    from opct.backends import BackendError
    from opct.data.mcq import McqError
    from opct.data.safety import SafetyDataError
    from opct.judges.safety import JudgeError
    from opct.data.pairs import PairsError
    from opct.models import ModelError
    from opct.train.checkpoint import CheckpointError
    from opct.train.loop import RunError

    return (config.ConfigError, AxisError, SafetyDataError, JudgeError, PairsError, ModelError, RunError, McqError,
            BackendError, CheckpointError, FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
