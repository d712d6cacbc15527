"""A command run from a test with every process it starts, so that a hang fails that test instead of the suite.

subprocess.run's own timeout kills only the process it started; torchrun starts each rank in a session of its own,
so neither that nor a kill of the launcher's process group reaches a hung rank, which keeps the test's output pipes
open: the test's wait for them then never ends (a CI run stopped at its time limit that way). Here, past `timeout`,
every descendant gets SIGABRT first (PYTHONFAULTHANDLER=1 makes a Python rank print each thread's stack on it), then
SIGKILL, and the test fails with the stacks in its message."""

import contextlib
import os
import signal
import subprocess

import psutil
import pytest


def run_tree(cmd: list, timeout: float = 300, env: dict | None = None, ok: bool | None = True,
             **kw) -> subprocess.CompletedProcess:
    """Run `cmd` to its end (stdout and stderr captured as text); `ok` True: its exit status must be 0, False: not
    0, None: either. Past `timeout` s the test fails, as above."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            out, err = "", "(its output pipes stayed open after every process of the tree was killed)"
        pytest.fail(f"{' '.join(map(str, cmd[:8]))} ...: no exit after {timeout} s; stderr (with each Python "
                    f"process's stacks at the time):\n{err[-6000:]}")
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if ok is not None:
        assert (p.returncode == 0) == ok, f"exit {p.returncode}:\n{p.stderr[-3000:]}"
    return p


def kill_tree(pid: int) -> None:
    """SIGABRT to every descendant of `pid` (their stacks), up to 3 s for them to print and die, then SIGKILL to
    those left and to `pid`."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        tree = root.children(recursive=True)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGABRT)
        _, alive = psutil.wait_procs(tree, timeout=3)
        for p in [*alive, root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
