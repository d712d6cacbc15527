"""What every axis shares for its evaluation (the interface itself is opct.axes.interface): replies generated and
split into reasoning and answer by the model's `ChatFormat` (`replies`; `respond` for the axes whose evaluation reads
free text, safety and jailbreak), the count of replies whose reasoning never closed, and the per-example samples file
with each row's verdict (`write_samples`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from opct.data.chat import ChatFormat
from opct.data.io import atomic_write
from opct.backends.sampling import SamplingSettings


@dataclass
class Reply:
    """One generated reply, split where a thinking model's reasoning ends (`ChatFormat.split`): `answer` is what an
    axis grades (the whole reply for a model without reasoning), `reasoning` the span before it (None: none), and
    `closed` False when the reasoning never closed within the token budget: then there is no answer to grade, and
    the axis counts the reply as unclosed instead of scoring it."""
    answer: str
    reasoning: str | None = None
    closed: bool = True


def generate_split(policy, fmt: ChatFormat, chats: list[list[dict]], max_new_tokens: int, temperature: float = 0.0,
                   batch_size: int = 16, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Each chat rendered (`fmt.prompt`: the chat template, its options, the generation prompt) and answered:
    (prompt ids, reply ids), for `fmt.split` to tell the reasoning from the answer. Sampled ones draw from one
    generator seeded with `seed`."""
    ids = [fmt.prompt(m) for m in chats]
    got = policy.generate(ids, SamplingSettings(max_new_tokens, temperature), torch.Generator().manual_seed(seed),
                          batch_size=batch_size)
    return list(zip(ids, got))


def replies(policy, fmt: ChatFormat, chats: list[list[dict]], max_new_tokens: int, temperature: float = 0.0,
            batch_size: int = 16, seed: int = 0, think_budget: int = 0) -> list[Reply]:
    """`respond`, with each reply split into reasoning and answer (`fmt.split`, as a `Reply`). A thinking model
    (`fmt.thinks`) may generate `think_budget` more tokens, for its reasoning."""
    tok = policy.tok
    budget = max_new_tokens + (think_budget if fmt.thinks else 0)

    def text(r):
        return tok.decode(r, skip_special_tokens=True).strip()

    out = []
    for p, r in generate_split(policy, fmt, chats, budget, temperature, batch_size, seed):
        s = fmt.split(p, r)
        out.append(Reply(text(s.answer), None if s.reasoning is None else text(s.reasoning), s.closed))
    return out


UNCLOSED = "unclosed reasoning: no answer to grade"  # why an axis did not grade a reply (Reply.closed False)


def unclosed_counts(splits: list[str], got: list[Reply]) -> dict[str, int]:
    """How many replies of each split ended inside their reasoning (no answer to grade)."""
    out: dict[str, int] = {}
    for s, r in zip(splits, got):
        out[s] = out.get(s, 0) + (not r.closed)
    return out


def respond(policy, fmt: ChatFormat, chats: list[list[dict]], max_new_tokens: int, temperature: float = 0.0,
            batch_size: int = 16, seed: int = 0, think_budget: int = 0) -> list[str]:
    """One response per chat (messages rendered by `fmt`: the chat template, its options and its generation
    prompt), decoded to text without special tokens: for a thinking model the answer after its reasoning
    ("" where the reasoning never closed; `replies` tells which). Greedy by default; sampled ones draw from one
    generator seeded with `seed`, so the same call gives the same answers. Batching and execution are the policy's
    (`Policy.generate`)."""
    return [r.answer for r in replies(policy, fmt, chats, max_new_tokens, temperature, batch_size, seed,
                                      think_budget)]


def write_samples(path: Path, rows: list[dict], verdict: Callable[[dict], dict]) -> None:
    """An evaluation's per-example rows as JSONL at `path` (written whole, atomically), each with its "verdict": the
    axis' own (`Axis.verdict(row)`, {name: {"value": 0 or 1, "answer", "explanation"}}, {} where there is none). The
    rest of a row is the axis' (split, id, the prompt, the answer or response, what its judge said), so every axis'
    rows carry the one verdict shape, for the report, an Inspect log (opct.inspect_log) or pandas alike."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(json.dumps({**r, "verdict": verdict(r)}, ensure_ascii=False) + "\n" for r in rows))
