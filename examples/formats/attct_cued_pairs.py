"""opct pairs from AttCT's clean sycophancy prompts, cued the way AttCT's own AttCT / ACT / MLPCT training cues them,
so that student and teacher differ in the cue and nothing else (docs/pairs.md, "AttCT, sycophancy").

AttCT's stored bct_ / control_ rows differ in more than the cue: in nearly every row the answer-format instruction
is worded differently, and in about half only one side ends with "The best answer is: (" (docs/pairs.md has the
counts), so OPCT on them partly trains invariance to the answer format. AttCT's OPCT-style methods instead read only
the control_ prompts (data/attct_datasets.py, AttCTDataset) and put one of its 12 sycophancy cue templates
(data/wrappers.py, SYCOPHANCY_TEMPLATES) in front of each, drawing the template and the suggested option at random
each time a prompt is used. This script does that with AttCT's own code (the data/wrappers.py of the AttCT checkout
you name), `--draws` times per prompt from a fixed `--seed`, and writes opct's pairs format:

    python examples/formats/attct_cued_pairs.py PATH/TO/AttCT \\
        PATH/TO/AttCT/datasets/sycophancy_bct/control_non_cot_train.jsonl cued.jsonl --draws 1 --seed 0
    opct train --pairs cued.jsonl ...

Each row: {"student": [{"role": "user", "content": CUE + PROMPT}], "teacher": [{"role": "user", "content": PROMPT}],
"cue": CUE, "clean": "control_<split>.jsonl:LINE"}. A prompt without answer choices is left out, as AttCTDataset
leaves it out (every template names an option). Where AttCT draws a new cue for a prompt each epoch, these pairs are
fixed: `--draws N` writes N independently cued pairs per prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path


def attct_wrappers(attct_dir: str | Path):
    """AttCT's data/wrappers.py (standard library only), imported from its checkout."""
    path = Path(attct_dir) / "data" / "wrappers.py"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (name the root of an AttCT checkout)")
    spec = importlib.util.spec_from_file_location("attct_wrappers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cued_pairs(attct_dir: str | Path, control: str | Path, seed: int = 0, draws: int = 1) -> list[dict]:
    """The opct pair rows (module docstring) for AttCT's control_ file `control`."""
    w = attct_wrappers(attct_dir)
    wrapper = w.AdversarialWrapper(templates=w.SYCOPHANCY_TEMPLATES, strategy="random", mode="sycophancy")
    random.seed(seed)  # AttCT's wrapper draws from the random module's global generator
    control = Path(control)
    rows = []
    with control.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            prompt = str(json.loads(line)["messages"][0]["content"])  # as AttCT's _read_jsonl_user_messages
            if not w._extract_answer_choices(prompt):  # as AttCTDataset drops it
                continue
            for _ in range(draws):
                wrapped, start, length = wrapper.wrap(prompt)
                assert wrapped[start:start + length] == prompt
                rows.append({"student": [{"role": "user", "content": wrapped}],
                             "teacher": [{"role": "user", "content": prompt}],
                             "cue": wrapped[:start], "clean": f"{control.name}:{lineno}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("attct_dir", help="the root of an AttCT checkout (its data/wrappers.py is used)")
    ap.add_argument("control", help="an AttCT control_<split>.jsonl (the clean prompts)")
    ap.add_argument("out", help="the opct pairs JSONL to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draws", type=int, default=1, help="cued pairs per prompt (default 1)")
    args = ap.parse_args(argv)
    if args.draws < 1:
        ap.error("--draws must be at least 1")
    rows = cued_pairs(args.attct_dir, args.control, args.seed, args.draws)
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{args.out}: {len(rows)} pairs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
