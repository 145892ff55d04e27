#!/usr/bin/env bash
# Everything that needs a GPU, for a bare GPU machine (torch, triton, transformers installed; no
# internet), in stages small enough for one call each on a lent machine (10 minutes at most per
# command; none of these durations has been measured yet; each stage but engine has its own timeout,
# so that a hung stage leaves time for the next). Check it first on a CPU with the device's packages:
# tests/gpu/device_env_check.sh. Run from the repo root:
#   OUT=/some/dir bash tests/gpu/run.sh [stage ...]      # no stage: all of them, in this order
# Stages:
#   tests   pytest: tests/gpu (parity with transformers on CUDA, CUDA graphs = eager, batch
#           invariance, seeded sampling, preemption / prefix hits, KV presets, NCCL, LoRA adapters
#           eager and captured vs merged weights, sleep mode's device memory, a draft model, images), the CUDA
#           cases of test_sampler / test_engine_device and DeepSeek-V4's kernels (test_dsv4_triton, bf16)
#   graphs  tests/bench/gpu_engine.py sections 1 and 4 on the Llama-3.2-1B shape (roofline, batch
#           1 with and without CUDA graphs): the quickest look at the engine's speed
#   engine  tests/bench/gpu_engine.py, every section on both shapes (the issue's ~10 minutes)
#   tq      tests/bench/tq_triton_gpu.py (TurboQuant kernels vs SDPA)
#   images  tests/bench/image_encoder.py --device cuda (Gemma 3's vision tower per image vs transformers)
#   quant   tests/bench/quant_gpu.py (quantized-weight kernels; --budget-s 240)
#   dsv4    tests/bench/dsv4_decode.py --device cuda (DeepSeek-V4 decode: batched + CUDA graphs vs
#           per sequence, eager) and tests/bench/dsv4_attn_gpu.py (the dsv4-triton kernels vs the torch
#           reference at DeepSeek-V4-Flash's shapes, 8K-128K context)
# pytest (pure Python) and Pillow (the image test) may be missing there: carry their wheels in
# .gpu-wheels/ (`pip download pytest -d .gpu-wheels` here, and Pillow's for the machine's Python:
# `pip download pillow -d .gpu-wheels --only-binary=:all: --platform manylinux_2_28_x86_64
# --python-version 3.12`, one per version it may have; the folder is git-ignored).
set -uo pipefail
OUT=${OUT:-/tmp/tqserve-gpu}
mkdir -p "$OUT"
# conftest sets TRITON_INTERPRET=1 only when unset: 0 runs the kernels for real.
export PYTHONPATH=. TRITON_INTERPRET=0
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests graphs engine tq images quant dsv4)
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
for stage in "${stages[@]}"; do
    echo "== $stage $(date -u +%T)"
    case $stage in
    tests)
        python -c "import pytest" 2>/dev/null || python -m pip install -q --no-index --find-links .gpu-wheels pytest
        python -c "import PIL" 2>/dev/null || python -m pip install -q --no-index --find-links .gpu-wheels pillow
        # -v: one line per test as it ends, so a stage cut by its timeout still says which passed.
        timeout 420 python -m pytest -v -ra tests/gpu tests/test_sampler.py tests/test_engine_device.py \
            tests/test_dsv4_triton.py 2>&1 \
            | tee "$OUT/pytest.txt" ;;
    graphs)
        timeout 300 python tests/bench/gpu_engine.py --models llama-3.2-1b --only 1,4 --out "$OUT/gpu_engine_graphs" 2>&1 \
            | tee "$OUT/gpu_engine_graphs.log" ;;
    engine)
        python tests/bench/gpu_engine.py --out "$OUT/gpu_engine" 2>&1 | tee "$OUT/gpu_engine.log" ;;
    tq)
        timeout 360 python tests/bench/tq_triton_gpu.py --hot off,k --sweep 2>&1 | tee "$OUT/tq_triton_gpu.log"
        cp tests/bench/results/tq_triton_gpu.* "$OUT/" 2>/dev/null || true ;;
    images)
        timeout 180 python tests/bench/image_encoder.py --device cuda --repeat 5 --out "$OUT/image_encoder_cuda" 2>&1 \
            | tee "$OUT/image_encoder.log" ;;
    quant)
        # GGUF / FP8 / MXFP4 / grouped MoE (MXFP4 and GGUF experts) vs bf16 cuBLAS and the copy-bandwidth
        # roofline; the script skips what is left past --budget-s 240, timeout is the hard stop.
        timeout 360 python tests/bench/quant_gpu.py --out "$OUT/quant_gpu" 2>&1 | tee "$OUT/quant_gpu.log" ;;
    dsv4)
        timeout 300 python tests/bench/dsv4_decode.py --device cuda --batch 1,8,64 2>&1 | tee "$OUT/dsv4_decode.log"
        timeout 240 python tests/bench/dsv4_attn_gpu.py --out "$OUT/dsv4_attn_gpu" 2>&1 | tee "$OUT/dsv4_attn_gpu.log"
        cp tests/bench/results/dsv4_decode_cuda.* "$OUT/" 2>/dev/null || true ;;
    *)
        echo "unknown stage $stage (tests, graphs, engine, tq, images, quant, dsv4)" >&2
        exit 2 ;;
    esac
done
