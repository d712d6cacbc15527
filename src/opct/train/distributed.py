"""Data-parallel training over processes started by torchrun (or `accelerate launch`): DDP or FSDP2.

Each of W processes ("replicas") takes a contiguous 1/W of the step's prompts, samples and scores them, and the
update equals one process running the whole global batch:
  - the loss normaliser is the global response-token count (summed over replicas), and gradients are SUMMED
    across replicas, not averaged (a DDP comm hook; FSDP2 with divide factor 1), once per step: the micro-batches
    before the last one run without gradient sync;
  - sampling draws, for this rank's rows, exactly the uniforms one process would draw for the whole batch
    (`ShardDraws`), and every rank decodes until all ranks' rows are done, so the samples (and the sampling RNG
    state) match the single-process run;
  - logged numbers are summed over replicas; rank 0 writes metrics and the final model (gathered).
DDP keeps a full copy of the weights on every rank, and rank 0 writes checkpoints; FSDP2
(`torch.distributed.fsdp.fully_shard`) shards them (each decoder layer, then the root; a full fine-tune's frozen
teacher copy too), and every rank writes its own shards of each checkpoint (`torch.distributed.checkpoint`, see
train/checkpoint.py). The policy runs every forward through `Replica`, the module DDP / FSDP2 wrap, so their
hooks see every forward.

Shape letters: B rows of this rank's batch.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from opct.errors import UserError
from opct.models import lm_parts, unwrap


class DistributedError(UserError, RuntimeError):
    """A distributed setting that cannot work (the message says why)."""


@dataclass(frozen=True)
class Replicas:
    """This process's place among the data-parallel replicas (rank 0 of 1 in an ordinary run)."""
    rank: int = 0
    world: int = 1
    mode: str = "none"  # none | ddp | fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, x):
        """x (a number, or a dict of numbers) summed over replicas, in float64."""
        if self.world == 1:
            return x
        keys = list(x) if isinstance(x, dict) else None
        vals = [x[k] for k in keys] if keys else [x]
        t = torch.tensor([float(v) for v in vals], dtype=torch.float64)
        dist.all_reduce(t)
        out = t.tolist()
        if keys:
            return dict(zip(keys, out))
        return int(out[0]) if isinstance(x, int) else out[0]

    def max(self, x: float):
        if self.world == 1:
            return x
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return type(x)(t.item())

    def all(self, flag: bool) -> bool:
        """True when `flag` holds on every replica."""
        return flag if self.world == 1 else self.max(0.0 if flag else 1.0) == 0.0

    def gather(self, items: list) -> list:
        """Every replica's list, concatenated in rank order."""
        if self.world == 1:
            return items
        parts = [None] * self.world
        dist.all_gather_object(parts, items)
        return [x for p in parts for x in p]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def shard(self, items: list) -> list:
        """This rank's contiguous 1/W of `items` (len(items) must divide evenly)."""
        n = len(items) // self.world
        return items[self.rank * n:(self.rank + 1) * n]

    def on_main(self, fn):
        """fn() on rank 0 only (a write); every rank returns once it is done. If it fails, rank 0 raises its error
        and every other rank a DistributedError quoting it, instead of waiting at a barrier until a timeout."""
        if self.world == 1:
            return fn()
        if not self.is_main:
            err = self.broadcast(None)
            if err:
                raise DistributedError(f"rank 0 failed, so this rank stops too: {err}")
            return None
        try:
            out = fn()
        except BaseException as e:
            self.broadcast(f"{type(e).__name__}: {e}")
            raise
        self.broadcast(None)
        return out

    def broadcast(self, obj):
        """Rank 0's value of a picklable object, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SINGLE = Replicas()


def launched() -> bool:
    """Whether this process was started by a multi-process launcher (torchrun, accelerate launch)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device, mode: str) -> tuple[Replicas, torch.device]:
    """Join the process group torchrun describes (gloo on the CPU, NCCL on CUDA); each rank gets its own CUDA
    device (LOCAL_RANK). `mode` auto picks DDP."""
    if not launched():
        if mode not in ("auto", "none"):
            raise DistributedError(f"--parallel {mode} needs several processes: launch with torchrun "
                                   "--nproc-per-node N -m opct train ...")
        if os.environ.get("ACCELERATE_USE_CPU") == "True" and "MASTER_PORT" in os.environ:
            # what `accelerate launch --cpu --num_processes N` (N > 1) leaves: its simple launcher starts one process
            print("opct: warning: `accelerate launch --cpu` started ONE process; for several CPU processes use "
                  "`accelerate launch --multi_gpu --num_processes N` (torch.distributed.run; gloo on a CPU) or "
                  "torchrun", file=sys.stderr)
        return SINGLE, device
    if device.type not in ("cpu", "cuda"):
        raise DistributedError(f"--device {device}: distributed training runs on CPU (gloo) or CUDA (NCCL)")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                                if device.type == "cuda" else None)
    mode = "ddp" if mode in ("auto", "none") else mode
    return Replicas(dist.get_rank(), dist.get_world_size(), mode), device


