#!/usr/bin/env bash
# One run of the serving benchmark: tqserve (fp32, bf16, bf16 + int4) and llama.cpp's
# llama-server (same GGUF, -np 16), one after another on this machine.
#   LLAMA_SERVER=/path/to/llama-server tests/bench/run_serving.sh [extra `tqserve bench serve` args]
# Results: tests/bench/results/serving.{json,md}
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
GGUF=$($PY -c "from model_zoo.resolve import resolve_path; print(resolve_path('smollm2-135m'))")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
targets=()
if [ -n "${LLAMA_SERVER:-}" ]; then
  "$LLAMA_SERVER" -m "$GGUF" -np 16 -c 16384 --host 127.0.0.1 --port 8091 -t "$(nproc)" \
      > tests/bench/results/llama-server.log 2>&1 &
  pids+=($!)
  targets+=(--target "llama-server=http://127.0.0.1:8091/v1")
fi
.venv/bin/tqserve serve --model smollm2-135m --dtype bfloat16 --port 8092 --max-num-seqs 64 --max-queue 0 \
    > tests/bench/results/tqserve-bf16.log 2>&1 &
pids+=($!)
targets+=(--target "tqserve-bf16=http://127.0.0.1:8092/v1")
.venv/bin/tqserve serve --model smollm2-135m --dtype bfloat16 --quantization int4 --port 8093 --max-num-seqs 64 \
    --max-queue 0 > tests/bench/results/tqserve-bf16-int4.log 2>&1 &
pids+=($!)
targets+=(--target "tqserve-bf16-int4=http://127.0.0.1:8093/v1")
for _ in $(seq 120); do
  ok=1
  curl -sf http://127.0.0.1:8092/health >/dev/null || ok=0
  curl -sf http://127.0.0.1:8093/health >/dev/null || ok=0
  if [ -n "${LLAMA_SERVER:-}" ]; then curl -sf http://127.0.0.1:8091/health >/dev/null || ok=0; fi
  [ $ok = 1 ] && break
  sleep 1
done
.venv/bin/tqserve bench serve --launch-tqserve "${targets[@]}" --dataset-path tests/data/tinyshakespeare.txt \
    --tokenizer smollm2-135m --ignore-eos --out tests/bench/results/serving "$@"
