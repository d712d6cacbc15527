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

import torch
from tqdm.auto import tqdm

from opct import losses
from opct.config import SFTConfig
from opct.opct import data_order, end_step, optimizer_step, save_final, start_run
from opct.pairs import ConsistencyPair
from opct.rollout import SamplingSettings, sample
from opct.scoring import build_batch, response_hidden, response_logprobs


def make_targets(run, cfg: SFTConfig) -> list[tuple[list[int], list[int]]]:
    """(student_ids, target_ids) examples; targets come from the frozen model on the teacher prompts."""
    path = run.out / "targets.jsonl"
    if cfg.resume and path.is_file():
        return [tuple(json.loads(line)) for line in path.read_text().splitlines()]
    distinct = list(dict.fromkeys(tuple(t) for _, t in run.rendered))
    settings = SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
    answers: dict[tuple, list[list[int]]] = {t: [] for t in distinct}
    jobs = [t for t in distinct for _ in range(cfg.samples_per_prompt)]
    with run.teacher() as frozen:
        for i in tqdm(range(0, len(jobs), cfg.micro_batch), desc="sft targets", leave=False):
            chunk = jobs[i:i + cfg.micro_batch]
            for t, r in zip(chunk, sample(frozen, [list(t) for t in chunk], settings, run.eos_ids, run.pad_id, run.gen)):
                answers[t].append(r)
    examples = [(s, r) for s, t in run.rendered for r in answers[tuple(t)]]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps([s, r]) + "\n" for s, r in examples))
    tmp.replace(path)
    return examples


def train_sft(cfg: SFTConfig, pairs: list[ConsistencyPair] | None = None, probe=None, probe_every: int = 0,
              show_progress: bool = True) -> Path:
    run = start_run(cfg, pairs)
    t_run = time.perf_counter()
    t0 = time.perf_counter()
    examples = make_targets(run, cfg)
    targets_s = time.perf_counter() - t0
    per_step = cfg.prompts_per_step * cfg.samples_per_prompt  # the same number of sequences as an OPCT step
    bar = tqdm(range(run.start, cfg.steps), initial=run.start, total=cfg.steps, desc="sft", disable=not show_progress)
    for step in bar:
        idx = data_order(len(examples), cfg.seed, step * per_step, per_step)
        batch = [examples[i] for i in idx]
        n_tokens = sum(len(r) for _, r in batch)
        t1 = time.perf_counter()
        run.model.train()
        total = 0.0
        for c in range(0, len(batch), cfg.micro_batch):
            mb = batch[c:c + cfg.micro_batch]
            b = build_batch([s for s, _ in mb], [r for _, r in mb], run.pad_id)
            logp_BT = response_logprobs(run.model, response_hidden(run.model, b), b.response_BT)
            nll = -(logp_BT * b.mask_BT).sum()
            (nll / n_tokens).backward()
            total += float(nll.detach())
        row = {"loss": total / n_tokens, "response_len": n_tokens / len(batch), "response_tokens": n_tokens,
               "time_student": time.perf_counter() - t1}
        row.update(optimizer_step(run, cfg))
        step_s = row["time_student"] + row["time_optim"]
        row = {"step": step + 1, **row, "step_seconds": step_s, "tokens_per_s": n_tokens / step_s}
        end_step(run, cfg, step, row, probe, probe_every, bar, show_progress)
    run.log.close()
    save_final(run.out, run.model, run.tok, cfg, {"wall_seconds": time.perf_counter() - t_run, "steps": cfg.steps,
                                                  "targets_seconds": targets_s, "examples": len(examples)})
    return run.out