# The process groups of the runs that ended here, kept to the interpreter's exit (see close).
_ENDED_GROUPS: list = []


def close(replicas: Replicas) -> None:
    """The end of a finished run on every rank: a barrier, then the process group is destroyed, its Python handle
    kept. The DDP reducer, freed once the run returns, holds the GIL in its destructor; were it the group's last
    owner, that destructor would join gloo's worker threads while one of them may still wait for the GIL to drop
    the last collective's Python-owned tensors: a rank that never exits (pytorch/pytorch#56297). With the handle
    kept, the reducer only drops its reference; the group ends with the handle at exit (or never: `python -m opct`
    under torchrun leaves with os._exit), and torch's binding releases the GIL before that join.
    docs/reliability.md has the history."""
    if replicas.world > 1 and dist.is_initialized():
        dist.barrier()
        _ENDED_GROUPS.append(dist.group.WORLD)
        dist.destroy_process_group()


class Replica(torch.nn.Module):
    """The module DDP / FSDP2 wrap. `forward(part="lm", ...)` is the causal LM's forward (sampling);
    `part="body"` the transformer body's last hidden states (scoring, whose head runs outside)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, part: str = "lm", **kw):
        if part == "body":
            return lm_parts(self.lm)[0](**kw).last_hidden_state
        return self.lm(**kw)


def _sum_hook(process_group, bucket):
    """DDP comm hook: all-reduce SUM (the default divides by the world size)."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap(model, replicas: Replicas, device: torch.device):
    """The model's Replica wrapped for `replicas.mode` (DDP, or FSDP2 over each decoder layer and the root)."""
    replica = Replica(model)
    if replicas.mode == "ddp":
        # buffers (rotary frequencies) are the same on every rank: not synced before every forward (torch 2.13
        # renamed the setting; an older torch, as a GPU image may have, knows only broadcast_buffers)
        name = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        ddp = DDP(replica, device_ids=[device.index] if device.type == "cuda" else None, **{name: False})
        ddp.register_comm_hook(None, _sum_hook)
        return ddp
    if replicas.mode == "fsdp":
        for m in _fully_shard(replica):  # a plain sum over ranks (the default divides by the world size)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1.0), which gloo lacks
        return replica
    raise DistributedError(f"--parallel {replicas.mode!r}: expected auto, ddp or fsdp")


def _fully_shard(replica: Replica) -> list:
    """FSDP2 over each decoder layer, then the root (the Replica: embeddings, final norm, LM head); returns them."""
    layers = getattr(unwrap(replica.lm).base_model, "layers", None)
    if layers is None:
        raise DistributedError("--parallel fsdp: cannot find the model's decoder layers (model.layers)")
    for layer in layers:
        fully_shard(layer)
    fully_shard(replica)
    return [*layers, replica]


