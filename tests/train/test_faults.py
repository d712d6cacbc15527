"""Fault injection: kill -9 at seeded points (inside checkpoint writes too), a full disk mid-checkpoint and
mid-final-save. After each, `opct train --resume` must finish with the uninterrupted run's per-step metrics and
adapter, bit for bit, and leave no litter; a failed write must stop with a message naming the path."""

import errno
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.faults import ForkServer
from opct.cli import main


pytestmark = pytest.mark.integration  # process-level: real opct / torchrun processes

PAIR = {"student": [{"role": "system", "content": "Always answer (B)."}, {"role": "user", "content": "Hi? I think B."}],
        "teacher": [{"role": "user", "content": "Hi?"}]}
QS = ["What is 2+2?", "Name a colour.", "Is water wet?", "Say hello."]
STEPS = 5
DETERMINISTIC = ("loss", "kl", "logp_student", "logp_teacher", "response_tokens", "grad_norm", "lr")
SEEDS = int(os.environ.get("OPCT_FAULT_SEEDS", "5"))  # the CI sweep; a longer one: OPCT_FAULT_SEEDS=40


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    p = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    lines = []
    for q in QS:
        lines.append({"student": [PAIR["student"][0], {"role": "user", "content": q + " I think B."}],
                      "teacher": [{"role": "user", "content": q}]})
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def argv(model, pairs, out, *extra):
    return ["train", "--model", str(model), "--pairs", str(pairs), "--out", str(out), "--steps", str(STEPS),
            "--save-every", "1", "--keep-checkpoints", "2", "--prompts-per-step", "2", "--max-new-tokens", "4",
            "--lora-rank", "2", "--lr", "1e-2", "--report-to", "none", "--threads", "1", *extra]


def metrics(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def adapter(out):
    return load_file(str(Path(out) / "model" / "adapter_model.safetensors"))


def assert_same_run(ref, out):
    a, b = metrics(ref), metrics(out)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in DETERMINISTIC} == {k: rb[k] for k in DETERMINISTIC}, ra["step"]
    wa, wb = adapter(ref), adapter(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((Path(out) / "run.json").read_text())["steps"] == STEPS


def litter(out):
    """Anything a killed write leaves: hidden files and directories other than the lock."""
    return [p for p in Path(out).rglob(".*") if p.name != ".lock"]


@pytest.fixture(scope="module")
def server():
    s = ForkServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(server, tiny_model_dir, pairs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    code, err, events = server.run(argv(tiny_model_dir, pairs, out), out.parent / "log")
    assert code == 0, err
    return out, events


@pytest.mark.slow
def test_kill_9_at_seeded_points_then_resume_equals_the_uninterrupted_run(server, reference, tiny_model_dir, pairs,
                                                                          tmp_path):
    """Per seed: kill -9 at a seeded event (before or in the middle of a write), resume and kill again at another,
    then resume to the end. Each kill point is one of the 42 writes and step starts of a 5-step run that
    checkpoints every step, so the seeds land in checkpoint files, manifests, renames, rotations and metrics."""
    ref, labels = reference
    events = len(labels)
    assert events > 30  # every step, checkpoint file, rename and row is a kill point
    hits = []
    for seed in range(SEEDS):
        rng = random.Random(seed)
        out = tmp_path / f"seed{seed}"
        kills = [(rng.randint(1, events), rng.choice(["before", "mid"])) for _ in range(2)]
        for attempt, (at, mode) in enumerate(kills):
            code, err, _ = server.run(argv(tiny_model_dir, pairs, out, *(["--resume"] if attempt else [])),
                                      tmp_path / f"log{seed}-{attempt}", kill_at=at, mode=mode)
            assert code in (-9, 0) and "Traceback" not in err, (seed, attempt, code, err[-2000:])
            if (out / "run.json").exists():  # finished; a kill in the middle of run.json's rename comes after it
                assert code == 0 or mode == "mid"
                break
        hits += [f"{labels[at - 1]} ({mode})" for at, mode in kills]
        while not (out / "run.json").exists():
            code, err, _ = server.run(argv(tiny_model_dir, pairs, out, "--resume"), tmp_path / f"log{seed}-end")
            assert code == 0 and "Traceback" not in err, err[-2000:]
        assert_same_run(ref, out)
        assert litter(out) == [], (seed, kills, litter(out))
    print(f"kill points of {SEEDS} seeds (2 per seed, of {events} events; named as in the uninterrupted run, which "
          "a resumed run's events differ from):", "; ".join(hits))
    assert any(h.startswith(("save_file", "save ", "write_text")) for h in hits)  # some kills hit a checkpoint


def test_a_run_killed_before_its_first_checkpoint_restarts_with_resume(server, tiny_model_dir, pairs, reference,
                                                                       tmp_path):
    out = tmp_path / "run"
    code, _, _ = server.run(argv(tiny_model_dir, pairs, out), tmp_path / "a", kill_at=2, mode="mid")  # 1st step
    assert code == -9 and not list((out / "checkpoints").glob("step-*"))
    code, err, _ = server.run(argv(tiny_model_dir, pairs, out), tmp_path / "b")
    assert code == 2 and "already holds a run; pass --resume" in err
    code, err, _ = server.run(argv(tiny_model_dir, pairs, out, "--resume"), tmp_path / "c")
    assert code == 0 and "no checkpoint yet; starting from step 0" in err
    assert_same_run(reference[0], out)


def test_a_truncated_last_metrics_line_is_dropped_on_resume(server, tiny_model_dir, pairs, reference, tmp_path):
    out = tmp_path / "run"
    at = reference[1].index("metrics row 3") + 1
    code, _, _ = server.run(argv(tiny_model_dir, pairs, out), tmp_path / "a", kill_at=at, mode="mid")
    assert code == -9 and not (out / "metrics.jsonl").read_text().endswith("\n")
    code, err, _ = server.run(argv(tiny_model_dir, pairs, out, "--resume"), tmp_path / "b")
    assert code == 0 and "Traceback" not in err
    assert_same_run(reference[0], out)


# ---- a full disk -------------------------------------------------------------------------------------------


def enospc_after_half(real):
    """A writer that writes half of what it was given and then fails as a full disk does."""
    def write(obj, path, *a, **kw):
        real(obj, path, *a, **kw)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def run_cli(capsys, args):
    code = main(args)
    return code, capsys.readouterr().err


def test_disk_full_mid_checkpoint_stops_naming_the_path_and_resume_finishes(monkeypatch, capsys, tiny_model_dir,
                                                                            pairs, reference, tmp_path):
    from opct.train import checkpoint

    out = tmp_path / "run"
    calls = {"n": 0}
    real = checkpoint.torch.save

    def save(obj, path, *a, **kw):  # the 3rd checkpoint's optim.pt
        calls["n"] += 1
        return (enospc_after_half(real) if calls["n"] == 5 else real)(obj, path, *a, **kw)
    monkeypatch.setattr(checkpoint.torch, "save", save)
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out))
    monkeypatch.undo()
    assert code == 1 and "Traceback" not in err
    assert f"{out / 'checkpoints' / 'step-000003'}: could not be written (No space left on device" in err
    assert "--resume" in err
    assert not (out / "run.json").exists() and not (out / "model").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]  # no partial
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out, "--resume"))
    assert code == 0, err
    assert_same_run(reference[0], out)
    assert litter(out) == []


