"""The offline baseline: consistency SFT (BCT, Chua et al. 2024; Irpan et al. 2025).

  1. targets  the frozen initial model answers each distinct teacher (clean) prompt once — greedy by default,
              or k samples — and the answers are saved to targets.jsonl (reused on --resume);
  2. SFT      cross-entropy on (student prompt -> target), on the response tokens only, normalised by the step's
              total target-token count; same LoRA, optimizer, batch and step count as OPCT.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from opct.backends.base import Policy, Rollout
from opct.backends.sampling import SamplingSettings
from opct.config import SFTConfig
from opct.data.io import atomic_write
from opct.data.chat import ChatFormat
from opct.data.pairs import ConsistencyPair
from opct.train import loop


def read_targets(path: Path) -> list[tuple[list[int], list[int]]]:
    """targets.jsonl as make_targets wrote it, each line [student_ids, target_ids]; anything else is a RunError
    naming the file and line (delete the file and --resume makes the targets again)."""
    def bad(msg):
        return loop.RunError(f"{msg}; delete it and --resume makes the targets again")

    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise bad(f"{path}: unreadable ({e})") from None
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad(f"{path}:{i}: damaged ({e.msg})") from None
        if not (isinstance(row, list) and len(row) == 2 and all(
                isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                for ids in row)):
            raise bad(f"{path}:{i}: not a [student token ids, target token ids] pair")
        out.append((row[0], row[1]))
    return out


def make_targets(run: loop.Run, cfg: SFTConfig) -> list[tuple[list[int], list[int]]]:
    """(student_ids, target_ids) examples; targets come from the frozen model on the teacher prompts."""
    path = run.out / "targets.jsonl"
    if cfg.resume and path.is_file():
        return read_targets(path)
    distinct = list(dict.fromkeys(tuple(t) for _, t in run.rendered))
    settings = SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    answers: dict[tuple, list[list[int]]] = {t: [] for t in distinct}
    jobs = [t for t in distinct for _ in range(cfg.samples_per_prompt)]
    with run.policy.teacher() as frozen:
        for i in tqdm(range(0, len(jobs), cfg.micro_batch), desc="sft targets", leave=False):
            chunk = jobs[i:i + cfg.micro_batch]
            for t, r in zip(chunk, frozen.sample([list(t) for t in chunk], settings, run.gen).responses):
                answers[t].append(r)
    examples = [(s, r) for s, t in run.rendered for r in answers[tuple(t)]]
    if run.replicas.is_main:  # every data-parallel rank made the same targets (same generator); rank 0 writes
        atomic_write(path, "".join(json.dumps([s, r]) + "\n" for s, r in examples))
    return examples


def sft_step(policy: Policy, fmt: ChatFormat, batch: list[tuple[list[int], list[int]]], micro_batch: int,
             answers_only: bool = False) -> dict:
    """One optimizer step's forward/backward work: summed negative log-likelihood of the targets after the
    student prompts, divided by the step's total target-token count. `fmt`: the student's chat format;
    `answers_only` (train_on_thinking off): for a thinking model (`fmt.thinks`) the targets' reasoning tokens leave
    the loss (`ChatFormat.answer_mask`), and a target whose reasoning never closes trains nothing."""
    answers_only = answers_only and fmt.thinks
    students, targets = [s for s, _ in batch], [r for _, r in batch]
    n_tokens = policy.replicas.sum(fmt.answer_tokens(students, targets)[0] if answers_only
                                   else sum(map(len, targets)))  # over data-parallel replicas too
    t0 = time.perf_counter()
    total = 0.0
    starts = range(0, len(batch), micro_batch)
    for c in starts:
        mb = batch[c:c + micro_batch]
        prompts = [s for s, _ in mb]
        scores = policy.score(prompts, Rollout(prompts, [r for _, r in mb]), grad=True, sync=c == starts[-1])
        logp_NT = scores.logp_NT
        if answers_only:
            logp_NT = logp_NT * fmt.answer_mask(prompts, [r for _, r in mb], logp_NT.shape[1])[0]
        nll = -logp_NT.sum()
        (nll / max(n_tokens, 1)).backward()
        total += float(nll.detach())
    n_seq = policy.replicas.sum(len(batch))
    return {"loss": policy.replicas.sum(total) / max(n_tokens, 1), "response_len": n_tokens / n_seq,
            "response_tokens": n_tokens, "time_student": time.perf_counter() - t0}


def train_sft(cfg: SFTConfig, pairs: list[ConsistencyPair] | None = None, probe=None, probe_every: int = 0,
              show_progress: bool = True) -> Path:
    with loop.start_run(cfg, pairs) as run:  # on an error, the run's sampler and logs are closed at once
        t0 = time.perf_counter()
        examples = make_targets(run, run.cfg)
        targets_s = time.perf_counter() - t0
        per_step = cfg.prompts_per_step * cfg.samples_per_prompt  # the same number of sequences as an OPCT step
        bar = loop.steps(run, "sft", show_progress)
        for step in bar:
            idx = loop.data_order(len(examples), cfg.seed, step * per_step, per_step)
            batch, _ = loop.share(run, [examples[i] for i in idx])  # this process's share (all of it in one process)
            row = sft_step(run.policy, run.fmt, batch, cfg.micro_batch, answers_only=not cfg.train_on_thinking)
            row.update(loop.optimizer_step(run, step, row["loss"]))
            loop.end_step(run, step, row, probe, probe_every, bar, show_progress)
        return loop.save_final(run, {"targets_seconds": targets_s, "examples": len(examples)})
