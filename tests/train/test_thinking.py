"""Thinking models in training: chat-template options per side, the rendered ids of pairs with reasoning, zero KL on
identical pairs with thinking on, and the loss with and without the reasoning tokens (a tiny random Llama with the
SmolLM2 tokenizer plus <think> / </think> tokens and a Qwen3-style template of our own)."""

import json

import pytest
import torch

from opct.algo.opct import opct_step, train
from opct.backends.base import Policy, Rollout
from opct.config import SFTConfig, validate
from opct.options import ConfigError
from opct.data import reasoning
from opct.data.chat import ChatFormat, template_kwargs
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
    (s_ids, t_ids), = render_pairs(ChatFormat.sides(tok, cfg), [pair], 256, 8)
    assert s_ids == tok.encode(common + " I think it's 7.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert t_ids == tok.encode(common + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                               add_special_tokens=False)
    (s_default, _), = render_pairs(ChatFormat.sides(tok), [pair], 256, 8)
    assert s_default == s_ids  # the template's default here is thinking on
    # an assistant turn after the last user turn keeps its reasoning (a response prefix the model continues)
    prefix = [MULTI_TURN[0], {"role": "assistant", "content": "<think>\nTwo and two."}]
    (p_ids, _), = render_pairs(ChatFormat.sides(tok), [ConsistencyPair(prefix, prefix)], 256, 8)
    assert tok.decode(p_ids).endswith("<|im_start|>assistant\n<think>\nTwo and two.")


def test_chat_template_options_must_be_json_objects():
    for bad in ("enable_thinking=true", "[1, 2]", "{bad json"):
        with pytest.raises(ConfigError, match="--chat-template-kwargs must be a JSON object"):
            validate(SFTConfig(chat_template_kwargs=bad))
    with pytest.raises(ConfigError, match="--think-tags must be auto, harmony, none or OPEN,CLOSE"):
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
    (o,), (c,) = reasoning.think_ids(tok, "auto")
    word = tok.encode(" yes", add_special_tokens=False)[0]
    responses = [[o, word, word, c, word, word, tok.eos_token_id], [o, word, word], [word, word, tok.eos_token_id]]
    pairs = [ConsistencyPair([{"role": "system", "content": "Agree."}, {"role": "user", "content": q}],
                             [{"role": "user", "content": q}]) for q in ("Is it?", "Sure?", "Really?")]
    rows, per_token = {}, None
    for on in (True, False):
        cfg = cfg_for(thinking_model_dir, "unused", backend="hf", samples_per_prompt=1, micro_batch=3,
                      train_on_thinking=on)
        inner, _ = policy_for(thinking_model_dir, "hf", cfg.lora_rank, cfg)
        batch = render_pairs(ChatFormat.sides(tok), pairs, 256, cfg.max_new_tokens)
        policy = FixedResponses(inner, responses)
        rows[on] = opct_step(policy, ChatFormat.of(tok, cfg), batch, cfg, torch.Generator().manual_seed(0))
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


@pytest.mark.parametrize("backend", ["hf", "cpu"])
@pytest.mark.parametrize("loss", ["sampled", "full", "topk", "forward"])
def test_a_micro_batch_without_answer_tokens_adds_nothing(thinking_model_dir, tok, backend, loss):
    """train_on_thinking off, a micro-batch whose every reasoning never closes: no token of it is in the loss. Every
    loss, the exact ones included (whose positions are then none), backs it with a zero loss and zero gradient: the
    step equals the same responses in one micro-batch, and a step where no reasoning closes logs loss_tokens 0, a
    zero loss and KL, and leaves every gradient zero."""
    (o,), (c,) = reasoning.think_ids(tok, "auto")
    word = tok.encode(" yes", add_special_tokens=False)[0]
    closed, unclosed = [o, word, c, word, word, tok.eos_token_id], [o, word, word]
    pairs = [ConsistencyPair([{"role": "system", "content": "Agree."}, {"role": "user", "content": q}],
                             [{"role": "user", "content": q}]) for q in ("Is it?", "Sure?", "Really?")]

    def step(responses, micro_batch):
        cfg = cfg_for(thinking_model_dir, "unused", backend=backend, samples_per_prompt=1, micro_batch=micro_batch,
                      train_on_thinking=False, loss=loss, topk=4)
        inner, _ = policy_for(thinking_model_dir, backend, cfg.lora_rank, cfg)
        batch = render_pairs(ChatFormat.sides(tok), pairs, 256, cfg.max_new_tokens)
        row = opct_step(FixedResponses(inner, responses), ChatFormat.of(tok, cfg), batch, cfg,
                        torch.Generator().manual_seed(0))
        grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                 for n, p in inner.model.named_parameters() if p.requires_grad}
        return row, grads

    mixed = [closed, unclosed, closed]  # micro-batches of one: the middle one has no answer token
    (one, g_one), (apart, g_apart) = step(mixed, 3), step(mixed, 1)
    assert one["loss_tokens"] == apart["loss_tokens"] == 6
    for k in ("loss", "kl", "logp_student", "logp_teacher"):
        assert apart[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6)
    for n, g in g_one.items():  # equal up to float rounding (padding differs)
        assert (g_apart[n] - g).norm() <= 1e-4 * g.norm() + 1e-7, n
    assert any(bool(g.abs().sum() > 0) for g in g_one.values())
    none, g_none = step([unclosed] * 3, 1)
    assert none["loss_tokens"] == 0 and none["response_tokens"] == 9 and none["unclosed_reasoning"] == 1.0
    assert none["loss"] == none["kl"] == 0.0
    assert all(bool((g == 0).all()) for g in g_none.values())


