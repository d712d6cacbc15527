"""opct vs TRL's SDFTTrainer, side by side on this machine: step time, phases, peak RSS, and the bounds.

    pip install -e '.[bench]'
    python benchmarks/vs_trl.py --model /tmp/smol --rounds 2 --steps 5 --warmup 1 [--full] [--out vs_trl.json]
        [--prompt-tokens N] [--vllm-python /path/to/vllm-venv/bin/python] [--contention] [--vary-seed]

Each round runs `benchmarks/step.py` (opct) and `benchmarks/trl_step.py` (TRL), each in its own
subprocess so each side's peak RSS is its own, alternating (and swapping who goes first every round) so
that slow drift of the machine hits both sides alike. The machine must otherwise be idle: on 2 cores one
competing process more than halves either side's speed; `--wait-idle S` waits up to S seconds for that. Then `benchmarks/bounds.py` measures the machine. With `--full` every
round also runs both sides as full fine-tunes (`--lora-rank 0`). If step.py is missing, TRL is reported alone.

Workload: `--model`, `--batch`, `--max-new-tokens`, and `--prompt-tokens N` (default: the ~70-token
`common.bench_prompts`; with N: jailbreak-wrapped behaviours of about N tokens with the model's tokenizer,
`common.length_prompts`). Every side gets the same flags, so the same prompts. By default every round runs
seed 0, so every round samples the same responses on each side, and a step's cost moves with how long the sampled
responses ran (the two sides draw from the same distribution with different random streams). `--vary-seed` runs
round r with `--seed r` on both sides (round r's prompts and samples), so the pooled ratio averages over draws;
`--first-seed K` starts that count at K, so that a second run adds new draws (pool the files with
`pool_vs_trl.py`).

`--vllm-python PATH` adds a third side, `opct_vllm`: step.py run by that interpreter (one with vllm installed)
with `--sampler vllm`, in the same rotation (the order of the three reverses every round), pooled like the others
and compared with TRL in `ratio_vllm`. Every side reports `decode_s_per_token`, seconds per decode step at batch B,
each with `decode_s_per_token_includes` (opct: its decode loop, prefill excluded; vLLM: the whole generate call;
TRL: `generate`, prefill included); the summary lists them together and their ratio to TRL.
`--trl-vllm` adds TRL with its colocated vLLM engine (`trl_step.py --vllm`, under `--vllm-python` if given) as side
`trl_vllm`; each opct side is then also compared with it in `ratio_to_trl_vllm` (a GPU comparison: TRL's colocated
mode needs one). `--sides opct,trl_vllm` runs only those of the sides set up, where device time is short.

`--contention` runs every side under the same load: for the duration of each run a busy-loop process (plain
Python integer arithmetic from a fixed seed, `nice 19`, pinned to the last core with sched_setaffinity) is
started before the run and killed after it, in a session of its own like another user's job (`--contention same`:
in this session, where autogroup scheduling lets nice 19 yield to the benchmark; see `BusyLoop`).
`others_busy_cores` of each run then shows the load it ran under (about 1 when the busy process gets its core);
the bounds are measured without it.

Summary per configuration: each side's median over all measured steps (every round pooled), the median
per-phase split across rounds, the largest peak RSS, `ratio` = opct / TRL for step time and peak RSS (the
issue's target: step time <= 0.5) with `step_time_spread` (the ratio round by round, and a 95% bootstrap
interval: how firmly one run's ratio sits on either side of 0.5), and each phase against its bound:

  teacher  FLOPs = F(teacher prompt + response tokens, response logits)                 vs matmul peak
  student  FLOPs = k x F(student prompt + response tokens, response logits)             vs matmul peak
           k = 2 with LoRA (forward + activation gradients; frozen weights get no weight gradients),
           k = 3 for a full fine-tune (forward + activation + weight gradients).
  optim    AdamW step, memory-bound: reads param, grad and both moments, writes param and moments
           = 7 x 4 bytes per trainable fp32 parameter                                   vs bandwidth
  sample   seconds per decode step (phase seconds / decode steps = sampled tokens, prompt prefill included)
           vs weights bytes / bandwidth (every weight read once per step); the phase bound is the prompt
           prefill at matmul peak plus one weight pass per token after the first (which the prefill gives).
           `decode_only` (opct reports its decode loop separately): seconds per step vs that bandwidth bound
           and vs the FLOP bound, batch x F(1 token, 1 logit) / peak
           (at batch 8 a step does ~2 GFLOP, so on a 2-core CPU the FLOP bound is the larger one)
  step     median step seconds vs the sum of the phase bounds

where F(tokens, logits) = 2 x non-embedding params x tokens + 2 x hidden x vocab x logits (bounds.py's
`flops_per_token`: the lm_head runs only where logits are kept, attention score FLOPs and LoRA adapter
FLOPs are left out, so achieved figures are slight underestimates). Token counts are real (unpadded)
tokens per step from each side's JSON (`prompt_tokens`, `teacher_prompt_tokens` if given, else the prompt
count, `response_tokens`, `decode_steps`): padding counts as wasted time, not as work. When a side reports
`student_prompt_forward_in_sample` (opct's fused path: the student's prompt forward with grad doubles as the
sampler's prefill), that forward's FLOPs move from `student` to `sample`, so no FLOP is counted twice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import machine, median  # noqa: E402

from opct.cpu_load import cpu_busy_seconds  # noqa: E402  (all cores' busy seconds, /proc/stat; no torch)

OPCT_STEP = os.path.join(HERE, "step.py")
TRL_STEP = os.path.join(HERE, "trl_step.py")
BOUNDS = os.path.join(HERE, "bounds.py")


def huge_pages_env() -> bool:
    """Whether this environment gives the sides PyTorch's huge-page allocator (THP_MEM_ALLOC_ENABLE)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0")


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores kept busy right now by other processes (this script sleeps meanwhile)."""
    b0 = cpu_busy_seconds()
    time.sleep(seconds)
    b1 = cpu_busy_seconds()
    return None if b0 is None else (b1 - b0) / seconds


def wait_idle(max_wait_s: float) -> None:
    """Wait (up to max_wait_s) until other processes use under a quarter of a core, so runs are not shared."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline and (busy_cores() or 0.0) > 0.25:
        time.sleep(5)


