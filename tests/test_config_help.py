"""`--help` of every command lists the same options with the same defaults, choices and kinds as the snapshot
tests/fixtures/help_options.json.

The snapshot was written from the parser of commit 4192c45 (before config.py's option machinery was reworked);
after a deliberate change of the options (a new one, a new default), rewrite it and review the diff:

    OPCT_WRITE_HELP_SNAPSHOT=1 PYTHONPATH=src python -m pytest -q tests/test_config_help.py

Each option is recorded with what `--help` shows of it: its flags, where it is listed (its group's heading), the
default its help text ends with ("(default: X)", the dataclass default), its choices, its value's type and
metavar, and argparse's own default (None for every config option: config.build tells set from unset). The help
texts themselves are not compared.
"""

import argparse
import json
import os
from pathlib import Path

import pytest

from opct.cli import main

SNAPSHOT = Path(__file__).parent / "fixtures" / "help_options.json"


class _Parsed(Exception):
    pass


def _parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser `opct` builds (cli.main), caught where it would parse."""
    caught = []

    def catch(self, *args, **kwargs):
        caught.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed):
        main([])
    return caught[0]


def _option(action: argparse.Action, group: str) -> dict:
    help_ = action.help or ""
    shown = help_.rsplit(" (default: ", 1)[1][:-1] if help_.endswith(")") and " (default: " in help_ else None
    kind = action.type.__name__ if isinstance(action.type, type) else (None if action.type is None
                                                                       else repr(action.type))
    return {"group": group, "dest": action.dest, "action": type(action).__name__, "type": kind,
            "metavar": action.metavar, "nargs": action.nargs, "choices": None if action.choices is None
            else list(action.choices), "default": action.default, "default_shown": shown,
            "required": action.required}


def _options(parser: argparse.ArgumentParser) -> dict:
    """{flags (or a positional's name): what --help shows of it}, each option under its listing's heading."""
    out = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            out[", ".join(action.option_strings) or action.dest] = _option(action, group.title)
    return out


def snapshot(monkeypatch) -> dict:
    """{command: {option: ...}}: "opct" for the top-level parser, then every subcommand `opct --help` lists."""
    parser = _parser(monkeypatch)
    commands = {"opct": _options(parser)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update({name: _options(sub) for name, sub in action.choices.items()})
    return commands


def test_help_of_every_command_lists_the_snapshot_options(monkeypatch):
    now = snapshot(monkeypatch)
    if os.environ.get("OPCT_WRITE_HELP_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(now, indent=1) + "\n")
    then = json.loads(SNAPSHOT.read_text())
    assert set(now) == set(then), "commands differ"
    assert {"train", "sft", "eval", "demo", "report"} <= set(now)
    for command in then:
        assert set(now[command]) == set(then[command]), f"opct {command}: options differ"
        for option, shown in then[command].items():
            assert now[command][option] == shown, f"opct {command} {option}"
