#!/usr/bin/env bash
# One run of the serving benchmark: tqserve with its DEFAULT settings (`--launch-tqserve`:
# `tqserve serve --model smollm2-135m --max-num-seqs 64 --max-queue 0`, dtype / weights / KV
# chosen for this machine and logged at startup) and llama.cpp's llama-server (same GGUF,
# -np 16), one after another on this machine.
#   LLAMA_SERVER=/path/to/llama-server tests/bench/run_serving.sh [extra `tqserve bench serve` args]
# e.g. `--concurrency 1 16`. Results: tests/bench/results/serving.{json,md}.
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
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8091/health >/dev/null && break; sleep 1; done
fi
.venv/bin/tqserve bench serve --launch-tqserve "${targets[@]}" --dataset-path tests/data/tinyshakespeare.txt \
    --tokenizer smollm2-135m --ignore-eos --out tests/bench/results/serving "$@"
