"""Token logs of training (opct.lens.tokens): what a logged step writes is the step's own log-probs, and a run
without them is the same run."""

import json

import pyarrow.parquet as pq
import pytest

from opct.algo.opct import train
from opct.lens import tokens
from tests.train.test_train import DETERMINISTIC, cfg_for, make_pairs, metrics


@pytest.mark.parametrize("backend", ["hf", "cpu"])
def test_logged_steps_hold_the_steps_own_log_probs_and_change_nothing(tiny_model_dir, tmp_path, backend):
    # a fixed thread count: under `auto` a busy machine changes it between steps, and with it the float rounding
    logged = train(cfg_for(tiny_model_dir, tmp_path / "on", backend=backend, steps=3, token_log_every=2, threads=2),
                   make_pairs(), show_progress=False)
    plain = train(cfg_for(tiny_model_dir, tmp_path / "off", backend=backend, steps=3, threads=2), make_pairs(),
                  show_progress=False)
    assert not (plain / tokens.TOKENS_DIR).exists()
    assert tokens.logged_steps(logged) == [2, 3]  # every 2nd step and the last
    on, off = metrics(logged), metrics(plain)
    for a, b in zip(on, off):  # the same run: every deterministic number identical
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}
    assert ["time_tokens" in r for r in on] == [False, True, True]
    for step in (2, 3):
        tok_t, prompts = tokens.read_step(logged, step)
        rows = tok_t.to_pylist()
        row = on[step - 1]
        assert len(rows) == row["response_tokens"]
        assert prompts.num_rows == 3 * 2  # prompts_per_step x samples_per_prompt
        # the logged kl is the mean over loss tokens of log p_S - log p_T (the sampled-token estimate)
        kl = sum(r["logp_student"] - r["logp_teacher"] for r in rows if r["in_loss"]) / sum(r["in_loss"] for r in rows)
        assert kl == pytest.approx(row["kl"], rel=1e-4, abs=1e-5)
        lp = sum(r["logp_student"] for r in rows) / len(rows)
        assert lp == pytest.approx(row["logp_student"], rel=1e-4)
        p = prompts.to_pylist()[0]
        assert p["student_prompt"] != p["teacher_prompt"] and len(p["student_tokens"]) == len(p["student_ids"])
        positions = [r["position"] for r in rows if r["sample"] == 0]
        assert positions == list(range(len(positions)))


def test_the_files_are_parquet_that_pandas_reads_as_one_table(tiny_model_dir, tmp_path):
    import pandas as pd

    out = train(cfg_for(tiny_model_dir, tmp_path / "run", steps=2, token_log_every=1), make_pairs(),
                show_progress=False)
    files = sorted((out / "tokens").glob("step-*.parquet"))
    table = pd.concat(map(pd.read_parquet, files))
    assert sorted(table["step"].unique()) == [1, 2]
    gap = (table["logp_student"] - table["logp_teacher"]).abs()
    top = table.assign(gap=gap).nlargest(3, "gap")  # the documented query (docs/lens.md)
    assert len(top) == 3 and top["gap"].is_monotonic_decreasing
    assert pq.read_schema(files[0]).names == tokens.TOKEN_SCHEMA.names


def test_due_steps():
    assert [s for s in range(7) if tokens.due(3, s, 7)] == [2, 5, 6]
    assert not any(tokens.due(0, s, 7) for s in range(7))


def test_the_option_is_offered_by_train_and_demo_only():
    from opct import config

    assert config.TrainConfig().token_log_every == 0  # off in the library
    assert config.DemoConfig().token_log_every == 5  # on in the demos
    assert "token_log_every" not in {f.name for f in __import__("dataclasses").fields(config.SFTConfig)}
    json.dumps(config.TrainConfig(token_log_every=2).token_log_every)


def test_a_thinking_models_reasoning_tokens_are_marked(tmp_path):
    """`reasoning` is true exactly before the answer starts (ChatFormat.answer_start), and for every token of a
    reply whose reasoning never closed; the logged values and the loss mask are the step's, token for token."""
    import torch
    from transformers import AutoTokenizer

    from opct.data.chat import ChatFormat
    from tests.conftest import make_tiny_model
    from tests.train.test_thinking import TEMPLATE

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m", extra_tokens=("<think>", "</think>"),
                                                        chat_template=TEMPLATE))
    fmt = ChatFormat.of(tok)
    prompt = fmt.prompt([{"role": "user", "content": "What is 2+2?"}])
    closed = tok.encode("Two and two.\n</think>\n\nIt is 4.<|im_end|>", add_special_tokens=False)
    unclosed = tok.encode("<think>\nStill thinking", add_special_tokens=False)
    T = len(closed)
    logp_s = -torch.arange(2 * T, dtype=torch.float32).reshape(2, T) / 10
    mask = torch.ones(2, T)
    mask[1, len(unclosed):] = 0  # padding
    mask[0, 0] = 0  # e.g. a token left out of the loss
    sink = tokens.StepTokens(7, [3, 5])
    sink.add([prompt, prompt], [prompt, prompt], [closed, unclosed], logp_s, logp_s - 1, mask)
    sink.write(tmp_path / "run", tok, fmt)
    rows = tokens.read_step(tmp_path / "run", 7)[0].to_pylist()
    first, second = [r for r in rows if r["sample"] == 0], [r for r in rows if r["sample"] == 1]
    start = fmt.answer_start(prompt, closed)
    assert 0 < start < len(closed)
    assert [r["reasoning"] for r in first] == [i < start for i in range(len(closed))]
    assert len(second) == len(unclosed) and all(r["reasoning"] for r in second)
    assert [r["in_loss"] for r in first] == [False] + [True] * (len(closed) - 1)
    assert [r["logp_student"] for r in first] == pytest.approx(logp_s[0].tolist())
    assert [r["logp_teacher"] for r in second] == pytest.approx((logp_s[1, :len(unclosed)] - 1).tolist())
    assert {r["pair"] for r in first} == {3} and {r["pair"] for r in second} == {5}