def test_disk_full_mid_final_save_stops_naming_the_path_and_resume_finishes(monkeypatch, capsys, tiny_model_dir,
                                                                            pairs, reference, tmp_path):
    from peft import PeftModel

    out = tmp_path / "run"
    real = PeftModel.save_pretrained

    def save_pretrained(self, d, *a, **kw):  # the adapter is written, then the disk fills during the next file
        real(self, d, *a, **kw)
        (Path(d) / "README.md").write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(PeftModel, "save_pretrained", save_pretrained)
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out))
    monkeypatch.undo()
    assert code == 1 and "Traceback" not in err
    assert f"{out / 'model'}: could not be written (No space left on device" in err
    assert not (out / "run.json").exists() and not (out / "model").exists() and litter(out) == []
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out, "--resume"))
    assert code == 0, err
    assert_same_run(reference[0], out)


def test_disk_full_mid_metrics_row(monkeypatch, capsys, tiny_model_dir, pairs, reference, tmp_path):
    out = tmp_path / "run"
    real_open = Path.open
    rows = {"n": 0}

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_(self, mode="r", *a, **kw):
        f = real_open(self, mode, *a, **kw)
        if self.name == "metrics.jsonl" and mode == "a":
            rows["n"] += 1
            if rows["n"] == 4:
                return Full(f)
        return f
    monkeypatch.setattr(Path, "open", open_)
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out))
    monkeypatch.undo()
    assert code == 1 and "Traceback" not in err
    assert f"{out / 'metrics.jsonl'}: could not be written (No space left on device" in err
    assert "a cut-off last row is dropped by --resume" in err and not (out / "run.json").exists()
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out, "--resume"))
    assert code == 0, err
    assert_same_run(reference[0], out)


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB tmpfs (needs root and mount rights; skips otherwise)."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("leave_kib,where", [(150, "checkpoints"), (1500, "model")])
def test_a_real_full_disk(small_disk, capsys, tiny_model_dir, pairs, reference, leave_kib, where):
    """A tmpfs with `leave_kib` free: a checkpoint (~84 KiB) fits once, or every checkpoint fits but the final
    model/ (3.4 MiB, mostly tokenizer.json) does not. torch.save and safetensors then fail without an errno."""
    out = small_disk / "run"
    ballast = small_disk / "ballast"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    ballast.write_bytes(b"\0" * (free - leave_kib * 1024))
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out))
    assert code == 1 and "Traceback" not in err, err
    assert f"{out}/{where}" in err and "could not be written" in err
    assert not (out / "run.json").exists() and not (out / "model").exists() and litter(out) == []
    ballast.unlink()
    code, err = run_cli(capsys, argv(tiny_model_dir, pairs, out, "--resume"))
    assert code == 0, err
    assert_same_run(reference[0], out)
