"""tests.procs.run_tree: a command whose child runs on in a session of its own (as torchrun starts its ranks) and
keeps the output pipes open fails the test at the timeout, with the child's Python stacks, and leaves nothing running."""

import sys
import time

import psutil
import pytest

from tests.procs import run_tree

# a launcher that starts a child in a new session (its stdout the same pipe) and waits for it; the child never ends
LAUNCHER = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time\\nprint(\"child up\", flush=True)\\n"
            "while True: time.sleep(0.1)'], start_new_session=True); "
            "print('child', c.pid, flush=True); c.wait()")


def test_a_hung_child_in_its_own_session_fails_the_test_with_its_stack_and_is_killed():
    t0 = time.perf_counter()
    with pytest.raises(pytest.fail.Exception) as e:
        run_tree([sys.executable, "-c", LAUNCHER], timeout=3)
    assert time.perf_counter() - t0 < 30
    msg = str(e.value)
    assert "no exit after 3 s" in msg
    assert "Fatal Python error: Aborted" in msg and 'File "<string>", line 3 in <module>' in msg, msg  # its loop
    assert not [p for p in psutil.process_iter(["cmdline"]) if "child up" in " ".join(p.info["cmdline"] or [])]


def test_the_exit_status_is_checked_as_asked():
    assert run_tree([sys.executable, "-c", "print('hi')"]).stdout == "hi\n"
    assert run_tree([sys.executable, "-c", "raise SystemExit(3)"], ok=False).returncode == 3
    with pytest.raises(AssertionError, match="exit 3"):
        run_tree([sys.executable, "-c", "raise SystemExit(3)"])
