"""opct's error hierarchy: every error opct raises on purpose is a `UserError` or a `MachineError`.

The CLI (`opct.cli.main`) reports either kind in one line, `opct: error: <message>`, without a traceback, and
chooses the exit status from the base class alone:

- `UserError`, bad input (a file, an option, a model name, a missing optional package): exit status 2;
- `MachineError`, the machine or a service, not the input (a full disk, a judge endpoint that stopped answering, a
  vLLM sampler that does not serve the trained weights): exit status 1, the line followed by what a command that
  stopped early left behind and how to go on.

Each concrete error class also keeps a stdlib base, e.g. `class ConfigError(UserError, ValueError)`, so code that
catches `ValueError` or `RuntimeError` still catches it. A new error class inherits from one of the two kinds (and
a stdlib type) and needs nothing in the CLI. Of the stdlib's own errors the CLI reports two kinds the same way
(opct.cli.USER_ERRORS, MACHINE_ERRORS): a FileNotFoundError as bad input (2), any other OSError as the machine's
(1). Anything else, a bug, ends in a traceback.

This module imports nothing from opct, so any module may import it without an import circle.
"""


class OpctError(Exception):
    """The base of every error opct raises on purpose; use `UserError` or `MachineError`, not this."""


class UserError(OpctError):
    """Bad input: the CLI prints one line and exits with status 2."""


class MachineError(OpctError):
    """The machine or a service: the CLI prints one line (and how to go on) and exits with status 1."""
