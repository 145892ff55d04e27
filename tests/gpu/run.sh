#!/usr/bin/env bash
# Everything that needs a GPU, in one run, for a bare GPU machine (torch, triton,
# transformers installed; no internet). Run from the repo root:
#   OUT=/some/dir bash tests/gpu/run.sh
# pytest (pure Python) may be missing there: carry its wheels in .gpu-wheels/
# (`pip download pytest -d .gpu-wheels` here; the folder is git-ignored).
set -uo pipefail
OUT=${OUT:-/tmp/tqserve-gpu}
mkdir -p "$OUT"
export PYTHONPATH=. TRITON_INTERPRET=0
python -c "import pytest" 2>/dev/null || python -m pip install -q --no-index --find-links .gpu-wheels pytest
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# conftest sets TRITON_INTERPRET=1 only when unset: 0 runs the kernels for real.
python -m pytest -q -ra tests/gpu tests/test_sampler.py tests/test_engine_device.py tests/test_dense_triton.py \
    tests/test_tq_triton.py 2>&1 | tee "$OUT/pytest.txt"
python tests/bench/gpu_engine.py --out "$OUT/gpu_engine" 2>&1 | tee "$OUT/gpu_engine.log"
python tests/bench/tq_triton_gpu.py --hot off,k 2>&1 | tee "$OUT/tq_triton_gpu.log"
cp tests/bench/results/tq_triton_gpu.* "$OUT/" 2>/dev/null || true
# Quantized-weight kernels (issue 15): GGUF / FP8 / MXFP4 / grouped MoE vs bf16 cuBLAS and the
# copy-bandwidth roofline, ~2-3 min on an H200 (mostly Triton compiles); the script skips what is
# left past --budget-s 240 (default), timeout is the hard stop. Results: $OUT/quant_gpu.{json,md}.
timeout 360 python tests/bench/quant_gpu.py --out "$OUT/quant_gpu" 2>&1 | tee "$OUT/quant_gpu.log"
