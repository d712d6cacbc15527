"""`opct train` on bad input: a clear message naming file:line and field, exit status 2, nothing half-written."""

import json
import os

import pytest

from opct.cli import main
from opct.experiment import evaluation

GOOD = {"student": [{"role": "user", "content": "Hi (B)?"}], "teacher": [{"role": "user", "content": "Hi?"}]}


def run(capsys, *argv):
    code = main(["train", *argv])
    return code, capsys.readouterr().err


def write_pairs(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("lines,expect", [
    ([GOOD, '{"student": [}'], ":2: malformed JSON"),
    ([{"teacher": GOOD["teacher"]}], ":1: missing field 'student'"),
    ([{"student": [], "teacher": GOOD["teacher"]}], ":1: field 'student' must be a non-empty list"),
    ([{"student": GOOD["student"], "teacher": [{"role": "critic", "content": "x"}]}], ":1: field 'teacher[0].role'"),
    ([], "empty"),
    ([GOOD, {"student": [{"role": "user", "content": "word " * 300}], "teacher": GOOD["teacher"]}],
     ":2: prompt is"),
])
def test_bad_pairs(tmp_path, capsys, tiny_model_dir, lines, expect):
    pairs = write_pairs(tmp_path / "pairs.jsonl", lines)
    out = tmp_path / "out"
    code, err = run(capsys, "--model", str(tiny_model_dir), "--pairs", str(pairs), "--out", str(out), "--steps", "1")
    assert code == 2
    assert "opct: error:" in err and str(pairs) in err and expect in err
    assert not out.exists()


def test_unknown_model(tmp_path, capsys):
    pairs = write_pairs(tmp_path / "pairs.jsonl", [GOOD])
    out = tmp_path / "out"
    code, err = run(capsys, "--model", str(tmp_path / "no-such-model"), "--pairs", str(pairs), "--out", str(out))
    assert code == 2 and "no-such-model" in err and "--model takes" in err
    assert not out.exists()


def test_missing_pairs_file(tmp_path, capsys):
    code, err = run(capsys, "--pairs", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"))
    assert code == 2 and "nope.jsonl: no such file" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_dir_as_user(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    code, err = run(capsys, "--pairs", str(write_pairs(tmp_path / "p.jsonl", [GOOD])), "--out", str(ro / "out"))
    assert code == 2 and "not writable" in err


def test_out_dir_under_a_file(tmp_path, capsys, tiny_model_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run(capsys, "--model", str(tiny_model_dir), "--pairs", str(write_pairs(tmp_path / "p.jsonl", [GOOD])),
                    "--out", str(blocker / "out"))
    assert code == 2 and f"{blocker} is not a directory" in err


def test_bad_option_value(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: many\n")
    code, err = run(capsys, "--config", str(cfg))
    assert code == 2 and "c.yaml:1: option 'steps' must be int" in err


def test_help_lists_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0
    for needle in ("--lora-rank", "(default: 32)", "--loss", "(default: sampled)", "--resume", "--max-new-tokens"):
        assert needle in text


TRAINING = ("--prefill-scoring", "--unpadded-prompts", "--unpadded-scoring", "--lora-node", "--low-memory-norms",
            "--decode-dtype")
STUDENT_SAMPLING = ("--prefill-reuse", "--teacher-prefix-cache", "--merged-decode")
SAMPLER = ("--sampler", "--vllm-url", "--sampler-check-every")
ENGINE = ("--vllm-dtype", "--vllm-kv-cache-gib", "--vllm-gpu-memory")  # any vLLM engine's: a sampler's, an eval's


def test_each_command_offers_only_the_settings_that_apply_to_it(tmp_path, capsys):
    helps = {}
    for cmd in ("train", "sft", "demo", "eval"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        helps[cmd] = capsys.readouterr().out
    offers = {cmd: {f for f in TRAINING + STUDENT_SAMPLING + SAMPLER + ENGINE if f + " " in text or f + "," in text}
              for cmd, text in helps.items()}
    assert offers["train"] == set(TRAINING + STUDENT_SAMPLING + SAMPLER + ENGINE)
    # the demo's OPCT runs take --sampler (auto, policy or an in-process vllm engine: no server, no sync-check
    # setting of their own), its engine settings apply
    assert offers["demo"] == set(TRAINING + STUDENT_SAMPLING + ENGINE + ("--sampler",))
    assert offers["sft"] == set(TRAINING)  # SFT's targets come from the frozen model, never the student
    assert offers["eval"] == set(ENGINE)  # the evaluation's own engine (--eval-engine)
    assert "--lean-decoder" in helps["eval"] and "--cpu-gemm" in helps["eval"]  # how the eval itself runs
    assert "--steps N" in helps["train"] and "--lr FLOAT" in helps["train"] and " V " not in helps["train"]
    cfg = tmp_path / "e.yaml"
    cfg.write_text("axis: sycophancy\nprefill_reuse: false\n")
    assert main(["eval", "--config", str(cfg)]) == 2
    assert "e.yaml:2: option 'prefill_reuse' does not apply to opct eval (it applies to opct train, opct demo)" in \
        capsys.readouterr().err
    # OPCT's student-sampler options are opct train's (config.StudentSampler): an sft config file naming one is
    # refused as another command's, not as an unknown option
    for name, value in (("sampler", "vllm"), ("vllm_url", "http://x"), ("sampler_check_every", 2)):
        cfg.write_text(f"steps: 2\n{name}: {value}\n")
        assert main(["sft", "--config", str(cfg)]) == 2
        assert f"e.yaml:2: option {name!r} does not apply to opct sft (it applies to opct train)" in \
            capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["eval", "--no-prefill-reuse"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["sft", "--sampler", "vllm"])
    assert e.value.code == 2


def test_train_cli_end_to_end(tmp_path, capsys, tiny_model_dir):
    pairs = write_pairs(tmp_path / "p.jsonl", [GOOD] * 3)
    out = tmp_path / "out"
    code, _ = run(capsys, "--model", str(tiny_model_dir), "--pairs", str(pairs), "--out", str(out), "--steps", "2",
                  "--prompts-per-step", "2", "--max-new-tokens", "4", "--lora-rank", "2", "--report-to", "none")
    assert code == 0 and (out / "run.json").is_file() and (out / "model" / "adapter_config.json").is_file()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    need = {"kl", "logp_student", "logp_teacher", "response_len", "time_sample", "time_teacher", "time_student",
            "tokens_per_s", "peak_mem_mb"}
    assert [r["step"] for r in rows] == [1, 2] and need <= set(rows[0])


@pytest.mark.parametrize("flag,value,expect", [
    ("--temperature", "-1", "--temperature must be >= 0"),
    ("--top-p", "2", "--top-p must be in (0, 1]"),
    ("--lora-rank", "-1", "--lora-rank must be >= 0"),
    ("--lr", "-0.1", "--lr must be > 0"),
    ("--betas", "0.9", "--betas must be two numbers"),
    ("--threads", "-3", "--threads must be >= 0"),
    ("--top-k", "-5", "--top-k must be >= 0"),
])
def test_bad_values_are_rejected_before_any_work(tmp_path, capsys, flag, value, expect):
    out = tmp_path / "out"
    code, err = run(capsys, "--pairs", "nonexistent.jsonl", "--out", str(out), flag, value)
    assert code == 2 and expect in err and "Traceback" not in err
    assert not out.exists()


def test_lora_rank_above_the_hidden_size_is_an_error(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "out"
    code, err = run(capsys, "--model", str(tiny_model_dir), "--pairs", str(write_pairs(tmp_path / "p.jsonl", [GOOD])),
                    "--out", str(out), "--lora-rank", "64")
    assert code == 2 and "larger than the model's hidden size (32)" in err


def test_yaml_scientific_notation_is_a_float(tmp_path):
    import argparse

    from opct import config, options

    y = tmp_path / "c.yaml"
    y.write_text("lr: 1e-4\n")
    p = argparse.ArgumentParser()
    options.add_arguments(p, config.TrainConfig)
    assert config.build(config.TrainConfig, p.parse_args(["--config", str(y)])).lr == 1e-4


def test_nan_training_stops_with_an_error_and_nothing_looks_finished(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "out"
    code, err = run(capsys, "--model", str(tiny_model_dir), "--pairs", str(write_pairs(tmp_path / "p.jsonl", [GOOD] * 2)),
                    "--out", str(out), "--steps", "2", "--prompts-per-step", "2", "--max-new-tokens", "4",
                    "--lora-rank", "2", "--kl-coef", "1e39", "--lr", "1e6", "--report-to", "none")
    assert code == 2 and "is not finite" in err and "Traceback" not in err
    assert not (out / "run.json").exists() and not (out / "model").exists()


def test_sft_does_not_take_opct_only_flags(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--kl-coef", "5"])
    assert "unrecognized arguments: --kl-coef" in capsys.readouterr().err


@pytest.mark.parametrize("content,expect", [
    (b'{"student": [{"role": "user", "content": "caf\xe9"}], "teacher": [{"role": "user", "content": "x"}]}\n',
     ":1: not UTF-8 text"),
    (b'{"student": [{"role": "user", "content": "a"}], "student": [], "teacher": []}\n', ":1: duplicate key 'student'"),
    (b'{"student": [{"role": "system", "content": "a"}], "teacher": [{"role": "user", "content": "b"}]}\n',
     ":1: field 'student' has no user turn"),
])
def test_more_bad_pairs_files(tmp_path, capsys, tiny_model_dir, content, expect):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(content)
    out = tmp_path / "out"
    code, err = run(capsys, "--model", str(tiny_model_dir), "--pairs", str(pairs), "--out", str(out))
    assert code == 2 and f"{pairs}{expect}" in err and "Traceback" not in err and not out.exists()


def test_identical_sides_are_warned_about(tmp_path, capsys):
    from opct.data.pairs import load_pairs

    p = write_pairs(tmp_path / "p.jsonl", [GOOD, {"student": [{"role": "user", "content": "Hi? "}],
                                                  "teacher": [{"role": "user", "content": " Hi?"}]}])
    load_pairs(p)
    assert "1 of 2 pairs have the same student and teacher side" in capsys.readouterr().err


def test_a_native_crash_in_a_command_prints_the_python_stack():
    """A C++ abort inside `python -m opct ...` (here os.abort() from the command itself) prints where Python was,
    through faulthandler, which the CLI turns on; the process still dies by the signal, never exit 0."""
    import subprocess
    import sys

    code = ("import os, opct.cli as c\n"
            "c.cmd_report = lambda args: os.abort()\n"
            "c.main(['report', 'anywhere'])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"})
    assert p.returncode != 0
    assert "Fatal Python error: Aborted" in p.stderr
    assert "<lambda>" in p.stderr and "in main" in p.stderr


def test_eval_prints_a_rate_over_no_item_as_a_dash(capsys, monkeypatch):
    """A thinking model whose every reasoning stayed open has rates over no item (value None): printed, not a crash."""
    import opct.evaluate

    empty = {"value": None, "lo": 0.0, "hi": 1.0, "n": 0}
    monkeypatch.setattr(opct.evaluate, "run_eval",
                        lambda cfg: evaluation({"sycophancy_rate": {"shifted_heldout_cues": empty}}))
    assert main(["eval", "--axis", "sycophancy", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "sycophancy_rate  shifted_heldout_cues   -    [0.000, 1.000]  n=0" in out


def test_parsing_and_refusing_options_load_no_heavy_library():
    """`opct --help`, every command's parser and a refused option stay light (docs/design.md "Imports"): what needs
    torch lives in modules that only a running command imports (opct.commands, after before_torch)."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io; from opct import cli; cli.build_parser()\n"
            "with contextlib.redirect_stderr(io.StringIO()): rc = cli.main(['train', '--lr', '-1'])\n"
            "print(rc, sorted(m for m in ('torch', 'transformers', 'matplotlib', 'pyarrow', 'datasets', 'lm_eval')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["2", "[]"], out


@pytest.mark.parametrize("offline,expect", [("on", "True True"), ("auto", "False False")])
def test_offline_on_switches_the_hub_off_before_any_library_reads_the_switch(offline, expect):
    """`opct eval --tasks --offline on` never reaches the Hub: huggingface_hub (imported by transformers) and datasets
    read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, when first imported, so the CLI sets them before any import
    (cli.before_torch); the real libraries' own switches are read back."""
    import subprocess
    import sys

    code = ("import types; from opct import cli\n"
            "def run(cfg):\n"
            "    import huggingface_hub.constants, datasets.config, transformers\n"
            "    print(huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)\n"
            "cli.commands = lambda: types.SimpleNamespace(eval_tasks=run)\n"
            f"raise SystemExit(cli.main(['eval', '--tasks', 'arc_easy', '--offline', '{offline}']))")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.split()[-2:] == expect.split(), out.stdout + out.stderr


@pytest.mark.parametrize("command", ["train", "sft", "eval", "demo", "check"])
def test_process_settings_are_made_before_torch_is_imported(command):
    """--huge-pages' THP_MEM_ALLOC_ENABLE, which torch reads at its first allocation, is set while torch is not yet
    imported, by every command that loads a model: before the config is built, since a demo's or an evaluation's
    config reads its axis' defaults, and importing the axis loads torch."""
    import subprocess
    import sys

    code = ("import os, sys, types; from opct import cli\n"
            "real = cli.before_torch\n"
            "def spy(*a, **k):\n"
            "    real(*a, **k)\n"
            "    print('torch' in sys.modules, os.environ.get('THP_MEM_ALLOC_ENABLE'))\n"
            "cli.before_torch = spy\n"
            "cli.commands = lambda: types.SimpleNamespace(**{n: (lambda *a: None) for n in ('train', 'sft', "
            "'eval_axis', 'run_demo', 'check')})\n"
            f"raise SystemExit(cli.main(['{command}', '--huge-pages']))")  # what follows may refuse: printed by then
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split()[:2] == ["False", "1"], out.stdout + out.stderr


def test_no_axis_default_sets_a_process_setting():
    """cli.before_torch reads PROCESS_FIELDS from the user's settings alone; an axis' defaults must leave them be."""
    from opct.axes import AXES, get_axis
    from opct.cli import PROCESS_FIELDS

    for name in AXES:
        assert not set(get_axis(name).defaults) & set(PROCESS_FIELDS), name
