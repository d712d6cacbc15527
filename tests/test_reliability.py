"""Issue 17 at the command line, one test per case: the exit status, a message that names the file, line or option
and what is wrong, no traceback, and what is left on disk (nothing that looks finished, no litter).

Fault injection (kill -9, a full disk) is in train/test_faults.py; the older per-case tests are in test_cli.py and
train/test_train.py (the table in docs/reliability.md maps each case of the issue to its test)."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from opct.cli import main

GOOD = {"student": [{"role": "system", "content": "Say B."}, {"role": "user", "content": "Hi? I think B."}],
        "teacher": [{"role": "user", "content": "Hi?"}]}
SMALL = ["--prompts-per-step", "2", "--max-new-tokens", "4", "--lora-rank", "2", "--report-to", "none"]


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return code, cap.err, cap.out


@pytest.fixture
def pairs(tmp_path):
    p = tmp_path / "pairs.jsonl"
    p.write_text((json.dumps(GOOD) + "\n") * 3)
    return p


def train_args(model, pairs, out, *extra):
    return ["train", "--model", model, "--pairs", pairs, "--out", out, *SMALL, *extra]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_model_dir):
    """A 3-step run with checkpoints at steps 1 and 2, stopped before it finished (what a kill during step 3
    leaves); tests copy it (a run directory may move: --out is not compared on resume)."""
    d = tmp_path_factory.mktemp("stopped")
    p = d / "pairs.jsonl"
    p.write_text((json.dumps(GOOD) + "\n") * 3)
    out = d / "run"
    assert main([str(a) for a in train_args(tiny_model_dir, p, out, "--steps", "3", "--save-every", "1")]) == 0
    (out / "run.json").unlink()
    shutil.rmtree(out / "model")
    return out, p


def stopped_run(stopped, out):
    shutil.copytree(stopped[0], out)
    return out, stopped[1]


def looks_finished(out) -> bool:
    return (out / "run.json").exists() or (out / "model").exists()


# ---- security -------------------------------------------------------------------------------------------


def test_resume_refuses_a_planted_pickle_and_does_not_run_it(tmp_path, capsys, tiny_model_dir, stopped):
    from opct.data.io import sha256_file
    from opct.train.checkpoint import MANIFEST

    out, pairs = stopped_run(stopped, tmp_path / "run")
    shutil.rmtree(out / "checkpoints" / "step-000002")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ckpt = out / "checkpoints" / "step-000001"
    torch.save({"optimizer": Payload(), "scheduler": {}}, ckpt / "optim.pt")
    manifest = json.loads((ckpt / MANIFEST).read_text())  # the attacker makes the manifest match
    manifest["optim.pt"] = {"bytes": (ckpt / "optim.pt").stat().st_size, "sha256": sha256_file(ckpt / "optim.pt")}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "3", "--save-every", "1",
                                           "--resume"))
    assert code == 2 and f"{ckpt / 'optim.pt'}: refused to load" in err and "execute code" in err
    assert not marker.exists() and not looks_finished(out)


def test_a_model_that_ships_its_own_code_is_refused_not_run(tmp_path, capsys, tiny_model_dir):
    evil = tmp_path / "evil"
    shutil.copytree(tiny_model_dir, evil)
    cfg = json.loads((evil / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil.C", "AutoModelForCausalLM": "evil.M"})
    (evil / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "pwned"
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    code, err, _ = cli(capsys, "eval", "--model", evil, "--n-eval", "4")
    assert code == 2 and str(evil) in err and "trust_remote_code is off" in err
    assert not marker.exists()


# ---- failed training must not look like success -------------------------------------------------------------


def test_nonfinite_skip_skips_every_bad_update_and_says_so(tmp_path, capsys, tiny_model_dir, pairs):
    out = tmp_path / "run"
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "2", "--kl-coef", "1e39",
                                           "--nonfinite", "skip"))
    assert code == 0 and "the update was skipped (--nonfinite skip" in err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [1, 1]
    from safetensors.torch import load_file

    weights = load_file(str(out / "model" / "adapter_model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert all(not w.any() for k, w in weights.items() if "lora_B" in k)  # never updated: B is still zero
    assert json.loads((out / "run.json").read_text())["execution"]["warnings"] == ["skipped"]


def test_a_collapse_to_uniform_is_warned_about_and_recorded(tmp_path, capsys, tiny_model_dir, pairs):
    out = tmp_path / "run"
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "3", "--lr", "1e6"))
    assert code == 0
    assert "warning: step 2: the student's sampled tokens have probability 1/" in err
    assert "the gradient is zero while the loss is" in err
    warnings = json.loads((out / "run.json").read_text())["execution"]["warnings"]
    assert {"uniform", "no_gradient"} <= set(warnings)


# ---- values are validated before any work ---------------------------------------------------------------


@pytest.mark.parametrize("argv,expect", [
    (["train", "--loss", "topk", "--topk", "0"], "--topk must be >= 1, got 0"),
    (["train", "--kl-coef", "nan"], "--kl-coef must be a finite number"),
    (["train", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["train", "--steps", "0"], "--steps must be >= 1"),
    (["eval", "--n-eval", "0"], "--n-eval must be >= 1, got 0"),
    (["sft", "--micro-batch", "0"], "--micro-batch must be >= 1"),
])
def test_more_bad_values_are_rejected_before_any_work(tmp_path, capsys, argv, expect):
    out = tmp_path / "out"
    code, err, _ = cli(capsys, *argv, *(["--out", out] if argv[0] != "eval" else []))
    assert code == 2 and expect in err and not out.exists()


@pytest.mark.parametrize("targets,bad", [("nope", "nope"), ("q_proj,v_prj", "v_prj"), ("q_proj,", "")])
def test_an_unknown_lora_target_names_the_layers_there_are(tmp_path, capsys, tiny_model_dir, pairs, targets, bad):
    out = tmp_path / "out"
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--lora-targets", targets))
    assert code == 2 and f"--lora-targets: {bad!r} matches no linear layer" in err and "q_proj, up_proj" in err
    assert not out.exists()


def small_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("keep", [15, 200, -100])
def test_a_truncated_gguf_is_named(tmp_path, capsys, pairs, keep):
    data = small_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "model.gguf"
    cut.write_bytes(data[:keep])
    for cmd in (["eval", "--model", cut, "--n-eval", "4"], train_args(cut, pairs, tmp_path / "out")):
        code, err, _ = cli(capsys, *cmd)
        assert code == 2 and f"{cut}: " in err and "truncated" in err and "download it again" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "junk.gguf").write_bytes(b"<html>404</html>")
    code, err, _ = cli(capsys, "eval", "--model", tmp_path / "junk.gguf")
    assert code == 2 and "junk.gguf: not a GGUF file" in err


def spawn_train(model, pairs, out, steps=400):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "opct", *map(str, train_args(model, pairs, out, "--steps", steps,
                                                                                 "--save-every", "2",
                                                                                 "--threads", "1"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            # a shell that runs this in the background ignores SIGINT, and the child would inherit it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,says", [(signal.SIGINT, 130, "opct: interrupted"),
                                           (signal.SIGTERM, 143, "opct: stopped by SIGTERM")])
def test_ctrl_c_or_sigterm_stops_cleanly_and_resume_finishes(tmp_path, tiny_model_dir, pairs, sig, code, says):
    """A real `opct train` process gets the signal after its 3rd step: exit 130 (143 for SIGTERM), one line that
    says how to continue, nothing that looks finished, and --resume then completes the run."""
    out = tmp_path / "run"
    proc = spawn_train(tiny_model_dir, pairs, out)
    rows = out / "metrics.jsonl"
    deadline = time.time() + 120
    while not (rows.is_file() and len(rows.read_text().splitlines()) >= 3) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in err
    assert f"{says}; nothing was marked finished (no run.json); continue from the last checkpoint" in err
    assert not looks_finished(out) and [p.name for p in out.rglob(".*") if p.name != ".lock"] == []
    if sig == signal.SIGTERM:
        return
    done = len(rows.read_text().splitlines())
    r = subprocess.run([sys.executable, "-m", "opct", *map(str, train_args(
        tiny_model_dir, pairs, out, "--steps", done + 1, "--save-every", "2", "--threads", "1", "--resume"))],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "run.json").read_text())["steps"] == done + 1


# ---- resume at the edges --------------------------------------------------------------------------------


@pytest.mark.parametrize("change,expect", [
    (["--lora-rank", "4"], "--lora-rank 2 -> 4"),
    (["--lr", "0.01"], "--lr 0.0002 -> 0.01"),
    (["--model", "OTHER"], "--model "),
    (["--pairs", "OTHER"], "--pairs "),
    (["--steps", "1"], "beyond --steps 1"),
])
def test_resume_refuses_changed_settings(tmp_path, capsys, tiny_model_dir, stopped, change, expect):
    out, pairs = stopped_run(stopped, tmp_path / "run")
    other = tmp_path / "other"
    if "OTHER" in change:
        shutil.copytree(tiny_model_dir, other) if change[0] == "--model" else shutil.copy(pairs, other)
    args = train_args(tiny_model_dir, pairs, out, "--steps", "3", "--save-every", "1", "--resume")
    args += [other if a == "OTHER" else a for a in change]
    code, err, _ = cli(capsys, *args)
    assert code == 2 and str(out) in err and expect in err and not looks_finished(out)
    if expect.startswith("--"):
        assert "resume with the same values or start a new --out" in err


@pytest.mark.parametrize("recorded", ["policy", "auto"])
def test_an_sft_run_whose_config_yaml_has_the_old_sampler_fields_resumes(tmp_path, capsys, tiny_model_dir, pairs,
                                                                         recorded):
    """SFTConfig no longer has OPCT's student-sampler fields (config.StudentSampler); an SFT run stopped by an opct
    that recorded them in its config.yaml (`sampler: policy`, resolved, and the defaults of the others) resumes: the
    recorded fields the config no longer has are not compared. Its new config.yaml and run.json lack them, and a
    changed setting is still refused."""
    out = tmp_path / "sft"
    args = ["sft", "--model", tiny_model_dir, "--pairs", pairs, "--out", out, *SMALL, "--save-every", "1"]
    assert cli(capsys, *args, "--steps", "2")[0] == 0
    (out / "run.json").unlink()
    shutil.rmtree(out / "model")
    saved = out / "config.yaml"
    assert "sampler" not in saved.read_text()
    old = saved.read_text().replace("nonfinite:", f"sampler: {recorded}\nvllm_url: ''\nsampler_check_every: 1\n"
                                    "nonfinite:")
    saved.write_text(old)
    code, err, _ = cli(capsys, *args, "--steps", "3", "--resume", "--lr", "0.01")
    assert code == 2 and "--lr 0.0002 -> 0.01" in err and saved.read_text() == old
    code, err, _ = cli(capsys, *args, "--steps", "3", "--resume")
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((out / "run.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3] and "sampler" not in saved.read_text()
    assert not {"sampler", "vllm_url", "sampler_check_every"} & set(info["config"])
    assert info["execution"]["sampler_used"] == "policy" and "sampler_setting" not in info["execution"]


def test_a_directory_holding_only_a_lock_is_empty(tmp_path, capsys, tiny_model_dir, pairs):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").touch()  # a run killed right after taking its lock
    assert cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "1"))[0] == 0


def test_a_moved_run_directory_resumes(tmp_path, capsys, tiny_model_dir, stopped):
    out, pairs = stopped_run(stopped, tmp_path / "moved")
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "3", "--save-every", "1",
                                           "--resume"))
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and json.loads((out / "run.json").read_text())["steps"] == 3


@pytest.mark.parametrize("flip", [["--no-decode-huge-pages"], ["--no-lean-decoder", "--backend", "hf"],
                                  ["--threads", "1", "--keep-checkpoints", "3"]])
def test_a_resume_that_changes_only_where_and_how_fast_it_runs_is_accepted(tmp_path, capsys, tiny_model_dir,
                                                                           stopped, flip):
    out, pairs = stopped_run(stopped, tmp_path / "run")
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "3", "--save-every", "1",
                                           "--resume", *flip))
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_what_a_resume_may_change_is_derived_from_the_fields():
    from opct.config import CPU, ExecConfig, SFTConfig, TrainConfig
    from opct.options import resumable_fields

    speed = {f.name for f in dataclasses.fields(ExecConfig) if f.metadata["group"] == CPU}
    for cls in (TrainConfig, SFTConfig):
        may = resumable_fields(cls)
        assert speed <= may and {"decode_huge_pages", "device", "backend", "threads", "steps", "out"} <= may
        assert not may & {"model", "pairs", "lr", "lora_rank", "dtype", "seed", "loss", "temperature"}


def test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys, tiny_model_dir,
                                                                                 stopped):
    out, pairs = stopped_run(stopped, tmp_path / "run")
    f = out / "checkpoints" / "step-000002" / "optim.pt"
    f.write_bytes(f.read_bytes()[:100])
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "3", "--save-every", "1",
                                           "--resume"))
    assert code == 0 and f"warning: {f}: missing, truncated or changed since the checkpoint was written; trying " \
        "an older checkpoint" in err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # steps 2 and 3 recomputed from the step-1 checkpoint
    before = [json.loads(x) for x in (stopped[0] / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kl"], r["loss"]) for r in rows[:2]] == [(r["kl"], r["loss"]) for r in before[:2]]  # exact resume


def test_resume_of_a_finished_run_and_a_second_writer_are_refused(tmp_path, capsys, tiny_model_dir, pairs):
    from opct.train.loop import acquire_lock

    out = tmp_path / "run"
    assert cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "1"))[0] == 0
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "1", "--resume"))
    assert code == 2 and f"{out}: this run already finished (run.json)" in err
    busy = tmp_path / "busy"
    held = acquire_lock(busy)  # another process (flock locks are per open file, so this process counts too)
    try:
        code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, busy, "--steps", "1", "--resume"))
    finally:
        held.close()
    assert code == 2 and f"{busy}: another opct process is writing this directory" in err
    assert not looks_finished(busy)


# ---- provenance -----------------------------------------------------------------------------------------


def test_run_json_records_versions_device_and_the_git_commit(tmp_path, capsys, tiny_model_dir, pairs):
    from opct.provenance import source_root

    out = tmp_path / "run"
    assert cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "1"))[0] == 0
    ex = json.loads((out / "run.json").read_text())["execution"]
    assert {"opct", "torch", "transformers", "peft", "python", "device", "backend", "git"} <= set(ex)
    root = source_root()
    if root is None:
        assert ex["git"] is None
    else:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert ex["git"]["commit"] == head.stdout.strip() and isinstance(ex["git"]["dirty"], bool)


def test_git_commit_is_none_outside_a_checkout_and_the_head_inside_one(tmp_path):
    from opct.provenance import git_commit

    assert git_commit(tmp_path) is None
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_commit(repo) == {"commit": head, "dirty": False}
    (repo / "f").write_text("y")
    assert git_commit(repo)["dirty"] is True
    assert git_commit(repo, ("src",))["dirty"] is False  # changes outside the paths asked about


def test_version_flag(capsys):
    from opct import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"opct {__version__}")


@pytest.mark.parametrize("name,base", [("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                       ("someorg/some-model", "someorg/some-model")])
def test_adapters_name_their_base_by_a_name_that_loads_elsewhere(tmp_path, name, base):
    from opct.models import SMOLLM2, adapter_base
    from opct.train.loop import record_base_model

    d = tmp_path / "model"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/root/.cache/opct/models/x"}))
    record_base_model(d, name)
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    if name == SMOLLM2["alias"]:
        info = json.loads((d / "opct-base.json").read_text())
        assert info["alias"] == name and info["sha256"] == SMOLLM2["sha256"] and adapter_base(d) == name
    else:
        assert not (d / "opct-base.json").exists() and adapter_base(d) == base


def test_a_trained_adapter_dir_is_what_eval_loads(tmp_path, capsys, tiny_model_dir, pairs):
    out = tmp_path / "run"
    assert cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "2", "--save-every", "1"))[0] == 0
    for f in [out / "model", *(out / "model").iterdir(), *(out / "checkpoints").rglob("*")]:
        assert f.stat().st_mode & 0o777 == (0o755 if f.is_dir() else 0o644), f  # readable on a shared machine
    base = json.loads((out / "model" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(tiny_model_dir)  # a local path stays as typed
    code, err, stdout = cli(capsys, "eval", "--model", out / "model", "--n-eval", "4", "--cued-n", "2")
    assert code == 0 and "clean_accuracy" in stdout


# ---- further bad input (the sweep in docs/reliability.md) ---------------------------------------------------


@pytest.mark.parametrize("text,expect", [
    (b"lr: 1e-4\nstpes: 3\n", "c.yaml:2: unknown option 'stpes' (did you mean 'steps'?)"),
    (b"steps: 2\nlr: 1e-4\nsteps: 3\n", "c.yaml:3: option 'steps' is given twice (first on line 1)"),
    (b"steps: 2\n# caf\xe9\n", "c.yaml:2: not UTF-8 text"),
    (b"steps: 2\nlr: [1\n", "c.yaml:3: invalid YAML (expected ',' or ']'"),
    (b"1: 2\n", "c.yaml:1: option names are words, got 1"),
    (b"save_every: 2.5\n", "c.yaml:1: option 'save_every' must be int, got 2.5"),
    (b"- steps: 2\n", "c.yaml: expected a mapping of option: value"),
])
def test_bad_config_files(tmp_path, capsys, text, expect):
    (tmp_path / "c.yaml").write_bytes(text)
    code, err, _ = cli(capsys, "train", "--config", tmp_path / "c.yaml", "--out", tmp_path / "out")
    assert code == 2 and expect in err and not (tmp_path / "out").exists()


def test_config_files_say_what_users_write(tmp_path):
    import argparse

    from opct import config, options

    y = tmp_path / "c.yaml"
    y.write_bytes(b"\xef\xbb\xbfsteps: 1e3\nsave_every: 20.0\nlr: 1e-4\n")  # a byte-order mark, YAML 1.1 numbers
    p = argparse.ArgumentParser()
    options.add_arguments(p, config.TrainConfig)
    cfg = config.build(config.TrainConfig, p.parse_args(["--config", str(y)]))
    assert (cfg.steps, cfg.save_every, cfg.lr) == (1000, 20, 1e-4)


def test_an_unreadable_or_directory_config(tmp_path, capsys, monkeypatch):
    code, err, _ = cli(capsys, "train", "--config", tmp_path)
    assert code == 2 and f"{tmp_path}: is a directory, not a config file" in err
    y = tmp_path / "c.yaml"
    y.write_text("steps: 1\n")

    def denied(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", denied)
    code, err, _ = cli(capsys, "train", "--config", y)
    assert code == 2 and f"{y}: cannot read it (Permission denied)" in err


def test_pairs_path_that_is_a_directory_and_a_byte_order_mark(tmp_path, capsys, tiny_model_dir):
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, tmp_path, tmp_path / "out"))
    assert code == 2 and f"{tmp_path}: is a directory, not a pairs file" in err
    from opct.data.pairs import load_pairs

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")  # Notepad's UTF-8
    assert len(load_pairs(bom)) == 1


@pytest.mark.parametrize("name,content,says", [
    ("ctm_are_you_sure.jsonl", None, ":2: field 'bias_type' is 'are_you_sure': its 'biased_messages' are staged turns"),
    ("ctm_families.jsonl", None, ":1: a CTM prompt-family row"),
    ("ctm_bct_targets.jsonl", None, ":1: a CTM BCT target row"),
    ("attacks.csv", b'prefill\n"Sure! "\n', ":1: missing column 'prompt': a CSV of prefills without prompts is"),
    ("prefills.csv", b'prompt,prefill\r\n"a\r\nb",Sure\r\nx,"open\r\ny,Sure\r\n',
     ":4: malformed CSV record (unexpected end of data, at line 5: a quote left open?)"),
])
def test_a_peers_file_that_is_not_pairs_is_one_line_saying_what_it_is(tmp_path, capsys, tiny_model_dir, name, content,
                                                                      says):
    src = Path(__file__).parent / "fixtures" / "formats" / name
    if content is not None:
        src = tmp_path / name
        src.write_bytes(content)
    out = tmp_path / "out"
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, src, out))
    assert code == 2 and f"opct: error: {src}{says}" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_outputs_that_are_files_or_directories(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, err, _ = cli(capsys, "eval", "--out", tmp_path)
    assert code == 2 and "is a directory; give a file name for the JSON results" in err
    code, err, _ = cli(capsys, "eval", "--out", tmp_path / "afile" / "r.json")
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a directory" in err
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        code, err, _ = cli(capsys, "demo", "--out", out)
        assert code == 2 and f"--out {out}: cannot be used as the output directory: {tmp_path / 'afile'} is a file" \
            in err


def test_eval_on_directories_that_are_not_models(tmp_path, capsys, tiny_model_dir, stopped):
    run, _ = stopped
    for d, expect in [(tmp_path, "not a model directory (no config.json or adapter_config.json)"),
                      (run, f"an opct run keeps its trained model in {run / 'model'}"),
                      (run / "checkpoints" / "step-000001", "this is a training checkpoint")]:
        code, err, _ = cli(capsys, "eval", "--model", d, "--n-eval", "4")
        assert code == 2 and str(d) in err and expect in err


def test_empty_names_and_a_file_that_is_not_a_model(tmp_path, capsys, pairs):
    assert cli(capsys, "eval", "--model", "")[1].endswith("option --model must name a model, got ''\n")
    assert "option --out must name an output directory, got ' '" in cli(capsys, "train", "--out", " ")[1]
    code, err, _ = cli(capsys, "eval", "--model", pairs)
    assert code == 2 and f"{pairs}: is a file but not a .gguf model" in err


def test_an_adapter_whose_base_is_gone(tmp_path, capsys, tiny_model_dir, pairs):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    out = tmp_path / "run"
    assert cli(capsys, *train_args(base, pairs, out, "--steps", "1"))[0] == 0
    shutil.rmtree(base)
    code, err, _ = cli(capsys, "eval", "--model", out / "model", "--n-eval", "4")
    assert code == 2 and f"the adapter's base model {base} (base_model_name_or_path) does not exist" in err


def test_missing_optional_pieces_and_unknown_tasks(tmp_path, capsys, monkeypatch, tiny_model_dir, pairs):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, tmp_path / "out", "--sampler", "vllm"))
    assert code == 2 and not (tmp_path / "out").exists()
    assert "--sampler vllm needs vllm, which is not installed here: pip install 'opct[vllm]'" in err
    monkeypatch.undo()
    # (an unknown task name is the same TaskError, raised once lm-eval has indexed its tasks: ~15 s, not run here)
    code, err, _ = cli(capsys, "eval", "--tasks", " , ", "--model", "x/y")
    assert code == 2 and "--tasks ' , ': give a suite" in err


def test_report_on_a_broken_results_file(tmp_path, capsys):
    (tmp_path / "results.json").write_text('{"methods": \n')
    code, err, _ = cli(capsys, "report", tmp_path)
    assert code == 2 and f"{tmp_path / 'results.json'}:2: not valid JSON" in err
    (tmp_path / "results.json").write_text("[]")
    code, err, _ = cli(capsys, "report", tmp_path)
    assert code == 2 and "expected a JSON object" in err


def test_warnings_go_to_stderr_and_a_resume_without_checkpoint_says_so(tmp_path, capsys, tiny_model_dir, pairs):
    out = tmp_path / "run"
    code, err, stdout = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "1", "--resume"))
    assert code == 0 and f"opct: {out}: no checkpoint yet; starting from step 0" in err and "no checkpoint" \
        not in stdout


@pytest.mark.parametrize("damage,expect", [
    ("steps: [1\n", "config.yaml:2: invalid YAML"),
    ("- a list\n", "config.yaml: expected a mapping of option: value"),
])
def test_a_damaged_config_yaml_on_resume_is_one_line_naming_it(tmp_path, capsys, tiny_model_dir, stopped, damage,
                                                              expect):
    out, pairs = stopped_run(stopped, tmp_path / "run")
    (out / "config.yaml").write_text(damage)
    code, err, _ = cli(capsys, *train_args(tiny_model_dir, pairs, out, "--steps", "3", "--resume"))
    assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("damage,expect", [
    ('[[1, 2], [3]]\n{"not": "a pair"}\n', "targets.jsonl:2: not a [student token ids, target token ids] pair"),
    ("[[1, 2], [3", "targets.jsonl:1: damaged"),
])
def test_damaged_sft_targets_on_resume_are_one_line_naming_them(tmp_path, capsys, tiny_model_dir, pairs, damage,
                                                               expect):
    out = tmp_path / "sft"
    args = ["sft", "--model", tiny_model_dir, "--pairs", pairs, "--out", out, *SMALL, "--steps", "1"]
    out.mkdir()
    (out / "targets.jsonl").write_text(damage)
    code, err, _ = cli(capsys, *args, "--resume")
    assert code == 2 and expect in err and "delete it and --resume makes the targets again" in err, err
    assert not looks_finished(out)


def test_a_damaged_demo_stage_on_resume_is_one_line_naming_it(tmp_path, capsys, tiny_model_dir, monkeypatch):
    import opct.algo.opct

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(opct.algo.opct, "train", interrupted)
    out = tmp_path / "demo"
    flags = ["--n-train", "6", "--n-eval", "4", "--cued-n", "2", "--steps", "1", "--methods", "opct", "--probe-every",
             "0", "--capability", "", "--threads", "1"]
    assert cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags)[0] == 130
    monkeypatch.undo()
    stage = out / "stages" / "eval_base.json"
    stage.write_text('{"sycophancy_rate": ')
    code, err, _ = cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags, "--resume")
    assert code == 2 and f"{stage}: damaged" in err and "delete it and --resume runs that stage again" in err
    stage.write_text("[1, 2]")
    code, err, _ = cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags, "--resume")
    assert code == 2 and f"{stage}: not a stage's result" in err
    stage.unlink()
    assert cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags, "--resume")[0] == 0


def test_an_interrupted_demo_says_so_and_resume_keeps_what_finished(tmp_path, capsys, tiny_model_dir, monkeypatch):
    """Ctrl-C while OPCT trains: exit 130 and how to go on; the same command refuses the directory without
    --resume; with it, the base evaluation is kept (not run again) and the results equal an uninterrupted demo's."""
    import opct.algo.opct

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(opct.algo.opct, "train", interrupted)  # Ctrl-C while OPCT trains
    out = tmp_path / "demo"
    flags = ["--n-train", "6", "--n-eval", "4", "--cued-n", "2", "--steps", "1", "--methods", "opct", "--probe-every",
             "0", "--capability", "", "--threads", "1"]
    code, err, _ = cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags)
    assert code == 130 and "opct: interrupted; the demo did not finish (no results.json): the same command with " \
        "--resume continues it" in err
    assert err.replace("\r", "\n").strip().splitlines()[-1].startswith("opct: interrupted")  # after the demo's bar
    assert not (out / "results.json").exists()
    kept = (out / "stages" / "eval_base.json").stat().st_mtime_ns
    monkeypatch.undo()
    assert cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags)[0] == 2  # --resume needed
    assert cli(capsys, "demo", "--model", tiny_model_dir, "--out", out, *flags, "--resume")[0] == 0
    assert (out / "stages" / "eval_base.json").stat().st_mtime_ns == kept
    whole = tmp_path / "whole"
    assert cli(capsys, "demo", "--model", tiny_model_dir, "--out", whole, *flags)[0] == 0
    continued, uninterrupted = (json.loads((d / "results.json").read_text()) for d in (out, whole))
    assert continued["kept_from_before"] == ["eval_base"] and "eval_base" not in continued["timings"]
    assert continued["runs"] == uninterrupted["runs"] and "kept_from_before" not in uninterrupted


