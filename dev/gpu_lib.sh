# Shared by dev/gpu_vs_trl.sh and dev/gpu_vllm.sh (sourced, on the lent GPU machine, from the repo root): the
# carried wheels installed, the environment every run needs, random-weight models (dev/gpu_results.py prints the
# results).

# gpu_setup [EXTRA_PYTHONPATH]: .gpu/whl's wheels into /tmp/site, then PYTHONPATH (/tmp/site, the extra entries,
# src/) and the offline environment; prints the GPU.
gpu_setup() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/whl/*.whl || return 1
    export PYTHONPATH=/tmp/site${1:+:$1}:$PWD/src PYTHONUNBUFFERED=1 OPCT_CACHE=$PWD/.gpu/cache HF_HUB_OFFLINE=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}

# random_model NAME: seeded random weights of .gpu/like/NAME's architecture and tokenizer in /tmp/NAME (qwen: the
# 0.5B, smol: SmolLM2; benchmarks/random_weights.py).
random_model() {
    rm -rf "/tmp/like-$1" && cp -r ".gpu/like/$1" "/tmp/like-$1" && gunzip "/tmp/like-$1/tokenizer.json.gz" \
        && python3 benchmarks/random_weights.py --like "/tmp/like-$1" --out "/tmp/$1" 2>/dev/null
}
