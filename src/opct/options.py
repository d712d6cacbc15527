"""The option machinery: a command's settings are a dataclass whose fields say everything about themselves.

A field is declared with `opt(default, help, ...)`, which stores its marks in the field's metadata:

  help, choices   what `--help` shows (the default is appended as "(default: X)") and the values allowed
  group           the `--help` heading it is listed under (None: the command's own options)
  commands        the commands (a config class's `command` attribute) that offer it; None: every config that has it
  axes            the axes it applies to (None: all), so a report lists only its axis' settings
  resumable       a resumed run may set it differently from the run's saved config
  check           `Check`s on its value alone, applied by `check_fields` in declaration order
  env             an environment variable that overrides it (`apply_env_overrides`: it wins over YAML and flags)

Everything else is derived from those marks, for any config class:

  add_arguments    one `--flag` per offered field (booleans as --flag / --no-flag), argparse default None so that
                   what the user set can be told from what they did not
  read_yaml        a `--config` file's {key: value} and {key: line}, refusing duplicate keys and malformed files
  from_dict        cls(**values), each value type-checked and coerced (YAML 1.1 reads 1e-4 as text), unknown or
                   other commands' keys refused with the file:line and the closest known name
  resolve          dataclass defaults < `defaults(user values)` < YAML < flags < overrides, then from_dict
  check_fields     each field's own checks; a config module adds the rules between fields (opct.config.validate)
  to_yaml          the config as YAML, in field order

Precedence is defaults < YAML < flags < environment (for the fields with `env`). Nothing here names a command, an
option or an axis: opct.config declares the commands' settings, opct.axes.options the axes'.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from opct.errors import UserError


class ConfigError(UserError, ValueError):
    """A setting that cannot be meant: a bad value, an unknown key, a malformed config file (exit status 2)."""


# -- checks on one value -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """A rule on one option's value alone: `ok(value)`, else `check_fields` refuses it with "option --NAME `why`,
    got VALUE". A field's checks (`opt(check=...)`) run in the order given, the first that fails is the message."""
    ok: Callable[[Any], bool]
    why: str
    raises: bool = False  # `parses`: ok raises ValueError with the message instead of returning False


def parses(parse: Callable[[Any], Any]) -> Check:
    """The value is one `parse` accepts (a parser another module owns); its ValueError, which names the option, is
    the message: "option " + its text."""
    return Check(parse, "", raises=True)


FINITE = Check(math.isfinite, "must be a finite number")


def at_least(low: int, note: str = "") -> Check:
    return Check(lambda v: v >= low, f"must be >= {low}{note}")


def above(low: int) -> Check:
    return Check(lambda v: v > low, f"must be > {low}")


def within(interval: str) -> Check:
    """The value lies in `interval`, written as the message shows it: "(0, 1)", "[0, 1)", "(0, 1]" or "[0, 1]"."""
    low, high = (float(x) for x in interval[1:-1].split(", "))
    low_ok = (lambda v: v >= low) if interval[0] == "[" else (lambda v: v > low)
    high_ok = (lambda v: v <= high) if interval[-1] == "]" else (lambda v: v < high)
    return Check(lambda v: low_ok(v) and high_ok(v), f"must be in {interval}")


def not_blank(why: str) -> Check:
    """Text with something other than spaces in it."""
    return Check(lambda v: bool(v.strip()), why)


def _json_object(text: str) -> bool:
    """Empty (none) or a JSON object."""
    if not text:
        return True
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def json_object(example: str) -> Check:
    """Empty text (none) or a JSON object."""
    return Check(_json_object, f"must be a JSON object, e.g. {example}")


# -- the field marks ---------------------------------------------------------------------------------------------

def opt(default, help: str, choices=None, group: str | None = None, resumable: bool = False,
        commands: tuple[str, ...] | None = None, axes: tuple[str, ...] | None = None,
        check: Check | tuple[Check, ...] = (), env: str | None = None):
    """A config field: its default, `--help` text and choices, and the marks the module docstring lists."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group, "resumable": resumable,
                                            "commands": commands, "axes": axes, "env": env,
                                            "checks": check if isinstance(check, tuple) else (check,)})


def offered(cls) -> list:
    """The fields a command's config (its `command` class attribute) offers as options: those whose `commands`
    include it (all of them for a config without a command)."""
    cmd = getattr(cls, "command", None)
    return [f for f in fields(cls) if cmd is None or f.metadata.get("commands") is None
            or cmd in f.metadata["commands"]]


def resumable_fields(cls) -> set[str]:
    """The fields of a config class a resumed run may change (`opt(resumable=...)`); any other difference from the
    run's saved config is refused."""
    return {f.name for f in fields(cls) if f.metadata.get("resumable")}


def _kind(f):
    """A field's value type (the annotations are strings under `from __future__ import annotations`)."""
    return {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type), f.type)


def _check(cond: bool, option: str, why: str, value) -> None:
    if not cond:
        raise ConfigError(f"option --{option.replace('_', '-')} {why}, got {value!r}")


