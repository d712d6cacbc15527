"""`opct` command line: parse and check a command's config, then run it (opct.commands). Errors in user input exit with
status 2.

This is the one place that sets process-wide state before torch is imported: transparent huge pages for the CPU
backend (`huge_pages`), which PyTorch reads at its first allocation, and `opct eval --offline on`'s Hub switches.
Nothing is set on `import opct`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
from pathlib import Path

from opct import __version__, config, options
from opct.errors import MachineError, UserError
from opct.axes import axis_defaults, axis_names
from opct.provenance import git_commit


# The fields before_torch reads: set by the user (flags, --config YAML, environment) and never by an axis' defaults
# (tests/test_cli.py), so they are known before the config is built
PROCESS_FIELDS = ("huge_pages", "backend", "device", "tasks", "offline")


def before_torch(cls, args) -> None:
    """Process settings that must come before a library reads them, from the command's flags, --config YAML and
    environment alone: the cpu backend's huge_pages, which torch reads at its first allocation (cpu/process.py), and
    `opct eval --tasks --offline on`'s Hub switches, which huggingface_hub (imported by transformers) and datasets
    read once, when first imported. It runs before the config is built: building a demo's or an evaluation's config
    reads its axis' defaults, and importing the axis loads torch and transformers."""
    cfg, _ = options.apply_env_overrides(options.resolve(cls, args))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.huge_pages and cfg.backend in ("auto", "cpu") and cfg.device in ("auto", "cpu"):
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if isinstance(cfg, config.EvalConfig) and cfg.tasks and cfg.offline == "on":
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


def commands():
    """opct.commands, what each command runs. Its import loads torch, so it comes only when a command runs, after
    `before_torch` has set the process up and the config is checked: the one import cli.py defers."""
    from opct import commands

    return commands


def cmd_train(args) -> None:
    before_torch(config.TrainConfig, args)
    cfg = config.build(config.TrainConfig, args)
    commands().train(cfg)


def cmd_sft(args) -> None:
    before_torch(config.SFTConfig, args)
    cfg = config.build(config.SFTConfig, args)
    commands().sft(cfg)


