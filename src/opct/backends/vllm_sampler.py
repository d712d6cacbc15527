"""vLLM as the student's sampler: rollouts from a vLLM engine, kept on the trainer's current weights every step.

Two modes with one interface (`sample`, `sync`, `prompt_logprobs`, `close`):

- `VLLMSampler` (opct.backends.vllm_engine, the one module that imports vllm): in-process, a colocated `vllm.LLM`.
  Its engine core runs in a spawned child process, so a script that builds one needs the
  `if __name__ == "__main__":` guard (pytest does not).
- `VLLMServerSampler`: a running `vllm serve`, reached over its OpenAI-compatible `/v1/completions` with prompt token
  ids in and token ids out (stdlib HTTP only, so opct's venv needs no vllm: the server may live in another venv with
  other pins). Pass `url=` for a server you started, or `model_dir=` and it starts one on 127.0.0.1 and stops it on
  `close()`.

Sampling: every setting is explicit (`SamplingSettings`: temperature, top_p, top_k, max_new_tokens); the engine is
built with `generation_config="vllm"` so nothing comes from the model's generation_config.json; generation stops at
the given EOS ids (the EOS is kept in the response, as opct's decoder does); token ids are returned as sampled, never
re-tokenised from text; each request has its own seed, a hash of (seed, prompt index), so a step is reproducible and
no two prompts share a random stream.

Log-probs: vLLM's default `logprobs_mode` is `raw_logprobs`, the log-softmax of the model's logits before
temperature / top-k / top-p, which is the same quantity as the trainer's temperature-1 log-probs. They come back
for monitoring only (the sampler-vs-trainer gap); the loss must use the trainer's own log-probs.

Weight sync (`sync(model, step)`), by the kind of `model`:
- a PEFT model (LoRA): the adapter is saved to a fresh directory and loaded under a fresh adapter id (in-process an
  increasing integer, on a server a new name; the server gives each name a new integer id). vLLM caches adapters by
  id: a request that reuses a resident id with a new path is served the OLD weights. The previous adapter is then
  removed and its directory deleted. vLLM's prefix cache is keyed by adapter, so no KV computed with old weights is
  reused.
- a plain model (full fine-tuning): reload from disk. The weights are saved as safetensors to a fresh directory
  and `opct.backends.vllm_worker.WeightSync.opct_reload_weights`, mixed into vLLM's worker, reloads them into the
  running model in place (vLLM's `reload_weights`, plus re-tying shared parameters such as tied embeddings, which
  that reload leaves stale); then the prefix cache is reset (cached prompt KV was computed with the old weights).
  This needs only a shared filesystem and works on CPU and through a server (its dev endpoint `/collective_rpc`,
  which needs `VLLM_SERVER_DEV_MODE=1` and `--worker-extension-cls opct.backends.vllm_worker.WeightSync`; both set
  when we start the server). Pushing tensors through vLLM's weight-transfer engine would skip the disk but needs
  NCCL or CUDA IPC. Full fine-tuning takes an engine built with `lora_rank=0`.
The sampler serves the base weights until the first `sync`; call `sync(model, 0)` before the first step.

On CPU vLLM reserves `VLLM_CPU_KVCACHE_SPACE` GiB for the KV cache (default here 1), and writes zmq sockets,
compiled kernels and caches under `VLLM_RPC_BASE_PATH`, `TORCHINDUCTOR_CACHE_DIR` and `VLLM_CACHE_ROOT`; unless they
are set, the sockets go to a fresh directory removed on `close()` and the caches under opct's cache directory,
where the compiled kernels survive between runs.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from opct.models import cache_dir

DEFAULT_MAX_MODEL_LEN = 2048  # an engine's context when the run's prompts + responses are shorter

WORKER_EXT = "opct.backends.vllm_worker.WeightSync"
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
ENGINE_EXIT_S = 60.0  # seconds the engine's processes get to exit on SIGTERM before vLLM SIGKILLs them


def request_seed(seed: int, i: int) -> int:
    """The seed of prompt i's request in a step seeded `seed`: a hash, so neighbouring steps never share streams."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank `rank`."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({LORA_RANKS[-1]})")


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


ENV_KEYS = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_RPC_BASE_PATH", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")
_USER_SET = frozenset(k for k in ENV_KEYS if k in os.environ)  # the user's values win over ours


