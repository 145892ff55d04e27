#!/usr/bin/env bash
# Before spending a lent GPU's minutes: run what tests/gpu/run.sh will run, on this CPU, in a venv that
# has only what the GPU machine has (torch 2.11 + CUDA 13 wheels, triton 3.6, transformers 5.17; no
# gguf, fastapi, uvicorn, pydantic), so that an import the bare machine lacks or an API that triton 3.6
# or torch 2.11 does not have fails here. Kernels run under Triton's interpreter and compile for sm_90
# and sm_121 with triton 3.6's ptxas. ~5 GB of wheels from PyPI the first time; then ~14 minutes (2 cores).
#   bash tests/gpu/device_env_check.sh [venv dir, default /tmp/tqserve-device-env]
# numpy < 2.4: triton 3.6's interpreter converts 1-element arrays with int(), which numpy 2.4 refuses
# (interpreter only: compiled kernels on the GPU do not go through it).
set -euo pipefail
VENV=${1:-/tmp/tqserve-device-env}
PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
    "$PY" -m pip install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4" pytest
fi
if "$PY" -c "import gguf" 2>/dev/null; then
    echo "gguf is installed in $VENV: this check wants the bare machine's packages" >&2
    exit 2
fi
export PYTHONPATH=. TRITON_INTERPRET=1
OUT=$(mktemp -d)
echo "== pytest: Triton kernels, sampler, device code paths, tests/gpu (skipped: no CUDA)"
"$PY" -m pytest -q -ra tests/test_tq_triton.py tests/test_tq_store.py tests/test_dense_triton.py \
    tests/test_quant_fp.py tests/test_dsv4_quant.py tests/test_sampler.py tests/test_engine_device.py \
    tests/test_pynccl.py tests/test_cuda_graph.py tests/test_dsv4_triton.py tests/gpu
echo "== the GPU benches' own CPU checks (nothing written to tests/bench/results)"
"$PY" tests/bench/gpu_engine.py --device cpu --tiny --out "$OUT/gpu_engine"
"$PY" tests/bench/tq_triton_gpu.py --cpu-check
"$PY" tests/bench/quant_gpu.py --device cpu --out "$OUT/quant_gpu"
"$PY" tests/bench/dsv4_decode.py --batch 1,2 --context 40 --tokens 4 --backends dsv4-triton,dsv4-torch \
    --out "$OUT/dsv4_decode"
"$PY" tests/bench/dsv4_attn_gpu.py --cpu-check
echo "device env check passed ($("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