def check_fields(cfg) -> None:
    """Each field's own checks (`opt(check=...)`), in field order (as `--help` lists them); the first that fails
    raises a ConfigError naming the option."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        for check in f.metadata.get("checks", ()):
            if not check.raises:
                _check(check.ok(value), f.name, check.why, value)
                continue
            try:
                check.ok(value)
            except ValueError as e:
                raise ConfigError(f"option {e}") from None


# -- flags -------------------------------------------------------------------------------------------------------

METAVARS = {int: "N", float: "FLOAT", str: "TEXT"}  # what --help shows a value as (choices are listed instead)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per offered field (booleans as --flag / --no-flag); the parsed default is None so we can tell
    what was given. Fields with a `group` are listed under that heading."""
    parser.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in offered(cls):
        g = f.metadata.get("group")
        target = groups.setdefault(g, parser.add_argument_group(g)) if g else parser
        name, help_ = f"--{f.name.replace('_', '-')}", f"{f.metadata.get('help', '')} (default: {f.default})"
        if _kind(f) is bool:
            target.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
            continue
        metavar = None if f.metadata.get("choices") else METAVARS.get(_kind(f), "VALUE")
        target.add_argument(name, dest=f.name, type=_kind(f), default=None, choices=f.metadata.get("choices"),
                            metavar=metavar, help=help_)


# -- values from a file or a dict --------------------------------------------------------------------------------

def from_dict(cls, values: dict, where: str = "config", lines: dict | None = None):
    """cls(**values) with each value type-checked; `lines` ({option: line number}) lets messages name the line.
    Two class attributes refine the messages: `foreign` (other commands' pieces whose options cls refuses as
    theirs, "does not apply to ...") and `renamed` ({option of an earlier release: what took its place})."""
    known = {f.name: f for piece in (*getattr(cls, "foreign", ()), cls) for f in fields(piece)}
    allowed = {f.name for f in offered(cls)}
    renamed = getattr(cls, "renamed", {})
    kwargs = {}
    base = where
    for k, v in values.items():
        where = f"{base}:{lines[str(k)]}" if lines and str(k) in lines else base
        if not isinstance(k, str):
            raise ConfigError(f"{where}: option names are words, got {k!r}")
        key = k.replace("-", "_")
        if key in renamed and key not in known:
            raise ConfigError(f"{where}: option {k!r} is now {renamed[key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"{where}: unknown option {k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if key not in allowed:
            applies = ", ".join(f"opct {c}" for c in known[key].metadata["commands"])
            raise ConfigError(f"{where}: option {k!r} does not apply to opct {cls.command} (it applies to {applies})")
        f = known[key]
        want = _kind(f)
        if want is float and isinstance(v, str):  # YAML 1.1 reads 1e-4 as a string
            try:
                v = float(v)
            except ValueError:
                pass
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if want is int and isinstance(v, float) and v.is_integer():  # steps: 1e3 or 20.0
            v = int(v)
        if want is int and isinstance(v, str):  # YAML 1.1 reads 1e3 as a string
            try:
                v = int(float(v)) if float(v).is_integer() else v
            except ValueError:
                pass
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{where}: option {k!r} must be {want.__name__}, got {v!r}")
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise ConfigError(f"{where}: option {k!r} must be one of {choices}, got {v!r}")
        kwargs[key] = v
    return cls(**kwargs)


def read_yaml(p: Path) -> tuple[dict, dict]:
    """A config file's {option: value} and {option: line}; a missing, unreadable, non-UTF-8 or malformed file, a
    top level that is not a mapping, or a key given twice (YAML would keep the last silently) is a ConfigError."""
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if loaded is None:
        return {}, {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: expected a mapping of option: value")
    lines: dict = {}
    for key_node, _ in node.value:
        line = key_node.start_mark.line + 1
        if key_node.value in lines:
            raise ConfigError(f"{p}:{line}: option {key_node.value!r} is given twice (first on line "
                              f"{lines[key_node.value]})")
        lines[key_node.value] = line
    return loaded, lines


def user_values(cls, args: argparse.Namespace) -> dict:
    """The options the user set: the --config YAML file's, then the flags given (which win); keys as field names."""
    values: dict = {}
    if getattr(args, "config", None):
        p = Path(args.config)
        loaded, lines = read_yaml(p)
        from_dict(cls, loaded, where=str(p), lines=lines)  # type-check the file on its own, so errors name it
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
    for f in fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return values


def resolve(cls, args: argparse.Namespace, defaults=None, overrides: dict | None = None):
    """The config (not yet validated) from dataclass defaults < `defaults(user_values)` (e.g. an axis' own defaults,
    chosen by what the user set) < the --config YAML < flags < `overrides` (e.g. one axis of several). Defaults for
    options `cls` lacks are ignored."""
    values = {**user_values(cls, args), **(overrides or {})}
    if defaults is not None:
        known = {f.name for f in offered(cls)}
        values = {**{k: v for k, v in defaults(values).items() if k in known}, **values}
    return from_dict(cls, values)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


# -- the environment ---------------------------------------------------------------------------------------------

def apply_env_overrides(cfg, environ=None):
    """cfg with the fields that environment variables override (`opt(env=...)`), in field order; returns
    (cfg, {variable: value}) so a run can record which ones applied. A value of the wrong kind is a ConfigError."""
    environ = os.environ if environ is None else environ
    applied, values = {}, {}
    for f in fields(cfg):
        var = f.metadata.get("env")
        if var is None or var not in environ:
            continue
        raw = environ[var]
        if _kind(f) is bool:
            if raw not in ("0", "1"):
                raise ConfigError(f"environment variable {var}={raw!r}: expected 0 or 1")
            values[f.name] = raw == "1"
        elif _kind(f) is int:
            if not raw.isdigit():
                raise ConfigError(f"environment variable {var}={raw!r}: expected a whole number >= 0")
            values[f.name] = int(raw)
        else:
            choices = f.metadata.get("choices")
            if choices and raw not in choices:
                raise ConfigError(f"environment variable {var}={raw!r}: expected one of {choices}")
            values[f.name] = raw
        applied[var] = raw
    return dataclasses.replace(cfg, **values), applied