def _set_env_defaults(environ, kv_cache_gib: float) -> str | None:
    """vLLM's CPU settings and housekeeping directories in `environ` (os.environ for an in-process engine, a copy
    for a server), where the user did not set them. The zmq sockets go to a fresh short directory under the temp
    dir (set anew per sampler, and short: a socket path is limited to 107 characters). Returns that directory, to
    be deleted on close, or None when the user chose the socket directory."""
    rpc = None if "VLLM_RPC_BASE_PATH" in _USER_SET else tempfile.mkdtemp(prefix="opct-vllm-rpc-")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),  # vLLM parses it with int(): "1.0" is an error
           "VLLM_RPC_BASE_PATH": str(rpc),
           "VLLM_CACHE_ROOT": str(cache_dir() / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir() / "vllm" / "inductor")}
    for k, v in env.items():
        if k not in _USER_SET:
            environ[k] = v
    return rpc


class _Versions:
    """Fresh directories (and, in-process, fresh adapter ids) for each synced weight version; the previous one is
    deleted once the new one is live."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.next_id = 1
        self.current: tuple[int, Path] | None = None  # (id, dir) being served

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def save(self, model, step: int) -> tuple[int, Path]:
        vid = self.new_id()
        d = self.workdir / f"weights-step{step}-v{vid}"
        model.save_pretrained(d)  # a PEFT model writes its adapter only; safetensors either way
        return vid, d

    def retire(self, new: tuple[int, Path]) -> tuple[int, Path] | None:
        old, self.current = self.current, new
        return old


class _Closing:
    """What both samplers do on close: remove the socket directory and a work directory made here; usable as a
    context manager. A sampler that started an engine or a server also closes at interpreter exit if nobody closed
    it before (`_close_at_exit`): a `vllm serve` runs in a session of its own and would outlive opct otherwise."""

    def _close_at_exit(self) -> None:
        atexit.register(self.close)

    def _remove_dirs(self) -> None:
        if getattr(self, "rpc_dir", None):
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            if os.environ.get("VLLM_RPC_BASE_PATH") == str(self.rpc_dir):  # not left pointing at a deleted
                del os.environ["VLLM_RPC_BASE_PATH"]  # directory for later processes to inherit
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def server_root(url: str) -> str:
    """A server's root URL; the OpenAI base URL (`.../v1`) that clients are usually given is accepted too."""
    return url.rstrip("/").removesuffix("/v1")


_LORA_ROUTES = "the server has no run-time LoRA routes: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
_DEV_ROUTES = ("the server cannot reload weights: start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
               "opct.backends.vllm_worker.WeightSync")
SYNC_ROUTES = {"/v1/load_lora_adapter": _LORA_ROUTES, "/v1/unload_lora_adapter": _LORA_ROUTES,
               "/collective_rpc": _DEV_ROUTES, "/reset_prefix_cache": _DEV_ROUTES}


API_KEY_ENV = "OPCT_VLLM_API_KEY"  # the bearer token for a server started with --api-key


def _headers() -> dict:
    key = os.environ.get(API_KEY_ENV)
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _hint(path: str, code: int, text: str) -> str:
    """What an HTTP error from the server most likely means, for the error message."""
    if code == 401:
        return f"; the server wants an API key: set ${API_KEY_ENV}"
    if path == "/v1/load_lora_adapter" and "No adapter found" in text:
        return "; the server reads the adapters opct writes: run it on this machine or on a shared file system"
    if code == 404 and path in SYNC_ROUTES and '"Not Found"' in text:  # the answer for a route the server lacks
        return f"; {SYNC_ROUTES[path]}"
    return ""