def shard_teacher(teacher, replicas: Replicas) -> None:
    """Under FSDP2, shard a full fine-tune's frozen teacher copy (`opct.models.Teacher`) like the student: each
    decoder layer, then the root. Its forwards then run through `teacher.replica` on every rank together, as the
    student's do; FSDP2 keeps a root's parameters gathered after its forward (it expects a backward), so the
    teacher's embeddings, final norm and LM head stay whole on every rank after its first forward, which is what
    lets the LM head run outside the forward. With LoRA the teacher is the student itself (nothing to do)."""
    if replicas.mode != "fsdp" or teacher.shared:
        return
    teacher.replica = Replica(teacher.model)
    _fully_shard(teacher.replica)


def set_grad_sync(replica, sync: bool) -> None:
    """Whether the next backward exchanges gradients (True only for a step's last micro-batch; earlier ones
    accumulate locally and are exchanged with it). Read by DDP at forward time, by FSDP2 at backward time."""
    if hasattr(replica, "set_requires_gradient_sync"):  # FSDP2 (recurses into the sharded layers)
        replica.set_requires_gradient_sync(sync)
    else:  # DDP (what its no_sync() context sets)
        replica.require_backward_grad_sync = sync


class ShardDraws:
    """The sampling RNG of a rank that samples rows [lo, hi) of a global batch of `total` rows: every draw takes
    the uniforms one process would draw for all rows and keeps this rank's, so the samples match a single-process
    run; `all_done` makes every rank decode until all ranks' rows are finished (one process's loop length)."""

    def __init__(self, gen: torch.Generator, total: int, lo: int, hi: int, replicas: Replicas):
        self.gen, self.total, self.lo, self.hi, self.replicas = gen, total, lo, hi, replicas

    def uniforms(self, B: int) -> torch.Tensor:
        assert B == self.hi - self.lo, (B, self.lo, self.hi)
        return torch.rand(self.total, 1, dtype=torch.float64, generator=self.gen)[self.lo:self.hi]

    def all_done(self, done: bool) -> bool:
        return self.replicas.all(done)


def draws_for(gen: torch.Generator, replicas: Replicas, rows_total: int):
    """The generator a rank samples its shard of a `rows_total`-row batch with (the generator itself alone)."""
    if replicas.world == 1:
        return gen
    n = rows_total // replicas.world
    return ShardDraws(gen, rows_total, replicas.rank * n, (replicas.rank + 1) * n, replicas)



# -- checkpoint state: full tensors (one process, DDP) or this rank's shards (FSDP2) ------------------------------

def _is_sharded(t) -> bool:
    return isinstance(t, DTensor)


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The trainable parameters as full tensors (FSDP2 shards gathered: every rank must call this)."""
    return {n: (p.full_tensor() if _is_sharded(p) else p).detach().contiguous()
            for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the (unsharded) parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)


def full_state_options():
    """get_*_state_dict options for whole tensors, gathered into CPU memory (the final model)."""
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _sharded_options():
    # Only the trainable parameters (the frozen base of a LoRA run is --model itself); set_state_dict then loads
    # that subset, so it is not strict about the frozen ones (the keys come from the model, none is unexpected).
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def sharded_state(replica, optimizer) -> dict:
    """This rank's shards of the trainable weights and of the optimizer state, keyed by parameter name
    (`get_state_dict` over the FSDP2 root: DTensors, never gathered), for `torch.distributed.checkpoint`. On
    a fresh optimizer it first takes one zero-gradient step at lr 0 to create the state tensors a load fills."""
    model_sd, optim_sd = get_state_dict(replica, optimizer, options=_sharded_options())
    return {"model": model_sd, "optimizer": optim_sd}


def load_sharded_state(replica, optimizer, state: dict) -> None:
    """Put a `sharded_state` dict that `torch.distributed.checkpoint.load` filled back into the model and the
    optimizer (learning rates and the rest of the parameter groups included)."""
    set_state_dict(replica, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_sharded_options())