BUSY_LOOP = """
import os, sys
os.nice(19)
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(sys.argv[1])})
x, parent = int(sys.argv[2]), int(sys.argv[3])
while os.getppid() == parent:  # stops by itself if the benchmark dies without killing it
    for _ in range(1000000):
        x = (x * 1103515245 + 12345) % 2147483648
"""


class BusyLoop:
    """A seeded busy-loop process at nice 19 pinned to `core` (default the last one) while the `with` block runs:
    contention that is the same for every side. It is killed and waited for on exit.

    `new_session` (default): the loop runs in a session of its own (setsid), like another user's job. Under
    autogroup scheduling (Linux's default, /proc/sys/kernel/sched_autogroup_enabled) nice only orders processes
    within one session, so such a loop takes its core whatever its nice value; in the benchmark's own session
    (`new_session=False`) nice 19 makes it yield to the benchmark (dev/LOG.md, 2026-11-24: a busy machine, and the thread policy)."""

    def __init__(self, core: int | None = None, seed: int = 0, new_session: bool = True):
        self.core = (os.cpu_count() or 1) - 1 if core is None else core
        self.seed = seed
        self.new_session = new_session
        self.proc = None

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.core), str(self.seed), str(os.getpid())],
                                     start_new_session=self.new_session)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()

    def describe(self) -> dict:
        return {"on": True, "core": self.core, "nice": 19, "seed": self.seed,
                "session": "own (setsid)" if self.new_session else "the benchmark's",
                "what": "python integer LCG loop, one process, for the duration of each side's run"}