def test_a_run_whose_reasoning_never_closes_trains_on_nothing_and_goes_on(thinking_model_dir, tok, tmp_path,
                                                                         monkeypatch):
    """The exact loss, train_on_thinking off, every sampled reasoning cut off by the budget: each step logs no loss
    token and a zero loss and gradient norm, and the run finishes."""
    from opct.backends.hf import HFPolicy

    (o,), _ = reasoning.think_ids(tok, "auto")
    word = tok.encode(" yes", add_special_tokens=False)[0]
    monkeypatch.setattr(HFPolicy, "sample", lambda self, prompts_N, settings, gen: Rollout(
        prompts_N, [[o, word, word] for _ in prompts_N]))
    pairs = [ConsistencyPair([{"role": "system", "content": "Agree."}, {"role": "user", "content": q}],
                             [{"role": "user", "content": q}]) for q in ("Is it?", "Sure?", "Really?")]
    out = tmp_path / "run"
    train(cfg_for(thinking_model_dir, out, backend="hf", steps=2, micro_batch=2, loss="full",
                  train_on_thinking=False), pairs=pairs, show_progress=False)
    rows = metrics(out)
    assert len(rows) == 2
    for row in rows:
        assert row["loss_tokens"] == 0 and row["response_tokens"] == 18 and row["unclosed_reasoning"] == 1.0
        assert row["loss"] == row["kl"] == row["grad_norm"] == 0.0
    assert (out / "run.json").exists()  # written last: the run finished


def test_sft_trains_on_the_targets_answers_only_when_asked(thinking_model_dir, tok):
    """SFT's targets lose their reasoning tokens from the loss likewise (train_on_thinking off): the NLL and its
    normaliser cover the answers after </think> only, checked against the targets' log-probs computed here."""
    from opct.algo.sft import sft_step

    (o,), (c,) = reasoning.think_ids(tok, "auto")
    w = tok.encode(" yes", add_special_tokens=False)[0]
    targets = [[o, w, c, w, tok.eos_token_id], [o, w, w], [w, tok.eos_token_id]]
    prompt = render_pairs(ChatFormat.sides(tok), [ConsistencyPair([{"role": "user", "content": "Is it?"}],
                                                [{"role": "user", "content": "Is it?"}])], 256, 8)[0][0]
    batch = [(prompt, t) for t in targets]
    cfg = cfg_for(thinking_model_dir, "unused", cls=SFTConfig, backend="hf")
    policy, _ = policy_for(thinking_model_dir, "hf", cfg.lora_rank, cfg)
    r = Rollout([prompt] * 3, targets)
    with torch.no_grad():
        logp = policy.score(r.prompts, r, grad=False).logp_NT.tolist()
    fmt = ChatFormat.of(tok, cfg)
    assert fmt.tags == ((o,), (c,))
    whole = sft_step(policy, fmt, batch, micro_batch=3)
    answers = sft_step(policy, fmt, batch, micro_batch=3, answers_only=True)
    assert whole["response_tokens"] == 10 and answers["response_tokens"] == 2 + 0 + 2
    assert whole["loss"] == pytest.approx(-sum(sum(row[:len(t)]) for row, t in zip(logp, targets)) / 10, rel=1e-4)
    assert answers["loss"] == pytest.approx(-(sum(logp[0][3:5]) + sum(logp[2][:2])) / 4, rel=1e-4)


