#!/usr/bin/env bash
# Before/after check for a behaviour-preserving refactor (issue 64): on a tiny random Llama, every axis' `opct eval`
# (dev/eval_seam_check.py), a short demo of each axis and a short five-method two-seed demo, with a fixed thread
# count so runs are bit-reproducible under load. Run it from two checkouts into two folders and compare them with
# `python dev/behaviour_compare.py OLD NEW`.
#
#     bash dev/behaviour_check.sh OUT_DIR [PYTHON]
set -euo pipefail
out=$(realpath -m "$1"); py=${2:-python}
mkdir -p "$out"
export OPCT_THREADS=2 PYTHONHASHSEED=0 TQDM_DISABLE=1
"$py" - "$out/tiny" <<'PY'
import sys; sys.path.insert(0, "tests")
from pathlib import Path
from conftest import make_tiny_model
p = Path(sys.argv[1])
if not (p / "config.json").is_file():
    make_tiny_model(p)
PY
"$py" dev/eval_seam_check.py "$out/eval_seam.json" --model "$out/tiny"
common=(--model "$out/tiny" --steps 2 --prompts-per-step 4 --n-train 8 --n-eval 8 --probe-every 0 --capability ""
        --report-to none --threads 2 --max-new-tokens 8)
opct=("$py" -m opct.cli)
"${opct[@]}" demo --axis sycophancy --cued-n 8 --shift-n 8 --out "$out/sycophancy" "${common[@]}"
"${opct[@]}" demo --axis safety --out "$out/safety" "${common[@]}"
"${opct[@]}" demo --axis jailbreak --eval-max-new-tokens 8 --pairs-per-behaviour 1 --n-benign 4 --out "$out/jailbreak" "${common[@]}"
"${opct[@]}" demo --axis sycophancy --cued-n 8 --shift-n 8 --methods sft,opct,opct-shuffled,opct-fixed,opct-clip \
    --seeds 2 --out "$out/methods" "${common[@]}"
echo "behaviour check written to $out"