def check_output_file(path: str, option: str) -> None:
    """An output file option must name a file that can be created: not a directory, not under a file."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise options.ConfigError(f"{option} {path}: is a directory; give a file name for the JSON results")
    parent = next((q for q in p.parents if q.exists()), Path("."))
    if not parent.is_dir():
        raise options.ConfigError(f"{option} {path}: cannot be created: {parent} is a file, not a directory")


def check_output_dir(path: str, option: str) -> None:
    """An output directory option must not be, or lie under, an existing file."""
    p = Path(path)
    existing = p if p.exists() else next((q for q in p.parents if q.exists()), Path("."))
    if not existing.is_dir():
        raise options.ConfigError(f"{option} {path}: cannot be used as the output directory: {existing} is a file")


def cmd_eval(args) -> None:
    before_torch(config.EvalConfig, args)
    cfg = config.build(config.EvalConfig, args, defaults=axis_defaults)
    check_output_file(cfg.out, "--out")
    run = commands()
    (run.eval_tasks if cfg.tasks else run.eval_axis)(cfg)


# Options that name one axis' data: meaningless for another axis, so refused for a run over several.
ONE_AXIS_OPTIONS = ("source", "eval_source")


def cmd_demo(args) -> None:
    user = options.user_values(config.DemoConfig, args)
    names = axis_names(user.get("axis") or config.DemoConfig.axis)
    before_torch(config.DemoConfig, args)
    if len(names) == 1:
        cfg = config.build(config.DemoConfig, args, defaults=axis_defaults, overrides={"axis": names[0]})
        check_output_dir(cfg.out, "--out")
        commands().run_demo(cfg)
        return
    for name in ONE_AXIS_OPTIONS:
        if name in user:
            raise options.ConfigError(f"option --{name.replace('_', '-')} names one axis' data; with several axes "
                                     f"(--axis {user['axis']}) each reads its own: run `opct demo --axis NAME "
                                     f"--{name.replace('_', '-')} ...` for that axis")
    args.stopped_in = "demo over several axes"  # what a failure from here on says (after_failure)
    top = Path(user.get("out") or config.DemoConfig.out)
    check_output_dir(str(top), "--out")
    cfgs = [config.build(config.DemoConfig, args, defaults=axis_defaults, overrides={"axis": n, "out": str(top / n)})
            for n in names]
    commands().run_demos(cfgs, top, names)


def cmd_check(args) -> None:
    before_torch(config.CheckConfig, args)
    cfg = config.build(config.CheckConfig, args)
    check_output_dir(cfg.out, "--out")
    commands().check(cfg)


def cmd_report(args) -> None:
    results = Path(args.run_dir) / "results.json"
    summary = Path(args.run_dir) / "summary.json"
    if summary.is_file() and not results.is_file():  # a demo over several axes: each axis' report, then the summary
        try:
            prior = json.loads(summary.read_text())
            axes, wall = prior["axes"], prior.get("wall_seconds")
        except (ValueError, KeyError, TypeError) as e:
            raise options.ConfigError(f"{summary}: not a summary `opct demo --axis all` wrote ({e})") from None
        commands().write_summary(args.run_dir, axes, wall)
        return
    if results.is_file():
        try:
            loaded = json.loads(results.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            where = f"{results}:{e.lineno}" if isinstance(e, json.JSONDecodeError) else str(results)
            raise options.ConfigError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}); it is written by "
                                     "`opct demo`") from None
        if not isinstance(loaded, dict):
            raise options.ConfigError(f"{results}: expected a JSON object (a demo's results), got "
                                     f"{type(loaded).__name__}")
    commands().write_report(args.run_dir)


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, its options generated from its config class (opct.options)."""
    parser = argparse.ArgumentParser(prog="opct", description="On-Policy Consistency Training of language models.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="OPCT on a JSONL of consistency pairs",
                       description=config.TrainConfig.__doc__ + " Options may also come from --config YAML.")
    options.add_arguments(p, config.TrainConfig)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="the offline baseline: SFT on the frozen model's clean-prompt answers (BCT)",
                       description=config.SFTConfig.__doc__)
    options.add_arguments(p, config.SFTConfig)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="evaluate a model on an axis (--axis sycophancy, safety, jailbreak) or on "
                                    "lm-eval tasks",
                       description="Evaluate one model on an axis' evaluation set; with the same axis options it is "
                                   "the set `opct demo --axis` evaluates. sycophancy: no generation; --mode text "
                                   "(default): the prompt asks for a reply \"The answer is <option>\" and the answer "
                                   "is the option whose first token is most probable after that prefix; --mode letter: "
                                   "the most probable option letter at the first response position. safety: greedy "
                                   "responses graded by --judge on held-out facts, training facts, contrast prompts "
                                   "(over-warning) and, for reference, with the fact in the system prompt (oracle). "
                                   "jailbreak: greedy answers to bare and wrapped harmful requests judged for refusal "
                                   "per split, the adaptive per-target attack, and over-refusal on benign "
                                   "look-alikes.")
    options.add_arguments(p, config.EvalConfig)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("demo", help="an axis end to end: eval base -> SFT -> OPCT -> eval -> report",
                       description="Evaluate the base model, train the SFT baseline and OPCT on the same consistency "
                                   "pairs of an axis (--axis sycophancy by default, safety or jailbreak), evaluate "
                                   "both, and write results.json + report.md/html with plots. Each axis sets its own "
                                   "defaults (model, sizes, steps) for the options you do not set.")
    options.add_arguments(p, config.DemoConfig)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("check", help="before training: does a pairs file carry a signal on a model? (token diff of "
                                     "the prompts, answer changes, the per-token teacher-student gap, a verdict)",
                       description=config.CheckConfig.__doc__)
    options.add_arguments(p, config.CheckConfig)
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("report", help="(re)write report.md/html + plots from a demo's results.json")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_report)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _stack_on_crash()
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        args.func(args)
    except USER_ERRORS as e:
        print(f"opct: error: {e}", file=sys.stderr)
        return 2
    except MACHINE_ERRORS as e:
        print(f"opct: error: {e}{after_failure(args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"opct: {'stopped by SIGTERM' if isinstance(e, Terminated) else 'interrupted'}"
              f"{after_failure(args)}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


# How main() reports an error: in one line, with exit status 2 for bad input and 1 for the machine or a service
# (opct.errors). opct's own errors choose by their base class; two stdlib errors are mapped here too. The first
# tuple is tried first, so a missing file (FileNotFoundError, an OSError) is the user's, exit 2, and every other
# OSError (a file opct may not read, a full disk) the machine's, exit 1.
USER_ERRORS = (UserError, FileNotFoundError)
MACHINE_ERRORS = (MachineError, OSError)


# What is left after a command stops early, and how to go on.
_RESUME = ("; nothing was marked finished (no run.json); continue from the last checkpoint with the same command "
           "and --resume")
AFTER_FAILURE = {"train": _RESUME, "sft": _RESUME,
                 "demo": "; the demo did not finish (no results.json): the same command with --resume continues "
                         "it, keeping the stages that finished",
                 "eval": "; no results were written",
                 "check": "; check.json was not written",
                 "demo over several axes": "; the same command with --resume continues it, keeping the axes "
                                           "and stages that finished"}


def after_failure(args) -> str:
    return AFTER_FAILURE.get(getattr(args, "stopped_in", None) or args.command, "")


def _stack_on_crash() -> None:
    """A native crash (SIGSEGV, SIGABRT from a C++ library, ...) prints every thread's Python stack to stderr
    (`faulthandler`), so a report says where it happened. Left alone where a handler is already on (pytest's) or
    stderr is no file."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, RuntimeError, ValueError, OSError):  # sys.stderr None, no fileno(), ...
            pass


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler or `timeout` stopping the run), handled like Ctrl-C: writes in progress are undone."""


def _terminated(signum, frame):
    raise Terminated


def version_text() -> str:
    git = git_commit()
    return f"opct {__version__}" + (f" (git {git['commit'][:12]}{', modified' if git['dirty'] else ''})"
                                     if git else "")


if __name__ == "__main__":
    sys.exit(main())
