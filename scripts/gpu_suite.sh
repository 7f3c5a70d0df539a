#!/usr/bin/env bash
# Check and measure on a CUDA GPU in one go: the test suite on CUDA, the register report, the
# kernel sweep. Results go to $OUT (default ./gpu_results). Usage:
#   bash scripts/gpu_suite.sh [tests] [registers] [tune] [lora-tune] [layout] [smoke|kernels] [layer] [align] [gemm] [eager]
# The project's .venv/bin/python is used when it exists (PYTHON=... to choose another).
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests registers kernels)
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      $PY -m pytest tests --gpu -q -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15 ;;
    registers)
      $PY -m moelora_lab.bench registers --out "$OUT" 2>&1 | tail -n 3 ;;
    tune)
      $PY -m moelora_lab.bench kernels --tune --tokens 1 8 32 128 512 2048 --ranks 16 64 256 --out "$OUT" --name tune 2>&1 | tail -n 3 ;;
    lora-tune)
      $PY -m moelora_lab.bench tune --max-seconds "${TUNE_SECONDS:-480}" --out "$OUT" 2>&1 \
        | grep -v "it/s\]" | tee "$OUT/lora_tune.log" | tail -n 40 ;;
    layout)
      $PY -m moelora_lab.bench layout --out "$OUT" 2>&1 | tail -n 3 ;;
    smoke)
      $PY -m moelora_lab.bench kernels --presets qwen3-30b-a3b --tokens 1 32 2048 --ranks 16 256 \
        --out "$OUT" --name smoke --time-alignment 2>&1 | tail -n 5 ;;
    layer)
      $PY -m moelora_lab.bench layer --out "$OUT" 2>&1 | tail -n 5 ;;
    align)
      $PY -m moelora_lab.bench align --out "$OUT" 2>&1 | tail -n 3 ;;
    gemm)
      $PY -m moelora_lab.bench gemm --max-seconds 360 --out "$OUT" 2>&1 | tail -n 3 ;;
    eager)
      $PY -m moelora_lab.bench eager --out "$OUT" 2>&1 | tail -n 3 ;;
    kernels)
      $PY -m moelora_lab.bench kernels --time-alignment --out "$OUT" 2>&1 | tail -n 5 ;;
    *) echo "unknown step $step" ;;
  esac
done
