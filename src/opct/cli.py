"""`opct` command line: parse a config, call one function. Errors in user input exit with status 2."""

from __future__ import annotations

import argparse
import os
import sys

from opct import config

def cmd_train(args) -> None:
    from opct.opct import train

    cfg = config.build(config.TrainConfig, args)
    out = train(cfg)
    print(f"opct: done -> {out}/model (metrics: {out}/metrics.jsonl)")


def cmd_sft(args) -> None:
    from opct.sft import train_sft

    cfg = config.build(config.SFTConfig, args)
    out = train_sft(cfg)
    print(f"opct: done -> {out}/model (targets: {out}/targets.jsonl, metrics: {out}/metrics.jsonl)")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="opct", description="On-Policy Consistency Training of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="OPCT on a JSONL of consistency pairs",
                       description="On-policy consistency training: the student samples on the student prompt, the "
                                   "frozen initial model scores the same tokens on the teacher prompt, and the "
                                   "student minimises per-token reverse KL. Options may also come from --config YAML.")
    config.add_arguments(p, config.TrainConfig)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="the offline baseline: SFT on the frozen model's clean-prompt answers (BCT)",
                       description=config.SFTConfig.__doc__)
    config.add_arguments(p, config.SFTConfig)
    p.set_defaults(func=cmd_sft)

    args = parser.parse_args(argv)
    from opct.models import ModelError
    from opct.opct import RunError
    from opct.pairs import PairsError

    try:
        args.func(args)
    except (config.ConfigError, PairsError, ModelError, RunError) as e:
        print(f"opct: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