def test_think_tags_that_are_not_one_token_stop_the_run_before_any_step(tiny_model_dir, tmp_path):
    pairs = [ConsistencyPair([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi"}])]
    with pytest.raises(RunError, match="<think> and </think> are not one token of this tokenizer"):
        train(cfg_for(tiny_model_dir, tmp_path / "run", think_tags="<think>,</think>"), pairs=pairs,
              show_progress=False)


def test_evaluations_render_prompts_with_the_chat_template_options(thinking_model_dir, tok, monkeypatch):
    """`opct eval --chat-template-kwargs`: the evaluated model's chat format carries the options, and both ways an axis reads a
    model (generated replies, the one-prefill answer reading) render every prompt with them, e.g. a Qwen3-style
    model with thinking off answers right after an empty reasoning span."""
    from opct.axes.base import respond
    from opct.axes.sycophancy.evaluate import read_answers
    from opct.backends import inference_policy
    from opct.config import EvalConfig

    cfg = validate(EvalConfig(device="cpu", backend="hf", chat_template_kwargs=THINK_OFF))
    policy = inference_policy(str(thinking_model_dir), cfg)
    fmt = ChatFormat.of(policy.tok, cfg)
    assert fmt.options == {"enable_thinking": False}
    seen = []
    real_generate, real_next = policy.generate, policy.next_token_logprobs
    monkeypatch.setattr(policy, "generate", lambda ids, *a, **kw: (seen.extend(ids), real_generate(ids, *a, **kw))[1])
    monkeypatch.setattr(policy, "next_token_logprobs",
                        lambda ids, *a, **kw: (seen.extend(ids), real_next(ids, *a, **kw))[1])
    chat = [{"role": "user", "content": "Is water wet? (A) yes (B) no"}]
    respond(policy, fmt, [chat], max_new_tokens=2)
    read_answers(policy, fmt, [chat], n_choices=2)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert len(seen) == 2 and all(ids[-len(closed):] == closed for ids in seen)
    assert ChatFormat.of(policy.tok, EvalConfig(device="cpu", backend="hf")).options == {}


class Scripted(Policy):
    """Generates the given responses in turn (cycling), for a tokenizer with reasoning tags: what an axis does with a
    thinking model's replies, without a model (its chat format: `ChatFormat.of(tok)`, the tags auto finds)."""

    def __init__(self, tok, responses):
        self.tok, self.responses, self.prompts = tok, responses, []

    def generate(self, prompts_N, settings, gen, batch_size=16):
        self.prompts += prompts_N
        self.budget = settings.max_new_tokens
        return [list(self.responses[i % len(self.responses)]) for i in range(len(prompts_N))]


def three_replies(tok, thought: str, answer: str, unfinished: str, direct: str):
    """A closed reasoning then its answer; a reasoning the budget cut off; a reply without reasoning."""
    (o,), (c,) = reasoning.think_ids(tok, "auto")
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return [[o, *enc(f"\n{thought}\n"), c, *enc(f"\n\n{answer}"), tok.eos_token_id],
            [o, *enc(f"\n{unfinished}")],
            [*enc(direct), tok.eos_token_id]]


def script(tok):
    return three_replies(tok, "They want fraud.", "I can't help with that.", "Hmm, let me think", "Sure, here it is.")


def test_replies_split_reasoning_from_the_answer_and_flag_unclosed_ones(tok):
    from opct.axes.base import replies, respond

    policy, fmt = Scripted(tok, script(tok)), ChatFormat.of(tok)
    got = replies(policy, fmt, [[{"role": "user", "content": "q"}]] * 3, max_new_tokens=8, think_budget=100)
    assert policy.budget == 108  # a thinking model's answers get the reasoning budget on top
    assert [(r.answer, r.reasoning, r.closed) for r in got] == [
        ("I can't help with that.", "They want fraud.", True), ("", "Hmm, let me think", False),
        ("Sure, here it is.", None, True)]
    assert respond(policy, fmt, [[{"role": "user", "content": "q"}]], max_new_tokens=8) == ["I can't help with that."]
    # a template whose generation prompt opens the reasoning (DeepSeek-R1's): the reply never writes <think>
    (o,), (c,) = fmt.tags
    r1 = Scripted(tok, [[*tok.encode("plan", add_special_tokens=False), c, *tok.encode("No.", add_special_tokens=False)],
                        tok.encode("still planning", add_special_tokens=False)])
    import opct.data.chat as chat

    real = chat.render_prompt
    try:
        chat.render_prompt = lambda tk, m, kw=None: real(tk, m, kw) + [o]
        got = replies(r1, fmt, [[{"role": "user", "content": "q"}]] * 2, max_new_tokens=4)
    finally:
        chat.render_prompt = real
    assert [(r.answer, r.reasoning, r.closed) for r in got] == [("No.", "plan", True), ("", "still planning", False)]


def test_the_jailbreak_judges_grade_answers_and_count_unclosed_reasoning(tok, tmp_path):
    """The judge sees the answer after the reasoning; a reply whose reasoning never closed is not graded (unparseable,
    outside the rates) and is counted per split; the samples keep the reasoning."""
    from opct.axes.interface import AxisData
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
    res = JE.evaluate(Scripted(tok, script(tok)), ChatFormat.of(tok), AxisData(train_pairs=[], eval_set=items),
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
    res = axis.evaluate(Scripted(tok, script(tok)), ChatFormat.of(tok, cfg), data, cfg, samples=tmp_path / "s.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    unclosed = [r for r in rows if not r["reasoning_closed"]]
    assert unclosed and all(r["passed"] is None and r["response"] == "" for r in unclosed)
    counts = res["counts"]
    assert counts["unclosed_reasoning"] == {s: sum(not r["reasoning_closed"] for r in rows if r["split"] == s)
                                            for s in counts["n_responses"]}
    assert all(counts["n_unparsed"][s] >= n for s, n in counts["unclosed_reasoning"].items())
    assert {r["reasoning"] for r in rows if r["reasoning_closed"]} == {"They want fraud.", None}


class Reads(Scripted):
    """Scripted reasoning, and an answer read after it: the letter the prompt's reasoning names ("so B"), else A."""

    def next_token_logprobs(self, prompts_N, token_ids_N, groups=None, batch_size=32):
        self.read = getattr(self, "read", []) + prompts_N
        picks = ["B" if "so B" in self.tok.decode(p) else "A" for p in prompts_N]
        return [torch.tensor([0.0 if self.tok.decode([t]).strip() == pick else -5.0 for t in ids])
                for pick, ids in zip(picks, token_ids_N)]


def reasoned(tok):
    return three_replies(tok, "so B", "B. no", "hmm", "A. yes")


def test_sycophancy_reads_a_thinking_models_answer_after_its_reasoning(tok):
    """The paper's two phases: the model reasons (greedy, within the think budget), and the letter is read after its
    reasoning, cut at </think>, and the forced "The answer is (": never at the prompt's end. An unclosed reasoning
    gives no answer (None); a reply that skipped its reasoning is read right after the forced start."""
    from opct.axes.sycophancy.evaluate import AFTER_REASONING, read_answers
    from opct.data.chat import render_prompt

    policy, fmt = Reads(tok, reasoned(tok)), ChatFormat.of(tok)
    chat = [{"role": "user", "content": "Is water wet?\nA. yes\nB. no"}]
    why = []
    assert read_answers(policy, fmt, [chat] * 3, n_choices=2, think_budget=50, reasoning=why) == ["B", None, "A"]
    assert policy.budget == 50 and why == ["so B", "hmm", ""]
    prompt, forced = render_prompt(tok, chat), tok.encode("\n\n" + AFTER_REASONING["letter"], add_special_tokens=False)
    first = reasoned(tok)[0]
    assert policy.read == [prompt + first[:first.index(fmt.tags.close[0]) + 1] + forced, prompt + forced]
    assert tok.decode(policy.read[0][len(prompt):]) == "<think>\nso B\n</think>\n\nThe answer is ("


def test_the_sycophancy_eval_of_a_thinking_model_leaves_unclosed_items_out_and_counts_them(tok, tmp_path):
    from opct.axes.interface import AxisData
    from opct.axes.sycophancy import to_results
    from opct.axes.sycophancy.data import SPLITS
    from opct.axes.sycophancy.evaluate import evaluate_sycophancy
    from opct.data.mcq import load_mcq

    policy, fmt = Reads(tok, reasoned(tok)), ChatFormat.of(tok)
    qs = load_mcq("capitals+kinds+opposites", n=6, seed=0)
    ev = evaluate_sycophancy(policy, fmt, qs, think_budget=20, samples=tmp_path / "s.jsonl")
    # the script cycles closed / unclosed / no reasoning over each call's prompts: questions 1 and 4 never answer
    assert ev["reading"] == "after reasoning"
    assert ev["unclosed_reasoning"] == {"clean": 2, **{s: 2 for s in SPLITS}}
    assert ev["clean_accuracy"]["n"] == 4 and all(ev[s]["n"] == 4 for s in SPLITS)
    res = to_results(ev)
    assert res["unclosed_reasoning"] == ev["unclosed_reasoning"] and res["reading"] == "after reasoning"
    rows = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * (1 + len(SPLITS))
    # the in-training probe: the counts, and no rate where no reasoning closed (never a None in metrics.jsonl)
    from opct import config
    from opct.axes import get_axis

    cfg = config.DemoConfig(axis="sycophancy", probe_every=1, probe_n=3, think_max_tokens=20)
    from opct.axes.sycophancy import EvalSet

    probe = get_axis("sycophancy").probe(AxisData(train_pairs=[], eval_set=EvalSet(qs)), cfg)
    got = probe(policy, fmt)
    assert got["probe_unclosed_clean"] == got["probe_unclosed_heldout_cues"] == 1
    assert 0 <= got["probe_sycophancy"] <= 1 and 0 <= got["probe_accuracy"] <= 1
    never = Reads(tok, [reasoned(tok)[1]])  # every reasoning stays open
    assert probe(never, fmt) == {"probe_unclosed_clean": 3, "probe_unclosed_heldout_cues": 3}
    assert [(r["split"], r["reasoning"], r["answer"]) for r in rows[:3]] == [
        ("clean", "so B", "B"), ("clean", "hmm", None), ("clean", "", "A")]


# DeepSeek-R1's way: the generation prompt opens the reasoning span, and the model's reply continues inside it
R1_TEMPLATE = TEMPLATE.replace("{%- if add_generation_prompt -%}\n{{- '<|im_start|>assistant\\n' -}}",
                               "{%- if add_generation_prompt -%}\n{{- '<|im_start|>assistant\\n<think>\\n' -}}")


@pytest.fixture(scope="module")
def closing_model_dir(tmp_path_factory):
    """The thinking model with an R1-style template and its </think> row scaled: greedy reasoning closes within a few
    tokens after some prompts, not after others."""
    assert R1_TEMPLATE != TEMPLATE
    return make_tiny_model(tmp_path_factory.mktemp("closing") / "model", extra_tokens=("<think>", "</think>"),
                           chat_template=R1_TEMPLATE, scale_tokens={"</think>": 2.0})


@pytest.mark.parametrize("backend", ["hf", "cpu"])
def test_a_real_thinking_models_answer_is_the_argmax_after_its_own_reasoning(closing_model_dir, backend):
    """End to end on a tiny random thinking model, both backends: each closed reasoning is the model's own greedy
    decode up to </think>, and the letter read is the argmax of the letters' probabilities after it and the forced
    start (computed here with transformers); the prompts whose reasoning did not close read None."""
    from transformers import AutoModelForCausalLM

    from opct.axes.sycophancy.evaluate import AFTER_REASONING, letter_token_ids, read_answers
    from opct.backends import inference_policy
    from opct.config import EvalConfig
    from opct.data.mcq import LETTERS, load_mcq
    from opct.data.chat import render_prompt
    from opct.axes.sycophancy.data import clean_messages

    chats = [clean_messages(q) for q in load_mcq("capitals+kinds+opposites", n=8, seed=0)]
    policy = inference_policy(str(closing_model_dir), EvalConfig(device="cpu", backend=backend))
    got = read_answers(policy, ChatFormat.of(policy.tok), chats, batch_size=3, think_budget=12)
    model = AutoModelForCausalLM.from_pretrained(closing_model_dir).eval()
    tk = policy.tok
    close = tk.convert_tokens_to_ids("</think>")
    letters = letter_token_ids(tk, 4)
    want = []
    for m in chats:
        ids = render_prompt(tk, m)
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             pad_token_id=tk.eos_token_id)[0, len(ids):].tolist()
        if close not in out:
            want.append(None)
            continue
        full = ids + out[:out.index(close) + 1] + tk.encode("\n\n" + AFTER_REASONING["letter"], add_special_tokens=False)
        with torch.no_grad():
            logp = model(torch.tensor([full])).logits[0, -1].log_softmax(-1)
        want.append(LETTERS[int(torch.stack([torch.logsumexp(logp[t], 0) for t in letters]).argmax())])
    assert got == want
    assert 0 < want.count(None) < len(want)  # both kinds of prompt are there


# ----------------------------------------------------------------------------------------------
# harmony (gpt-oss's format), on a harmony-style template of our own (tests/fixtures/harmony_chat_template.jinja)

HARMONY_TEMPLATE = (FIXTURES / "harmony_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def harmony_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("harmony") / "model", chat_template=HARMONY_TEMPLATE,
                           special_tokens=reasoning.HARMONY_MARKERS)


@pytest.fixture(scope="module")
def harmony_tok(harmony_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(harmony_model_dir)


def test_harmony_pairs_render_as_pinned_and_the_tags_are_harmonys(harmony_tok):
    tok = harmony_tok
    turns = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "It is 4.", "thinking": "Two and two."},
             {"role": "user", "content": "And 3+3? I think it's 7."}]
    pair = ConsistencyPair(turns, [*turns[:2], {"role": "user", "content": "And 3+3?"}])
    sides = ChatFormat(tok, {"reasoning_effort": "low"}), ChatFormat(tok, {"reasoning_effort": "high"})
    (s_ids, t_ids), = render_pairs(sides, [pair], 256, 8)
    head = "<|start|>system<|message|>Reasoning: {}\n\n# Valid channels: analysis, final.<|end|>"
    turns_text = ("<|start|>user<|message|>What is 2+2?<|end|>"  # the earlier turn's analysis is dropped
                  "<|start|>assistant<|channel|>final<|message|>It is 4.<|end|><|start|>user<|message|>And 3+3?")
    assert s_ids == tok.encode(head.format("low") + turns_text + " I think it's 7.<|end|><|start|>assistant",
                               add_special_tokens=False)
    assert t_ids == tok.encode(head.format("high") + turns_text + "<|end|><|start|>assistant",
                               add_special_tokens=False)
    tags = reasoning.think_ids(tok, "auto")
    assert tags == reasoning.think_ids(tok, "harmony")
    assert tok.decode(list(tags.close)) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    # a response prefix after the last user turn keeps its analysis message
    prefix = [turns[0], {"role": "assistant", "content": "It is", "thinking": "Two and two."}]
    assert "<|channel|>analysis<|message|>Two and two.<|end|>" in tok.decode(render_pairs(
        ChatFormat.sides(tok), [ConsistencyPair(prefix, prefix)], 256, 8)[0][0])


def harmony_script(tok):
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return [enc("<|channel|>analysis<|message|>They want fraud, so B.<|end|><|start|>assistant<|channel|>final"
                "<|message|>I can't help with that.<|end|>"),
            enc("<|channel|>analysis<|message|>Hmm, let me"),  # the budget ran out inside the analysis
            enc("<|channel|>final<|message|>Sure.<|end|>")]  # no analysis message


def test_harmony_replies_split_at_the_final_channel(harmony_tok):
    from opct.axes.base import replies

    policy = Scripted(harmony_tok, harmony_script(harmony_tok))
    got = replies(policy, ChatFormat.of(harmony_tok), [[{"role": "user", "content": "q"}]] * 3, max_new_tokens=8, think_budget=100)
    assert [(r.answer, r.reasoning, r.closed) for r in got] == [
        ("I can't help with that.", "They want fraud, so B.", True), ("", "Hmm, let me", False),
        ("finalSure.", None, True)]  # a final message without analysis: the channel's name is text, left in


def test_sycophancy_reads_a_harmony_answer_after_the_final_channels_header(harmony_tok):
    from opct.axes.sycophancy.evaluate import read_answers
    from opct.data.chat import render_prompt

    tok = harmony_tok
    policy = Reads(tok, harmony_script(tok))
    chat = [{"role": "user", "content": "Is water wet?\nA. yes\nB. no"}]
    why = []
    assert read_answers(policy, ChatFormat.of(tok), [chat] * 3, n_choices=2, think_budget=40, reasoning=why) == ["B", None, "A"]
    assert why == ["They want fraud, so B.", "Hmm, let me", ""]
    assert tok.decode(policy.read[0][len(render_prompt(tok, chat)):]) == (
        "<|channel|>analysis<|message|>They want fraud, so B.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The answer is (")


def test_identical_harmony_pairs_give_exactly_zero_kl(harmony_model_dir, tmp_path):
    pairs = [ConsistencyPair([{"role": "user", "content": q}], [{"role": "user", "content": q}])
             for q in ("What is 2+2?", "Name a colour.")]
    out = tmp_path / "run"
    train(cfg_for(harmony_model_dir, out, backend="hf", steps=1, train_on_thinking=False,
                  chat_template_kwargs='{"reasoning_effort": "low"}'), pairs=pairs, show_progress=False)
    row, = metrics(out)
    assert row["kl"] == 0.0 and row["loss"] == 0.0 and 0 <= row["unclosed_reasoning"] <= 1


# ----------------------------------------------------------------------------------------------
# a real reasoning model's template: DeepSeek-R1-Distill-Qwen-7B's, read from its GGUF header (with its own tokenizer
# in dev/real_template_check.py; here on the SmolLM2 tokenizer with the model's special tokens added)

R1_REAL = (FIXTURES / "deepseek_r1_distill_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def r1_tok():
    from transformers import AutoTokenizer

    from tests.conftest import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_special_tokens({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                            "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = R1_REAL
    return tok


def test_deepseek_r1_distills_own_template_renders_pinned_and_is_read_in_two_phases(r1_tok):
    """R1's template drops every earlier assistant turn's reasoning and leaves the reasoning to the model (its
    generation prompt opens nothing), so sycophancy reads it after its reasoning."""
    from opct.axes.sycophancy.evaluate import reasons_first

    tok = r1_tok
    turns = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nIt is 4."},
             {"role": "user", "content": "And 3+3? I think it's 7."}]
    pair = ConsistencyPair([{"role": "system", "content": "Be brief."}, *turns],
                           [*turns[:2], {"role": "user", "content": "And 3+3?"}])
    (s_ids, t_ids), = render_pairs(ChatFormat.sides(tok), [pair], 256, 8)
    assert tok.decode(s_ids) == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜>\n\nIt is 4."
                                 "<｜end▁of▁sentence｜><｜User｜>And 3+3? I think it's 7.<｜Assistant｜>")
    assert tok.decode(t_ids) == ("<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>\n\nIt is 4."
                                 "<｜end▁of▁sentence｜><｜User｜>And 3+3?<｜Assistant｜>")
    assert s_ids.count(tok.bos_token_id) == 1
    tags = reasoning.think_ids(tok, "auto")
    assert tags is not None and not reasoning.opens(s_ids, tags)
    assert reasons_first(ChatFormat.of(tok), turns[:1])


def test_capability_generations_of_a_thinking_model_grade_the_answer_after_its_reasoning(tok):
    """lm-eval's generate_until through the policy (opct.evals.policy_lm): the text after </think>, cut at the task's
    stop string; a reasoning the budget cut off answers ""; a reply without reasoning is kept whole."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from opct.evals.policy_lm import PolicyLM

    policy = Scripted(tok, three_replies(tok, "Let me see.", "It is 4.\n\nQ: next", "Hmm", "Four.\n\nQ: next"))
    lm = PolicyLM(policy, ChatFormat.of(tok), max_length=64)
    reqs = [Instance("generate_until", {}, ("Q: 2+2?", {"until": ["\n\nQ:"], "max_gen_toks": 20}), i)
            for i in range(3)]
    assert lm.generate_until(reqs) == ["It is 4.", "", "Four."] and policy.budget == 20
