"""Atomic checkpoints and exact resume.

A checkpoint holds everything the next step depends on: the trainable weights (the LoRA adapter, or all
weights for full fine-tuning), the optimizer and scheduler, every RNG (python, numpy, torch, the sampling
generator) and the step; the data position is a pure function of the step and seed. It is written into a
temporary directory that is renamed into place only when complete, so a kill never leaves a checkpoint
that looks whole but is not.

    step-000002/
      trainable.safetensors   the trainable weights, whole (one process, DDP: rank 0 writes)
      optim.pt                {"optimizer": its state_dict(), "scheduler": ...}; under FSDP2 the scheduler alone
      dcp/                    FSDP2 only, instead of trainable.safetensors and the optimizer: every rank's shards
        __0_0.distcp ...        of the trainable weights and the optimizer state, written by the rank itself with
        .metadata               torch.distributed.checkpoint (DCP), never gathered
      rng.pt, state.json      every RNG (rank 0's: all ranks hold the same); the step, process count and mode
      manifest.json           size and sha256 of every file above; written last, so it vouches for the rest

Under FSDP2 rank 0 makes the temporary directory, every rank writes its DCP shards into it, and after a barrier
rank 0 adds the rest and renames it into place: a checkpoint with a missing rank's shards is never renamed, so
never resumed from. `python -m torch.distributed.checkpoint.format_utils dcp_to_torch step-N/dcp full.pt`
turns the shards of a checkpoint one trusts into one file of whole tensors ({"model": ..., "optimizer": ...}).

Nothing read back can execute code: weights are safetensors, the step is JSON, and the optimizer, scheduler
and RNG states are loaded with `torch.load(weights_only=True)` (tensors and plain containers only; numpy's RNG
state is stored as plain numbers for that reason). A file that holds anything else is refused. DCP reads its
.metadata with plain pickle and its non-tensor entries with torch.load(weights_only=False), so opct checks both
first: .metadata with an unpickler that admits only DCP's own metadata classes, torch.Size and dtypes; each
non-tensor entry with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from opct.data.io import sha256_file, write_failure
from opct.errors import UserError
from opct.train import distributed

MANIFEST = "manifest.json"
SHARDS = "dcp"  # the subdirectory of an FSDP2 checkpoint that torch.distributed.checkpoint writes


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be used; the message names the file and why."""


