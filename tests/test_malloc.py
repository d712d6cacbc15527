"""opct.malloc: raising glibc's thresholds is opt-out and reports what it did."""

import os
import platform
import subprocess
import sys

import pytest

CODE = "from opct import malloc; print(malloc.keep_freed_memory(), malloc.keep_freed_memory())"


def _run(env_value=None):
    env = dict(os.environ)
    env.pop("OPCT_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["OPCT_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_raised_once_on_glibc():
    assert _run() == ["True", "True"]


def test_opt_out():
    assert _run("0") == ["False", "False"]
