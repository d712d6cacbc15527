"""The vLLM policy wrapper with a stand-in sampler (no vllm needed): sampling goes to the sampler, scoring and
gradients stay with the training backend, weights are synced after every step, and the log-prob gap is logged."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opct.algo.opct import train
from opct.backends import vllm as vllm_backend
from tests.train.test_train import Killed, cfg_for, make_pairs


class FakeSampler:
    def __init__(self):
        self.synced, self.closed = [], False

    def sample(self, prompts, settings, seed, first=0):
        responses = [[100 + (i + seed) % 7, 200, 2][: settings.max_new_tokens] for i in range(len(prompts))]
        return responses, [[0.0] * len(r) for r in responses]  # "log-prob 0": the gap is -logp_student

    def sync(self, model, step):
        self.synced.append(step)
        return 0.0

    def prompt_logprobs(self, seqs_N, starts_N):  # the sync check's probe: "log-prob 0", as sample's
        return [[0.0] * (len(s) - st) for s, st in zip(seqs_N, starts_N)]

    def close(self):
        self.closed = True


@pytest.mark.parametrize("micro_batch", [6, 2])
def test_vllm_policy_samples_through_the_sampler_and_syncs_every_step(tiny_model_dir, tmp_path, monkeypatch,
                                                                     micro_batch):
    fake = FakeSampler()
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: fake)
    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)  # vllm need not be installed: the sampler is fake
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=3, sampler="vllm", micro_batch=micro_batch), pairs=make_pairs(),
          show_progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert fake.synced == [0, 1, 2, 3] and fake.closed
    for r in rows:
        assert r["response_len"] == 3 and r["sampler_logp_gap"] == pytest.approx(-r["logp_student"], rel=1e-5)
    info = json.loads((out / "run.json").read_text())
    assert info["execution"]["sampler"] == "FakeSampler"


class SleepingSampler(FakeSampler):
    """Records the order of what the policy asks of an engine with vLLM's sleep mode (--vllm-sleep)."""
    sleep_level = 1

    def __init__(self):
        super().__init__()
        self.events = []

    def sample(self, prompts, settings, seed, first=0):
        self.events.append("sample")
        return super().sample(prompts, settings, seed, first)

    def sync(self, model, step):
        self.events.append(f"sync{step}")
        return super().sync(model, step)

    def rest(self):
        self.events.append("rest")

    def wake(self):
        self.events.append("wake")


