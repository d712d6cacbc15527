#!/bin/bash
# opct vs TRL 1.16 SDFTTrainer with vLLM on a lent GPU machine (the `device` tool): issue 22 acceptance 6's
# "TRL + vLLM" sides, beside the sides dev/gpu_vs_trl.sh measures.
#
# The image has torch 2.11.0+cu130 and no vLLM; vllm 0.26.0 is the release built for that torch (TRL 1.16 supports
# 0.22-0.31). Its wheel (304 MB) and the packages it imports that the image lacks cannot travel in one call (64 MiB),
# so `prepare` builds one site directory and splits its .tar.xz (~73 MB) over two calls:
#   /tmp/vsite  vllm 0.26.0 without its FlashAttention-2/3, MoE and FlashMLA extensions, deep_gemm / fmha_sm100
#               headers and the vllm-rs binary (~620 MB of the 730), so vLLM selects its Triton attention backend
#               (two lines patched so that it can: vllm_flash_attn no longer raises on import, and the FlashAttention
#               backend reports itself unsupported without the extensions); plus, as cp312 wheels at the versions
#               .venv-vllm holds, what `import vllm`, vllm.entrypoints.llm, the V1 engine, GPU worker and model runner,
#               trl.generation.vllm_generation and opct.backends.vllm import (found by importing them with every
#               other distribution blocked), less mistral_common's tokenizer files and pycountry's translations.
# Here, once, after `bash dev/gpu_vs_trl.sh prepare` (.gpu/):  bash dev/gpu_vllm.sh prepare  (fills .gv1/, .gv2/)
# Then two device calls back to back (the machine stays warm 30 s between them; on 2026-11-27 the first call's
# machine took ~5 min to start, out of the session's 15 min of device time, so give the second call ~9 min):
#   1. carry [".gv1"]:          bash dev/gpu_vllm.sh keep
#   2. carry [".gpu", ".gv2"]:  bash dev/gpu_vllm.sh         (results in $OUT)
# Run first on a lent GPU (issue 62: the risks ../shared/research/vllm-gpu-contract.md lists, which no CPU run can
# see: Model Runner V2 on CUDA, sleep mode, CUDA graphs with LoRA, lm-eval's vLLM model), in place of call 2:
#   2'. carry [".gpu", ".gv2"]: bash dev/gpu_vllm.sh first  (results in $OUT: stages.txt, one log and run a stage)
#   stages, in order, each under its own time limit and all within FIRST_BUDGET_S (default 540 s; a stage that would
#   start past it is skipped and says so): one OPCT step of the in-process engine, eager, then with CUDA graphs
#   (3 steps each on Qwen2.5-0.5B's architecture with random weights; the weight-sync check runs before steps 2-3);
#   the sync sabotaged (dev/gpu_sync_check.py: the run must stop with exit 1); an adapter after every wake from
#   sleep (levels 1 and 2, tests/backends/test_vllm_sampler.py on SmolLM2's architecture, random weights); the server
#   opct starts; lm-eval's vLLM model on the eager run's adapter (merged) where lm-eval is importable; each run's
#   metrics, summarised. Then, in a later call, the TRL + vLLM side by side (call 2 above) and the 8B configuration.
# Issue 49's configuration (b), an 8B-class model (random weights, bfloat16, LoRA r=32, 8 prompts of ~400 tokens,
# 1,024 sampled tokens), one side a call (each loads 15 GB twice and captures CUDA graphs; not yet run):
#   3. carry [".gpu", ".gv2"]:  SIDES=opct_vllm bash dev/gpu_vllm.sh big
#   4. carry [".gpu", ".gv2"]:  SIDES=trl_vllm bash dev/gpu_vllm.sh big
set -u -o pipefail
if [ "${1:-}" = prepare ]; then
    for d in .gv1 .gv2; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
    site=$(mktemp -d) && tmp=$(mktemp -d) || exit 1
    plat="--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64"
    deps="distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5"  # openai 3.57 imports httpx2
    for p in pydantic pydantic-core annotated-types typing-inspection cachetools cbor2 msgspec pyzmq pybase64 openai \
             jiter sniffio partial-json-parser setproctitle ijson blake3 python-json-logger depyf astor mistral-common \
             oss-harmony jsonschema jsonschema-specifications referencing rpds-py pydantic-extra-types pycountry \
             llguidance xgrammar apache-tvm-ffi fastapi starlette; do
        deps="$deps $p==$(.venv-vllm/bin/python -c "import importlib.metadata as m; print(m.version('$p'))")" || exit 1
    done
    python3 -m pip download -q --no-deps $plat -d "$tmp" vllm==0.26.0 $deps || exit 1
    python3 -m pip install -q --no-deps --no-compile $plat --target "$site" "$tmp"/*.whl || exit 1
    (cd "$site" && rm -rf vllm/vllm_flash_attn/_vllm_fa[23]_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so \
        vllm/_flashmla_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 \
        mistral_common/data/* pycountry/locales/* pycountry/tests tvm_ffi/include tvm_ffi/3rdparty bin) || exit 1
    python3 - "$site/vllm" <<'PY' || exit 1
import sys
root = sys.argv[1]
edits = {
    "vllm_flash_attn/__init__.py": ("if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(",
                                    "if False:  # carried without its extensions (opct dev/gpu_vllm.sh)\n"
                                    "    raise ImportError("),
    "v1/attention/backends/flash_attn.py": (
        "    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:\n"
        "        return capability >= DeviceCapability(8, 0)",
        "    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:\n"
        "        from vllm.vllm_flash_attn.flash_attn_interface import FA2_AVAILABLE, FA3_AVAILABLE\n"
        "        return (FA2_AVAILABLE or FA3_AVAILABLE) and capability >= DeviceCapability(8, 0)"),
}
for rel, (old, new) in edits.items():
    path = f"{root}/{rel}"
    text = open(path).read()
    assert text.count(old) == 1, f"{path}: the text to patch is not there once"
    open(path, "w").write(text.replace(old, new))
PY
    rm -rf .gv1 .gv2 && mkdir .gv1 .gv2 || exit 1
    (cd "$site" && tar cf - .) | xz -9 -T2 > "$tmp/site.tar.xz" || exit 1
    head -c 56000000 "$tmp/site.tar.xz" > .gv1/a && tail -c +56000001 "$tmp/site.tar.xz" > .gv2/b || exit 1
    (cd "$tmp" && sha256sum site.tar.xz) > .gv2/sha256
    rm -rf "$site" "$tmp"
    du -sh .gv1 .gv2
    exit 0
fi
if [ "${1:-}" = keep ]; then
    mkdir -p /tmp/keep && cp .gv1/a /tmp/keep/a && ls -la /tmp/keep && nvidia-smi -L
    exit $?
fi
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/vsite
a=/tmp/keep/a; [ -f "$a" ] || a=.gv1/a
sums=$PWD/.gv2/sha256
cat "$a" .gv2/b > /tmp/site.tar.xz && (cd /tmp && sha256sum -c "$sums") || exit 1
xz -dc /tmp/site.tar.xz | tar xf - -C /tmp/vsite || exit 1
. dev/gpu_lib.sh
gpu_setup /tmp/vsite || exit 1
# vLLM's sampler otherwise imports flashinfer (not carried) to ask whether it can use it
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 -c "import torch, transformers, peft, trl, vllm, vllm.entrypoints.llm, trl.generation.vllm_generation
import opct.backends.vllm
print({m.__name__: m.__version__ for m in (torch, transformers, peft, trl, vllm)})" 2>&1 | tail -3 || exit 1
if [ "${1:-}" = first ]; then
    t_first=$(date +%s)
    # stage NAME LIMIT CMD...: CMD under LIMIT seconds (less what is left of FIRST_BUDGET_S), its output in
    # $OUT/NAME.log, one line in $OUT/stages.txt and the log's tail on stdout
    stage() {
        local name=$1 limit=$2 left t rc
        shift 2
        left=$(( ${FIRST_BUDGET_S:-540} - ($(date +%s) - t_first) ))
        if [ "$left" -lt 30 ]; then
            echo "$name skipped: ${left} s of FIRST_BUDGET_S left" | tee -a "$OUT/stages.txt"
            return 0
        fi
        [ "$left" -lt "$limit" ] && limit=$left
        t=$(date +%s)
        timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
        rc=$?
        echo "$name rc=$rc seconds=$(( $(date +%s) - t )) limit=$limit" | tee -a "$OUT/stages.txt"
        grep -v "it/s\]" "$OUT/$name.log" | tail -n 4 | cut -c1-600
        return 0
    }
    random_model qwen || exit 1
    random_model smol || exit 1
    train="-m opct train --model /tmp/qwen --pairs examples/pairs.jsonl --device cuda --prompts-per-step 4
           --max-new-tokens 32 --lora-rank 32 --save-every 0 --report-to none"
    stage opct_step_eager 240 python3 $train --steps 3 --sampler vllm --no-cuda-graphs --out "$OUT/eager"
    stage sync_check_sabotaged 200 python3 dev/gpu_sync_check.py vllm -- ${train#-m opct train} --steps 6 --lr 1e-3 \
        --no-cuda-graphs --out /tmp/sabotaged
    stage wake_after_sleep 240 env OPCT_VLLM_TEST_MODEL=/tmp/smol python3 -m pytest -q -m vllm -p no:cacheprovider \
        tests/backends/test_vllm_sampler.py -k adapter_applies_after_every_wake
    stage opct_step_graphs 240 python3 $train --steps 3 --sampler vllm --out "$OUT/graphs"
    stage server 240 python3 $train --steps 2 --sampler vllm-server --out "$OUT/server"
    if python3 -c "import lm_eval" 2>/dev/null; then
        stage lm_eval_vllm 240 python3 -m opct eval --tasks arc_easy,gsm8k --limit 8 --eval-engine vllm \
            --model "$OUT/eager/model" --out "$OUT/capability_vllm.json"
    else
        echo "lm_eval_vllm skipped: lm-eval is not importable here" | tee -a "$OUT/stages.txt"
    fi
    python3 - "$OUT" <<'PY'
import json, pathlib, sys
for run in ("eager", "graphs", "server"):
    f = pathlib.Path(sys.argv[1]) / run / "metrics.jsonl"
    rows = [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []
    keys = ("step", "kl", "sampler_logp_gap", "is_weight_mean", "is_truncated", "sync_gap_trainer",
            "sync_gap_initial", "sync_drift", "check_seconds", "sync_seconds", "time_sample", "step_seconds")
    print(run, [{k: round(r[k], 5) if isinstance(r.get(k), float) else r.get(k) for k in keys if k in r}
                for r in rows] or "no metrics")
PY
    exit 0
fi
if [ "${1:-}" = big ]; then
    random_big || exit 1
    printf '#!/bin/bash\nexec timeout -k 10 %s python3 "$@"\n' "${SIDE_LIMIT_S:-480}" > /tmp/pyv && chmod +x /tmp/pyv
    python3 benchmarks/vs_trl.py --model /tmp/qwen7b --device cuda --dtype bfloat16 --batch 8 --prompt-tokens 400 \
        --max-new-tokens 1024 --lora-rank 32 --rounds 1 --steps 2 --warmup 1 --vllm-python /tmp/pyv --trl-vllm \
        --sides "${SIDES:-opct_vllm}" --out "$OUT/vs_trl-gpu-qwen7b-random-vllm-${SIDES:-opct_vllm}.json" \
        > /dev/null 2> "$OUT/vs_trl-big.log"
    rc=$?
    grep "^\[vs_trl\]" "$OUT/vs_trl-big.log"
    python3 dev/gpu_results.py "$OUT"
    exit $rc
fi
random_model qwen || exit 1
# Up to four sides in one rotation: opct (hf backend, CUDA graphs), trl (transformers generate; measured before, so
# left out by default), opct_vllm (--sampler vllm), trl_vllm (TRL's colocated vLLM); the new axes' configuration
# (issue 22 acceptance 1's flags), random weights. SIDES=opct,trl,opct_vllm,trl_vllm runs all four.
# The vLLM sides run under a time limit (a hung engine must not take the whole call). A first start compiles and
# captures CUDA graphs: TRL's engine was ready within ~100 s on an H200; opct's fp32 + LoRA engine took over 75 s.
# OPCT_FLAGS reach vs_trl.py, e.g. "--opct-set merged_decode=true --decode-dtype bfloat16": the opct side then
# samples as TRL's vLLM does (adapters merged, bfloat16 weights; training float32 on both sides).
printf '#!/bin/bash\nexec timeout -k 10 %s python3 "$@"\n' "${SIDE_LIMIT_S:-330}" > /tmp/pyv && chmod +x /tmp/pyv
python3 benchmarks/vs_trl.py --model /tmp/qwen --device cuda --batch 8 --prompt-tokens 400 --max-new-tokens 128 \
    --lora-rank 32 --rounds "${ROUNDS:-1}" --steps 3 --warmup 1 --vary-seed --vllm-python /tmp/pyv \
    --trl-vllm --sides "${SIDES:-opct,opct_vllm,trl_vllm}" ${OPCT_FLAGS:-} \
    --out "$OUT/vs_trl-gpu-qwen05b-random-vllm.json" > /dev/null 2> "$OUT/vs_trl.log"
rc=$?
grep "^\[vs_trl\]" "$OUT/vs_trl.log"
python3 dev/gpu_results.py "$OUT"
exit $rc
