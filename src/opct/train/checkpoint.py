"""Atomic checkpoints and exact resume.

A checkpoint holds everything the next step depends on: the trainable weights (the LoRA adapter, or all
weights for full fine-tuning), the optimizer and scheduler, every RNG (python, numpy, torch, the sampling
generator) and the step; the data position is a pure function of the step and seed. It is written into a
temporary directory that is renamed into place only when complete, so a kill never leaves a checkpoint
that looks whole but is not.

Nothing read back can execute code: weights are safetensors, the step is JSON, and the optimizer, scheduler
and RNG states are loaded with `torch.load(weights_only=True)` (tensors and plain containers only; numpy's RNG
state is stored as plain numbers for that reason). A file that holds anything else is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from opct.data.io import sha256_file, write_failure
from opct.train import distributed

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and why."""


def atomic_dir(final: Path, write) -> Path:
    """Call write(tmp_dir), then rename tmp_dir to `final` (replacing an older one). A failed write (a full disk:
    opct.data.io.WriteError naming `final`) or an interrupt removes tmp_dir and leaves `final` as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        for f in (tmp, *tmp.rglob("*")):  # mkdtemp and safetensors create private modes; outputs are for reading
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException as e:
        failed = write_failure(final, e)  # before the cleanup frees the space
        shutil.rmtree(tmp, ignore_errors=True)
        if failed:
            raise failed from e
        raise
    return final


def save(out: Path, step: int, model, optimizer, scheduler, sample_gen: torch.Generator, keep: int = 2,
         replica=None, replicas: distributed.Replicas = distributed.SINGLE) -> Path | None:
    """Every data-parallel rank calls this (FSDP2 shards are gathered); rank 0 writes. Returns the path (rank 0)."""
    trainable = distributed.trainable_state(model)
    optim = distributed.optimizer_state(optimizer, replica)
    return replicas.on_main(lambda: _write(out, step, trainable, optim, scheduler, sample_gen, keep, replicas))


def _write(out: Path, step: int, trainable: dict, optim: dict, scheduler, sample_gen, keep: int,
           replicas: distributed.Replicas) -> Path:
    def write(d: Path):
        save_file({n: t.cpu() for n, t in trainable.items()}, str(d / "trainable.safetensors"))
        torch.save({"optimizer": optim, "scheduler": scheduler.state_dict()}, d / "optim.pt")
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        torch.save({"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                           has_gauss, gauss],
                    "torch": torch.get_rng_state(), "sample": sample_gen.get_state()}, d / "rng.pt")
        (d / "state.json").write_text(json.dumps({"step": step, "processes": replicas.world,
                                                  "parallel": replicas.mode}))
        (d / MANIFEST).write_text(json.dumps({f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                                              for f in sorted(d.iterdir())}))  # last: it vouches for the rest

    path = atomic_dir(Path(out) / "checkpoints" / f"step-{step:06d}", write)
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        gone = old.with_name(f".{old.name}.old-{os.getpid()}")  # renamed first: a kill mid-delete leaves litter
        os.replace(old, gone)  # that remove_partial recognises, never a half-deleted checkpoint
        try:
            shutil.rmtree(gone, ignore_errors=True)
        except BaseException:  # Ctrl-C mid-delete: finish it, then stop
            shutil.rmtree(gone, ignore_errors=True)
            raise
    return path


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (each has its manifest, written last)."""
    d = Path(out) / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("step-*") if (p / MANIFEST).is_file())


def verify(path: Path) -> None:
    """Every file the manifest lists is there with its size and sha256 (a truncated or altered file fails)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / MANIFEST}: unreadable ({e})") from None
    for name, want in manifest.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != want["bytes"] or sha256_file(f) != want["sha256"]:
            raise CheckpointError(f"{f}: missing, truncated or changed since the checkpoint was written")


def remove_partial(out: Path) -> list[Path]:
    """Delete what killed writes left behind: temporary and half-deleted checkpoint and model directories, and
    the temporary files of atomic writes (config.yaml, metrics.jsonl, run.json). Returns them."""
    out = Path(out)
    litter = [*(out / "checkpoints").glob(".step-*.tmp-*"), *out.glob(".model.tmp-*"),
              *(out / "checkpoints").glob(".step-*.old-*"), *out.glob(".model.old-*"),
              *(p for p in out.glob(".*.tmp") if p.is_file())]
    for p in litter:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return litter


def _load_plain(path: Path) -> dict:
    """torch.load restricted to tensors and plain containers: a file that would run code is refused."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 (pickle raises many kinds)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused to load: not plain tensors and numbers ({first[:300]}); "
                              "opct never loads files that could execute code") from None


def load(path: Path, model, optimizer, scheduler, sample_gen: torch.Generator, replica=None,
         replicas: distributed.Replicas = distributed.SINGLE) -> int:
    """Restore a checkpoint in place (after checking it against its manifest); returns the step it was taken
    after. A checkpoint written by another number of processes or another --parallel mode is refused."""
    verify(path)
    info = json.loads((path / "state.json").read_text())
    was = (info.get("processes", 1), info.get("parallel", "none"))
    if was != (replicas.world, replicas.mode):
        raise CheckpointError(f"{path}: written by {was[0]} process(es) ({was[1]}), resumed with {replicas.world} "
                              f"({replicas.mode}); resume with the same torchrun --nproc-per-node and --parallel")
    state = load_file(str(path / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise CheckpointError(f"{path}: checkpoint does not match the model (e.g. {missing[0]})")
    distributed.load_trainable(model, state)
    opt = _load_plain(path / "optim.pt")
    distributed.load_optimizer(optimizer, replica, opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = _load_plain(path / "rng.pt")
    random.setstate(_tuples(rng["python"]))
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(rng["torch"])
    sample_gen.set_state(rng["sample"])
    return info["step"]


def _tuples(x):
    """random.setstate wants the nested tuples it gave (a plain load may return them as tuples or lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
