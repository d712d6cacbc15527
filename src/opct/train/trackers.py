"""Experiment trackers: where a run's per-step metrics go besides metrics.jsonl (`--report-to`).

    tensorboard  event files under out/tb (the default; `tensorboard --logdir out/tb`)
    wandb        Weights & Biases (`pip install 'opct[wandb]'`); WANDB_MODE=offline keeps the run under out/wandb
                 for a later `wandb sync`; the project is $WANDB_PROJECT, else "opct"
    trackio      Hugging Face's trackio (`pip install 'opct[trackio]'`): a local store ($TRACKIO_DIR, else
                 trackio's own), `trackio show` opens it; the project is $TRACKIO_PROJECT, else "opct"
    none         metrics.jsonl only

Every tracker gets the run's config once and, every step, the numbers of the row metrics.jsonl gets (the same
keys and values, at the same step). metrics.jsonl stays the record opct itself reads back. On --resume a tracker
continues the same run (by the W&B id and trackio name kept in out/trackers.json); TensorBoard drops
the steps after the checkpoint, as metrics.jsonl does, while W&B and trackio keep what they were sent and are
sent those steps again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import sys
from pathlib import Path

from opct.data.io import atomic_write
from opct.errors import UserError
from opct.extras import MissingExtra, require

TRACKERS = ("tensorboard", "wandb", "trackio")


class TrackerError(UserError, RuntimeError):
    """A tracker --report-to names could not start (the CLI: one line, exit status 2)."""


def parse(report_to: str) -> list[str]:
    """The trackers a --report-to value names: "none", or one or more of TRACKERS separated by commas."""
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or not names:
        raise ValueError(f"--report-to {report_to!r}: expected none, or one or more of {', '.join(TRACKERS)} "
                         "separated by commas")
    return list(dict.fromkeys(names))


def check(report_to: str) -> None:
    """Each named tracker's package is installed (checked before any model loads)."""
    for name in parse(report_to):
        if name == "tensorboard":
            if importlib.util.find_spec("tensorboard") is None:
                raise MissingExtra("--report-to tensorboard (the default) needs tensorboard, one of opct's own "
                                   "dependencies, which is not installed here: pip install tensorboard, or pass "
                                   "--report-to none (metrics.jsonl is written either way)")
        else:
            require(name, f"--report-to {name}", "or --report-to none: metrics.jsonl is written either way")


def scalars(row: dict) -> dict:
    """A metrics row's numbers, without its step: what every tracker logs."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoard:
    def __init__(self, out: Path, config: dict, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tb"), purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, config: dict, resume_step: int, ids: dict):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "opct"), name=out.name, id=ids.get("wandb"),
                              dir=str(out), config=config, resume="allow", reinit="create_new")
        ids["wandb"] = self.run.id

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


class Trackio:
    def __init__(self, out: Path, config: dict, resume_step: int, ids: dict):
        import trackio

        self.trackio = trackio
        # trackio knows a run by its name: a new run gets a name of its own (a demo's runs are all "opct" or "sft")
        name = ids.setdefault("trackio", f"{out.name}-{secrets.token_hex(3)}")
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "opct"), name=name, config=config,
                                resume="allow")

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def read_ids(path: Path) -> dict:
    """out/trackers.json's {tracker: run id}; a missing or damaged file gives {} (the trackers start new runs),
    saying so when it was damaged."""
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        ids = None
    if not (isinstance(ids, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in ids.items())):
        print(f"opct: warning: {path}: not a JSON object of tracker run ids; the trackers start new runs",
              file=sys.stderr)
        return {}
    return ids


def open_trackers(report_to: str, out: Path, config: dict, resume_step: int) -> list:
    """The trackers --report-to names, started for the run in `out` (continued on resume: their run ids are kept
    in out/trackers.json)."""
    names = parse(report_to)
    ids_path = out / "trackers.json"
    ids = read_ids(ids_path) if resume_step else {}
    opened = []
    try:
        for name in names:
            try:
                opened.append(TensorBoard(out, config, resume_step) if name == "tensorboard" else
                              {"wandb": WandB, "trackio": Trackio}[name](out, config, resume_step, ids))
            except Exception as e:  # noqa: BLE001 (a tracker's own errors: no login, no network, ...)
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise TrackerError(f"--report-to {name}: the tracker did not start ({reason}); W&B runs without an "
                                   "account with WANDB_MODE=offline; or pass --report-to none") from None
    except BaseException:
        for t in opened:
            t.close()
        raise
    if ids:
        atomic_write(ids_path, json.dumps(ids))
    return opened
