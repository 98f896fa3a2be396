#!/usr/bin/env bash
# The one prepared GPU check for the Triton HKT kernel (needs a CUDA torch and triton):
#   1. correctness of impl="fused_triton" compiled for the GPU against the float64 reference
#      (tests/test_hkt_gpu.py: float64, float32, bfloat16 vs FlashAttention's own error);
#   2. timing: SDPA (FlashAttention), the HKT fast path and the Triton kernel, forward+backward,
#      bfloat16, T in {4k, 16k, 64k}, L in {2, 3} (benchmarks/attention.py --preset gpu).
# Writes everything under ${OUT:-results/gpu}. Usage: OUT=/tmp/out bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-results/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_hkt_gpu.py 2>&1 | tee "$OUT/tests.txt"
timeout 420 "$PY" benchmarks/attention.py --preset gpu --reference-max-len 0 \
    --tile-loop-max-len 0 --out-dir "$OUT" 2>&1 | tee "$OUT/bench.txt"
