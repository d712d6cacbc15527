"""The training harness shared by OPCT and the SFT baseline: set a run up, step it, log, checkpoint, save.

    with start_run(cfg, pairs) as run:        validate, load the model on its device, add LoRA, build the policy,
                                              the optimizer and the schedule, resume from a checkpoint
        for step in steps(run, cfg, "opct"):  the progress bar over the remaining steps
            row = step_fn(...)                an algorithm's forward/backward work (opct_step, sft_step)
            row |= optimizer_step(run, cfg)   clip, AdamW, schedule, zero grads, policy.after_step()
            end_step(run, cfg, step, row)     probe, metrics.jsonl + trackers, checkpoint, CPU thread count
        save_final(run, cfg, summary)         model/ (PEFT adapter or full model), then run.json
    (leaving the `with` on an error closes the logs and the sampler's vLLM engine or server)
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import platform
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from tqdm.auto import tqdm

import opct
from opct import backends, models, threads
from opct.backends.base import Policy
from opct.config import RunConfig, StudentSampler, validate
from opct.data import reasoning
from opct.data.chat import ChatFormat
from opct.data.io import atomic_write, write_json
from opct.data.formats import read_pairs
from opct.data.pairs import ConsistencyPair, PairsError
from opct.errors import UserError
from opct.models import ALIASES, add_lora, load_model
from opct.options import apply_env_overrides, read_yaml, resumable_fields, to_yaml
from opct.train import checkpoint, distributed, trackers
from opct.train.metrics import MetricsLog, peak_rss_mb
from opct.provenance import git_commit


class RunError(UserError, RuntimeError):
    """The run cannot start (bad output directory, config, ...)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_out_dir(cfg: RunConfig) -> Path:
    """Fail before any work if the output directory is unusable or would be silently overwritten; on --resume,
    refuse settings that differ from the run's own (other than `opct.options.resumable_fields`)."""
    out = Path(cfg.out)
    existing = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not existing.is_dir():
        raise RunError(f"{out}: cannot create the output directory: {existing} is not a directory")
    if not os.access(existing, os.W_OK):
        raise RunError(f"{out}: output directory is not writable ({existing})")
    if not cfg.resume:
        if out.exists() and any(p.name != ".lock" for p in out.iterdir()):  # a lock alone: killed at once
            raise RunError(f"{out}: already holds a run; pass --resume to continue it or choose another --out")
        return out
    if (out / "run.json").is_file():
        raise RunError(f"{out}: this run already finished (run.json); choose another --out")
    saved = out / "config.yaml"
    if saved.is_file():
        before, _ = read_yaml(saved)  # a damaged file: ConfigError naming it (and the line)
        now = dataclasses.asdict(cfg)
        may_change = resumable_fields(type(cfg))  # where and how fast it runs, run management (opct.options.opt)
        changed = sorted(k for k in now if k in before and k not in may_change and before[k] != now[k])
        if changed:
            diffs = ", ".join(f"--{k.replace('_', '-')} {before[k]!r} -> {now[k]!r}" for k in changed)
            raise RunError(f"{out}: --resume with settings that differ from the run's ({diffs}); "
                           f"resume with the same values or start a new --out")
    return out


def acquire_lock(out: Path):
    """An exclusive lock on out/.lock for this process's lifetime: two runs never write one directory."""
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RunError(f"{out}: another opct process is writing this directory") from None
    return f


def resume_from(out: Path, policy: Policy, optimizer, scheduler, gen, steps: int) -> int:
    """Load the newest checkpoint whose files match its manifest (a truncated newest one is skipped with a warning);
    0 when the run was killed before its first checkpoint. A file that is whole but would run code is refused,
    never skipped; so is a checkpoint beyond --steps. With several processes rank 0 checks the manifests (every
    file's sha256, all ranks' shards included) and every rank loads the checkpoint it chose."""
    replicas = policy.replicas
    chosen = replicas.broadcast(replicas.on_main(lambda: newest_whole_checkpoint(out)))
    if chosen is None:
        return 0
    start = checkpoint.load(Path(chosen), policy.model, optimizer, scheduler, gen, getattr(policy, "replica", None),
                            replicas, verified=True)
    if start > steps:
        raise RunError(f"{out}: the checkpoint is at step {start}, beyond --steps {steps}; pass --steps >= {start}")
    return start


