"""backends/cpu/process.py: raising glibc's thresholds happens once, only when asked, and reports what it did."""

import platform
import subprocess
import sys

import pytest

CODE = ("from opct.backends.cpu import process; import functools; "
        "before = process.keep_freed_memory.cache_info().currsize; "
        "print(before, process.keep_freed_memory(), process.keep_freed_memory())")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_raised_once_on_glibc_and_not_on_import():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True", "True"]


def test_cpu_backend_setup_applies_it_only_when_on(monkeypatch):
    """And huge pages are never set in-process (only the CLI can, before torch allocates)."""
    from opct.backends.cpu import process, setup_process
    from opct.config import ExecConfig

    calls = []
    monkeypatch.setattr(process, "keep_freed_memory", lambda: calls.append(1))
    setup_process(ExecConfig(keep_freed_memory=False))
    assert calls == []
    setup_process(ExecConfig())
    assert calls == [1]
