"""Configs: one dataclass per command, one source of truth for defaults and their documentation.

Precedence: dataclass defaults < YAML file (`--config FILE`) < command-line flags. `opct train --help`
prints every field with its default and help text, generated from the dataclass below.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


def opt(default, help: str, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # Data and model
    model: str = opt("smollm2-135m-instruct", "model: built-in alias, .gguf file, local dir or Hub id")
    pairs: str = opt("", "JSONL of consistency pairs: {\"student\": [messages], \"teacher\": [messages], ...}")
    out: str = opt("runs/opct", "output directory (metrics.jsonl, tb/, checkpoints/, model/)")
    # Steps and batch
    steps: int = opt(20, "optimizer steps")
    prompts_per_step: int = opt(8, "pairs per optimizer step")
    samples_per_prompt: int = opt(1, "student samples per pair per step")
    micro_batch: int = opt(8, "sequences per forward/backward (gradient accumulation below prompts*samples)")
    # Sampling (explicit; never inherited from the model's generation_config)
    max_new_tokens: int = opt(32, "max sampled response tokens")
    temperature: float = opt(1.0, "sampling temperature for the student (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling (1 = off)")
    top_k: int = opt(0, "top-k sampling (0 = off)")
    # Loss
    loss: str = opt("sampled", "sampled: sampled-token reverse KL as per-token advantage; full: exact reverse KL; "
                    "topk: reverse KL over the student's top-k; forward: exact forward KL",
                    choices=["sampled", "full", "topk", "forward"])
    topk: int = opt(20, "k for loss=topk")
    kl_coef: float = opt(1.0, "scale of the KL advantage (loss=sampled)")
    kl_discount: float = opt(0.0, "discount for summing future per-token KL into the advantage (0 = per-token)")
    # Parameters being trained
    lora_rank: int = opt(32, "LoRA rank; 0 = full fine-tuning (teacher becomes a frozen copy)")
    lora_alpha: float = opt(64.0, "LoRA alpha")
    lora_dropout: float = opt(0.0, "LoRA dropout")
    lora_targets: str = opt("all-linear", "LoRA target modules: all-linear or comma-separated names")
    # Optimizer
    lr: float = opt(2e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    betas: str = opt("0.9,0.999", "AdamW betas")
    warmup_steps: int = opt(0, "linear warm-up steps")
    schedule: str = opt("constant", "LR schedule after warm-up", choices=["constant", "linear", "cosine"])
    grad_clip: float = opt(1.0, "max global grad norm (0 = off)")
    # Run management
    seed: int = opt(0, "seed for data order, sampling and LoRA init")
    save_every: int = opt(10, "checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = opt(2, "how many recent checkpoints to keep")
    resume: bool = opt(False, "continue from the latest checkpoint in --out")
    max_length: int = opt(0, "max prompt + response tokens (0 = the model's context length); longer pairs are an error")
    threads: int = opt(0, "torch CPU threads (0 = torch default)")
    tensorboard: bool = opt(True, "also write TensorBoard event files under out/tb")


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per dataclass field; the parsed default is None so we can tell what was given."""
    parser.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    for f in fields(cls):
        kind = {"int": int, "float": float, "bool": _parse_bool}.get(str(f.type), str)
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                            choices=f.metadata.get("choices"), metavar=None if f.metadata.get("choices") else "V",
                            help=f"{f.metadata.get('help', '')} (default: {f.default})")


def from_dict(cls, values: dict, where: str = "config"):
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for k, v in values.items():
        key = k.replace("-", "_")
        if key not in known:
            raise ConfigError(f"{where}: unknown option {k!r}")
        f = known[key]
        want = {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type), f.type)
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ConfigError(f"{where}: option {k!r} must be {want.__name__}, got {v!r}")
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise ConfigError(f"{where}: option {k!r} must be one of {choices}, got {v!r}")
        kwargs[key] = v
    return cls(**kwargs)


def build(cls, args: argparse.Namespace):
    values: dict = {}
    if getattr(args, "config", None):
        p = Path(args.config)
        if not p.is_file():
            raise ConfigError(f"{p}: no such config file")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of option: value")
        values.update(loaded)
        from_dict(cls, values, where=str(p))  # type-check the file on its own, so errors name it
    for f in fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return from_dict(cls, values)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


@dataclass
class SFTConfig(TrainConfig):
    """The offline baseline (BCT): the frozen initial model answers each teacher prompt once, then supervised
    fine-tuning on (student prompt -> that answer). Same data, LoRA and optimizer options as `opct train`;
    --temperature/--top-p/--top-k/--max-new-tokens apply to target generation; --samples-per-prompt is the
    number of targets per teacher prompt."""
    out: str = opt("runs/sft", "output directory (targets.jsonl, metrics.jsonl, tb/, checkpoints/, model/)")
    temperature: float = opt(0.0, "temperature for the frozen model's targets (0 = greedy, as in BCT)")