@pytest.mark.parametrize("tracker,install", [("tensorboard", "pip install tensorboard"),
                                             ("wandb", "pip install 'opct[wandb]'"),
                                             ("trackio", "pip install 'opct[trackio]'")])
def test_a_tracker_not_installed_stops_before_the_model_loads(capsys, monkeypatch, tmp_path, pairs, tracker, install):
    """--report-to TRACKER (tensorboard is the default) whose package is missing (a venv with opct installed
    --no-deps, or without the tracker's extra): the run stops at once, exit 2, with one line naming what to install
    and --report-to none; no model is loaded, nothing written."""
    import opct.train.loop as loop

    monkeypatch.setitem(sys.modules, tracker, None)  # importlib.util.find_spec now says it is not installed
    loaded = []
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("model loaded"))
    out = tmp_path / "run"
    code, err, _ = cli(capsys, *train_args("smollm2-135m-instruct", pairs, out), "--report-to", tracker)
    assert code == 2 and f"--report-to {tracker}" in err and install in err and "--report-to none" in err
    assert len(err.strip().splitlines()) == 1
    assert not loaded and not out.exists()


def test_a_vllm_url_with_no_server_is_named_before_the_model_loads(capsys, monkeypatch, tmp_path, pairs):
    """--sampler vllm-server --vllm-url URL where nothing answers: exit 2 at once, naming the URL and the reason
    (it was a bare "<urlopen error ...>" and exit 1 at the first step, after loading the model)."""
    import socket

    import opct.train.loop as loop

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    out = tmp_path / "run"
    code, err, _ = cli(capsys, *train_args("smollm2-135m-instruct", pairs, out, "--sampler", "vllm-server",
                                           "--vllm-url", f"http://127.0.0.1:{port}"))
    assert code == 2 and f"--vllm-url http://127.0.0.1:{port}: no vLLM server answers there" in err
    assert not out.exists()