def run_json(script: str, flags: list[str], python: str | None = None, threads: int | None = None,
             extra_env: dict | None = None) -> dict:
    """Run a benchmark script in a fresh interpreter and return the last JSON line it printed.

    Also records `others_busy_cores`: the cores other processes kept busy on average during the run
    (machine busy time minus the child's own CPU time), the check that the timings are not shared.
    `python`: the interpreter (default this one); `threads`: OMP_NUM_THREADS for the child (default: inherited);
    `extra_env`: more environment for the child (a side's own settings).
    """
    # Each side at its defaults: neither opct (huge_pages off by default) nor TRL asks PyTorch for huge pages;
    # THP_MEM_ALLOC_ENABLE=1 in this environment gives both sides them (recorded as config.huge_pages),
    # --trl-huge-pages only TRL's (a Side's own `env`).
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", **(extra_env or {})}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    busy0, child0 = cpu_busy_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([python or sys.executable, script, *flags], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    busy1, child1 = cpu_busy_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    others = None
    if busy0 is not None:
        child_cpu = (child1.ru_utime + child1.ru_stime) - (child0.ru_utime + child0.ru_stime)
        others = max(0.0, (busy1 - busy0 - child_cpu) / wall)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"{os.path.basename(script)} exited {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    result = json.loads(lines[-1])
    result["process_wall_s"] = wall
    result["others_busy_cores"] = others
    return result


