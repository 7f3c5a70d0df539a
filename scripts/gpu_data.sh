#!/usr/bin/env bash
# Regenerate every committed GPU data file with the current code, on a CUDA machine, from the
# repository root:
#   bash scripts/gpu_data.sh                 # every step, written to moelora_lab/data/h200
#   OUT=/tmp/run bash scripts/gpu_data.sh kernels layer   # some steps, elsewhere
# Steps: registers align kernels layout expand eager layer priority side_path fp8 profiler in_k gemm tma tune dram grad tests
# (default: all; dram needs Nsight Compute's ncu and a GPU whose counters it may read).
# Each row records its provenance and the code's stamp (schema, tile-rule fingerprint, commit; see
# moelora_lab/results.py); the notebooks refuse files whose stamp does not match the code.
# Without a git checkout, set MOELORA_CODE_VERSION to the commit the tree came from.
set -uo pipefail
OUT=${OUT:-moelora_lab/data/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
if [ -z "${MOELORA_CODE_VERSION:-}" ]; then
  MOELORA_CODE_VERSION=$(git rev-parse --short=10 HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD -- moelora_lab 2>/dev/null || MOELORA_CODE_VERSION="$MOELORA_CODE_VERSION-dirty"
fi
export MOELORA_CODE_VERSION
bench() { echo "== $(date +%T) bench $*"; $PY -m moelora_lab.bench "$@" --out "$OUT" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -n 4; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "code $MOELORA_CODE_VERSION"
ALL_STEPS=(registers align kernels layout expand eager layer priority side_path fp8 profiler in_k gemm tma tune dram grad tests)
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=("${ALL_STEPS[@]}")
for step in "${steps[@]}"; do
  case "$step" in
    registers) bench registers ;;
    align)     bench align ;;
    kernels)   bench kernels --time-alignment ;;
    layout)    bench layout ;;
    expand)    bench expand ;;
    eager)     bench eager ;;
    layer)     bench layer --max-seconds 240 ;;
    priority)  bench layer --ranks 16 64 --tokens 1 16 64 128 512 2048 --variants no_lora sequential dual_stream \
                 --trace-tokens 0 --side-priority default --name layer_priority ;;
    side_path) bench layer --presets qwen3-30b-a3b deepseek-v2-lite --ranks 16 64 --tokens 1 2 3 4 8 16 24 32 64 \
                 --variants no_lora dual_stream dual_stream_side --trace-tokens 0 --name layer_side_path ;;
    fp8)       # the same cases on the bf16 and on the FP8 base, one after the other: the ratio comes from one run
               fp8_case=(--presets qwen3-30b-a3b --tokens 1 16 64 128 512 2048 8192 --ranks 16 64
                         --variants no_lora sequential dual_stream --trace-tokens 0)
               bench layer "${fp8_case[@]}" --name layer_fp8_bf16
               bench layer "${fp8_case[@]}" --base fp8 --name layer_fp8 ;;
    profiler)  bench profiler ;;
    in_k)      bench in_k ;;
    gemm)      bench gemm --max-seconds 180 ;;
    tma)       bench gemm --rule-only --w-tma --lora-rank 0 --presets qwen3-30b-a3b deepseek-v2-lite --name gemm_tma ;;
    tune)      bench tune --max-seconds 200 ;;
    dram)      bench dram ;;
    grad)      bench grad ;;
    tests)
      echo "== $(date +%T) tests"
      { echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); code $MOELORA_CODE_VERSION; $(date -I)"
        echo "# python -m pytest tests --gpu -v -p no:cacheprovider -n ${TEST_WORKERS:-8}"
        $PY -m pytest tests --gpu -v -p no:cacheprovider -n "${TEST_WORKERS:-8}" 2>&1; } > "$OUT/gpu_tests.log"
      tail -n 3 "$OUT/gpu_tests.log" ;;
    *) echo "unknown step $step (steps: ${ALL_STEPS[*]})"; exit 2 ;;
  esac
done
echo "== $(date +%T) done"
