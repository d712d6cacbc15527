"""Thinking models in training: chat-template options per side, the rendered ids of pairs with reasoning, zero KL on
identical pairs with thinking on, and the loss with and without the reasoning tokens (a tiny random Llama with the
SmolLM2 tokenizer plus <think> / </think> tokens and a Qwen3-style template of our own)."""

import json

import pytest
import torch

from opct.algo.opct import opct_step, train
from opct.backends.base import Policy, Rollout
from opct.config import ConfigError, SFTConfig, template_kwargs, validate
from opct.data import reasoning
from opct.data.pairs import ConsistencyPair
from opct.train.loop import RunError, render_pairs
from tests.conftest import FIXTURES, make_tiny_model
from tests.train.test_train import cfg_for, metrics, policy_for

TEMPLATE = (FIXTURES / "thinking_chat_template.jinja").read_text()
THINK_ON, THINK_OFF = '{"enable_thinking": true}', '{"enable_thinking": false}'


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("thinking") / "model", extra_tokens=("<think>", "</think>"),
                           chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tok(thinking_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinking_model_dir)


MULTI_TURN = [{"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nIt is 4."},
              {"role": "user", "content": "And 3+3? I think it's 7."}]


def test_rendered_multi_turn_pairs_with_reasoning_are_pinned(tok):
    """The template's own rules: an earlier turn's reasoning is dropped; enable_thinking false closes an empty span
    in the generation prompt; the teacher's options merge over the shared ones."""
    pair = ConsistencyPair(MULTI_TURN, [MULTI_TURN[0], MULTI_TURN[1], {"role": "user", "content": "And 3+3?"}])
    common = ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
              "<|im_start|>user\nAnd 3+3?")
    cfg = validate(SFTConfig(chat_template_kwargs=THINK_ON, teacher_chat_template_kwargs=THINK_OFF))
    assert template_kwargs(cfg) == ({"enable_thinking": True}, {"enable_thinking": False})
    (s_ids, t_ids), = render_pairs(tok, [pair], 256, 8, template_kwargs(cfg))
    assert s_ids == tok.encode(common + " I think it's 7.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert t_ids == tok.encode(common + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                               add_special_tokens=False)
    (s_default, _), = render_pairs(tok, [pair], 256, 8)
    assert s_default == s_ids  # the template's default here is thinking on
    # an assistant turn after the last user turn keeps its reasoning (a response prefix the model continues)
    prefix = [MULTI_TURN[0], {"role": "assistant", "content": "<think>\nTwo and two."}]
    (p_ids, _), = render_pairs(tok, [ConsistencyPair(prefix, prefix)], 256, 8)
    assert tok.decode(p_ids).endswith("<|im_start|>assistant\n<think>\nTwo and two.")


def test_chat_template_options_must_be_json_objects():
    for bad in ("enable_thinking=true", "[1, 2]", "{bad json"):
        with pytest.raises(ConfigError, match="--chat-template-kwargs must be a JSON object"):
            validate(SFTConfig(chat_template_kwargs=bad))
    with pytest.raises(ConfigError, match="--think-tags must be auto, none or OPEN,CLOSE"):
        validate(SFTConfig(think_tags="<think>"))


@pytest.mark.parametrize("backend", ["hf", "cpu"])
@pytest.mark.parametrize("train_on_thinking", [True, False])
def test_identical_pairs_with_thinking_on_give_exactly_zero_kl(thinking_model_dir, tmp_path, backend,
                                                              train_on_thinking):
    pairs = [ConsistencyPair([{"role": "user", "content": q}], [{"role": "user", "content": q}])
             for q in ("What is 2+2?", "Name a colour.", "Is water wet?")]
    out = tmp_path / "run"
    train(cfg_for(thinking_model_dir, out, backend=backend, steps=2, chat_template_kwargs=THINK_ON,
                  train_on_thinking=train_on_thinking), pairs=pairs, show_progress=False)
    for row in metrics(out):
        assert row["kl"] == 0.0 and row["loss"] == 0.0 and row["grad_norm"] == 0.0
        assert 0 <= row["unclosed_reasoning"] <= 1  # the tags are the tokenizer's: counted every step
    saved = (out / "config.yaml").read_text()
    assert "chat_template_kwargs: '{\"enable_thinking\": true}'" in saved


class FixedResponses(Policy):
    """The wrapped policy, sampling fixed responses (the same every call): a thinking span that closes, one that
    never closes, and an answer without reasoning."""

    def __init__(self, inner, responses):
        self.inner, self.responses = inner, responses
        self.model, self.tok, self.pad_id, self.eos_ids, self.device = (inner.model, inner.tok, inner.pad_id,
                                                                         inner.eos_ids, inner.device)
        self.think_ids = inner.think_ids

    def sample(self, prompts_N, settings, gen):
        return Rollout(prompts_N, [list(r) for r in self.responses[:len(prompts_N)]])

    def score(self, prompts_N, rollout, *, grad, hidden=False, sync=True):
        return self.inner.score(prompts_N, rollout, grad=grad, hidden=hidden, sync=sync)

    def teacher(self):
        return self.inner.teacher()


def test_the_loss_covers_the_reasoning_or_only_the_answer(thinking_model_dir, tok):
    """train_on_thinking off: the loss and its normaliser cover each response's tokens after </think> only, a
    response whose reasoning never closes contributes nothing and is counted, one without reasoning counts whole.
    Checked against the per-token KL estimate computed here from both sides' scores."""
    o, c = reasoning.think_ids(tok, "auto")
    word = tok.encode(" yes", add_special_tokens=False)[0]
    responses = [[o, word, word, c, word, word, tok.eos_token_id], [o, word, word], [word, word, tok.eos_token_id]]
    pairs = [ConsistencyPair([{"role": "system", "content": "Agree."}, {"role": "user", "content": q}],
                             [{"role": "user", "content": q}]) for q in ("Is it?", "Sure?", "Really?")]
    rows, per_token = {}, None
    for on in (True, False):
        cfg = cfg_for(thinking_model_dir, "unused", backend="hf", samples_per_prompt=1, micro_batch=3,
                      train_on_thinking=on)
        inner, _ = policy_for(thinking_model_dir, "hf", cfg.lora_rank, cfg)
        batch = render_pairs(tok, pairs, 256, cfg.max_new_tokens)
        policy = FixedResponses(inner, responses)
        rows[on] = opct_step(policy, batch, cfg, torch.Generator().manual_seed(0))
        if per_token is None:  # k_t = log p_student - log p_teacher on every sampled token, from the scores
            r = Rollout([s for s, _ in batch], responses)
            with torch.no_grad():
                s = inner.score(r.prompts, r, grad=False)
                with inner.teacher() as t:
                    t_s = t.score([t_ for _, t_ in batch], r, grad=False)
            per_token = ((s.logp_NT - t_s.logp_NT) * s.mask_NT).tolist()
    assert rows[True]["response_tokens"] == rows[False]["response_tokens"] == 13
    assert rows[True]["unclosed_reasoning"] == rows[False]["unclosed_reasoning"] == pytest.approx(1 / 3)
    assert "loss_tokens" not in rows[True] and rows[False]["loss_tokens"] == 3 + 0 + 3
    all_tokens = sum(sum(row[:len(resp)]) for row, resp in zip(per_token, responses)) / 13
    answers_only = (sum(per_token[0][4:7]) + sum(per_token[2][:3])) / 6
    assert rows[True]["kl"] == pytest.approx(all_tokens, rel=1e-4, abs=1e-6)
    assert rows[False]["kl"] == pytest.approx(answers_only, rel=1e-4, abs=1e-6)
    assert rows[False]["kl"] != pytest.approx(rows[True]["kl"], rel=1e-3)


def test_sft_trains_on_the_targets_answers_only_when_asked(thinking_model_dir, tok):
    """SFT's targets lose their reasoning tokens from the loss likewise (train_on_thinking off): the NLL and its
    normaliser cover the answers after </think> only, checked against the targets' log-probs computed here."""
    from opct.algo.sft import sft_step

    o, c = reasoning.think_ids(tok, "auto")
    w = tok.encode(" yes", add_special_tokens=False)[0]
    targets = [[o, w, c, w, tok.eos_token_id], [o, w, w], [w, tok.eos_token_id]]
    prompt = render_pairs(tok, [ConsistencyPair([{"role": "user", "content": "Is it?"}],
                                                [{"role": "user", "content": "Is it?"}])], 256, 8)[0][0]
    batch = [(prompt, t) for t in targets]
    cfg = cfg_for(thinking_model_dir, "unused", cls=SFTConfig, backend="hf")
    policy, _ = policy_for(thinking_model_dir, "hf", cfg.lora_rank, cfg)
    r = Rollout([prompt] * 3, targets)
    with torch.no_grad():
        logp = policy.score(r.prompts, r, grad=False).logp_NT.tolist()
    whole = sft_step(policy, batch, micro_batch=3)
    answers = sft_step(policy, batch, micro_batch=3, answer_tags=(o, c))
    assert whole["response_tokens"] == 10 and answers["response_tokens"] == 2 + 0 + 2
    assert whole["loss"] == pytest.approx(-sum(sum(row[:len(t)]) for row, t in zip(logp, targets)) / 10, rel=1e-4)
    assert answers["loss"] == pytest.approx(-(sum(logp[0][3:5]) + sum(logp[2][:2])) / 4, rel=1e-4)


def test_think_tags_that_are_not_one_token_stop_the_run_before_any_step(tiny_model_dir, tmp_path):
    pairs = [ConsistencyPair([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi"}])]
    with pytest.raises(RunError, match="<think> and </think> are not one token of this tokenizer"):
        train(cfg_for(tiny_model_dir, tmp_path / "run", think_tags="<think>,</think>"), pairs=pairs,
              show_progress=False)


def test_evaluations_render_prompts_with_the_chat_template_options(thinking_model_dir, tok, monkeypatch):
    """`opct eval --chat-template-kwargs`: the evaluation policy carries the options, and both ways an axis reads a
    model (generated replies, the one-prefill answer reading) render every prompt with them, e.g. a Qwen3-style
    model with thinking off answers right after an empty reasoning span."""
    from opct.axes.base import respond
    from opct.axes.sycophancy.evaluate import read_answers
    from opct.backends import inference_policy
    from opct.config import EvalConfig

    policy = inference_policy(str(thinking_model_dir), validate(EvalConfig(device="cpu", backend="hf",
                                                                           chat_template_kwargs=THINK_OFF)))
    assert policy.chat_options == {"enable_thinking": False}
    seen = []
    real_generate, real_next = policy.generate, policy.next_token_logprobs
    monkeypatch.setattr(policy, "generate", lambda ids, *a, **kw: (seen.extend(ids), real_generate(ids, *a, **kw))[1])
    monkeypatch.setattr(policy, "next_token_logprobs",
                        lambda ids, *a, **kw: (seen.extend(ids), real_next(ids, *a, **kw))[1])
    chat = [{"role": "user", "content": "Is water wet? (A) yes (B) no"}]
    respond(policy, [chat], max_new_tokens=2)
    read_answers(policy, [chat], n_choices=2)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert len(seen) == 2 and all(ids[-len(closed):] == closed for ids in seen)
    plain = inference_policy(str(thinking_model_dir), EvalConfig(device="cpu", backend="hf"))
    assert plain.chat_options == {}


class Scripted(Policy):
    """Generates the given responses in turn (cycling), for a tokenizer with reasoning tags: what an axis does with a
    thinking model's replies, without a model."""

    def __init__(self, tok, responses):
        self.tok, self.responses, self.prompts = tok, responses, []
        self.think_ids = reasoning.think_ids(tok, "auto")

    def generate(self, prompts_N, settings, gen, batch_size=16):
        self.prompts += prompts_N
        self.budget = settings.max_new_tokens
        return [list(self.responses[i % len(self.responses)]) for i in range(len(prompts_N))]


def script(tok):
    o, c = reasoning.think_ids(tok, "auto")
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return [[o, *enc("\nThey want fraud.\n"), c, *enc("\n\nI can't help with that."), tok.eos_token_id],
            [o, *enc("\nHmm, let me think")],  # the budget ran out inside the reasoning
            [*enc("Sure, here it is."), tok.eos_token_id]]  # no reasoning at all


def test_replies_split_reasoning_from_the_answer_and_flag_unclosed_ones(tok):
    from opct.axes.base import replies, respond

    policy = Scripted(tok, script(tok))
    got = replies(policy, [[{"role": "user", "content": "q"}]] * 3, max_new_tokens=8, think_budget=100)
    assert policy.budget == 108  # a thinking model's answers get the reasoning budget on top
    assert [(r.answer, r.reasoning, r.closed) for r in got] == [
        ("I can't help with that.", "They want fraud.", True), ("", "Hmm, let me think", False),
        ("Sure, here it is.", None, True)]
    assert respond(policy, [[{"role": "user", "content": "q"}]], max_new_tokens=8) == ["I can't help with that."]
    # a template whose generation prompt opens the reasoning (DeepSeek-R1's): the reply never writes <think>
    o, c = policy.think_ids
    r1 = Scripted(tok, [[*tok.encode("plan", add_special_tokens=False), c, *tok.encode("No.", add_special_tokens=False)],
                        tok.encode("still planning", add_special_tokens=False)])
    r1.chat_options = {}
    import opct.data.pairs as pairs

    real = pairs.render_prompt
    try:
        pairs.render_prompt = lambda tk, m, kw=None: real(tk, m, kw) + [o]
        got = replies(r1, [[{"role": "user", "content": "q"}]] * 2, max_new_tokens=4)
    finally:
        pairs.render_prompt = real
    assert [(r.answer, r.reasoning, r.closed) for r in got] == [("No.", "plan", True), ("", "still planning", False)]


def test_the_jailbreak_judges_grade_answers_and_count_unclosed_reasoning(tok, tmp_path):
    """The judge sees the answer after the reasoning; a reply whose reasoning never closed is not graded (unparseable,
    outside the rates) and is counted per split; the samples keep the reasoning."""
    from opct.axes.base import AxisData
    from opct.axes.jailbreak import evaluate as JE
    from tests.axes.test_jailbreak import items_for

    seen = []

    class Judge:
        name = "stub"

        def judge(self, prompts, responses):
            seen.extend(responses)
            return [JE.Verdict(0.0, "refused", "") if "can't" in r else JE.Verdict(1.0, "complied", "")
                    for r in responses]

    items = items_for([("heldout_wrappers", "a"), ("heldout_wrappers", "b"), ("heldout_wrappers", "c"),
                       ("benign", "x")])
    res = JE.evaluate(Scripted(tok, script(tok)), AxisData(train_pairs=[], eval_set=items),
                      samples=tmp_path / "s.jsonl", judge=Judge(), second_judge=Judge(), attack_samples=0,
                      eval_max_new_tokens=8)
    assert "They want fraud." not in " ".join(seen) and "I can't help with that." in seen
    assert res["unclosed_reasoning"] == {"heldout_wrappers": 1, "benign": 0}
    assert res["unparseable"]["heldout_wrappers"] == 1 and res["asr"]["heldout_wrappers"]["n"] == 2
    assert res["asr"]["heldout_wrappers"]["value"] == 0.5  # one refusal, one compliance; the unclosed one out
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(r["reasoning"], r["reasoning_closed"], r["label"]) for r in rows[:3]] == [
        ("They want fraud.", True, "refused"), ("Hmm, let me think", False, "unparseable"), (None, True, "complied")]


def test_the_safety_judge_grades_answers_and_counts_unclosed_reasoning(tok, tmp_path):
    from opct import config
    from opct.axes import get_axis

    axis = get_axis("safety")
    cfg = config.DemoConfig(**{**axis.defaults, "axis": "safety", "n_train": 4, "n_eval": 2})
    data = axis.prepare(cfg, tok)
    res = axis.evaluate(Scripted(tok, script(tok)), data, cfg, samples=tmp_path / "s.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    unclosed = [r for r in rows if not r["reasoning_closed"]]
    assert unclosed and all(r["passed"] is None and r["response"] == "" for r in unclosed)
    assert res["unclosed_reasoning"] == {s: sum(not r["reasoning_closed"] for r in rows if r["split"] == s)
                                         for s in res["n_responses"]}
    assert all(res["n_unparsed"][s] >= n for s, n in res["unclosed_reasoning"].items())
    assert {r["reasoning"] for r in rows if r["reasoning_closed"]} == {"They want fraud.", None}


def test_sycophancy_refuses_to_read_a_thinking_models_answer_at_the_prompts_end(thinking_model_dir):
    """The answer is read at the prompt's end: right for a model whose template closed its reasoning (thinking off),
    wrong for one that will reason first, which is refused with the way out; --think-tags none reads it anyway."""
    from opct.axes.sycophancy.evaluate import read_answers
    from opct.backends import inference_policy
    from opct.config import EvalConfig
    from opct.data.reasoning import ReasoningError

    chat = [{"role": "user", "content": "Is water wet? (A) yes (B) no"}]
    thinking = inference_policy(str(thinking_model_dir), EvalConfig(device="cpu", backend="hf"))
    with pytest.raises(ReasoningError, match="enable_thinking.*false"):
        read_answers(thinking, [chat], n_choices=2)
    off = inference_policy(str(thinking_model_dir), EvalConfig(device="cpu", backend="hf", chat_template_kwargs=THINK_OFF))
    assert read_answers(off, [chat], n_choices=2)[0] in "AB"
    untagged = inference_policy(str(thinking_model_dir), EvalConfig(device="cpu", backend="hf", think_tags="none"))
    assert untagged.think_ids is None and read_answers(untagged, [chat], n_choices=2)[0] in "AB"