def pool_runs(runs: list[dict]) -> dict | None:
    """Combine one side's runs: median over all measured steps, median phase split, largest peak RSS."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"errors": runs} if runs else None
    steps = [s for r in ok for s in r["steps_s"]]
    phase_names = sorted({k for r in ok for k in r.get("phases_s", {})})
    token_keys = ("prompt_tokens", "teacher_prompt_tokens", "response_tokens", "decode_steps")
    pooled = {
        "median_step_s": median(steps),
        "steps_s": steps,
        "phases_s": {k: median([r["phases_s"][k] for r in ok if k in r["phases_s"]]) for k in phase_names},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
        **({"peak_gpu_mb": max(r["peak_gpu_mb"] for r in ok), "gpu": ok[0].get("gpu")}
           if all("peak_gpu_mb" in r for r in ok) else {}),
        "runs": len(ok),
        "others_busy_cores": [r.get("others_busy_cores") for r in ok],
    }
    for key in token_keys:
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            pooled[key] = sum(values) / len(values)
    per_token = [r["decode_s_per_token"] for r in ok if r.get("decode_s_per_token") is not None]
    if per_token:
        pooled["decode_s_per_token"] = median(per_token)  # the median over runs of each run's median
    for key in ("batch", "student_prompt_forward_in_sample", "decode_s_per_token_includes", "prompts"):
        if key in ok[0]:  # per-side facts, the same in every run
            pooled[key] = ok[0][key]
    if len(ok) < len(runs):
        pooled["errors"] = [r for r in runs if "error" in r]
    return pooled


def forward_flops(bounds: dict, tokens: float, logits: float) -> float:
    fpt = bounds["model"]["flops_per_token"]
    return fpt["body"] * tokens + fpt["lm_head"] * logits


def phase_table(side: dict, bounds: dict, lora_rank: int) -> dict:
    """Each phase of one side against this machine's bound (see the module docstring for the formulas)."""
    if side is None or "median_step_s" not in side or "response_tokens" not in side:
        return {"note": "no token counts from this side; cannot relate phases to bounds"}
    phases, peak = side["phases_s"], bounds["matmul"]["gflops"]
    response = side["response_tokens"]
    student_prompt = side.get("prompt_tokens", 0.0)
    teacher_prompt = side.get("teacher_prompt_tokens", student_prompt)
    k = 2 if lora_rank > 0 else 3
    flops = {
        "teacher": forward_flops(bounds, teacher_prompt + response, response),
        "student": k * forward_flops(bounds, student_prompt + response, response),
    }
    if side.get("student_prompt_forward_in_sample"):
        # opct's fused path: the student's prompt forward (with grad) is the sampler's prefill, timed in `sample`
        flops["student"] -= forward_flops(bounds, student_prompt, 0)
    table = {}
    for name, f in flops.items():
        seconds = phases.get(name)
        if not seconds:
            continue
        achieved = f / seconds / 1e9
        table[name] = {
            "seconds": seconds,
            "gflop": f / 1e9,
            "achieved_gflops": achieved,
            "peak_gflops": peak,
            "fraction_of_peak": achieved / peak,
            "bound_s": f / (peak * 1e9),
        }
    if phases.get("optim"):
        trainable = bounds["model"]["lora_params"] if lora_rank > 0 else bounds["model"]["params"]["total"]
        bound_s = 7 * 4 * trainable / (bounds["bandwidth"]["best_gbs"] * 1e9)
        table["optim"] = {"seconds": phases["optim"], "bound_s": bound_s, "times_bound": phases["optim"] / bound_s,
                          "trainable_params": trainable}
    decode = bounds["decode"].get(str(lora_rank)) or bounds["decode"]["0"]
    if phases.get("sample") and side.get("decode_steps"):
        per_step = phases["sample"] / side["decode_steps"]
        # Whole-phase bound: the prompt prefill at matmul peak (its last position gives the first token), then
        # one pass streaming the weights for each further token.
        passes = max(side["decode_steps"] - 1, 0)
        bound_s = passes * decode["s_per_step_weights"] + forward_flops(bounds, student_prompt, 0) / (peak * 1e9)
        table["sample"] = {
            "seconds": phases["sample"],
            "decode_steps": side["decode_steps"],
            "s_per_decode_step": per_step,
            "bound_s_per_decode_step": decode["s_per_step_weights"],
            "times_bound": per_step / decode["s_per_step_weights"],
            "bound_s": bound_s,
            "weight_bytes": decode["weight_bytes"],
            "bandwidth_gbs": decode["bandwidth_gbs"],
        }
        if phases.get("decode") and side.get("decode_s_per_token_includes", "").startswith("vLLM"):
            table["sample"]["decode_only"] = {"note": "vLLM's decode time includes its prefill; no decode-only bound"}
        elif phases.get("decode"):
            # The decode loop alone (decoder build included, prompt prefill excluded). At batch B a step is also
            # bounded by its FLOPs: B rows x (body + lm_head) per token at matmul peak.
            flop_s = side.get("batch", 8) * forward_flops(bounds, 1, 1) / (peak * 1e9)
            loop = phases["decode"] / side["decode_steps"]
            table["sample"]["decode_only"] = {
                "seconds": phases["decode"], "s_per_decode_step": loop,
                "bandwidth_bound_s_per_step": decode["s_per_step_weights"], "flop_bound_s_per_step": flop_s,
                "times_bandwidth_bound": loop / decode["s_per_step_weights"],
                "times_max_bound": loop / max(flop_s, decode["s_per_step_weights"]),
            }
            if decode.get("s_per_step_weights_one_stream"):  # the weights read at one stream's rate (bounds.py)
                table["sample"]["decode_only"].update(
                    one_stream_s_per_step=decode["s_per_step_weights_one_stream"],
                    times_one_stream=loop / decode["s_per_step_weights_one_stream"])
    table["step"] = {"seconds": side["median_step_s"], "bound_s": sum(row["bound_s"] for row in table.values())}
    return table


def ratio(opct: dict | None, trl: dict | None, key: str):
    if not opct or not trl or key not in opct or key not in trl or not trl[key]:
        return None
    return opct[key] / trl[key]