def temp_dir(final: Path) -> Path:
    """A new, empty temporary directory beside `final`, named so that remove_partial recognises it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def atomic_dir(final: Path, write, tmp: Path | None = None) -> Path:
    """Call write(tmp_dir), then rename tmp_dir to `final` (replacing an older one). A failed write (a full disk:
    opct.data.io.WriteError naming `final`) or an interrupt removes tmp_dir and leaves `final` as it was. `tmp`:
    a directory from temp_dir(final) that already holds part of the contents (other ranks' shards)."""
    final = Path(final)
    tmp = Path(tmp) if tmp is not None else temp_dir(final)
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
        _discard(tmp, final, e)
    return final


def _discard(tmp: Path | None, final: Path, e: BaseException):
    """Remove a temporary directory (if given) after `e` stopped its write, and raise: a WriteError naming `final`
    when `e` is a failed write (a full disk), else `e` itself. A DCP CheckpointException (which gathers every
    rank's error) stands for the error of its lowest failed rank."""
    cause = _first_failure(e)
    failed = write_failure(final, cause)  # before the cleanup frees the space
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        raise failed from e
    if cause is not e:
        raise cause from e
    raise e


def _first_failure(e: BaseException) -> BaseException:
    if isinstance(e, CheckpointException) and e.failures:
        return e.failures[min(e.failures)][0]
    return e


def save(out: Path, step: int, model, optimizer, scheduler, sample_gen: torch.Generator, keep: int = 2,
         replica=None, replicas: distributed.Replicas = distributed.SINGLE) -> Path | None:
    """Every data-parallel rank calls this. One process or DDP: rank 0 writes everything. FSDP2: every rank
    writes its shards with torch.distributed.checkpoint, then rank 0 the rest. Returns the path (on rank 0)."""
    if replicas.mode == "fsdp":
        return _save_sharded(out, step, optimizer, scheduler, sample_gen, keep, replica, replicas)
    trainable = distributed.trainable_state(model)
    optim = optimizer.state_dict()
    return replicas.on_main(lambda: _write(out, step, trainable, optim, scheduler, sample_gen, keep, replicas))


def _save_sharded(out: Path, step: int, optimizer, scheduler, sample_gen, keep: int, replica,
                  replicas: distributed.Replicas) -> Path | None:
    final = _step_dir(out, step)
    tmp = Path(replicas.broadcast(replicas.on_main(lambda: str(temp_dir(final)))))
    try:  # collective: each rank writes its own file, rank 0 then .metadata; an error on any rank raises on all
        dcp.save(distributed.sharded_state(replica, optimizer), checkpoint_id=tmp / SHARDS)
    except BaseException as e:
        _discard(tmp if replicas.is_main else None, final, e)
    replicas.barrier()  # every rank's shards are on disk before rank 0 vouches for them and renames
    return replicas.on_main(lambda: _write(out, step, None, None, scheduler, sample_gen, keep, replicas, tmp))


def _step_dir(out: Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step-{step:06d}"


def _write(out: Path, step: int, trainable: dict | None, optim: dict | None, scheduler, sample_gen, keep: int,
           replicas: distributed.Replicas, tmp: Path | None = None) -> Path:
    def write(d: Path):
        if trainable is not None:
            save_file({n: t.cpu() for n, t in trainable.items()}, str(d / "trainable.safetensors"))
        torch.save({**({"optimizer": optim} if optim is not None else {}), "scheduler": scheduler.state_dict()},
                   d / "optim.pt")
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        torch.save({"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                           has_gauss, gauss],
                    "torch": torch.get_rng_state(), "sample": sample_gen.get_state()}, d / "rng.pt")
        (d / "state.json").write_text(json.dumps({"step": step, "processes": replicas.world,
                                                  "parallel": replicas.mode}))
        files = sorted(f for f in d.rglob("*") if f.is_file())
        (d / MANIFEST).write_text(json.dumps({f.relative_to(d).as_posix(): {"bytes": f.stat().st_size,
                                                                            "sha256": sha256_file(f)}
                                              for f in files}))  # last: it vouches for the rest

    path = atomic_dir(_step_dir(out, step), write, tmp)
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / MANIFEST}: unreadable ({e})") from None
    if not (isinstance(manifest, dict) and all(isinstance(w, dict) and {"bytes", "sha256"} <= set(w)
                                               for w in manifest.values())):
        raise CheckpointError(f"{path / MANIFEST}: not a checkpoint manifest ({{file: {{bytes, sha256}}}})")
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
         replicas: distributed.Replicas = distributed.SINGLE, verified: bool = False) -> int:
    """Restore a checkpoint in place (after checking it against its manifest, unless the caller just `verified`
    it); returns the step it was taken after. A checkpoint written by another number of processes or another
    --parallel mode is refused. Every data-parallel rank calls this (collective under FSDP2)."""
    if not verified:
        verify(path)
    info = json.loads((path / "state.json").read_text())
    was = (info.get("processes", 1), info.get("parallel", "none"))
    if was != (replicas.world, replicas.mode):
        raise CheckpointError(f"{path}: written by {was[0]} process(es) ({was[1]}), resumed with {replicas.world} "
                              f"({replicas.mode}); resume with the same torchrun --nproc-per-node and --parallel")
    if replicas.mode == "fsdp":
        _load_sharded(path, optimizer, replica)
        opt = _load_plain(path / "optim.pt")
    else:
        state = load_file(str(path / "trainable.safetensors"))
        params = dict(model.named_parameters())
        missing = [n for n in state if n not in params]
        if missing:
            raise CheckpointError(f"{path}: checkpoint does not match the model (e.g. {missing[0]})")
        distributed.load_trainable(model, state)
        opt = _load_plain(path / "optim.pt")
        optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    rng = _load_plain(path / "rng.pt")
    random.setstate(_tuples(rng["python"]))
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(rng["torch"])
    sample_gen.set_state(rng["sample"])
    return info["step"]


def _load_sharded(path: Path, optimizer, replica) -> None:
    """Every rank reads its own shards of an FSDP2 checkpoint: the weights and the optimizer state straight into
    this rank's DTensors."""
    state = distributed.sharded_state(replica, optimizer)
    read_shards(path / SHARDS, state)
    distributed.load_sharded_state(replica, optimizer, state)


def read_shards(shards: Path, state: dict) -> None:
    """Fill `state` in place from a torch.distributed.checkpoint directory (collective when a process group is
    up), refusing what could execute code (the module docstring says how); a checkpoint that lacks one of
    `state`'s entries is a CheckpointError."""
    reader, planner = _plain_dcp(shards)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (CheckpointException, AssertionError) as e:
        if reader.refused is not None:  # torch 2.11 swallows read_metadata's error, then fails on a None metadata
            raise reader.refused from None
        cause = _first_failure(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise CheckpointError(f"{shards}: cannot be loaded into this model ({first[:300]})") from None


def _plain_dcp(shards: Path):
    """A DCP reader and load planner that refuse what could execute code (see the module docstring)."""
    allowed = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               *(("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)),
               *((dcp_metadata.__name__, n) for n, v in vars(dcp_metadata).items() if isinstance(v, type))}

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in allowed:
                raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
            return super().find_class(module, name)

    class _PlainReader(FileSystemReader):
        refused: CheckpointError | None = None  # why read_metadata refused the file, whatever DCP does with that

        def read_metadata(self, *args, **kwargs):
            f = Path(self.path) / ".metadata"
            try:
                with open(f, "rb") as fh:
                    MetadataUnpickler(fh).load()
            except Exception as e:  # noqa: BLE001 (pickle raises many kinds)
                self.refused = CheckpointError(f"{f}: refused to load: not DCP metadata ({str(e)[:300]}); "
                                               "opct never loads files that could execute code")
                raise self.refused from None
            return super().read_metadata(*args, **kwargs)  # the same bytes, now known to be plain

    class _PlainPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{shards}: entry {read_item.dest_index.fqn}: refused to load: not plain "
                                      f"tensors and numbers ({str(e).strip()[:300]})") from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return _PlainReader(shards), _PlainPlanner()


def _tuples(x):
    """random.setstate wants the nested tuples it gave (a plain load may return them as tuples or lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