def loads_adapters(url: str, timeout: float = 10) -> bool:
    """Whether the server at `url` has vLLM's run-time LoRA routes: a load request with empty names, which such a
    server refuses (HTTP 400) without loading anything, and one without them answers 404."""
    req = urllib.request.Request(server_root(url) + "/v1/load_lora_adapter", method="POST",
                                 data=json.dumps({"lora_name": "", "lora_path": ""}).encode(), headers=_headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return True
    except urllib.error.HTTPError as e:
        return e.code != 404


def unauthorized(url: str, timeout: float = 10) -> str | None:
    """Why the server at `url` refuses this client its /v1/models (it wants an API key, or another one), or None."""
    req = urllib.request.Request(server_root(url) + "/v1/models", headers=_headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        if e.code != 401:
            return None
        return f"it refused the API key in ${API_KEY_ENV}" if API_KEY_ENV in os.environ else \
            f"it wants an API key: set ${API_KEY_ENV}"


def unreachable(url: str, timeout: float = 10) -> str | None:
    """Why the vLLM server at `url` does not answer its /health with 200, or None when it does."""
    try:
        with urllib.request.urlopen(server_root(url) + "/health", timeout=timeout) as r:
            return None if r.status == 200 else f"/health answered HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"/health answered HTTP {e.code}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as e:  # ValueError: not a URL
        return str(getattr(e, "reason", e))


API_SERVER = "vllm.entrypoints.launchers.api_server.entry"  # the module `vllm serve` runs, from vLLM 0.29
API_SERVER_BEFORE_0_29 = "vllm.entrypoints.openai.api_server"  # the server module of 0.26-0.28 (in opct[vllm]'s range)
# The server command's Python code (`python -c SERVER_CODE ARGS`): it picks the module inside the Python that runs
# the server, which may be another venv's (start_server) where opct is not importable, and runs it as `python -m`
# would. Not API_SERVER_BEFORE_0_29 everywhere: from 0.29 it is a shim that warns it is deprecated and "may be
# removed in a future release" (it calls API_SERVER's main). tests/contract/ checks both against the releases.
SERVER_CODE = ("import importlib.util, runpy\n"
               "try:\n"
               f"    m = {API_SERVER!r} if importlib.util.find_spec({API_SERVER!r}) else None\n"
               "except ImportError:\n"
               "    m = None\n"
               f"runpy.run_module(m or {API_SERVER_BEFORE_0_29!r}, run_name='__main__', alter_sys=True)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServerSampler(_Closing):
    """Server mode: `url` of a running `vllm serve` (for LoRA started with --enable-lora, --max-lora-rank at least
    the adapter's and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; for full fine-tuning with VLLM_SERVER_DEV_MODE=1 and
    --worker-extension-cls opct.backends.vllm_worker.WeightSync, where opct is importable; either way it must read
    the adapter or weight files opct writes, so it shares this machine's file system), whose base model name and
    context (`max_model_len`) are read from its /v1/models; or `model_dir` to start one here on 127.0.0.1, serving
    it as `model_name` (`vllm_cmd`: the command before the arguments, default this Python running vLLM's OpenAI API
    server module; `["vllm", "serve"]` also works where that CLI does; its log goes to <workdir>/server.log).
    Every request sets its sampling parameters in full (penalties and min-p neutral), so a server's defaults from
    the model's generation_config.json do not change what is sampled."""

    def __init__(self, eos_ids, *, url: str | None = None, model_dir: str | None = None, model_name: str = "base",
                 dtype: str = "float32", lora_rank: int = 0, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 seed: int = 0, workdir: str | None = None, kv_cache_gib: float = 1, start_timeout: float = 900,
                 vllm_cmd: list[str] | None = None, extra_args: tuple[str, ...] = (), request_timeout: float = 600):
        if (url is None) == (model_dir is None):
            raise ValueError("VLLMServerSampler: pass exactly one of url= (a running server) or model_dir= (start one)")
        self.own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="opct-vllm-serve-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.eos_ids = sorted(int(e) for e in eos_ids)
        self.model_name = model_name
        self.timeout = request_timeout
        self.versions = _Versions(self.workdir)
        # data-parallel ranks sharing one server (--vllm-url under torchrun) each load their own adapters
        self.rank = f"rank{os.environ.get('RANK', '0')}-" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        self.served = model_name  # the model name requests go to: the base, or the current adapter's name
        self.proc = None
        self.max_model_len = max_model_len  # a running server's own: read by _adopt
        self.dtype = dtype if url is None else None  # a running server's is its own
        if url is None:
            url = self._start(model_dir, dtype, lora_rank, max_model_len, seed, kv_cache_gib, start_timeout,
                              vllm_cmd, extra_args)
        self.url = server_root(url)
        self.external = self.proc is None  # a server someone else started
        if self.external:
            self._adopt()

    def _adopt(self) -> None:
        """A running server's base model (the name requests go to while no adapter is loaded) and its context, from
        /v1/models: `vllm serve DIR` serves DIR under its path unless it was given --served-model-name."""
        base = [m for m in self._request("/v1/models")["data"] if not m.get("parent")]
        if not base:
            raise RuntimeError(f"{self.url}/v1/models lists no base model")
        self.model_name = self.served = base[0]["id"]
        self.max_model_len = base[0].get("max_model_len")

    def _start(self, model_dir, dtype, lora_rank, max_model_len, seed, kv_cache_gib, start_timeout, vllm_cmd,
               extra_args) -> str:
        port = _free_port()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
        self.rpc_dir = _set_env_defaults(env, kv_cache_gib)
        # `vllm serve` itself fails in vllm-cpu 0.32.0 (its CLI asks for the version of a distribution named "vllm"),
        # so the default runs the API server module that `vllm serve` runs.
        cmd = list(vllm_cmd or [sys.executable, "-c", SERVER_CODE]) + [
            "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", self.model_name,
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed), "--enforce-eager",
            "--generation-config", "vllm", "--worker-extension-cls", WORKER_EXT]
        if lora_rank > 0:
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_rank)), "--max-loras", "2"]
        cmd += list(extra_args)
        self.cmd = cmd
        self.log_path = self.workdir / "server.log"
        log = self.log_path.open("wb")
        # a session of its own: close() can stop the server and the engine process it spawns, and nothing else
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._close_at_exit()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode}; {self.log_path}:\n{tail}")
            if unreachable(url, timeout=5) is None:
                return url
            time.sleep(1)
        self.close()
        raise TimeoutError(f"vllm serve did not answer {url}/health within {start_timeout} s; see {self.log_path}")

    def _request(self, path: str, body: dict | None = None):
        """GET `path` (no body) or POST `body` as JSON; the answer's JSON (or text)."""
        req = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers=_headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"{self.url}{path}: HTTP {e.code}: {text}{_hint(path, e.code, text)}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise RuntimeError(f"{self.url}{path}: the vLLM server did not answer ({getattr(e, 'reason', e)}); "
                               "has it stopped?") from e
        return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()

    def _complete(self, bodies: list[dict]) -> list[dict]:
        """One request per prompt (each has its own seed), sent together so the server batches them."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(bodies))) as ex:
            return [r["choices"][0] for r in ex.map(lambda b: self._request("/v1/completions", b), bodies)]

    def sample(self, prompts_N: list[list[int]], settings, seed: int,
               first: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        """As `VLLMSampler.sample`, through the server."""
        bodies = [{"model": self.served, "prompt": list(p), "max_tokens": settings.max_new_tokens,
                   "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
                   "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "seed": request_seed(seed, first + i), "stop_token_ids": self.eos_ids, "logprobs": 0,
                   "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
                  for i, p in enumerate(prompts_N)]
        responses, logps = [], []
        for c in self._complete(bodies):
            toks = [int(t) for t in c["token_ids"]]
            lp = c["logprobs"]
            # with return_tokens_as_token_ids the logprob entries are named "token_id:<id>": check they line up
            if [int(s.split(":", 1)[1]) for s in lp["tokens"]] != toks:
                raise RuntimeError(f"{self.url}: log-prob tokens do not match the returned token ids")
            responses.append(toks)
            logps.append([float(x) for x in lp["token_logprobs"]])
        return responses, logps

    def prompt_logprobs(self, seqs_N: list[list[int]], starts_N: list[int]) -> list[list[float]]:
        """As `VLLMSampler.prompt_logprobs`, through the server."""
        # One request at a time: batched prompt log-probs with LoRA kill the engine (see VLLMSampler.prompt_logprobs).
        out = []
        for s, st in zip(seqs_N, starts_N):
            body = {"model": self.served, "prompt": list(s), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
            c = self._request("/v1/completions", body)["choices"][0]
            out.append([float(c["prompt_logprobs"][t][str(s[t])]["logprob"]) for t in range(st, len(s))])
        return out

    def sync(self, model, step: int) -> float:
        """As `VLLMSampler.sync`: a fresh adapter name per step (the server gives it a fresh id), or a reload."""
        t0 = time.perf_counter()
        new = self.versions.save(model, step)
        if _is_peft(model):
            name = f"opct-{self.rank}step{step}-v{new[0]}"
            self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(new[1])})
            old_name, self.served = self.served, name
        else:
            self._request("/collective_rpc", {"method": "opct_reload_weights", "args": [str(new[1])]})
            self._request("/reset_prefix_cache", {})
            old_name, self.served = self.served, self.model_name
        old = self.versions.retire(new)
        if old is not None:
            if old_name != self.model_name:
                self._request("/v1/unload_lora_adapter", {"lora_name": old_name})
            shutil.rmtree(old[1], ignore_errors=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the server we started (SIGTERM to its session, SIGKILL after 60 s); delete the work directory if it
        was made here."""
        atexit.unregister(self.close)
        proc, self.proc = getattr(self, "proc", None), None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc is not None:
            try:  # the engine process may outlive the API server by a moment
                os.killpg(proc.pid, 0)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._remove_dirs()


def start_server(python: str, model_dir: str, name: str, workdir: Path, max_model_len: int = 4096):
    """A `vllm serve` of `model_dir` under the name `name` from another venv's `python` (at nice 10), through
    `VLLMServerSampler`'s server start; for scripts that only need the endpoint (e.g. an LLM judge). Returns the
    server (`.url`, `.cmd`, `.close()`) and its start-up seconds."""
    t0 = time.time()
    server = VLLMServerSampler([], model_dir=model_dir, model_name=name, max_model_len=max_model_len,
                               workdir=str(workdir), vllm_cmd=["nice", "-n", "10", python, "-c", SERVER_CODE])
    return server, time.time() - t0
