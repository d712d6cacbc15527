"""Token logs of training: a logged step's samples, with each response token's student and teacher log-probs.

OPCT's step already holds what the lens shows: the student's log p_S(y_t | perturbed prompt, y_<t) and the frozen
teacher's log p_T(y_t | clean prompt, y_<t) of every sampled token (algo/opct.py, steps 2 and 3). Every
`--token-log-every` steps the step hands them to a `StepTokens` (one copy to the CPU per micro-batch; no forward
runs for it), which writes two Parquet files under the run directory:

    tokens/step-000005.parquet     one row per response token: step, sample, pair, position, token_id, token,
                                   logp_student, logp_teacher, in_loss, reasoning
    tokens/prompts-000005.parquet  one row per sample: step, sample, pair, student_prompt, teacher_prompt (the
                                   rendered texts), student_ids, teacher_ids (their token ids), student_tokens,
                                   teacher_tokens (each id decoded alone), response (text)

`pair` is the pair's index in the run's pairs (their order in the pairs file), `sample` the row's index in the step's
global batch (a pair sampled samples_per_prompt times has that many rows). Under torchrun each process writes its
own share, a contiguous slice of the batch (`-rank<R>` before `.parquet`). DuckDB or pandas read the folder as one table:

    SELECT token, logp_student - logp_teacher AS gap FROM 'run/tokens/step-*.parquet' ORDER BY gap DESC LIMIT 20
    pandas.read_parquet("run/tokens", filters=...)   # or pd.concat(map(pd.read_parquet, glob("run/tokens/step-*")))
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TOKENS_DIR = "tokens"


@dataclass
class StepTokens:
    """One logged step's samples, filled by `opct_step` as it goes (`add` per micro-batch), written by `write`."""
    step: int  # 1-based, as metrics.jsonl counts steps
    pairs: list[int]  # the pair index of each of this process's rows, in the step's row order
    rows: list[tuple] = field(default_factory=list)  # (student ids, teacher ids, response, logp_s, logp_t, in_loss)

    def add(self, prompts_s: list[list[int]], prompts_t: list[list[int]], responses: list[list[int]],
            logp_s_NT, logp_t_NT, mask_NT) -> None:
        """One micro-batch: each row's response tokens with their two log-probs (right-padded N x T tensors, as
        `Scores` holds them) and whether the loss counts them (the mask)."""
        ls, lt, m = (x.detach().float().cpu() for x in (logp_s_NT, logp_t_NT, mask_NT))
        for i, r in enumerate(responses):
            n = len(r)
            self.rows.append((prompts_s[i], prompts_t[i], r, ls[i, :n].tolist(), lt[i, :n].tolist(),
                              m[i, :n].bool().tolist()))

    def write(self, out: Path, tok, fmt, rank: int = 0, world: int = 1) -> list[Path]:
        """The two Parquet files of this step under out/tokens (module docstring), each written whole
        (a temporary file renamed into place). `fmt`: the student's ChatFormat, which says where a thinking model's
        answer starts (tokens before it are `reasoning`)."""
        if len(self.pairs) != len(self.rows):
            raise ValueError(f"step {self.step}: {len(self.rows)} token rows for {len(self.pairs)} pairs")
        cols = {k: [] for k in ("step", "sample", "pair", "position", "token_id", "token", "logp_student",
                                "logp_teacher", "in_loss", "reasoning")}
        prompts = {k: [] for k in ("step", "sample", "pair", "student_prompt", "teacher_prompt", "student_ids",
                                   "teacher_ids", "student_tokens", "teacher_tokens", "response")}
        first = rank * len(self.rows)  # this process's contiguous share of the global batch (Replicas.shard)
        for sample, (pair, (s_ids, t_ids, resp, ls, lt, keep)) in enumerate(zip(self.pairs, self.rows), first):
            start = fmt.answer_start(s_ids, resp) if fmt.thinks else 0
            start = len(resp) if start is None else start  # reasoning that never closed: all of it
            n = len(resp)
            cols["step"] += [self.step] * n
            cols["sample"] += [sample] * n
            cols["pair"] += [pair] * n
            cols["position"] += range(n)
            cols["token_id"] += resp
            cols["token"] += tok.batch_decode([[t] for t in resp])
            cols["logp_student"] += ls
            cols["logp_teacher"] += lt
            cols["in_loss"] += keep
            cols["reasoning"] += [i < start for i in range(n)]
            for k, v in (("step", self.step), ("sample", sample), ("pair", pair), ("student_ids", s_ids),
                         ("teacher_ids", t_ids)):
                prompts[k].append(v)
            prompts["student_tokens"].append(tok.batch_decode([[t] for t in s_ids]))
            prompts["teacher_tokens"].append(tok.batch_decode([[t] for t in t_ids]))
            prompts["student_prompt"].append(tok.decode(s_ids))
            prompts["teacher_prompt"].append(tok.decode(t_ids))
            prompts["response"].append(tok.decode(resp))
        folder = Path(out) / TOKENS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        suffix = f"-rank{rank}" if world > 1 else ""
        paths = [folder / f"step-{self.step:06d}{suffix}.parquet", folder / f"prompts-{self.step:06d}{suffix}.parquet"]
        for path, table in zip(paths, (pa.table(cols, schema=TOKEN_SCHEMA), pa.table(prompts, schema=PROMPT_SCHEMA))):
            tmp = path.with_name(path.name + ".tmp")
            pq.write_table(table, tmp)
            os.replace(tmp, path)
        return paths


TOKEN_SCHEMA = pa.schema([("step", pa.int32()), ("sample", pa.int32()), ("pair", pa.int32()),
                          ("position", pa.int32()), ("token_id", pa.int64()), ("token", pa.string()),
                          ("logp_student", pa.float32()), ("logp_teacher", pa.float32()), ("in_loss", pa.bool_()),
                          ("reasoning", pa.bool_())])
PROMPT_SCHEMA = pa.schema([("step", pa.int32()), ("sample", pa.int32()), ("pair", pa.int32()),
                           ("student_prompt", pa.string()), ("teacher_prompt", pa.string()),
                           ("student_ids", pa.list_(pa.int64())), ("teacher_ids", pa.list_(pa.int64())),
                           ("student_tokens", pa.list_(pa.string())), ("teacher_tokens", pa.list_(pa.string())),
                           ("response", pa.string())])


def due(every: int, step: int, steps: int) -> bool:
    """Whether 0-based `step` of `steps` logs its tokens: every `every` steps and the last (0: never)."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of a run whose token logs are on disk, in order."""
    folder = Path(run_dir) / TOKENS_DIR
    return sorted({int(p.name.split("-")[1].split(".")[0]) for p in folder.glob("step-*.parquet")}) \
        if folder.is_dir() else []


def read_step(run_dir: Path, step: int) -> tuple[pa.Table, pa.Table]:
    """(tokens, prompts) of one logged step, every process's share (rank files) concatenated."""
    folder = Path(run_dir) / TOKENS_DIR
    tokens = [pq.read_table(p) for p in sorted(folder.glob(f"step-{step:06d}*.parquet"))]
    prompts = [pq.read_table(p) for p in sorted(folder.glob(f"prompts-{step:06d}*.parquet"))]
    return pa.concat_tables(tokens), pa.concat_tables(prompts)
