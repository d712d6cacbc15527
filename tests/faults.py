"""Fault injection for the tests: `opct train` in a child process that SIGKILLs itself at a chosen write.

A fork server (`python tests/faults.py`, started once per test session) imports torch and opct, runs no tensor
op, and forks one child per request: the child installs the hooks below and runs `opct.cli.main(argv)`, exactly
what the `opct` command runs, with its stdout/stderr in files. Forking from the server saves each run the ~4 s of
imports, so a sweep of many killed-and-resumed runs stays fast.

Every write a run makes on the way to a finished run is an *event*, counted in order: each file of a checkpoint
(safetensors, torch.save, Path.write_text), every rename (os.replace: the atomic writes, checkpoint and model
directories), every deletion of an old checkpoint (shutil.rmtree), every metrics row, and the start of every
step. With `kill_at=N` the child is killed with SIGKILL at event N, either before it (`mode="before"`) or in the
middle of it (`mode="mid"`: the file is written and then cut to half its size, half of a metrics row is
appended, the rename or deletion is done) -- a kill -9 that lands inside a checkpoint write. The event sequence of
a run is deterministic, so a seeded choice of N is a deterministic kill point. The child writes its event count
(labels, in order) to `count_file` when it exits normally: a test's map of a run's kill points.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


class State:
    n = 0
    kill_at = 0
    mode = "before"
    labels: list[str] = []  # what each event was, in order


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _event(label: str) -> bool:
    """Count one event; True when this is the kill point in 'mid' mode (the caller does half the work, then
    dies); in 'before' mode the process dies here."""
    State.n += 1
    State.labels.append(label)
    if State.n != State.kill_at:
        return False
    if State.mode == "before":
        _die()
    return True


def _file_writer(fn, path_of):
    def wrapped(*args, **kwargs):
        mid = _event(f"{fn.__name__} {Path(path_of(args)).parent.name}/{Path(path_of(args)).name}")
        out = fn(*args, **kwargs)
        if mid:
            path = Path(path_of(args))
            if path.is_file():
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2])
            _die()
        return out
    return wrapped


def _after(fn, label=lambda a: ""):
    def wrapped(*args, **kwargs):
        mid = _event(f"{fn.__name__} {label(args)}".strip())
        out = fn(*args, **kwargs)
        if mid:
            _die()
        return out
    return wrapped


def install_hooks() -> None:
    import pathlib
    import shutil

    import torch

    from opct.algo import opct as algo
    from opct.train import checkpoint, metrics

    checkpoint.save_file = _file_writer(checkpoint.save_file, lambda a: a[1])
    torch.save = _file_writer(torch.save, lambda a: a[1])
    pathlib.Path.write_text = _file_writer(pathlib.Path.write_text, lambda a: a[0])
    os.replace = _after(os.replace, lambda a: f"{Path(a[0]).name} -> {Path(a[1]).name}")
    shutil.rmtree = _after(shutil.rmtree, lambda a: Path(a[0]).name)
    algo.opct_step = _after(algo.opct_step)
    log = metrics.MetricsLog.log

    def log_row(self, row):
        if _event(f"metrics row {row['step']}"):
            with self.path.open("a") as f:
                line = json.dumps(row) + "\n"
                f.write(line[: len(line) // 2])
            _die()
        return log(self, row)
    metrics.MetricsLog.log = log_row


def serve() -> None:
    """Read one JSON request per line on stdin, fork a child for it, answer {"code": exit status or -signal}."""
    import torch  # noqa: F401  (imported once here, shared by every child)

    import opct.algo.opct  # noqa: F401
    import opct.cli

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with open(req["stdout"], "w") as out, open(req["stderr"], "w") as err:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    State.kill_at, State.mode = req.get("kill_at", 0), req.get("mode", "before")
                    install_hooks()
                    code = opct.cli.main(req["argv"])
                    if req.get("count_file"):
                        Path(req["count_file"]).write_bytes(json.dumps(State.labels).encode())
            except BaseException:  # noqa: BLE001 (the child must never return into the server loop)
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"code": code}), flush=True)


class ForkServer:
    """The client: `run(argv, workdir, kill_at=0, mode=...)` -> (exit code or -9, stderr text, the run's events
    (labels, in order) when it exited by itself, else None)."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def run(self, argv: list[str], workdir: Path, kill_at: int = 0, mode: str = "before"):
        workdir.mkdir(parents=True, exist_ok=True)
        req = {"argv": argv, "kill_at": kill_at, "mode": mode, "stdout": str(workdir / "stdout"),
               "stderr": str(workdir / "stderr"), "count_file": str(workdir / "events")}
        (workdir / "events").unlink(missing_ok=True)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        code = json.loads(self.proc.stdout.readline())["code"]
        events = json.loads((workdir / "events").read_text()) if (workdir / "events").is_file() else None
        return code, (workdir / "stderr").read_text(), events

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
