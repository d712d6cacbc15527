"""One error hierarchy (opct.errors): every error class in src/opct is a UserError (exit status 2) or a MachineError
(exit status 1) and keeps its stdlib base; the CLI reports each in one line with its exit status."""

import ast
import importlib
from pathlib import Path

import pytest

import opct
from opct import cli
from opct.errors import MachineError, OpctError, UserError
from opct.extras import EXTRAS

# Every exception class defined in src/opct: module, kind, the stdlib base it keeps.
ERRORS = {
    "AxisError": ("opct.axes", UserError, ValueError),
    "BackendError": ("opct.backends.base", UserError, ValueError),
    "CheckpointError": ("opct.train.checkpoint", UserError, ValueError),
    "ConfigError": ("opct.options", UserError, ValueError),
    "DistributedError": ("opct.train.distributed", UserError, RuntimeError),
    "HarmfulDataError": ("opct.axes.jailbreak.harmful", UserError, ValueError),
    "JudgeError": ("opct.judges.base", UserError, ValueError),
    "McqError": ("opct.data.mcq", UserError, ValueError),
    "MissingExtra": ("opct.extras", UserError, RuntimeError),
    "ModelError": ("opct.models", UserError, ValueError),
    "NonFiniteError": ("opct.train.loop", UserError, RuntimeError),  # a RunError
    "OfflineTaskError": ("opct.evals.offline_tasks", UserError, RuntimeError),
    "PairsError": ("opct.data.pairs", UserError, ValueError),
    "ReasoningError": ("opct.data.reasoning", UserError, ValueError),
    "RunError": ("opct.train.loop", UserError, RuntimeError),
    "SafetyDataError": ("opct.axes.safety.facts", UserError, ValueError),
    "TaskError": ("opct.evals.capability", UserError, ValueError),
    "TrackerError": ("opct.train.trackers", UserError, RuntimeError),
    "WheelError": ("opct.data.wheels", UserError, ValueError),
    "EndpointError": ("opct.judges.endpoint", MachineError, RuntimeError),
    "SamplerStaleError": ("opct.backends.vllm", MachineError, RuntimeError),
    "WriteError": ("opct.data.io", MachineError, RuntimeError),
}
BASES = {"OpctError", "UserError", "MachineError"}  # opct.errors itself
NOT_ERRORS = {"Terminated"}  # opct.cli: SIGTERM, handled like Ctrl-C (a KeyboardInterrupt, exit 143)


def exception_classes() -> dict[str, type]:
    """Every class defined anywhere in src/opct (found in each module's source, then imported) that is an exception."""
    root = Path(opct.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        if not names:
            continue
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        try:
            module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        except ModuleNotFoundError as e:  # a module of an optional extra not installed here (vllm_engine.py: vllm)
            assert e.name.split(".")[0] in EXTRAS, e
            bases = {ast.unparse(b) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) for b in n.bases}
            assert not any(b.endswith(("Error", "Exception")) for b in bases), (path, bases)  # read from its source
            continue
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found[name] = cls
    return found


def test_every_error_class_is_a_user_or_a_machine_error_and_keeps_its_stdlib_base():
    found = exception_classes()
    assert set(found) - BASES - NOT_ERRORS == set(ERRORS), "a new error class: give it UserError or MachineError, list it here"
    for name, (module, kind, stdlib) in ERRORS.items():
        cls = found[name]
        assert cls.__module__ == module, name
        assert issubclass(cls, kind) and issubclass(cls, stdlib), name
        assert issubclass(cls, UserError) != issubclass(cls, MachineError), name  # exactly one kind
    assert not issubclass(found["Terminated"], OpctError)


def raising(exc):
    def func(args):
        raise exc
    return func


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_the_cli_maps_each_error_class_to_its_exit_status_in_one_line(name, monkeypatch, capsys):
    module, kind, _ = ERRORS[name]
    cls = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(cli, "cmd_report", raising(cls("the message")))
    code = cli.main(["report", "some-run"])
    assert code == (2 if kind is UserError else 1)
    assert capsys.readouterr().err == "opct: error: the message\n"  # `opct report` leaves nothing to resume


@pytest.mark.parametrize("exc,code", [
    (FileNotFoundError(2, "No such file or directory", "pairs.jsonl"), 2),  # a missing input is the user's
    (PermissionError(13, "Permission denied", "out"), 1),  # any other OSError is the machine's
    (OSError(28, "No space left on device"), 1),
])
def test_the_cli_maps_the_stdlib_errors_as_before(exc, code, monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_report", raising(exc))
    assert cli.main(["report", "some-run"]) == code
    assert capsys.readouterr().err == f"opct: error: {exc}\n"


def test_a_machine_error_says_how_to_go_on_and_a_user_error_does_not(monkeypatch, capsys):
    from opct.data.io import WriteError

    monkeypatch.setattr(cli, "cmd_eval", raising(WriteError("results.json: disk full")))
    assert cli.main(["eval", "--axis", "sycophancy"]) == 1
    assert capsys.readouterr().err == f"opct: error: results.json: disk full{cli.AFTER_FAILURE['eval']}\n"
    monkeypatch.setattr(cli, "cmd_eval", raising(opct.options.ConfigError("--axis: no such axis")))
    assert cli.main(["eval", "--axis", "sycophancy"]) == 2
    assert capsys.readouterr().err == "opct: error: --axis: no such axis\n"


def test_any_other_exception_is_a_bug_and_is_not_reported_in_one_line(monkeypatch):
    monkeypatch.setattr(cli, "cmd_report", raising(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["report", "some-run"])
