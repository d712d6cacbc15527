"""The CPU thread policy (opct/threads.py): fixed counts stay, `auto` follows the cores other processes leave free."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from opct import threads
from opct.algo.opct import train
from opct.config import TrainConfig
from opct.options import ConfigError, apply_env_overrides
from opct.data.pairs import ConsistencyPair

BUSY = "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) % 2147483648\n"


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
    threads._active = None


class Clock:
    """Scripted readings: each `advance(wall, others, own)` moves time on by `wall` seconds during which other
    processes kept `others` cores busy and this process used `own` cores."""

    def __init__(self, monkeypatch):
        self.t, self.busy, self.own = 100.0, 0.0, 0.0
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.t)
        monkeypatch.setattr(threads, "cpu_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(threads, "own_cpu_seconds", lambda: self.own)

    def advance(self, wall, others, own):
        self.t += wall
        self.busy += wall * (others + own)
        self.own += wall * own


def test_auto_drops_to_the_free_cores_and_comes_back(monkeypatch, restore_threads):
    clock = Clock(monkeypatch)
    policy = threads.Threads(0, default=2)
    policy.cpus = {0, 1}
    assert torch.get_num_threads() == 2
    clock.advance(5.0, others=1.0, own=1.0)  # another session's process took a core
    assert policy.adjust() == 1
    clock.advance(5.0, others=0.98, own=1.0)
    assert policy.adjust() == 1
    clock.advance(5.0, others=0.05, own=1.0)  # it stopped
    assert policy.adjust() == 2
    clock.advance(5.0, others=0.2, own=1.8)  # light background work is not worth giving a thread up
    assert policy.adjust() == 2


def test_auto_waits_for_an_interval_long_enough_to_judge(monkeypatch, restore_threads):
    clock = Clock(monkeypatch)
    policy = threads.Threads(0, default=2)
    policy.cpus = {0, 1}
    clock.advance(0.2, others=1.0, own=1.0)
    assert policy.adjust() == 2  # 0.2 s: too short, the interval keeps growing
    clock.advance(0.4, others=1.0, own=1.0)
    assert policy.adjust() == 1  # 0.6 s in all


def test_a_fixed_count_never_changes(monkeypatch, restore_threads):
    clock = Clock(monkeypatch)
    policy = threads.Threads(1)
    clock.advance(5.0, others=0.0, own=1.0)
    assert policy.adjust() == 1 and torch.get_num_threads() == 1


def test_the_cap_is_torchs_own_count_not_a_lowered_one(monkeypatch, restore_threads):
    Clock(monkeypatch)
    torch.set_num_threads(2)
    threads._default = None
    threads.use(0)
    torch.set_num_threads(1)  # e.g. lowered by the previous run's policy
    assert threads.use(0).cap == 2


def test_opct_threads_environment_variable_is_a_whole_number():
    cfg, env = apply_env_overrides(TrainConfig(), {"OPCT_THREADS": "1"})
    assert cfg.threads == 1 and env == {"OPCT_THREADS": "1"}
    with pytest.raises(ConfigError, match="OPCT_THREADS"):
        apply_env_overrides(TrainConfig(), {"OPCT_THREADS": "two"})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_proc_readings_tell_other_processes_from_our_children(restore_threads):
    policy = threads.Threads(0, default=2)

    def others_over(seconds):
        policy._mark = policy._now()
        time.sleep(seconds)
        return policy.others_busy(policy._now())

    def attempt():
        """(stranger seen, child not counted as another, child counted as our own), each relative to the load
        measured just before; None when that load fills the machine (no extra process could show above it)."""
        base = others_over(1.0)
        if base > (os.cpu_count() or 1) - 0.7:
            return None
        # A busy process in its own session that is not our descendant: `sh` starts it and exits at once.
        pid = int(subprocess.run(["sh", "-c", f'{sys.executable} -c "{BUSY}" >/dev/null 2>&1 & echo $!'],
                                 capture_output=True, text=True, start_new_session=True).stdout)
        try:
            time.sleep(0.3)
            stranger = others_over(1.5) > base + 0.5
        finally:
            subprocess.run(["kill", str(pid)])
        # A busy child of ours counts as our own time, not as another process.
        child = subprocess.Popen([sys.executable, "-c", BUSY])
        try:
            time.sleep(0.3)
            own0 = threads.own_cpu_seconds()
            others = others_over(1.5)
            return stranger, others < base + 0.5, threads.own_cpu_seconds() - own0 > 0.7
        finally:
            child.kill()
            child.wait()

    # the machine's other load comes and goes (CI runs its index-bound stages beside the suite): up to 3 tries
    tries = [attempt()]
    while tries[-1] != (True, True, True) and len(tries) < 3:
        tries.append(attempt())
    if all(t is None for t in tries):
        pytest.skip("the machine was busy on every core in each try: no other process could show above its load")
    assert (True, True, True) in tries, tries


def test_metrics_record_each_steps_thread_count(tiny_model_dir, tmp_path, restore_threads):
    pairs = [ConsistencyPair([{"role": "user", "content": f"Q{i}? I think (B)."}], [{"role": "user", "content": f"Q{i}?"}])
             for i in range(4)]
    cfg = TrainConfig(model=str(tiny_model_dir), out=str(tmp_path / "run"), steps=2, prompts_per_step=2, micro_batch=2,
                      max_new_tokens=4, lora_rank=4, lora_alpha=8.0, save_every=0, report_to="none", threads=1)
    out = train(cfg, pairs=pairs, show_progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["threads"] for r in rows] == [1, 1]