def test_a_sleeping_engine_rests_after_sampling_and_wakes_before_each_sync(tiny_model_dir, tmp_path, monkeypatch):
    """--vllm-sleep: the engine frees its memory while the trainer scores and steps, and is woken before the new
    weights are synced into it, so an adapter is always loaded into an awake engine; wake time is logged."""
    fake = SleepingSampler()
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: fake)
    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=2, sampler="vllm"), pairs=make_pairs(), show_progress=False)
    assert fake.events == ["sync0", "sample", "rest", "wake", "sync1", "sample", "rest", "wake", "sync2"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("wake_seconds" in r for r in rows)


def test_sleep_mode_is_refused_where_vllm_cannot_sleep(tiny_model_dir, monkeypatch):
    from opct.backends.base import BackendError
    from opct.config import TrainConfig

    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    for sampler in ("vllm", "vllm-server"):  # on the CPU; a server's sleep is not driven by opct
        with pytest.raises(BackendError, match="--vllm-sleep 1: vLLM's sleep mode needs --sampler vllm"):
            spec = vllm_backend.sampler_spec(TrainConfig(model=str(tiny_model_dir), sampler=sampler, vllm_sleep=1))
            vllm_backend.make_sampler(spec, [2], device=torch.device("cpu"), dtype=torch.float32)


def test_the_engine_context_fits_the_longest_prompt_and_response(tiny_model_dir, tmp_path, monkeypatch):
    """The training loop sizes vLLM's max_model_len from the rendered student prompts (a fixed 2048 made a run with
    longer prompts fail when vLLM refused the first request), and run.json records it."""
    import importlib.util

    assert vllm_backend.needed_model_len([10, 30], 64) == vllm_backend.DEFAULT_MAX_MODEL_LEN
    assert vllm_backend.needed_model_len([2000, 30], 100) == 2100
    assert vllm_backend.needed_model_len([], 4096) == 4096

    seen = {}

    class Engine(FakeSampler):  # stands in for vllm_engine.VLLMSampler inside make_sampler
        def __init__(self, model_dir, eos_ids, *, max_model_len, **kw):
            super().__init__()
            seen.update(kw, model_dir=model_dir)
            self.max_model_len = seen["max_model_len"] = max_model_len

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else
                        real_find_spec(name, *a))
    monkeypatch.setattr(vllm_backend, "colocated", lambda: SimpleNamespace(VLLMSampler=Engine))
    monkeypatch.setattr(vllm_backend, "needed_model_len", lambda lengths, new: max(lengths) + new)  # the lengths
    out = tmp_path / "run"
    cfg = cfg_for(tiny_model_dir, out, steps=1, sampler="vllm")
    train(cfg, pairs=make_pairs(), show_progress=False)

    from transformers import AutoTokenizer

    from opct.data.chat import render_prompt
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    longest = max(len(render_prompt(tok, p.student)) for p in make_pairs())
    assert seen["max_model_len"] == longest + cfg.max_new_tokens
    assert json.loads((out / "run.json").read_text())["execution"]["vllm_max_model_len"] == seen["max_model_len"]


def test_the_kv_cache_size_reaches_vllm_as_a_whole_number_and_its_sockets_a_fresh_directory(monkeypatch):
    from opct.backends import vllm_sampler
    from opct.config import TrainConfig, validate
    from opct.options import ConfigError

    monkeypatch.setattr(vllm_sampler, "_USER_SET", frozenset())
    env = {}
    rpc = vllm_sampler._set_env_defaults(env, 1.0)  # the config default is a float
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # vLLM reads it with int(): "1.0" stopped its engine
    # and the engine's sockets go to the fresh short directory the sampler removes on close
    assert rpc and Path(rpc).is_dir() and env["VLLM_RPC_BASE_PATH"] == rpc and len(rpc) < 40
    Path(rpc).rmdir()
    with pytest.raises(ConfigError, match="vllm-kv-cache-gib"):
        validate(TrainConfig(vllm_kv_cache_gib=1.5))


