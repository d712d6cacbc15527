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

# random_big: an 8B-class model with the 0.5B's architecture and tokenizer and Qwen2.5-7B's dimensions (7.6B
# parameters, untied embeddings), bfloat16, drawn on the GPU, in /tmp/qwen7b (issue 49's configuration (b)).
random_big() {
    [ -f /tmp/qwen7b/opct-random-weights.json ] && return 0  # a warm machine keeps /tmp between calls
    rm -rf /tmp/like-big && cp -r .gpu/like/qwen /tmp/like-big && gunzip /tmp/like-big/tokenizer.json.gz \
        && python3 benchmarks/random_weights.py --like /tmp/like-big --out /tmp/qwen7b --dtype bfloat16 --device cuda \
            --set hidden_size=3584 --set intermediate_size=18944 --set num_hidden_layers=28 \
            --set num_attention_heads=28 --set num_key_value_heads=4 --set tie_word_embeddings=false 2>/dev/null
}
