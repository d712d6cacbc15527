"""--report-to: each tracker receives, step for step, the numbers metrics.jsonl holds, and the run's config. The
runs are real `opct train` processes on the tiny model, W&B in its offline mode and trackio in a local store, and
each tracker's own files are read back."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from opct.train import trackers


pytestmark = pytest.mark.integration  # process-level: real opct / torchrun processes

PAIRS = [{"student": [{"role": "user", "content": f"Hint: the answer is B. What is {i}+{i}?"}],
          "teacher": [{"role": "user", "content": f"What is {i}+{i}?"}]} for i in range(6)]
STEPS = 5


def train(tmp_path, tiny_model_dir, report_to: str, env: dict):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "opct", "train", "--model", str(tiny_model_dir), "--pairs", str(pairs), "--out",
           str(out), "--steps", str(STEPS), "--prompts-per-step", "2", "--max-new-tokens", "4", "--lora-rank", "2",
           "--threads", "1", "--save-every", "0", "--report-to", report_to]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return out, rows


def expected(rows: list[dict]) -> list[dict]:
    return [{"step": r["step"], **trackers.scalars(r)} for r in rows]


def same(got: list[dict], rows: list[dict]) -> None:
    want = expected(rows)
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), (sorted(set(g) ^ set(w)), g["step"])
        for k, v in w.items():
            assert g[k] == pytest.approx(v, rel=1e-6, abs=1e-12), (g["step"], k)


def wandb_records(path) -> list:
    """The protobuf records of an offline W&B run file (run-<id>.wandb): W&B writes them in LevelDB's log format,
    a 7-byte file header, then 32 KiB blocks of records each with a 7-byte header (crc32, length, type: full /
    first / middle / last); its Python SDK no longer ships a reader."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            break
        part, pos = part + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def test_report_to_wandb_offline_logs_every_row_and_the_config(tmp_path, tiny_model_dir):
    pytest.importorskip("wandb")
    out, rows = train(tmp_path, tiny_model_dir, "wandb", {"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    ids = json.loads((out / "trackers.json").read_text())
    [path] = glob.glob(str(out / "wandb" / f"offline-run-*-{ids['wandb']}" / f"run-{ids['wandb']}.wandb"))
    records = wandb_records(path)
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            item = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            history.append({"step": item["_step"], **{k: v for k, v in item.items() if not k.startswith("_")}})
    same(history, rows)
    config = {}
    for r in records:  # the config arrives with the run record, later changes as config records
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            update = r.run.config.update if kind == "run" else r.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    assert config["steps"] == STEPS and config["report_to"] == "wandb" and config["model"] == str(tiny_model_dir)
    assert not (out / "tb").exists()  # only what --report-to names


def test_report_to_trackio_logs_every_row_and_the_config(tmp_path, tiny_model_dir):
    pytest.importorskip("trackio")
    store = tmp_path / "trackio"
    out, rows = train(tmp_path, tiny_model_dir, "trackio", {"TRACKIO_DIR": str(store), "TRACKIO_PROJECT": "t"})
    name = json.loads((out / "trackers.json").read_text())["trackio"]
    assert name.startswith("run-")  # the --out directory's name, made unique
    read = subprocess.run([sys.executable, "-c", "import json, sys, trackio.sqlite_storage as s; "
                           "print(json.dumps([s.SQLiteStorage.get_logs('t', sys.argv[1]), "
                           "s.SQLiteStorage.get_run_config('t', sys.argv[1])]))", name],
                          capture_output=True, text=True, env={**os.environ, "TRACKIO_DIR": str(store)}, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    logs, config = json.loads(read.stdout.strip().splitlines()[-1])
    same([{k: v for k, v in r.items() if k != "timestamp"} for r in logs], rows)
    assert config["steps"] == STEPS and config["report_to"] == "trackio"


def test_report_to_tensorboard_logs_every_row(tmp_path, tiny_model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, rows = train(tmp_path, tiny_model_dir, "tensorboard", {})
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    by_step: dict = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            by_step.setdefault(e.step, {"step": e.step})[tag] = e.value
    got = [by_step[s] for s in sorted(by_step)]
    want = expected(rows)
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want):  # TensorBoard keeps float32
        assert set(g) == set(w) and all(g[k] == pytest.approx(float(v), rel=1e-6, abs=1e-30) for k, v in w.items())


def test_report_to_values_are_checked_by_name():
    assert trackers.parse("none") == [] and trackers.parse("wandb, tensorboard,wandb") == ["wandb", "tensorboard"]
    for bad in ("", "tensorbord", "none,wandb", ","):
        with pytest.raises(ValueError, match="expected none, or one or more of tensorboard, wandb, trackio"):
            trackers.parse(bad)


def test_a_resumed_run_continues_its_wandb_run_and_a_damaged_id_file_starts_a_new_one(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    out.mkdir()
    for t in trackers.open_trackers("wandb", out, {"steps": 4}, resume_step=0):
        t.log({"step": 1, "kl": 0.5})
        t.close()
    first = json.loads((out / "trackers.json").read_text())["wandb"]
    for t in trackers.open_trackers("wandb", out, {"steps": 4}, resume_step=1):
        assert t.run.id == first
        t.close()
    (out / "trackers.json").write_text("{not json")
    for t in trackers.open_trackers("wandb", out, {"steps": 4}, resume_step=1):
        assert t.run.id != first
        t.close()
    assert "trackers.json: not a JSON object of tracker run ids" in capsys.readouterr().err


def test_a_misspelt_tracker_is_a_one_line_error_before_any_work(tmp_path, capsys):
    from opct.cli import main

    code = main(["train", "--pairs", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "run"),
                 "--report-to", "tensorbord"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.strip() == ("opct: error: option --report-to 'tensorbord': expected none, or one or more of "
                           "tensorboard, wandb, trackio separated by commas")


def test_a_config_file_with_the_old_tensorboard_option_says_what_replaced_it(tmp_path, capsys):
    from opct.cli import main

    (tmp_path / "c.yaml").write_text("steps: 2\ntensorboard: false\n")
    code = main(["train", "--config", str(tmp_path / "c.yaml"), "--pairs", "x.jsonl", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path / 'c.yaml'}:2: option 'tensorboard' is now report_to" in err


def test_a_tracker_that_does_not_start_is_one_error_and_the_others_are_closed(tmp_path, monkeypatch):
    closed = []
    monkeypatch.setattr(trackers.TensorBoard, "close", lambda self: closed.append("tensorboard"))

    def no_login(*a, **k):
        raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")

    monkeypatch.setattr(trackers, "WandB", no_login)
    with pytest.raises(trackers.TrackerError) as e:
        trackers.open_trackers("tensorboard,wandb", tmp_path, {}, resume_step=0)
    assert str(e.value) == ("--report-to wandb: the tracker did not start (api_key not configured (no-tty)); W&B "
                            "runs without an account with WANDB_MODE=offline; or pass --report-to none")
    assert closed == ["tensorboard"]