def test_a_server_given_by_url_is_checked_before_use_and_its_loss_is_named(monkeypatch):
    """--vllm-url: a server that answers /health passes (its OpenAI base URL `.../v1` too); one that does not is
    named with the reason, so is one without run-time LoRA routes (with LoRA) or with too short a context; its base
    model name comes from /v1/models; a server that stops mid-run gives an error naming the URL, not a bare urlopen
    error."""
    import http.server
    import threading

    from opct.backends import BackendError, check_training
    from opct.backends.sampling import SamplingSettings
    from opct.backends.vllm import make_sampler, sampler_spec
    from opct.backends.vllm_sampler import VLLMServerSampler, unreachable
    from opct.config import TrainConfig

    lora_routes, key = [True], [None]

    class Server(http.server.BaseHTTPRequestHandler):
        def refused(self):  # vLLM's --api-key guards /v1/*
            if self.path.startswith("/v1") and key[0] and self.headers.get("Authorization") != f"Bearer {key[0]}":
                self.send_response(401)
                self.end_headers()
                self.wfile.write(b'{"error": "Unauthorized"}')
                return True
            return False

        def do_GET(self):
            if self.refused():
                return
            body = {"/v1/models": b'{"data": [{"id": "/models/m", "max_model_len": 512, "parent": null}, '
                                  b'{"id": "an-adapter", "parent": "/models/m"}]}', "/health": b""}.get(self.path)
            self.send_response(404 if body is None else 200)
            self.end_headers()
            self.wfile.write(body or b"")

        def do_POST(self):
            if self.refused():
                return
            name = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["lora_name"]
            if not (lora_routes[0] and self.path == "/v1/load_lora_adapter"):  # vLLM's answer for a missing route
                code, body = 404, b'{"error": {"message": "Not Found", "type": "Not Found", "code": 404}}'
            elif not name:
                code, body = 400, b'{"error": {"message": "Both lora_name and lora_path must be provided."}}'
            else:  # vLLM's answer for an adapter path it cannot read
                code, body = 404, b'{"error": {"message": "Loading lora x failed: No adapter found for /x"}}'
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    cfg = TrainConfig(sampler="vllm-server", vllm_url=url + "/v1", lora_rank=20, max_new_tokens=100)
    try:
        assert unreachable(url) is None and unreachable(url + "/v1/") is None
        check_training(cfg, torch.float32, "hf", sampler_spec(cfg))
        cpu = dict(device=torch.device("cpu"), dtype=torch.float32)
        sampler = make_sampler(sampler_spec(cfg), [2], prompt_lengths=[300, 412], **cpu)
        assert sampler.url == url and sampler.served == "/models/m" and sampler.max_model_len == 512
        with pytest.raises(RuntimeError, match=r"No adapter found for /x\"}}; the server reads the adapters opct writes"):
            sampler._request("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
        with pytest.raises(BackendError, match=rf"--vllm-url {url}/v1: the server's context is 512 tokens .*this "
                                               r"run needs 513 \(its longest prompt, 413, \+ --max-new-tokens 100\)"):
            make_sampler(sampler_spec(cfg), [2], prompt_lengths=[413], **cpu)
        lora_routes[0] = False
        with pytest.raises(BackendError, match=r"cannot load LoRA adapters .*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and "
                                               r"--enable-lora --max-lora-rank 32$"):
            check_training(cfg, torch.float32, "hf", sampler_spec(cfg))
        # full fine-tuning: no LoRA
        full = TrainConfig(sampler="vllm-server", vllm_url=url, lora_rank=0)
        check_training(full, torch.float32, "hf", sampler_spec(full))
        key[0] = "s3cret"  # a server started with --api-key
        with pytest.raises(BackendError, match=rf"--vllm-url {url}/v1: it wants an API key: set \$OPCT_VLLM_API_KEY"):
            check_training(cfg, torch.float32, "hf", sampler_spec(cfg))
        monkeypatch.setenv("OPCT_VLLM_API_KEY", "wrong")
        with pytest.raises(BackendError, match=r"it refused the API key in \$OPCT_VLLM_API_KEY"):
            check_training(cfg, torch.float32, "hf", sampler_spec(cfg))
        monkeypatch.setenv("OPCT_VLLM_API_KEY", "s3cret")
        assert VLLMServerSampler([2], url=url).served == "/models/m"  # requests carry the key
        key[0] = None
        with pytest.raises(RuntimeError, match=r"/v1/load_lora_adapter: HTTP 404: .*VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            sampler._request("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(BackendError, match=rf"--vllm-url {url}: no vLLM server answers there \(.*refused"):
        gone = TrainConfig(sampler="vllm-server", vllm_url=url)
        check_training(gone, torch.float32, "hf", sampler_spec(gone))
    with pytest.raises(RuntimeError, match=rf"{url}/v1/completions: the vLLM server did not answer .*has it stopped"):
        sampler.sample([[1, 2]], SamplingSettings(4, 1.0, 1.0, 0), seed=0)
    sampler.close()


def test_a_lora_rank_vllm_cannot_hold_is_refused_with_a_vllm_sampler():
    from opct.backends.vllm_sampler import max_lora_rank
    from opct.config import TrainConfig, validate
    from opct.options import ConfigError

    assert [max_lora_rank(r) for r in (1, 8, 9, 33, 512)] == [8, 8, 16, 64, 512]
    validate(TrainConfig(lora_rank=1024))  # the training backend alone has no such limit
    with pytest.raises(ConfigError, match="lora-rank.*must be <= 512 with a vLLM sampler"):
        validate(TrainConfig(sampler="vllm", lora_rank=1024))


@pytest.mark.parametrize("served", ["the trained model", "another model"])
def test_a_users_server_must_serve_the_model_being_trained(tiny_model_dir, tmp_path, monkeypatch, served):
    """A server given by --vllm-url is probed once its first weights are synced: vLLM's log-probs of a fixed text
    against the trainer's. The same model passes; another one is refused before any step (exit 2 from the CLI)."""
    from opct.backends import BackendError

    class UsersServer(FakeSampler):
        external, url, model_name = True, "http://127.0.0.1:1", "/models/other"

        def prompt_logprobs(self, seqs, starts):
            self.probed = [s[st:] for s, st in zip(seqs, starts)]
            if served == "another model":
                return [[-0.7] * len(t) for t in self.probed]
            policy = self.policy  # the trainer's own numbers, standing in for vLLM's on the same weights
            ids = seqs[0]
            return [policy.inner.score([ids[:1]], vllm_backend.Rollout([ids[:1]], [ids[1:]]), grad=False)
                    .logp_NT[0].add(1e-5).tolist()]

    fake = UsersServer()
    real_init = vllm_backend.VLLMPolicy.__init__

    def init(self, inner, sampler, **kw):
        sampler.policy = self
        real_init(self, inner, sampler, **kw)

    monkeypatch.setattr(vllm_backend.VLLMPolicy, "__init__", init)
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: fake)
    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    # (the per-step sync check, which probes too, off: tested below)
    cfg = cfg_for(tiny_model_dir, tmp_path / "run", steps=1, sampler="vllm-server", sampler_check_every=0)
    if served == "another model":
        with pytest.raises(BackendError, match=r"http://127.0.0.1:1: the server's model \(/models/other\) is not the "
                                               r"one being trained: .* by \d+\.\d{3} nats a token"):
            train(cfg, pairs=make_pairs(), show_progress=False)
        assert fake.closed and not (tmp_path / "run" / "metrics.jsonl").exists()
    else:
        train(cfg, pairs=make_pairs(), show_progress=False)
        assert fake.synced == [0, 1] and len(fake.probed[0]) > 5


def test_a_resumed_run_syncs_the_checkpoints_weights_before_its_first_sample(tiny_model_dir, tmp_path, monkeypatch):
    """--resume with a vLLM sampler: the checkpoint's weights reach vLLM before the first resumed step samples (not
    the freshly built adapter that the engine was given when the policy was made)."""

    class Recording(FakeSampler):
        def sync(self, model, step):
            weights = sum(float(p.detach().double().sum()) for p in model.parameters() if p.requires_grad)
            self.synced.append((step, weights))
            return 0.0

    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    out = tmp_path / "run"
    first = Recording()
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: first)

    def stop_after_step_3(policy, fmt):
        if len(first.synced) == 4:  # steps 1-3 done, the step-2 checkpoint written
            raise Killed

    with pytest.raises(Killed):
        train(cfg_for(tiny_model_dir, out, steps=4, save_every=2, sampler="vllm"), pairs=make_pairs(),
              probe=stop_after_step_3, probe_every=1, show_progress=False)
    again = Recording()
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: again)
    train(cfg_for(tiny_model_dir, out, steps=4, save_every=2, sampler="vllm", resume=True), pairs=make_pairs(),
          show_progress=False)
    assert [s for s, _ in first.synced] == [0, 1, 2, 3] and [s for s, _ in again.synced] == [0, 2, 3, 4]
    assert again.synced[1][1] == first.synced[2][1] != again.synced[0][1]  # step 2's weights, served before step 3