@pytest.mark.parametrize("command,axis", [("eval", "safety"), ("eval", "jailbreak"), ("demo", "jailbreak")])
def test_a_judge_endpoint_that_does_not_answer_is_named_before_any_model_loads(capsys, monkeypatch, tmp_path,
                                                                             command, axis):
    """--judge llm with a --judge-url where nothing answers (or none at all): exit 2 at once, naming the options;
    it was a traceback (exit 1) after the model had loaded and generated every answer."""
    import socket

    import opct.backends
    import opct.demo

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    monkeypatch.setattr(opct.backends, "inference_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(opct.demo, "train_sft", lambda *a, **k: pytest.fail("training started"), raising=False)
    out = tmp_path / "out"
    args = [command, "--axis", axis, "--judge", "llm", "--judge-model", "j", "--out",
            out / ("r.json" if command == "eval" else "demo")]
    code, err, _ = cli(capsys, *args, "--judge-url", url)
    assert code == 2 and f"--judge-url {url} --judge-model j: the judge endpoint does not answer" in err
    code, err, _ = cli(capsys, *args)
    assert code == 2 and "--judge-url" in err
    assert not out.exists() or not any(out.rglob("*.json"))


def test_a_judge_endpoint_that_stops_mid_run_is_one_line_and_exit_1(capsys, monkeypatch):
    import opct.evaluate
    from opct.judges.endpoint import EndpointError

    def dead(cfg):
        raise EndpointError("http://127.0.0.1:1/v1/chat/completions: no completion after 4 attempts; last error: x")

    monkeypatch.setattr(opct.evaluate, "run_eval", dead)
    code, err, _ = cli(capsys, "eval", "--axis", "safety")
    assert code == 1 and "no completion after 4 attempts" in err and "no results were written" in err


def test_a_local_judge_without_a_model_or_with_a_missing_one_is_named_before_any_model_loads(capsys, monkeypatch,
                                                                                           tmp_path):
    import opct.backends

    monkeypatch.setattr(opct.backends, "inference_model", lambda *a, **k: pytest.fail("model loaded"))
    code, err, _ = cli(capsys, "eval", "--axis", "safety", "--judge", "local")
    assert code == 2 and "--judge local needs --judge-model" in err
    code, err, _ = cli(capsys, "eval", "--axis", "safety", "--judge", "local", "--judge-model", tmp_path / "nope")
    assert code == 2 and f"{tmp_path / 'nope'}: no such model directory" in err


def test_a_demo_with_an_unknown_capability_task_stops_before_any_model_loads(capsys, monkeypatch, tmp_path):
    """--capability runs after all the demo's training: an unknown task name used to stop it there, minutes in.
    (lm-eval's index is faked here: the real one takes ~15 s to build.)"""
    import types

    import opct.backends
    from opct.evals import capability

    monkeypatch.setattr(capability, "task_manager", lambda offline, tasks: types.SimpleNamespace(all_tasks={"piqa"}))
    monkeypatch.setattr(opct.backends, "inference_model", lambda *a, **k: pytest.fail("model loaded"))
    code, err, _ = cli(capsys, "demo", "--capability", "piqa,nosuchtask", "--out", tmp_path / "demo")
    assert code == 2 and "--capability: unknown lm-eval task(s) ['nosuchtask']" in err
    assert not (tmp_path / "demo").exists()


# ---- issue 63: every input checked before any work, every output complete or absent ----------------------------


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading any model fails the test: what these cases refuse must be refused before."""
    import opct.models
    import opct.train.loop as loop

    def fail(*a, **k):
        pytest.fail("a model was loaded")
    monkeypatch.setattr(opct.models, "load_model", fail)
    monkeypatch.setattr(loop, "load_model", fail)


def test_a_tasks_eval_whose_results_name_has_no_suffix_is_refused_at_once(tmp_path, capsys, no_model_loads):
    """`opct eval --tasks ... --out runs/cap`: the samples went into a directory of that very name and the results
    could not be written after every task had run; now refused at once, nothing made."""
    out = tmp_path / "runs" / "cap"
    code, err, _ = cli(capsys, "eval", "--tasks", "arc_easy,gsm8k", "--limit", "20", "--out", out)
    assert code == 2 and err.strip() == (f"opct: error: --out {out}: name the results file with a suffix, e.g. "
                                         f"{out}.json: the per-example samples go to the directory of its name "
                                         f"without the suffix ({out}/)")
    assert not (tmp_path / "runs").exists()


def test_a_tasks_eval_whose_samples_directory_holds_other_files_is_refused(tmp_path, capsys, no_model_loads):
    (tmp_path / "cap").mkdir()
    (tmp_path / "cap" / "notes.txt").write_text("mine")
    code, err, _ = cli(capsys, "eval", "--tasks", "arc_easy", "--out", tmp_path / "cap.json")
    assert code == 2 and f"its per-example samples go to {tmp_path / 'cap'}/, which holds other files than an " \
                         "earlier run's samples (notes.txt); choose another --out" in err
    (tmp_path / "cap.samples.jsonl").mkdir()
    code, err, _ = cli(capsys, "eval", "--out", tmp_path / "cap.json")
    assert code == 2 and f"its per-example samples go to {tmp_path / 'cap.samples.jsonl'}, which is a directory" in err
    assert (tmp_path / "cap" / "notes.txt").read_text() == "mine" and not (tmp_path / "cap.json").exists()


@pytest.mark.parametrize("command", ["train", "eval", "demo"])
def test_a_chat_template_option_opct_itself_passes_is_refused(tmp_path, capsys, pairs, no_model_loads, command):
    argv = {"train": train_args("x", pairs, tmp_path / "run"), "eval": ["eval"],
            "demo": ["demo", "--out", tmp_path / "demo"]}[command]
    code, err, _ = cli(capsys, *argv, "--chat-template-kwargs", '{"enable_thinking": true, "add_generation_prompt": 0}')
    assert code == 2 and "option --chat-template-kwargs sets add_generation_prompt, which opct itself passes to the " \
                         "chat template" in err
    assert len(err.strip().splitlines()) == 1


def test_a_chat_template_that_refuses_an_option_names_the_option(tmp_path, capsys, pairs):
    """A value only the template can judge (it raises on it): the run stops before its first step, one line
    naming --chat-template-kwargs and the template's own words."""
    from tests.conftest import make_tiny_model

    template = ("{% if strict %}{{ raise_exception('strict mode takes a single user turn') }}{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    model = make_tiny_model(tmp_path / "strict", chat_template=template)
    out = tmp_path / "run"
    code, err, _ = cli(capsys, *train_args(model, pairs, out, "--steps", "1"), "--chat-template-kwargs",
                       '{"strict": true}')
    assert code == 2 and err.strip().splitlines()[-1] == ('opct: error: --chat-template-kwargs {"strict": true}: the chat '
                                                          f"template of {str(model)!r} refused it (strict mode takes a "
                                                          "single user turn)")
    assert not looks_finished(out)


@pytest.mark.parametrize("argv,says", [
    (["train", "--seed", "-1"], "option --seed must be in [0, 4294967295], got -1"),
    (["eval", "--seed", str(2 ** 32)], f"option --seed must be in [0, 4294967295], got {2 ** 32}"),
    (["demo", "--seed", str(2 ** 32 - 1), "--seeds", "2"], "option --seed must be in [0, 4294967295] with its --seeds "
     "2 (the last training seed is --seed + 1), got 4294967295"),
    (["eval", "--tasks", "arc_easy", "--limit", "-1"], "option --limit must be >= 0, got -1"),
])
def test_values_a_library_downstream_would_refuse_are_refused_first(capsys, no_model_loads, argv, says):
    """A seed numpy's generator refuses (its seeds are 0 .. 2**32 - 1; a demo's last training seed too) and a task
    limit lm-eval refuses: these were tracebacks after the model had loaded."""
    code, err, _ = cli(capsys, *argv)
    assert code == 2 and err.strip() == f"opct: error: {says}"


@pytest.mark.parametrize("argv", [["eval", "--eval-engine", "vllm"], ["eval", "--tasks", "arc_easy",
                                                                         "--eval-engine", "vllm"],
                                  ["demo", "--eval-engine", "vllm"], ["demo", "--sampler", "vllm"]])
def test_an_engine_that_is_not_installed_is_named_before_any_model_loads(capsys, monkeypatch, tmp_path,
                                                                         no_model_loads, argv):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    code, err, _ = cli(capsys, *argv, *(["--out", tmp_path / "demo"] if argv[0] == "demo" else []))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{argv[-2]} vllm needs vllm, which is not installed here: pip install 'opct[vllm]'" in err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("argv", [["eval", "--axis", "sycophancy"], ["demo"]])
def test_think_tags_not_of_the_model_stop_an_evaluation_before_its_policy_or_vllm_engine(capsys, monkeypatch,
                                                                                       tmp_path, tiny_model_dir,
                                                                                       argv):
    """`opct eval` / `opct demo` with --eval-engine vllm and --think-tags that are not tokens of the model: the
    evaluated model's chat format is built from its tokenizer before its policy and its vLLM engine (after the
    ChatFormat change they were made first). Without vLLM here: the engine's maker and make_policy only record."""
    import opct.backends
    import opct.backends.vllm as vllm_backend
    import opct.extras

    made = []

    class StandIn:  # a policy or an engine that was made, and closes
        model, pad_id, eos_ids, device = None, 0, set(), "cpu"

        def __init__(self, what, tok=None):
            made.append(what)
            self.tok = tok

        def close(self):
            pass

    monkeypatch.setattr(opct.extras, "require", lambda *a, **k: None)  # as if vllm were installed
    monkeypatch.setattr(vllm_backend, "inference_sampler", lambda *a, **k: StandIn("vllm engine"))
    monkeypatch.setattr(opct.backends, "make_policy", lambda backend, model, tok, *a, **k: StandIn("policy", tok))
    out = ["--out", tmp_path / ("demo" if argv[0] == "demo" else "eval.json")]
    code, err, _ = cli(capsys, *argv, "--model", tiny_model_dir, "--device", "cpu", "--eval-engine", "vllm",
                       "--think-tags", "<think>,</think>", *out)
    assert code == 2 and "<think> and </think> are not one token of this tokenizer" in err.strip().splitlines()[-1]
    assert made == []
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "demo" / "results.json").exists()


def test_a_demos_tracker_that_is_not_installed_is_named_before_any_model_loads(capsys, monkeypatch, tmp_path,
                                                                              no_model_loads):
    """docs/install.md promises it: a demo with --report-to wandb where wandb is missing stopped after loading the
    model and evaluating base, at its first training run; now at once."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    code, err, _ = cli(capsys, "demo", "--out", tmp_path / "demo", "--report-to", "wandb")
    assert code == 2 and "--report-to wandb needs wandb" in err and not (tmp_path / "demo").exists()


@pytest.mark.parametrize("argv", [["demo", "--vllm-sleep", "1"], ["train", "--vllm-sleep", "2", "--sampler", "policy"]])
def test_vllm_sleep_where_no_engine_sleeps_is_refused_not_ignored(capsys, tmp_path, pairs, no_model_loads, argv):
    """--vllm-sleep with the policy sampler, or on a CPU: it was ignored without a word (the demo, a policy
    sampler) or refused after the model loaded."""
    run = (["demo", "--out", tmp_path / "demo"] if argv[0] == "demo"
           else train_args("smollm2-135m-instruct", pairs, tmp_path / "run"))
    code, err, _ = cli(capsys, *run, *argv[1:])
    assert code == 2 and f"--vllm-sleep {argv[2]}: vLLM's sleep mode needs --sampler vllm (an in-process engine) on " \
                         "a CUDA device" in err
    assert not (tmp_path / "demo").exists() and not (tmp_path / "run").exists()


def sycophancy_eval(model, out, *extra):
    return ["eval", "--axis", "sycophancy", "--model", model, "--n-train", "4", "--n-eval", "6", "--cued-n", "4",
            "--shift-n", "4", "--out", out, *extra]


def test_an_eval_writes_its_files_as_one_unit_and_never_reads_an_earlier_runs(tmp_path, capsys, tiny_model_dir):
    """`opct eval --out X.json` twice, the second run without the shifted splits: its samples, Inspect log and
    result are the second run's alone (the first run's X.samples.shifted.jsonl was taken into the second's Inspect
    log); no staging directory is left."""
    out = tmp_path / "X.json"
    assert cli(capsys, *sycophancy_eval(tiny_model_dir, out))[0] == 0
    assert (tmp_path / "X.samples.shifted.jsonl").is_file()
    assert cli(capsys, *sycophancy_eval(tiny_model_dir, out, "--shift-source", ""))[0] == 0
    assert not (tmp_path / "X.samples.shifted.jsonl").exists()
    rows = (tmp_path / "X.samples.jsonl").read_text().splitlines()
    (log,) = tmp_path.glob("*_sycophancy_X_*.json")
    assert len(json.loads(log.read_text())["samples"]) == len(rows)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_eval_that_fails_at_its_end_leaves_the_earlier_complete_run_as_it_was(tmp_path, capsys, monkeypatch,
                                                                                tiny_model_dir):
    """A failure while the last file is written (here the Inspect log: a full disk): exit 1, and on disk the earlier
    run's result, samples and log unchanged, none of this run's, no staging directory; the message says what
    failed and nothing it says contradicts the disk."""
    import opct.inspect_log

    out = tmp_path / "X.json"
    assert cli(capsys, *sycophancy_eval(tiny_model_dir, out))[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full(path, *a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(opct.inspect_log, "write_json", full)
    code, err, _ = cli(capsys, *sycophancy_eval(tiny_model_dir, out, "--seed", "1"))
    assert code == 1 and err.strip().splitlines()[-1] == ("opct: error: [Errno 28] No space left on device; no results "
                                                          "were written") and err.count("opct: error") == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
