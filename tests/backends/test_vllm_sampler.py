"""The vLLM sampler on SmolLM2 (fp32): sampling, per-step weight sync that is never stale, the server mode.

Runs in the vLLM venv (.ci/vllm); skips cleanly where vllm is not importable or the model cannot be built.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from opct.backends.vllm_engine import VLLMSampler  # noqa: E402
from opct.backends.vllm_sampler import VLLMServerSampler  # noqa: E402
from opct.backends.sampling import SamplingSettings  # noqa: E402
from tests.procs import run_tree  # noqa: E402

pytestmark = pytest.mark.vllm

TOL = 2e-4  # fp32 vLLM vs fp32 transformers, per token (measured max ~7e-5)
TEXTS = ["The capital of France is", "Write a haiku about rain.", "2 + 2 =", "Name three colours:",
         "Why is the sky blue?", "Translate 'hello' to Spanish:", "A good breakfast is", "Once upon a time"]


@pytest.fixture(scope="module")
def model_dir():
    """SmolLM2-135M-Instruct's dense copy; $OPCT_VLLM_TEST_MODEL instead where it is set (dev/gpu_vllm.sh: random
    weights of its architecture on a machine the embedded model cannot reach)."""
    from opct.models import ModelError, resolve

    if os.environ.get("OPCT_VLLM_TEST_MODEL"):
        return os.environ["OPCT_VLLM_TEST_MODEL"]

    try:
        return resolve("smollm2-135m-instruct")
    except ModelError as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tok):
    out = []
    for t in TEXTS:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def hf_logprobs(model, seqs_N, starts_N):
    """transformers' fp32 log-probs of seqs_N[i][starts_N[i]:] (one sequence at a time, no padding)."""
    out = []
    with torch.no_grad():
        for s, st in zip(seqs_N, starts_N):
            logp_TV = model(input_ids=torch.tensor([s])).logits[0].float().log_softmax(-1)
            out.append([logp_TV[t - 1, s[t]].item() for t in range(st, len(s))])
    return out


def diffs(a, b):
    assert [len(r) for r in a] == [len(r) for r in b]
    d = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return max(d), statistics.fmean(d)


def student(model_dir, seed=0):
    """SmolLM2 fp32 with a rank-8 all-linear PEFT LoRA whose B is nonzero, so the adapter changes the outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.eval()


def train_step(model, seqs_N, starts_N, lr=1e-3):
    """One Adam step raising the log-probs of the given tokens: a real update of whatever is trainable."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = -sum(model(input_ids=torch.tensor([s])).logits[0, st - 1:-1].log_softmax(-1)
                .gather(-1, torch.tensor(s[st:])[:, None]).sum() for s, st in zip(seqs_N, starts_N))
    (loss / sum(len(s) - st for s, st in zip(seqs_N, starts_N))).backward()
    opt.step()
    model.eval()


def check_rollout(responses, logps, eos, max_new):
    assert len(responses) == len(logps) == len(TEXTS)
    for r, lp in zip(responses, logps):
        assert 1 <= len(r) <= max_new and len(lp) == len(r)
        assert all(isinstance(t, int) for t in r) and all(x <= 0 for x in lp)
        assert not any(t in eos for t in r[:-1])  # generation stops at the first EOS...
        if len(r) < max_new:
            assert r[-1] in eos  # ...and keeps it


# Each test owns its engine and closes it before the next starts: one vLLM engine at a time on a small machine.
@pytest.fixture
def lora_sampler(model_dir, tok):
    with VLLMSampler(model_dir, {tok.eos_token_id}, lora_rank=8) as s:
        yield s


@pytest.fixture
def full_sampler(model_dir, tok):
    with VLLMSampler(model_dir, {tok.eos_token_id}) as s:
        yield s