def newest_whole_checkpoint(out: Path) -> str | None:
    """The newest checkpoint that matches its manifest (warning about each newer one that does not); None, saying
    so, when there is none yet; a RunError when none matches."""
    found = checkpoint.list_checkpoints(out)
    if not found:
        tqdm.write(f"opct: {out}: no checkpoint yet; starting from step 0", file=sys.stderr)
        return None
    for path in reversed(found):
        try:
            checkpoint.verify(path)
        except checkpoint.CheckpointError as e:
            tqdm.write(f"opct: warning: {e}; trying an older checkpoint", file=sys.stderr)
            continue
        return str(path)
    raise RunError(f"{out}: no checkpoint matches its manifest ({', '.join(p.name for p in found)}); "
                   "start a new --out")


def render_pairs(formats: tuple[ChatFormat, ChatFormat], pairs: list[ConsistencyPair], max_length: int,
                 max_new_tokens: int):
    """Token ids of both sides of every pair, each rendered by its side's format (`formats`: the student's and the
    teacher's, ChatFormat.sides); a pair that cannot fit its response is an error."""
    student, teacher = formats
    rendered = []
    for i, p in enumerate(pairs):
        s_ids, t_ids = student.prompt(p.student), teacher.prompt(p.teacher)
        longest = max(len(s_ids), len(t_ids))
        if longest + max_new_tokens > max_length:
            where = p.meta.get("_where", f"pair {i}")
            raise PairsError(f"{where}: prompt is {longest} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                             f"max_length={max_length} (shorten the pair, lower --max-new-tokens, or raise --max-length)")
        rendered.append((s_ids, t_ids))
    return rendered


def data_order(n_pairs: int, seed: int, start: int, count: int) -> list[int]:
    """Pair indices for global positions start..start+count: a fresh seeded permutation every epoch, so the
    data position is a pure function of (step, seed) and resumes exactly."""
    idx = []
    for pos in range(start, start + count):
        epoch, k = divmod(pos, n_pairs)
        perm = torch.randperm(n_pairs, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        idx.append(int(perm[k]))
    return idx


def lr_lambda(cfg: RunConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if cfg.schedule == "linear":
            return max(0.0, 1.0 - frac)
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + float(np.cos(np.pi * min(1.0, frac))))
        return 1.0
    return f


@dataclass
class Run:
    """Everything a training loop needs, set up identically for OPCT and the SFT baseline."""
    cfg: RunConfig  # as resolved: environment overrides applied
    out: Path
    policy: Policy
    formats: tuple[ChatFormat, ChatFormat]  # the student's and the teacher's (ChatFormat.sides)
    rendered: list  # [(student_ids, teacher_ids)] per pair
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    gen: torch.Generator  # the sampling RNG, checkpointed with the rest
    start: int  # first step to run (> 0 when resuming)
    log: MetricsLog
    provenance: dict  # what run.json records about where and how it ran
    t_start: float
    lock: object  # the open, locked out/.lock (rank 0)
    replicas: distributed.Replicas = distributed.SINGLE  # the data-parallel processes (train/distributed.py)

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def fmt(self) -> ChatFormat:
        """The student's chat format: where its responses' answers start (the steps), what a probe renders with."""
        return self.formats[0]

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        """`with start_run(...) as run:` a run that stops on an error or Ctrl-C lets go of its metrics log and its
        sampler's vLLM engine or server at once (save_final did for a finished run; closing twice is a no-op)."""
        self.log.close()
        self.policy.close()


def start_run(cfg: RunConfig, pairs: list[ConsistencyPair] | None) -> Run:
    """Validate everything before writing anything, then load, add LoRA, build the policy and the optimizer,
    maybe resume."""
    t_start = time.perf_counter()
    cfg, env = apply_env_overrides(validate(cfg))
    trackers.check(cfg.report_to)
    device, dtype, backend = backends.resolve(cfg)
    replicas, device = distributed.init(device, cfg.parallel)
    asked = {}  # run.json: OPCT's --sampler as given (SFT has none: its sampler is the backend, SFTConfig.sampler)
    if isinstance(cfg, StudentSampler):  # resolved here, once: config.yaml, run.json and every check read the result
        asked = {"sampler_setting": cfg.sampler}
        cfg = dataclasses.replace(cfg, sampler=backends.resolve_sampler(cfg, device, replicas.mode))
    sampler = backends.vllm.sampler_spec(cfg)  # decided once: None where the backend samples (policy; SFT)
    backends.check_training(cfg, dtype, backend, sampler)
    if replicas.world > 1:
        backend = check_distributed(cfg, replicas, dtype)
    out = check_out_dir(cfg)
    replicas.barrier()  # every rank has checked the directory before rank 0 writes to it
    if pairs is None:
        if not cfg.pairs:
            raise RunError("no pairs: pass --pairs FILE.jsonl")
        pairs = read_pairs(cfg.pairs, cfg.pairs_format)
    threads.use(cfg.threads)
    seed_everything(cfg.seed)
    model, tok = load_model(cfg.model, device=device, dtype=dtype)
    max_length = cfg.max_length or getattr(model.config, "max_position_embeddings", 2048)
    try:  # tags that are not one token each stop the run here, before any step
        formats = ChatFormat.sides(tok, cfg)  # how each side renders, and where the student's answers start
    except reasoning.ReasoningError as e:
        raise RunError(str(e)) from None
    rendered = render_pairs(formats, pairs, max_length, cfg.max_new_tokens)
    eos_ids = models.eos_ids(model, tok)

    hidden = getattr(model.config, "hidden_size", None)
    if hidden and cfg.lora_rank > hidden:
        raise RunError(f"--lora-rank {cfg.lora_rank} is larger than the model's hidden size ({hidden}); "
                       "a LoRA update cannot have a higher rank than the matrix it adapts")
    if cfg.lora_rank > 0:
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    else:
        model.requires_grad_(True)
    policy = backends.make_policy(backend, model, tok, eos_ids, cfg, micro_batch=cfg.micro_batch,
                                  lora_dropout=cfg.lora_dropout, prompt_lengths=[len(s) for s, _ in rendered],
                                  sampler=sampler)
    try:
        run = _assemble(cfg, env, out, policy, formats, model, rendered, replicas, device, t_start)
        run.provenance.update(**asked, sampler_used=cfg.sampler)
        return run
    except BaseException:
        policy.close()  # a vLLM engine or server the sampler started is not left running
        raise


def _assemble(cfg: RunConfig, env: dict, out: Path, policy: Policy, formats: tuple[ChatFormat, ChatFormat], model,
              rendered: list, replicas: distributed.Replicas, device, t_start: float) -> Run:
    """start_run's second half, on a built policy: data-parallel wrapping, optimizer, lock, resume, logs."""
    if replicas.world > 1:
        trainer = getattr(policy, "inner", policy)  # under a vLLM sampler, the policy that scores
        trainer.replica = distributed.wrap(model, replicas, device)
        if getattr(trainer, "frozen", None) is not None:  # a full fine-tune's teacher copy: sharded too (FSDP2)
            distributed.shard_teacher(trainer.frozen, replicas)
        policy.replicas = trainer.replicas = replicas
    params = [p for p in model.parameters() if p.requires_grad]
    betas = tuple(float(x) for x in cfg.betas.split(","))
    # PyTorch's fused AdamW kernel where it has one (one kernel for all parameters, clipping included); FSDP2's
    # sharded parameters take the default implementation.
    fused_adamw = replicas.mode != "fsdp" and all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay, fused=fused_adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    gen = torch.Generator().manual_seed(cfg.seed)

    lock = acquire_lock(out) if replicas.is_main else None
    start = 0
    if cfg.resume:
        if replicas.is_main:
            checkpoint.remove_partial(out)
        replicas.barrier()
        start = resume_from(out, policy, optimizer, scheduler, gen, cfg.steps)
        if start:
            policy.after_load(start)
    if replicas.is_main:
        atomic_write(out / "config.yaml", to_yaml(cfg))
    log = (MetricsLog(out, resume_step=start, trackers=trackers.open_trackers(
        cfg.report_to, out, dataclasses.asdict(cfg), start)) if replicas.is_main else NullLog())
    provenance = {**policy.describe(), "env_overrides": env, **versions(),
                  **({"processes": replicas.world, "parallel": replicas.mode} if replicas.world > 1 else {})}
    threads.adjust()  # the first step's thread count, from the load time that passed since threads.use
    return Run(cfg, out, policy, formats, rendered, params, optimizer, scheduler, gen, start, log, provenance, t_start,
               lock, replicas)


class NullLog:
    """Metrics of a rank other than 0: logged numbers are already summed over ranks, and rank 0 writes them."""

    def log(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def check_distributed(cfg: RunConfig, replicas: distributed.Replicas, dtype: torch.dtype) -> str:
    """What a data-parallel run needs, checked before any work; returns the backend to use (hf)."""
    decode_dtype = backends.other_decode_dtype(cfg, dtype)
    if decode_dtype:
        raise RunError(f"--decode-dtype {decode_dtype}: a data-parallel run samples from the model itself (no lean "
                       "decoder, no merged copy); leave --decode-dtype at float32")
    if cfg.prompts_per_step % replicas.world:
        raise RunError(f"--prompts-per-step {cfg.prompts_per_step} does not divide evenly over {replicas.world} "
                       "processes; each process takes an equal share of the step's prompts")
    if cfg.sampler != "policy" and replicas.mode == "fsdp":
        raise RunError(f"--sampler {cfg.sampler} needs every rank to hold the full weights it syncs into vLLM; "
                       "use --parallel ddp (one vLLM engine per rank)")
    return backends.data_parallel_backend(cfg.backend)


def share(run: Run, items: list, rows_per_item: int = 1) -> tuple[list, object]:
    """This process's equal share of a step's items, and the sampling generator for its rows (the run's own
    generator in one process)."""
    return (run.replicas.shard(items),
            distributed.draws_for(run.gen, run.replicas, len(items) * rows_per_item))


def versions() -> dict:
    return {"opct": opct.__version__, "git": git_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__, "python": platform.python_version()}


def steps(run: Run, desc: str, show: bool):
    """The remaining steps, under a progress bar."""
    return tqdm(range(run.start, run.cfg.steps), initial=run.start, total=run.cfg.steps, desc=desc,
                disable=not (show and run.replicas.is_main))


class NonFiniteError(RunError):
    """A step's loss or gradient is NaN or infinite."""


def optimizer_step(run: Run, step: int, loss: float) -> dict:
    """Clip, AdamW, schedule. A non-finite loss or gradient norm stops the run (`nonfinite: stop`, the default:
    nothing is marked finished) or skips this update (`nonfinite: skip`: the row says skipped)."""
    t = time.perf_counter()
    cfg = run.cfg
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    lr = run.scheduler.get_last_lr()[0]
    bad = not (math.isfinite(loss) and math.isfinite(float(grad_norm)))
    if bad and cfg.nonfinite == "stop":
        last = checkpoint.list_checkpoints(run.out)
        raise NonFiniteError(
            f"step {step + 1}: the loss ({loss}) or gradient norm ({float(grad_norm)}) is not finite; stopped, "
            f"nothing saved as a finished run. Lower --lr or --kl-coef"
            + (f", then --resume from {last[-1]}" if last else "") + " (or pass --nonfinite skip to skip such steps)")
    if not bad:
        run.optimizer.step()
    with warnings.catch_warnings():  # torch warns when the first update was skipped; the schedule still counts it
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before")
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.policy.after_step()
    return {"grad_norm": float(grad_norm), "lr": lr, "skipped": int(bad), "time_optim": time.perf_counter() - t}


def end_step(run: Run, step: int, row: dict, probe, probe_every: int, bar, show: bool) -> dict:
    """Totals, probe, log, checkpoint: the bookkeeping shared by every loop. Step time is the sum of the row's
    `time_*` phases (other timings, e.g. decode_seconds, are parts of a phase)."""
    cfg = run.cfg
    show = show and run.replicas.is_main  # rank 0 speaks for all: its numbers are the global batch's
    step_s = sum(v for k, v in row.items() if k.startswith("time_"))
    row = {"step": step + 1, **row, "step_seconds": step_s, "tokens_per_s": row["response_tokens"] / step_s}
    if probe and probe_every and ((step + 1) % probe_every == 0 or step + 1 == cfg.steps):
        row.update(probe(run.policy, run.fmt) or {})
    row["peak_mem_mb"] = peak_rss_mb()
    row["threads"] = torch.get_num_threads()
    if threads.others_busy() is not None:  # why the count is what it is (opct/threads.py)
        row["others_busy_cores"] = round(threads.others_busy(), 3)
    run.log.log(row)
    warn_divergence(run, row)
    bar.set_postfix({k: f"{row[k]:.3f}" for k in ("kl", "loss") if k in row} | {"s": f"{row['step_seconds']:.1f}"})
    if show:
        timing = " ".join(f"{k[5:]} {v:.2f}s" for k, v in row.items() if k.startswith("time_"))
        main = " ".join(f"{k} {row[k]:.4f}" for k in ("kl", "loss", "logp_student", "logp_teacher") if k in row)
        probes = " ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith("probe_"))
        weights = (f" | is weight {row['is_weight_mean']:.4f} ratio max {row['is_ratio_max']:.3f} truncated "
                   f"{row['is_truncated']:.1%}") if "is_weight_mean" in row else ""  # a vLLM sampler's tokens
        tqdm.write(f"step {step + 1:4d} | {main} | len {row['response_len']:.1f} | {timing} | "
                   f"{row['tokens_per_s']:.0f} tok/s" + weights + (f" | {probes}" if probes else ""))
    if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
        checkpoint.save(run.out, step + 1, run.model, run.optimizer, run.scheduler, run.gen, cfg.keep_checkpoints,
                        getattr(run.policy, "replica", None), run.replicas)
    threads.adjust()  # the next step's CPU thread count (opct/threads.py)
    return row


def record_base_model(model_dir: Path, name: str) -> None:
    """A saved adapter names its base by a name that loads on another machine, not the local cache directory it
    was loaded from: a Hub id as given; for a built-in alias, the model's Hub id, with opct-base.json recording the
    alias and the embedded file's sha256 (`opct eval --model` loads that exact base). A local path stays as typed."""
    path = model_dir / "adapter_config.json"
    if not path.is_file() or Path(name).exists():
        return
    info = json.loads(path.read_text())
    spec = ALIASES.get(name)
    info["base_model_name_or_path"] = spec["hub_id"] if spec else name
    atomic_write(path, json.dumps(info, indent=2))
    if spec:
        packages = [p["package"] for p in spec.get("parts", [spec])]
        write_json(model_dir / "opct-base.json", {"alias": name, "packages": packages, "file": spec["file"],
                                                  "sha256": spec["sha256"], "hub_id": spec["hub_id"]})


def warn_divergence(run: Run, row: dict) -> None:
    """Say so (once per kind) when the policy looks collapsed: every sampled response identical; sampled tokens
    of probability ~1 (mean log p > -0.01 nats); sampled tokens of probability 1/vocab (a uniform distribution:
    mean log p within 1e-3 of -log V); or a zero gradient while the loss is not zero (the outputs no longer
    depend on the trained weights); and, with --nonfinite skip, the first skipped update."""
    seen = run.provenance.setdefault("warnings", [])
    n = row["response_tokens"] / max(row["response_len"], 1e-9)
    vocab = getattr(getattr(run.model, "config", None), "vocab_size", 0) or 0
    signs = {"identical": n >= 4 and row.get("distinct_responses", 1.0) <= 1.0 / n,
             "entropy": row.get("logp_student", -1.0) > -0.01 and run.cfg.temperature > 0,
             "uniform": vocab > 1 and abs(row.get("logp_student", 0.0) + math.log(vocab)) < 1e-3,
             "no_gradient": row.get("grad_norm", 1.0) == 0.0 and row.get("loss", 0.0) != 0.0,
             "skipped": bool(row.get("skipped"))}
    text = {"identical": "all sampled responses of this step are identical",
            "entropy": "the student's sampled tokens have probability ~1 (entropy collapse)",
            "uniform": f"the student's sampled tokens have probability 1/{vocab} (a uniform distribution)",
            "no_gradient": f"the gradient is zero while the loss is {row.get('loss', 0.0):.4g}",
            "skipped": "the loss or gradient is not finite; the update was skipped (--nonfinite skip; every "
                       "skipped step has skipped=1 in metrics.jsonl)"}
    for kind, hit in signs.items():
        if hit and kind not in seen:
            seen.append(kind)
            if run.replicas.is_main:  # every rank sees the same global row
                tqdm.write(f"opct: warning: step {row['step']}: {text[kind]}; the policy may be diverging "
                           "(lower --lr or --kl-coef); recorded in run.json", file=sys.stderr)


def save_final(run: Run, summary: dict) -> Path:
    """The trained model as a standard directory (PEFT adapter, or a full safetensors model), then run.json,
    which is written last: its presence marks a finished run."""
    run.log.close()
    run.policy.close()
    state = gathered_state(run)

    def finish():
        def write(d: Path):
            run.model.save_pretrained(d, **({"state_dict": state} if state is not None else {}))
            run.policy.tok.save_pretrained(d)
        checkpoint.atomic_dir(run.out / "model", write)
        record_base_model(run.out / "model", run.cfg.model)
        info = {"config": dataclasses.asdict(run.cfg), "model_dir": str(run.out / "model"),
                "adapter": run.cfg.lora_rank > 0, "execution": run.provenance,
                "wall_seconds": time.perf_counter() - run.t_start, "steps": run.cfg.steps, **summary}
        write_json(run.out / "run.json", info)
    run.replicas.on_main(finish)  # rank 0 writes; a failed write stops every rank
    distributed.close(run.replicas)
    return run.out


def gathered_state(run: Run) -> dict | None:
    """Under FSDP2, the full weights save_pretrained needs, gathered on every rank (None: the model has them)."""
    if run.replicas.mode != "fsdp":
        return None
    if run.cfg.lora_rank > 0:  # PEFT saves only the adapter's tensors
        return distributed.trainable_state(run.model)

    return get_model_state_dict(run.model, options=distributed.full_state_options())
