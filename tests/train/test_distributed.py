"""Data-parallel training on this CPU: torchrun (and accelerate launch), 2 processes, gloo. DDP and FSDP2 runs must
give the same per-step metrics and final weights as one process over the same global batch, for LoRA and full
fine-tuning, and a run whose rank is killed resumes to the uninterrupted run's metrics (under FSDP2 from sharded
torch.distributed.checkpoint checkpoints)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import kill_tree, run_tree

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

PAIRS = [{"student": [{"role": "user", "content": f"Hint: the answer is B. Question {i}: what is {i}+{i}?"}],
          "teacher": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}]} for i in range(8)]
COMPARED = ("loss", "kl", "logp_student", "logp_teacher", "grad_norm", "response_tokens", "distinct_responses",
            "decode_steps", "prompt_tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(model_dir, pairs, out, procs: int, *extra, steps: int = 3) -> list[str]:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "opct"]
              if procs > 1 else [sys.executable, "-m", "opct"])
    return [*launch, *extra, "--model", str(model_dir), "--pairs", str(pairs), "--out", str(out), "--steps", str(steps),
            "--prompts-per-step", "4", "--micro-batch", "2", "--max-new-tokens", "6", "--report-to", "none",
            "--backend", "hf", "--threads", "1"]


def run(cmd, env=None, timeout: int = 300, ok: bool | None = True, **kw) -> subprocess.CompletedProcess:
    """`cmd` to its end with OMP_NUM_THREADS=1 (tests.procs.run_tree: past `timeout` torchrun and every rank it
    started are killed and the test fails with the ranks' stacks)."""
    return run_tree(cmd, timeout, env or {**os.environ, "OMP_NUM_THREADS": "1"}, ok, **kw)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict:
    f = out / "model" / ("adapter_model.safetensors" if (out / "model" / "adapter_config.json").exists()
                         else "model.safetensors")
    return load_file(str(f))


def assert_same_run(a: Path, b: Path, tol: float = 1e-5) -> None:
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        for k in COMPARED:
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=tol, abs=tol), (k, x["step"], x[k], y[k])
    wa, wb = weights(a), weights(b)
    for k, t in wa.items():  # a gathered full model may add the tied head under its own name
        assert torch.allclose(t, wb[k], atol=1e-6, rtol=1e-5), k


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("dist")
    pairs = d / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return d, pairs


@pytest.fixture(scope="module")
def single(setup, tiny_model_dir):
    """One process over the global batch: the reference, for LoRA and for full fine-tuning."""
    d, pairs = setup
    outs = {}
    for kind, extra in (("lora", ["--lora-rank", "4", "--samples-per-prompt", "2"]),
                        ("full", ["--lora-rank", "0", "--lr", "1e-4", "--samples-per-prompt", "2"])):
        outs[kind] = d / f"single-{kind}"
        run(command(tiny_model_dir, pairs, outs[kind], 1, "train", *extra))
    return outs


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_two_processes_match_one(setup, single, tiny_model_dir, parallel, kind):
    d, pairs = setup
    out = d / f"{parallel}-{kind}"
    extra = ["--lora-rank", "4"] if kind == "lora" else ["--lora-rank", "0", "--lr", "1e-4"]
    p = run(command(tiny_model_dir, pairs, out, 2, "train", *extra, "--samples-per-prompt", "2", "--parallel",
                    parallel))
    assert p.stdout.count("opct: done") == 1  # rank 0 speaks for both
    assert_same_run(single[kind], out)
    info = json.loads((out / "run.json").read_text())["execution"]
    assert info["processes"] == 2 and info["parallel"] == parallel