def test_lora_step_then_sync_serves_the_updated_weights(lora_sampler, model_dir, tok, prompts, tmp_path):
    from vllm.lora.request import LoRARequest

    sampler = lora_sampler
    eos, settings = {tok.eos_token_id}, SamplingSettings(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
    model = student(model_dir)
    sampler.sync(model, 0)
    responses, logps = sampler.sample(prompts, settings, seed=0)
    check_rollout(responses, logps, eos, 16)
    assert sampler.sample(prompts, settings, seed=0)[0] == responses  # seeded per request: reproducible
    seqs, starts = [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts]
    before = hf_logprobs(model, seqs, starts)
    gmax, gmean = diffs(logps, before)
    print(f"\nsampled-token gap, LoRA v0: max {gmax:.2e} mean {gmean:.2e}")
    assert gmax < TOL

    model.save_pretrained(tmp_path / "v0")
    train_step(model, seqs, starts)
    model.save_pretrained(tmp_path / "v1")
    after = hf_logprobs(model, seqs, starts)
    moved = diffs(after, before)[1]
    assert moved > 50 * TOL  # the step changed the model far more than the tolerance

    sampler.sync(model, 1)
    got = sampler.prompt_logprobs(seqs, starts)
    gmax, gmean = diffs(got, after)
    print(f"fixed sequence after step+sync: max {gmax:.2e} mean {gmean:.2e} (the step moved it by {moved:.2e})")
    assert gmax < TOL
    assert len(sampler.llm.llm_engine.list_loras()) == 1  # the previous adapter was removed

    # The hazard the fresh id avoids: a resident id asked for with a new path keeps serving the old weights.
    llm = sampler.llm
    llm.llm_engine.add_lora(LoRARequest("stale", 10_000, str(tmp_path / "v0")))
    stale_req = LoRARequest("stale", 10_000, str(tmp_path / "v1"))
    sampler.lora_request, kept = stale_req, sampler.lora_request
    try:
        stale = sampler.prompt_logprobs(seqs, starts)
    finally:
        sampler.lora_request = kept
        llm.llm_engine.remove_lora(10_000)
    print(f"same id + new path: off the new weights by mean {diffs(stale, after)[1]:.2e}, "
          f"off the old by {diffs(stale, before)[1]:.2e}")
    assert diffs(stale, before)[0] < TOL and diffs(stale, after)[1] > 50 * TOL
    assert diffs(sampler.prompt_logprobs(seqs, starts), after)[0] < TOL  # our sync path: current weights


def test_full_finetune_sync_reloads_weights(full_sampler, model_dir, tok, prompts):
    from transformers import AutoModelForCausalLM

    sampler = full_sampler
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs, starts = [p + tok.encode(" Paris is nice.") for p in prompts], [len(p) for p in prompts]
    before = hf_logprobs(model, seqs, starts)
    train_step(model, seqs, starts, lr=1e-4)
    after = hf_logprobs(model, seqs, starts)
    assert diffs(after, before)[1] > 50 * TOL
    assert diffs(sampler.prompt_logprobs(seqs, starts), before)[0] < TOL
    sampler.sync(model, 1)
    gmax, gmean = diffs(sampler.prompt_logprobs(seqs, starts), after)
    print(f"\nfull fine-tuning, fixed sequence after step+reload: max {gmax:.2e} mean {gmean:.2e}")
    assert gmax < TOL  # SmolLM2 ties its embeddings: a stale output layer shows here (see vllm_worker.py)
    with pytest.raises(ValueError, match="lora_rank"):
        sampler.sync(student(model_dir), 2)


def test_server_mode_samples_token_ids_and_logprobs(model_dir, tok, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("vLLM's first-call compile needs a C++ compiler")
    eos, settings = {tok.eos_token_id}, SamplingSettings(max_new_tokens=16, temperature=0.8, top_p=0.95, top_k=50)
    with VLLMServerSampler(eos, model_dir=model_dir, lora_rank=8, workdir=str(tmp_path / "serve")) as s:
        responses, logps = s.sample(prompts, settings, seed=0)
        check_rollout(responses, logps, eos, 16)
        assert s.sample(prompts, settings, seed=0)[0] == responses
        seqs, starts = [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts]
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        gmax, gmean = diffs(logps, hf_logprobs(base, seqs, starts))  # raw log-probs, not temperature-scaled
        print(f"\nserver, sampled-token gap (base, T=0.8 top-p 0.95 top-k 50): max {gmax:.2e} mean {gmean:.2e}")
        assert gmax < TOL

        model = student(model_dir)
        for step in range(2):  # two syncs: the second replaces (and unloads) the first adapter
            if step:
                train_step(model, seqs, starts)
            s.sync(model, step)
            gmax, gmean = diffs(s.prompt_logprobs(seqs, starts), hf_logprobs(model, seqs, starts))
            print(f"server, LoRA sync {step}: max {gmax:.2e} mean {gmean:.2e}")
            assert gmax < TOL
        with urllib.request.urlopen(s.url + "/v1/models") as r:
            names = [m["id"] for m in json.loads(r.read())["data"]]
        assert sorted(names) == ["base", s.served]


def test_opct_train_with_the_vllm_sampler_logs_kl_and_a_small_gap(model_dir, tmp_path):
    """`opct train --sampler vllm` for real: 3 steps on SmolLM2 with LoRA; vLLM samples, the trainer scores, the
    weights are synced every step, and the sampler-vs-trainer log-prob gap stays below 1e-4 in fp32."""
    import json

    from opct.algo.opct import train
    from opct.config import TrainConfig
    from opct.data.pairs import load_pairs

    out = tmp_path / "run"
    cfg = TrainConfig(model="smollm2-135m-instruct", out=str(out), steps=3, prompts_per_step=4, micro_batch=4,
                      max_new_tokens=16, lora_rank=8, lora_alpha=16.0, save_every=0, report_to="none",
                      sampler="vllm", backend="hf", device="cpu")
    pairs = load_pairs(Path(__file__).parents[2] / "examples" / "pairs.jsonl")
    train(cfg, pairs=pairs, show_progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["kl"] == r["kl"] and r["sampler_logp_gap"] < 1e-4 for r in rows)
    # the same weights in the same precision: every importance weight within 1e-4 of 1, none truncated
    for r in rows:
        assert abs(r["is_weight_mean"] - 1) < 1e-4 and abs(r["is_ratio_max"] - 1) < 1e-4 and r["is_truncated"] == 0
    # the sync check before steps 2 and 3: vLLM serves the trainer's weights (its probe log-probs are the trainer's)
    assert all(r["sync_gap_trainer"] < 1e-4 for r in rows[1:]) and "sync_gap_trainer" not in rows[0]
    execution = json.loads((out / "run.json").read_text())["execution"]
    assert execution["sampler"] == "VLLMSampler" and execution["vllm_dtype"] == "float32"


@pytest.mark.parametrize("sampler", ["vllm", "vllm-server"])
def test_a_sabotaged_weight_sync_stops_the_run_with_exit_1(model_dir, tmp_path, monkeypatch, capsys, sampler):
    """The sync sabotaged on a real engine, in-process and through a server opct starts: after the first sync (step
    0's adapter: the initial weights) no new adapter is ever loaded, so vLLM keeps serving the initial model while the
    trainer learns. The sync check stops the run (exit 1, one line) before the third step samples."""
    from opct import cli
    cls = VLLMSampler if sampler == "vllm" else VLLMServerSampler
    real_sync = cls.sync

    def sync_that_never_loads(self, model, step):
        return real_sync(self, model, step) if step == 0 else 0.0

    monkeypatch.setattr(cls, "sync", sync_that_never_loads)
    out = tmp_path / "run"
    rc = cli.main(["train", "--model", "smollm2-135m-instruct", "--pairs",
                   str(Path(__file__).parents[2] / "examples" / "pairs.jsonl"), "--out", str(out), "--steps", "5",
                   "--prompts-per-step", "4", "--max-new-tokens", "16", "--lora-rank", "8", "--lr", "1e-3",
                   "--save-every", "0", "--report-to", "none", "--sampler", sampler, "--backend", "hf",
                   "--device", "cpu"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    print(line)  # the line a user sees (CI's log keeps it)
    assert rc == 1 and line.startswith("opct: error: after step 2: the vLLM sampler does not serve the trained "
                                       "weights")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and not (out / "run.json").exists()
    assert rows[1]["sync_gap_initial"] < 1e-4 < 1e-3 < rows[1]["sync_gap_trainer"]  # vLLM: the initial model


def test_a_bfloat16_engine_samples_for_a_float32_trainer_with_bounded_weights(model_dir, tmp_path):
    """A sampler that is really off the trainer: vLLM in bfloat16 (--vllm-dtype) for a float32 trainer. The
    importance weights move away from 1, stay at most the cap, and the run trains."""
    from opct.algo.opct import train
    from opct.config import TrainConfig
    from opct.data.pairs import load_pairs

    out = tmp_path / "run"
    cfg = TrainConfig(model="smollm2-135m-instruct", out=str(out), steps=2, prompts_per_step=4, micro_batch=4,
                      max_new_tokens=16, lora_rank=8, lora_alpha=16.0, save_every=0, report_to="none",
                      sampler="vllm", vllm_dtype="bfloat16", sampler_is_cap=1.5, backend="hf", device="cpu")
    train(cfg, pairs=load_pairs(Path(__file__).parents[2] / "examples" / "pairs.jsonl"), show_progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["sampler_logp_gap"] > 1e-3 and r["is_ratio_max"] > 1.01  # bfloat16's rounding shows
        assert 0.5 < r["is_weight_mean"] <= 1.5 and 0 <= r["is_truncated"] < 1 and r["grad_norm"] == r["grad_norm"]
    assert json.loads((out / "run.json").read_text())["execution"]["vllm_dtype"] == "bfloat16"


def test_an_axis_evaluation_through_vllm_gives_the_backends_answers(model_dir, tmp_path, monkeypatch):
    """`opct eval --axis jailbreak --eval-engine vllm` on a trained LoRA adapter (an opct run's model/: vLLM serves
    the base model plus the adapter) gives, greedy in float32, the same answers as the hf backend, item by item."""
    from opct.algo.opct import train
    from opct.config import EvalConfig, TrainConfig
    from opct.data.pairs import load_pairs
    from opct.evaluate import config_for_axis, run_eval

    run = tmp_path / "run"
    train(TrainConfig(model="smollm2-135m-instruct", out=str(run), steps=2, prompts_per_step=4, micro_batch=4,
                      max_new_tokens=16, lora_rank=8, lora_alpha=16.0, lr=5e-3, save_every=0, report_to="none",
                      sampler="policy", backend="hf", device="cpu"),
          pairs=load_pairs(Path(__file__).parents[2] / "examples" / "pairs.jsonl"), show_progress=False)
    generated = []  # prompts the vLLM engine answered
    real_sample = VLLMSampler.sample
    monkeypatch.setattr(VLLMSampler, "sample", lambda self, prompts_N, *a, **kw: (
        generated.extend(prompts_N), real_sample(self, prompts_N, *a, **kw))[1])
    answers = {}
    for engine in ("policy", "vllm"):
        cfg = config_for_axis(EvalConfig, axis="jailbreak", model=str(run / "model"), n_eval=2, n_benign=2,
                              attack_samples=0, eval_max_new_tokens=24, backend="hf", device="cpu",
                              eval_engine=engine, out=str(tmp_path / f"{engine}.json"))
        res = run_eval(cfg)
        rows = [json.loads(x) for x in (tmp_path / f"{engine}.samples.jsonl").read_text().splitlines()]
        answers[engine] = (res, rows)
    (res_hf, hf), (res_v, v) = answers["policy"], answers["vllm"]
    assert len(hf) == len(v) >= 10 and len(generated) == len(v)  # vLLM answered every item, the hf run none
    assert [r["response"] for r in v] == [r["response"] for r in hf]
    assert {k: res_v[k] for k in res_v if k != "info"} == {k: res_hf[k] for k in res_hf if k != "info"}


def test_a_server_the_user_started_samples_what_the_server_opct_starts_samples(model_dir, tmp_path, monkeypatch):
    """`opct train --sampler vllm-server --vllm-url` against a vLLM server started the way a user would: the model
    served under its path (no --served-model-name), an API key, LoRA routes on, and vLLM's default
    `--generation-config auto` with a generation_config.json whose defaults (repetition penalty, min-p) would change
    what is sampled. Same tokens and losses as the server opct starts itself (which passes `--generation-config
    vllm`)."""
    import os
    import subprocess
    import sys
    import time

    from opct.algo.opct import train
    from opct.backends import BackendError, check_training
    from opct.backends.vllm import sampler_spec
    from opct.backends.vllm_sampler import API_SERVER, _free_port, unreachable
    from opct.config import TrainConfig
    from opct.data.pairs import load_pairs
    from opct.judges import endpoint
    from opct.judges.endpoint import EndpointError

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("vLLM's first-call compile needs a C++ compiler")
    users = tmp_path / "users-model"
    users.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != "generation_config.json":
            (users / f.name).symlink_to(f)
    gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    (users / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": 1.5, "min_p": 0.2}))
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"},
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", API_SERVER, "--model", str(users), "--host", "127.0.0.1",
                               "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
                               "--enforce-eager", "--enable-lora", "--max-lora-rank", "8", "--api-key", "k3y"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 900
        while unreachable(url, timeout=5) is not None:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(1)
        pairs = load_pairs(Path(__file__).parents[2] / "examples" / "pairs.jsonl")
        with pytest.raises(BackendError, match=r"it wants an API key: set \$OPCT_VLLM_API_KEY"):
            cfg = TrainConfig(sampler="vllm-server", vllm_url=url, lora_rank=8)
            check_training(cfg, torch.float32, "hf", sampler_spec(cfg))
        monkeypatch.setenv("OPCT_VLLM_API_KEY", "k3y")
        monkeypatch.setenv("OPCT_JUDGE_API_KEY", "k3y")
        rows = {}
        for name, extra in (("users", {"vllm_url": url}), ("own", {})):
            cfg = TrainConfig(model="smollm2-135m-instruct", out=str(tmp_path / name), steps=2, prompts_per_step=4,
                              micro_batch=4, max_new_tokens=16, lora_rank=8, save_every=0, report_to="none",
                              sampler="vllm-server", backend="hf", device="cpu", **extra)
            train(cfg, pairs=pairs, show_progress=False)
            rows[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        execution = json.loads((tmp_path / "users" / "run.json").read_text())["execution"]
        assert execution["sampler"] == "VLLMServerSampler" and execution["vllm_max_model_len"] == 1024
        # a route the server was started without (full fine-tuning's weight reload): the error says how to start it
        with pytest.raises(RuntimeError, match=r"/collective_rpc: HTTP 404: .*VLLM_SERVER_DEV_MODE=1"):
            VLLMServerSampler([], url=url)._request("/collective_rpc", {"method": "opct_reload_weights"})
        # the LLM judge's pre-flight (one 1-token chat completion) against the same real server
        endpoint.check(url, str(users))
        with pytest.raises(EndpointError, match="HTTP 404.*no-such-model"):
            endpoint.check(url, "no-such-model")
    finally:
        os.killpg(server.pid, 15)
        server.wait(120)
    assert "Loaded new LoRA adapter" in (tmp_path / "server.log").read_text()  # the steps' adapters reached it
    assert len(rows["users"]) == len(rows["own"]) == 2
    for x, y in zip(rows["users"], rows["own"]):
        assert x["sampler_logp_gap"] < 1e-4 and x["response_tokens"] == y["response_tokens"]
        for k in ("loss", "kl", "logp_student", "logp_teacher"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), k


def test_torchrun_two_ranks_one_vllm_engine_each_match_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m opct train --sampler vllm` on this CPU: each rank has its own engine and
    samples its half of the step's prompts with the request seeds one process would use, so the per-step metrics
    match a single-process run (up to fp32 batch-composition noise)."""
    import os
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pairs = Path(__file__).parents[2] / "examples" / "pairs.jsonl"
    args = ["train", "--model", "smollm2-135m-instruct", "--pairs", str(pairs), "--steps", "2",
            "--prompts-per-step", "4", "--micro-batch", "4", "--max-new-tokens", "12", "--lora-rank", "8",
            "--save-every", "0", "--report-to", "none", "--sampler", "vllm", "--backend", "hf", "--device", "cpu",
            "--threads", "1", "--vllm-kv-cache-gib", "1"]
    # each process makes its own vLLM socket directory (not one an engine of this test process set or removed)
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    for cmd in ([sys.executable, "-m", "opct", *args, "--out", str(one)],
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(port), "-m", "opct", *args, "--out", str(two)]):
        p = run_tree(cmd, 1200, env)  # past the timeout every rank (and its engine) is killed
        # each engine exits on SIGTERM within close()'s grace period: none SIGKILLed, no shared memory left behind
        assert "force killing" not in p.stderr and "leaked shared_memory" not in p.stderr, p.stderr[-3000:]
    a = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert y["sampler_logp_gap"] < 1e-4
        assert y["response_tokens"] == x["response_tokens"]
        for k in ("loss", "kl", "logp_student", "logp_teacher", "grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-3, abs=1e-4), k
    assert json.loads((two / "run.json").read_text())["execution"]["processes"] == 2


def test_a_failed_run_or_an_unclosed_sampler_leaves_no_vllm_server_running(model_dir, tmp_path):
    """`vllm serve` runs in a session of its own, so nothing stops it along with opct: a run that fails (a NaN at
    step 1) closes it on the way out of the harness, and a process that exits without closing its sampler stops
    it at interpreter exit (atexit)."""
    import os
    import subprocess
    import sys

    import psutil

    from opct.backends.vllm_sampler import API_SERVER

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("vLLM's first-call compile needs a C++ compiler")

    def servers():
        return {p.pid for p in psutil.process_iter(["cmdline"]) if API_SERVER in " ".join(p.info["cmdline"] or [])}

    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    before = servers()
    pairs = Path(__file__).parents[2] / "examples" / "pairs.jsonl"
    p = subprocess.run([sys.executable, "-m", "opct", "train", "--pairs", str(pairs), "--out", str(tmp_path / "run"),
                        "--steps", "2", "--prompts-per-step", "4", "--max-new-tokens", "4", "--lora-rank", "8",
                        "--sampler", "vllm-server", "--backend", "hf", "--device", "cpu", "--threads", "1",
                        "--report-to", "none", "--kl-coef", "1e39", "--lr", "1e6"],
                       capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 2 and "not finite" in p.stderr, p.stderr[-3000:]
    assert servers() <= before

    code = ("import sys; from opct.backends.vllm_sampler import VLLMServerSampler; "
            "s = VLLMServerSampler([], model_dir=sys.argv[1]); print(s.proc.pid, flush=True); sys.exit(3)")
    p = subprocess.run([sys.executable, "-c", code, model_dir], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 3, p.stderr[-3000:]
    pid = int(p.stdout.split()[-1])
    assert pid not in servers() and servers() <= before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode needs a CUDA device")
@pytest.mark.parametrize("level", [1, 2])
def test_an_adapter_applies_after_every_wake_from_sleep(model_dir, tok, prompts, level):
    """--vllm-sleep on a GPU: after each sleep and wake (the weights offloaded or dropped, the KV cache dropped) and
    the sync that follows, greedy answers are the adapter's, not the base model's (LoRA that silently stops applying
    after a wake is a known vLLM trap)."""
    model = student(model_dir)
    greedy = SamplingSettings(16, 0.0, 1.0, 0)
    with VLLMSampler(model_dir, {tok.eos_token_id}, lora_rank=8, sleep_level=level,
                     gpu_memory_utilization=0.3) as s:
        base = s.sample(prompts, greedy, 0)[0]
        s.sync(model, 0)
        adapted = s.sample(prompts, greedy, 0)[0]
        assert adapted != base
        for step in (1, 2):
            s.rest()
            s.wake()
            s.sync(model, step)
            assert s.sample(prompts, greedy, 0)[0] == adapted, step


def vllm_sized_tiny_model(path):
    """The suite's tiny random Llama, with a head size vLLM's CPU attention takes (hidden 128, 4 heads: 32) and a
    context of 4096 (vLLM refuses an engine context above the model's)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import make_tiny_model

    make_tiny_model(path, hidden=128)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return path


def lm_eval_can_see_vllm_cpu(tmp_path, monkeypatch):
    """lm-eval's vLLM model asks importlib.metadata for the version of a distribution named "vllm"; vllm-cpu's is
    named vllm-cpu. A metadata-only alias (no code: the package is vllm-cpu's own) on the path of this process and
    of the engines it starts (vLLM reads "+cpu" in that version as its CPU platform)."""
    import importlib.metadata

    version = importlib.metadata.version("vllm-cpu")
    alias = tmp_path / "alias" / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(parents=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    monkeypatch.syspath_prepend(str(alias.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(alias.parent), os.environ.get("PYTHONPATH"))
                                                     if p))
    assert importlib.metadata.version("vllm") == f"{version}+cpu"


def test_the_demo_through_vllm_runs_end_to_end_and_matches_the_policy_demo(tmp_path, monkeypatch):
    """`opct demo --sampler vllm --eval-engine vllm` (what a GPU user's demo runs) end to end on vllm-cpu, beside
    the same demo with --sampler policy --eval-engine policy, on a tiny random model. Through vLLM: OPCT's samples
    (the weights synced and checked before every step: the sampler follows the trainer), and capability retention
    through lm-eval's own vLLM model (the trained adapters merged into copies of the base). The same numbers where
    the two demos compute the same thing: every evaluation of base and SFT (one-prefill readings through the backend
    on both), and capability on base and SFT (lm-eval's vLLM model against opct's policy: log-likelihoods and greedy
    generations in float32). OPCT's own samples come from another random stream (vLLM's per-request seeds), so its
    results are not compared; its importance weights hold the bound pinned for float32 (within 1e-4 of 1)."""
    from opct import cli

    lm_eval_can_see_vllm_cpu(tmp_path, monkeypatch)
    model = vllm_sized_tiny_model(tmp_path / "tiny")
    common = ["demo", "--model", str(model), "--steps", "3", "--n-train", "8", "--n-eval", "8", "--cued-n", "8",
              "--shift-n", "8", "--probe-every", "0", "--capability", "arc_easy,gsm8k", "--capability-limit", "4",
              "--threads", "2", "--report-to", "none", "--lora-rank", "8"]
    runs = {}
    for engine in ("vllm", "policy"):
        out = tmp_path / engine
        assert cli.main([*common, "--out", str(out), "--sampler", engine, "--eval-engine", engine]) == 0
        runs[engine] = json.loads((out / "results.json").read_text())
    v, p = runs["vllm"], runs["policy"]
    for r in ("base", "sft-seed0"):
        assert v["runs"][r] == p["runs"][r], r
    for task in ("arc_easy", "gsm8k"):
        cap_v, cap_p = v["capability"][task]["methods"], p["capability"][task]["methods"]
        for m in ("base", "sft"):
            assert cap_v[m]["value"] == cap_p[m]["value"] and cap_v[m]["n"] == cap_p[m]["n"] == 4, (task, m)
        assert cap_v["opct"]["n"] == 4
    rows = [json.loads(x) for x in (tmp_path / "vllm" / "opct-seed0" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert abs(r["is_weight_mean"] - 1) < 1e-4 and r["is_truncated"] == 0 and r["sampler_logp_gap"] < 1e-4
    assert all(r["sync_gap_trainer"] < 1e-4 < r["sync_drift"] for r in rows[1:])
    execution = json.loads((tmp_path / "vllm" / "opct-seed0" / "run.json").read_text())["execution"]
    assert execution["sampler"] == "VLLMSampler"
    policy_run = json.loads((tmp_path / "policy" / "opct-seed0" / "run.json").read_text())
    assert policy_run["execution"].get("sampler") is None