def test_ranks_sharing_one_server_load_their_adapters_under_their_own_names(tiny_model_dir, tmp_path, monkeypatch):
    """--vllm-url under torchrun: every rank syncs its adapter into the same server, which refuses a name it has
    already loaded (as vLLM does), so each rank's adapter names carry its rank."""
    import http.server
    import threading

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opct.backends.vllm_sampler import VLLMServerSampler
    from opct.models import peft_quietly

    loaded = []

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"data": [{"id": "m", "max_model_len": 512, "parent": null}]}')

        def do_POST(self):
            name = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["lora_name"]
            fresh = self.path != "/v1/load_lora_adapter" or name not in loaded
            if self.path == "/v1/load_lora_adapter" and fresh:
                loaded.append(name)
            self.send_response(200 if fresh else 400)
            self.end_headers()
            self.wfile.write(b"Success" if fresh else b'{"error": {"message": "already been loaded"}}')

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with peft_quietly():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                               LoraConfig(r=4, target_modules="all-linear"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            with VLLMServerSampler([2], url=f"http://127.0.0.1:{server.server_port}", lora_rank=4,
                                   workdir=str(tmp_path / f"rank{rank}")) as sampler:
                sampler.sync(model, 0)
                sampler.sync(model, 1)
    finally:
        server.shutdown()
        server.server_close()
    assert loaded == ["opct-rank0-step0-v1", "opct-rank0-step1-v2", "opct-rank1-step0-v1", "opct-rank1-step1-v2"]


@pytest.mark.parametrize("device,cuda_graphs,lora_rank,want", [("cuda", True, 8, False), ("cuda", False, 8, True),
                                                                ("cuda", True, 0, True), ("cpu", True, 8, None)])
def test_an_engine_on_a_gpu_captures_cuda_graphs_for_lora_unless_they_are_off(monkeypatch, tiny_model_dir, device,
                                                                                cuda_graphs, lora_rank, want):
    """In-process vLLM on a GPU: enforce_eager = not (cuda_graphs and LoRA), with the configured share of the GPU's
    memory (a full fine-tune's weight reload is not known to keep graph addresses); on the CPU neither is passed
    (the sampler's eager default)."""
    import torch

    from opct.config import TrainConfig

    seen = {}

    class Engine:
        def __init__(self, model_dir, eos_ids, **kw):
            seen.update(kw)

    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(vllm_backend, "colocated", lambda: SimpleNamespace(VLLMSampler=Engine))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = TrainConfig(model=str(tiny_model_dir), sampler="vllm", cuda_graphs=cuda_graphs, vllm_gpu_memory=0.25,
                      lora_rank=lora_rank)
    vllm_backend.make_sampler(vllm_backend.sampler_spec(cfg), [2], prompt_lengths=[10], device=torch.device(device),
                              dtype=torch.float32)
    assert seen.get("enforce_eager") is want
    assert seen.get("gpu_memory_utilization") == (0.25 if device == "cuda" else None)


class SnapshotSampler(FakeSampler):
    """Serves a copy of the weights of its last sync, as vLLM does; `stale`: only the first sync takes effect (the
    failure of verl #7495: the new adapter never loaded, the engine keeps the initial weights)."""

    def __init__(self, stale=False):
        super().__init__()
        self.stale, self.served = stale, None

    def sync(self, model, step):
        super().sync(model, step)
        if self.served is None or not self.stale:
            self.served = copy.deepcopy(model).eval()
        return 0.0

    def prompt_logprobs(self, seqs_N, starts_N):
        with torch.no_grad():
            logp = [self.served(input_ids=torch.tensor([s])).logits[0].float().log_softmax(-1) for s in seqs_N]
        return [[float(lp[t - 1, s[t]]) for t in range(st, len(s))] for lp, s, st in zip(logp, seqs_N, starts_N)]


def test_a_sampler_that_serves_the_trained_weights_passes_every_sync_check(tiny_model_dir, tmp_path, monkeypatch):
    """After each sync the sampler's log-probs of the probe (the first rollout's longest samples) equal the
    trainer's, while the trainer moves away from the initial model: logged with the step they precede, never a
    strike."""
    fake = SnapshotSampler()
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: fake)
    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=4, sampler="vllm", backend="hf"), pairs=make_pairs(),
          show_progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "sync_gap_trainer" not in rows[0]  # step 1 samples before the first check (after step 1's sync)
    for r in rows[1:]:
        assert r["sync_gap_trainer"] < 1e-5 and r["sync_drift"] > 1e-3
        assert r["sync_gap_initial"] == pytest.approx(r["sync_drift"], rel=1e-3)
    assert (out / "run.json").is_file()