def ratio_spread(opct_runs: list[dict], trl_runs: list[dict], n_boot: int = 4000, seed: int = 0) -> dict | None:
    """How firm the step-time ratio is. `per_round`: opct's median step over TRL's median step of the same round
    (both ran back to back). `ci95`: a 95% interval for the pooled ratio (median of all opct steps over median of
    all TRL steps) from a two-level bootstrap: resample each side's rounds with replacement, then the steps
    within each drawn round, so that round-to-round drift of the machine, the larger source of spread here,
    widens the interval as it should. Seeded: the same runs always give the same interval."""
    def steps(run):
        return run["steps_s"] if "error" not in run and run.get("steps_s") else None

    ok_o = [s for s in map(steps, opct_runs) if s]
    ok_t = [s for s in map(steps, trl_runs) if s]
    if not ok_o or not ok_t:
        return None
    # Rounds pair by position; a round where either side failed has no ratio.
    rounds = [(o, t) for o, t in zip(map(steps, opct_runs), map(steps, trl_runs)) if o and t]
    rng = random.Random(seed)

    def draw(rounds):
        picked = [rounds[rng.randrange(len(rounds))] for _ in rounds]
        return median([steps[rng.randrange(len(steps))] for steps in picked for _ in steps])

    boot = sorted(draw(ok_o) / draw(ok_t) for _ in range(n_boot))
    return {"per_round": [median(o) / median(t) for o, t in rounds],
            "ci95": [boot[int(0.025 * n_boot)], boot[int(0.975 * n_boot) - 1]],
            "share_of_bootstrap_at_most_0.5": sum(b <= 0.5 for b in boot) / n_boot}


class Side:
    """One benchmarked side: its name, script, interpreter (None: this one), extra flags and extra environment."""

    def __init__(self, name: str, script: str, python: str | None = None, extra: list[str] | None = None,
                 env: dict | None = None):
        self.name, self.script, self.python, self.extra = name, script, python, list(extra or [])
        self.env = dict(env or {})


def workload_flags(prompt_tokens: int | None) -> list[str]:
    """The workload flags every side gets beyond the shared ones (none by default: the original workload)."""
    return [] if prompt_tokens is None else ["--prompt-tokens", str(prompt_tokens)]


def run_side(side: Side, flags: list[str], contention: bool | str = False, threads: int | None = None) -> dict:
    """One run of one side, next to a BusyLoop when `contention` (started before the run, killed after it; "same":
    in this session, else in a session of its own).
    `threads`: torch threads (step.py's --threads; OMP_NUM_THREADS for every side); None keeps each side's default."""
    if threads is not None and side.script != TRL_STEP:
        flags = flags + ["--threads", str(threads)]
    if not contention:
        return run_json(side.script, flags + side.extra, side.python, threads, side.env)
    with BusyLoop(new_session=contention != "same"):
        result = run_json(side.script, flags + side.extra, side.python, threads, side.env)
    result["contention"] = "same session" if contention == "same" else "own session"
    return result


def compare(runs: dict[str, list[dict]], bounds: dict, rank: int) -> dict:
    """One configuration's summary from each side's runs ({"opct": [...], "trl": [...], "opct_vllm": [...]}):
    pooled sides, opct / TRL ratios (`ratio`; `ratio_vllm` for the vLLM side), decode seconds per token of every
    side with its ratio to TRL, each side against the bounds, and the raw runs."""
    pooled = {name: pool_runs(rs) for name, rs in runs.items()}
    opct, trl = pooled.get("opct"), pooled.get("trl")

    def ratios(side: str, peer: str) -> dict:
        a, b = pooled.get(side), pooled.get(peer)
        return {"step_time": ratio(a, b, "median_step_s"), "peak_rss": ratio(a, b, "peak_rss_mb"),
                "peak_gpu": ratio(a, b, "peak_gpu_mb"),
                "step_time_spread": ratio_spread(runs.get(side, []), runs.get(peer, [])),
                "decode_s_per_token": ratio(a, b, "decode_s_per_token")}

    entry = {"opct": opct, "trl": trl, "ratio": ratios("opct", "trl")}
    if "opct_vllm" in pooled:
        entry["opct_vllm"] = pooled["opct_vllm"]
        entry["ratio_vllm"] = ratios("opct_vllm", "trl")
    if "trl_vllm" in pooled:
        entry["trl_vllm"] = pooled["trl_vllm"]
        entry["ratio_to_trl_vllm"] = {name: ratios(name, "trl_vllm") for name in ("opct", "opct_vllm") if name in pooled}
    entry["decode_s_per_token"] = {
        name: {"seconds": p.get("decode_s_per_token"), "includes": p.get("decode_s_per_token_includes"),
               "ratio_to_trl": ratio(p, trl, "decode_s_per_token")}
        for name, p in pooled.items() if p and "decode_s_per_token" in p}
    if "error" not in bounds:
        entry["vs_bounds"] = {name: phase_table(p, bounds, rank) for name, p in pooled.items() if p}
    entry["raw_runs"] = runs
    return entry