def test_accelerate_launch_matches_one_process(setup, single, tiny_model_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` starts its processes through torch.distributed.run, also
    on a machine without GPUs (gloo); `--cpu` would start one process (accelerate's simple launcher)."""
    d, pairs = setup
    out = d / "accelerate"
    cmd = command(tiny_model_dir, pairs, out, 1, "train", "--lora-rank", "4", "--samples-per-prompt", "2")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(free_port())]
    # HF_HOME: no accelerate config file of this machine's user changes the launch
    p = run([*launch, *cmd[1:]], env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path)})
    assert p.stdout.count("opct: done") == 1
    assert json.loads((out / "run.json").read_text())["execution"]["processes"] == 2
    assert_same_run(single["lora"], out)


def test_accelerate_launch_cpu_says_it_started_one_process(setup, tiny_model_dir, tmp_path):
    """`accelerate launch --cpu --num_processes 2` runs accelerate's simple launcher: one process (it only sets
    MASTER_ADDR / MASTER_PORT); opct trains on it and says so instead of passing for a 2-process run."""
    d, pairs = setup
    cmd = command(tiny_model_dir, pairs, d / "accelerate-cpu", 1, "train", "--lora-rank", "4", steps=1)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    p = run([*launch, *cmd[1:]], env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path)})
    assert "`accelerate launch --cpu` started ONE process" in p.stderr
    assert "processes" not in json.loads((d / "accelerate-cpu" / "run.json").read_text())["execution"]


def test_sft_two_processes_match_one(setup, tiny_model_dir):
    d, pairs = setup
    a, b = d / "sft-1", d / "sft-2"
    run(command(tiny_model_dir, pairs, a, 1, "sft", "--lora-rank", "4"))
    run(command(tiny_model_dir, pairs, b, 2, "sft", "--lora-rank", "4", "--parallel", "ddp"))
    assert_same_run(a, b)


def test_prompts_must_divide_over_processes(setup, tiny_model_dir):
    d, pairs = setup
    cmd = command(tiny_model_dir, pairs, d / "odd", 2, "train", "--lora-rank", "4")
    cmd[cmd.index("--prompts-per-step") + 1] = "3"
    p = run(cmd, ok=False)
    assert "--prompts-per-step 3 does not divide evenly over 2 processes" in p.stderr


def test_parallel_without_torchrun_is_an_error(setup, tiny_model_dir):
    d, pairs = setup
    p = subprocess.run(command(tiny_model_dir, pairs, d / "solo", 1, "train", "--parallel", "fsdp"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--parallel fsdp needs several processes" in p.stderr


KINDS = {"lora": ["--lora-rank", "4"], "full": ["--lora-rank", "0", "--lr", "1e-4"]}


@pytest.fixture(scope="module")
def kill_refs(setup, tiny_model_dir):
    """The uninterrupted single-process runs the killed runs must reproduce, one per kind, made when first needed."""
    d, pairs = setup
    refs = {}

    def ref(kind: str) -> Path:
        if kind not in refs:
            refs[kind] = d / f"kill-ref-{kind}"
            run(command(tiny_model_dir, pairs, refs[kind], 1, *_kill_args(kind), steps=12))
        return refs[kind]
    return ref


def _kill_args(kind: str) -> list[str]:
    return ["train", *KINDS[kind], "--samples-per-prompt", "2", "--save-every", "1"]


def _kill_after_step_2(cmd: list[str], out: Path) -> None:
    """Start `cmd` (torchrun, 2 processes) and SIGKILL one rank once the step-2 checkpoint exists (torchrun then
    stops the other)."""
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 240
        while not (out / "checkpoints" / "step-000002" / "manifest.json").exists():
            assert launcher.poll() is None and time.time() < deadline, "the run ended before its second checkpoint"
            time.sleep(0.01)
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(children[-1]), signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
    finally:  # a failed wait leaves no rank running
        if launcher.poll() is None:
            kill_tree(launcher.pid)
    assert not (out / "run.json").exists() and len(metrics(out)) < 12


def _sharded_weights(ckpt: Path) -> dict:
    """The whole tensors of an FSDP2 checkpoint's DCP shards (torch's own converter), named as the model's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "dcp", ckpt.parent / f"{ckpt.name}.pt")
    state = torch.load(ckpt.parent / f"{ckpt.name}.pt", weights_only=True)["model"]
    (ckpt.parent / f"{ckpt.name}.pt").unlink()
    return {k.removeprefix("lm."): v for k, v in state.items()}


@pytest.mark.slow
@pytest.mark.parametrize("parallel,kind", [("ddp", "lora"), ("fsdp", "lora"), ("fsdp", "full")])
def test_killed_rank_resumes_to_the_uninterrupted_run(setup, kill_refs, tiny_model_dir, parallel, kind):
    """A rank killed after the step-2 checkpoint: --resume on 2 processes finishes with the metrics and weights
    of a single process that was never interrupted. Under FSDP2 every checkpoint is DCP shards written by both
    ranks (no whole-tensor weights file), and a checkpoint whose shards were not all written (never renamed into
    place) is passed over."""
    d, pairs = setup
    ref = kill_refs(kind)
    out = d / f"kill-{parallel}-{kind}"
    cmd = command(tiny_model_dir, pairs, out, 2, *_kill_args(kind), "--parallel", parallel, steps=12)
    _kill_after_step_2(cmd, out)
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    if parallel == "fsdp":
        files = json.loads((newest / "manifest.json").read_text())
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(files)
        assert not (newest / "trainable.safetensors").exists()
        assert "optimizer" not in torch.load(newest / "optim.pt", weights_only=True)
        # rank 1 killed while writing the next checkpoint: rank 0's shard in a temporary directory, never renamed
        step = int(newest.name.split("-")[1]) + 1
        partial = out / "checkpoints" / f".step-{step:06d}.tmp-killed" / "dcp"
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes((newest / "dcp" / "__0_0.distcp").read_bytes())
    run(cmd + ["--resume"])
    assert not list((out / "checkpoints").glob(".step-*"))
    assert_same_run(ref, out)
    if parallel == "fsdp":  # the shards of the last checkpoint hold the single process's weights at that step
        want = load_file(str(ref / "checkpoints" / "step-000011" / "trainable.safetensors"))
        got = _sharded_weights(out / "checkpoints" / "step-000011")
        for k, t in want.items():
            assert torch.allclose(t, got[k], atol=1e-6, rtol=1e-5), k


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_resume_with_another_process_count_is_refused(setup, tiny_model_dir, parallel):
    d, pairs = setup
    out = d / f"count-{parallel}"
    base = ["train", "--lora-rank", "4", "--save-every", "1", *(["--parallel", "fsdp"] if parallel == "fsdp" else [])]
    run(command(tiny_model_dir, pairs, out, 2, *base, steps=2))
    (out / "run.json").unlink()  # pretend it stopped after its last checkpoint
    procs = 1 if parallel == "ddp" else 4  # `--parallel fsdp` needs several processes; 4 ranks load the model, then stop
    p = run(command(tiny_model_dir, pairs, out, procs, *base, "--resume", steps=2), ok=False)
    now = "1 (none)" if parallel == "ddp" else "4 (fsdp)"
    assert f"written by 2 process(es) ({parallel}), resumed with {now}" in p.stderr, p.stderr[-2000:]


def _on_main_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from opct.train.distributed import DistributedError, Replicas

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    r = Replicas(rank, 2, "ddp")

    def fail():
        raise OSError(28, "No space left on device")
    try:
        r.on_main(fail)
        q.put((rank, "returned"))
    except DistributedError as e:
        q.put((rank, f"DistributedError: {e}"))
    except OSError as e:
        q.put((rank, f"OSError: {e}"))
    finally:
        dist.destroy_process_group()


def test_a_failed_write_on_rank_0_stops_every_rank():
    """Rank 0's write fails (a full disk): the other rank raises with rank 0's message instead of waiting at a
    barrier until the process-group timeout."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_on_main_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0].startswith("OSError") and "No space left" in got[0]
    assert got[1].startswith("DistributedError: rank 0 failed") and "No space left" in got[1]


def _teacher_worker(rank: int, port: int, model_dir: str, q) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from opct.backends.hf import head_logits
    from opct.models import Teacher, load_model
    from opct.train.distributed import Replicas, shard_teacher

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, _ = load_model(model_dir)
        ids_BT = torch.tensor([[1, 5, 9, 200, 3000, 7], [42, 43, 44, 45, 46, 47]])
        with torch.no_grad():
            want_BTV = model(input_ids=ids_BT).logits
        teacher = Teacher(model)  # full fine-tuning: a frozen copy
        shard_teacher(teacher, Replicas(rank, 2, "fsdp"))
        params = list(teacher.model.parameters())
        sharded = all(isinstance(p, DTensor) and not p.requires_grad for p in params)
        share = sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params)
        with teacher() as m:
            got_BTV = head_logits(m, teacher.replica(part="body", input_ids=ids_BT))
            again_BTV = head_logits(m, teacher.replica(part="body", input_ids=ids_BT))
        q.put((rank, sharded, share, (got_BTV - want_BTV).abs().max().item(), torch.equal(got_BTV, again_BTV)))
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_the_full_fine_tune_teacher(tiny_model_dir):
    """Under FSDP2 the frozen teacher copy of a full fine-tune holds 1/2 of the weights per rank (DTensor shards,
    no gradient), and its forward through its sharded wrapper, LM head outside, gives the unsharded model's logits."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_teacher_worker, args=(r, port, str(tiny_model_dir), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, sharded, share, err, same in got:
        assert sharded and share < 0.55 and err < 1e-6 and same, (rank, sharded, share, err, same)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, no group: intended
def test_planted_pickles_in_dcp_shards_are_refused_not_run(tmp_path):
    """DCP itself unpickles .metadata and its non-tensor entries freely; opct refuses a payload in either
    (read_shards, which an FSDP2 resume loads through), and still reads a plain checkpoint."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from opct.train.checkpoint import CheckpointError, read_shards

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    def state(lr=0.25):
        return {"w": torch.zeros(3, 2), "groups": [{"lr": lr, "betas": (0.9, 0.99), "foreach": None}]}

    plain = tmp_path / "plain"
    dcp.save({"w": torch.arange(6.0).view(3, 2), "groups": [{"lr": 0.5, "betas": (0.9, 0.99), "foreach": None}]},
             checkpoint_id=plain)
    got = state()
    read_shards(plain, got)
    assert torch.equal(got["w"], torch.arange(6.0).view(3, 2)) and got["groups"][0]["lr"] == 0.5
    with pytest.raises(CheckpointError, match="Missing key in checkpoint state_dict: extra"):
        read_shards(plain, {**state(), "extra": torch.zeros(1)})

    entry = tmp_path / "entry"  # a non-tensor entry that would run code when unpickled
    dcp.save({"w": torch.ones(3, 2), "groups": [{"lr": Payload()}]}, checkpoint_id=entry)
    with pytest.raises(CheckpointError, match="groups.*refused to load"):
        read_shards(entry, {"w": torch.zeros(3, 2), "groups": [{"lr": 0.0}]})

    meta = tmp_path / "meta"  # .metadata replaced by a payload
    dcp.save({"w": torch.ones(3, 2)}, checkpoint_id=meta)
    (meta / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load"):
        read_shards(meta, {"w": torch.zeros(3, 2)})
    assert not marker.exists()


def _full_disk_worker(rank: int, port: int, model_dir: str, out: str, q) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from opct.models import load_model
    from opct.train import checkpoint
    from opct.train.distributed import Replicas, wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        replicas = Replicas(rank, 2, "fsdp")
        model, _ = load_model(model_dir)
        replica = wrap(model, replicas, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        if rank == 1:  # rank 1's disk is full when it writes its shards
            def full(self, plan, planner):
                raise OSError(28, "No space left on device")
            FileSystemWriter.write_data = full
        try:
            checkpoint.save(Path(out), 1, model, opt, sched, torch.Generator(), replica=replica, replicas=replicas)
            q.put((rank, "saved"))
        except Exception as e:  # noqa: BLE001
            q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_a_full_disk_on_one_rank_stops_every_rank_and_leaves_no_checkpoint(tiny_model_dir, tmp_path):
    """FSDP2: rank 1 cannot write its DCP shards. Both ranks stop with a WriteError naming the checkpoint, and
    neither the checkpoint nor its temporary directory (with rank 0's shard) is left."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    out = tmp_path / "run"
    procs = [ctx.Process(target=_full_disk_worker, args=(r, port, str(tiny_model_dir), str(out), q))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        assert got[rank].startswith("WriteError") and "step-000001: could not be written" in got[rank], got
        assert "No space left" in got[rank]
    assert list((out / "checkpoints").iterdir()) == []