@pytest.mark.parametrize("every", [1, 2])
def test_a_sampler_whose_sync_does_not_take_effect_stops_the_run_with_exit_1(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys, every):
    """The sabotaged sync (the engine keeps the initial weights): the second check in a row stops the run, exit 1,
    one line saying what was seen; nothing is marked finished. Checked every `--sampler-check-every` steps."""
    from opct import cli
    from opct.data.pairs import save_pairs

    fake = SnapshotSampler(stale=True)
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: fake)
    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    save_pairs(make_pairs(), tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    rc = cli.main(["train", "--pairs", str(tmp_path / "pairs.jsonl"), "--model", str(tiny_model_dir), "--out",
                   str(out), "--steps", "8", "--prompts-per-step", "3", "--samples-per-prompt", "2",
                   "--max-new-tokens", "6", "--lr", "1e-2", "--lora-rank", "4", "--save-every", "0",
                   "--report-to", "none", "--device", "cpu", "--backend", "hf", "--sampler", "vllm",
                   "--sampler-check-every", str(every)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    stopped = 2 * every  # the checks of the syncs after steps every and 2 * every: two strikes
    assert err[-1].startswith(f"opct: error: after step {stopped}: the vLLM sampler does not serve the trained "
                              "weights: on ") and "(2 checks in a row)" in err[-1]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == stopped and not (out / "run.json").exists() and fake.closed
    first = rows[every]  # the first strike, logged with the step it preceded: the initial model to the last bit
    assert first["sync_gap_initial"] < 1e-6 and first["sync_gap_trainer"] > 1e-3
    assert all("sync_gap_trainer" not in r for i, r in enumerate(rows) if i % every)


def test_the_sync_check_can_be_turned_off(tiny_model_dir, tmp_path, monkeypatch):
    fake = SnapshotSampler(stale=True)
    monkeypatch.setattr(vllm_backend, "make_sampler", lambda cfg, eos_ids, prompt_lengths, **kw: fake)
    monkeypatch.setattr(vllm_backend, "check", lambda cfg: None)
    out = tmp_path / "run"
    train(cfg_for(tiny_model_dir, out, steps=3, sampler="vllm", backend="hf", sampler_check_every=0),
          pairs=make_pairs(), show_progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and not any("sync_gap_trainer" in r for r in rows)


def test_an_evaluations_engine_starts_only_when_the_evaluation_first_generates():
    """inference_sampler's engine is Deferred: an evaluation that never generates (sycophancy reads its answers in
    one prefill) starts none, and closing it then starts nothing."""
    started = []

    def start():
        started.append(1)
        return FakeSampler()

    lazy = vllm_backend.Deferred(start)
    lazy.close()
    assert started == []
    lazy = vllm_backend.Deferred(start)
    responses, _ = lazy.sample([[1, 2]], type("S", (), {"max_new_tokens": 2})(), seed=0)
    lazy.close()
    assert started == [1] and len(responses[0]) == 2 and lazy._sampler.closed