def main(argv=None):
    p = argparse.ArgumentParser(description="opct vs TRL SDFTTrainer, alternating runs; prints a JSON summary.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, dir or Hub id (resolved by opct.models.resolve)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--full", action="store_true", help="also compare full fine-tuning (--lora-rank 0)")
    p.add_argument("--out", help="also write the summary to this JSON file")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each run, wait up to this long for the machine to go idle (shared machines)")
    p.add_argument("--opct-step", default=OPCT_STEP, help="the opct side's script (default: benchmarks/step.py)")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="jailbreak-wrapped prompts of about N tokens (default: the ~70-token bench_prompts)")
    p.add_argument("--vllm-python", metavar="PATH",
                   help="also run opct with the vLLM sampler (step.py --sampler vllm) under this interpreter")
    p.add_argument("--trl-vllm", action="store_true",
                   help="also run TRL with its colocated vLLM engine (trl_step.py --vllm; under --vllm-python if "
                        "given): side trl_vllm, which opct's sides are also compared with (ratio_to_trl_vllm)")
    p.add_argument("--sides", default=None, metavar="A,B",
                   help="run only these of the sides the other flags set up (opct, trl, opct_vllm, trl_vllm), e.g. "
                        "opct,trl_vllm where device time is short")
    p.add_argument("--contention", nargs="?", const="own", choices=["own", "same"], default=None,
                   help="run every side next to a nice-19 busy loop pinned to the last core, in a session of its "
                        "own (default, like another user's job) or in this one (`--contention same`)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every side and the bounds (default: each side's own: opct's thread "
                        "policy, TRL's torch default, bounds.py's 2)")
    p.add_argument("--no-bounds", action="store_true", help="skip benchmarks/bounds.py (no vs_bounds tables)")
    p.add_argument("--vary-seed", action="store_true",
                   help="round r runs both sides with --seed r (other prompts, other samples) instead of seed 0 in "
                        "every round, so the pooled ratio averages over sampled response lengths")
    p.add_argument("--first-seed", type=int, default=0,
                   help="with --vary-seed, round r runs seed K + r: a further run adds new draws to pool")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both sides' model weights (step.py / trl_step.py --dtype)")
    p.add_argument("--decode-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="opct's decode_dtype (bfloat16: opct samples on bfloat16 weight copies, on a GPU with "
                        "--opct-set merged_decode=true; side trl samples in float32, trl_vllm in vLLM's bfloat16)")
    p.add_argument("--opct-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for the opct side (step.py --set), e.g. merged_decode=true (repeatable)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where both sides run (cuda: opct's hf backend and TRL on the first GPU, peak GPU memory "
                        "reported and compared; the CPU bounds are skipped)")
    p.add_argument("--trl-huge-pages", action="store_true",
                   help="give only TRL's process PyTorch's huge-page allocator (THP_MEM_ALLOC_ENABLE=1; opct's "
                        "default is off): each side at its faster setting")
    args = p.parse_args(argv)
    if args.first_seed and not args.vary_seed:
        p.error("--first-seed needs --vary-seed (without it every round runs seed 0)")

    have_opct = os.path.exists(args.opct_step)
    ranks = [args.lora_rank] + ([0] if args.full and args.lora_rank != 0 else [])
    trl_env = {"THP_MEM_ALLOC_ENABLE": "1"} if args.trl_huge_pages else {}
    opct_extra = ["--decode-dtype", args.decode_dtype, *[x for kv in args.opct_set for x in ("--set", kv)]]
    sides = [Side("opct", args.opct_step, extra=opct_extra)] if have_opct else []
    sides.append(Side("trl", TRL_STEP, env=trl_env))
    if args.vllm_python:
        sides.append(Side("opct_vllm", args.opct_step, python=args.vllm_python, extra=["--sampler", "vllm"]))
    if args.trl_vllm:
        sides.append(Side("trl_vllm", TRL_STEP, python=args.vllm_python, extra=["--vllm"], env=trl_env))
    if args.sides:
        wanted = args.sides.split(",")
        unknown = sorted(set(wanted) - {side.name for side in sides})
        if unknown:
            p.error(f"--sides: {', '.join(unknown)} not among the sides set up ({', '.join(s.name for s in sides)}; "
                    "opct_vllm needs --vllm-python, trl_vllm --trl-vllm)")
        sides = [side for side in sides if side.name in wanted]
    runs = {rank: {side.name: [] for side in sides} for rank in ranks}
    for r in range(args.rounds):
        for rank in ranks:
            flags = ["--model", args.model, "--batch", str(args.batch), "--max-new-tokens", str(args.max_new_tokens),
                     "--lora-rank", str(rank), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            flags += workload_flags(args.prompt_tokens) + ["--device", args.device, "--dtype", args.dtype]
            flags += ["--seed", str(args.first_seed + r)] if args.vary_seed else []
            # Swap who goes first every round, so neither side always runs on a just-warmed (or tired) machine.
            for side in sides if r % 2 == 0 else sides[::-1]:
                print(f"[vs_trl] round {r + 1}/{args.rounds} lora_rank={rank} {side.name} ...", file=sys.stderr,
                      flush=True)
                wait_idle(args.wait_idle)
                result = run_side(side, flags, args.contention, args.threads)
                runs[rank][side.name].append(result)
                print(f"[vs_trl]   median_step_s={result.get('median_step_s')} peak_rss_mb={result.get('peak_rss_mb')}"
                      f" others_busy_cores={result.get('others_busy_cores')}"
                      f"{' ERROR ' + result['error'] if 'error' in result else ''}", file=sys.stderr, flush=True)

    if args.no_bounds or args.device != "cpu":
        bounds = {"error": "skipped (" + ("--no-bounds" if args.no_bounds else "bounds.py measures the CPU") + ")"}
    else:
        print("[vs_trl] bounds ...", file=sys.stderr, flush=True)
        wait_idle(args.wait_idle)
        bounds = run_json(BOUNDS, ["--model", args.model, "--lora-rank", str(max(args.lora_rank, 0)),
                                   "--batch", str(args.batch)]
                          + (["--threads", str(args.threads)] if args.threads else []), threads=args.threads)

    summary = {"config": {**vars(args), "huge_pages": huge_pages_env()}, "machine": machine(),
               "bounds": bounds, "configs": {}, "notes": [],
               "contention": (BusyLoop(new_session=args.contention != "same").describe() if args.contention
                              else {"on": False})}
    if not have_opct:
        summary["notes"].append(f"{args.opct_step} not found: TRL reported alone")
    # Timings only mean something on an otherwise idle machine: with 2 cores, one competing process
    # roughly halves throughput (and OpenMP threads waiting on a descheduled peer make it worse).
    busy = [r["others_busy_cores"] for rank in ranks for side in runs[rank].values() for r in side
            if r.get("others_busy_cores") is not None]
    if args.contention:
        summary["notes"].append("contention mode: every run shared the machine with a nice-19 busy loop on core "
                                f"{summary['contention']['core']}; others_busy_cores per run (pooled sides list them) "
                                "shows the load each ran under")
    elif busy and max(busy) > 0.1:
        summary["notes"].append(f"machine was shared: other processes kept up to {max(busy):.2f} of "
                                f"{os.cpu_count()} cores busy during a run; its step times are inflated")
    for rank in ranks:
        name = f"lora_r{rank}" if rank > 0 else "full"
        summary["configs"][name] = compare(runs[rank], bounds, rank)

    text = json.dumps(summary, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
