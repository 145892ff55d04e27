"""The settings left at "auto" that depend on the machine and the checkpoint.

Each is chosen by a rule that a measurement backs (quality:
tests/bench/results/default_quality.md; speed: offline_throughput.md), and
EngineArgs.resolved logs the choice with its reason in one line.

- quantization: a .gguf file's quantized linear weights stay in the file's
  blocks ("gguf") on the CPU: the same weights the fp32 model dequantizes at
  load (logprobs within 1e-4), 4-6x less memory, and a decode step that
  reads 4-bit blocks (parallel/quant/gguf_cpu.py) rather than fp32 rows.
  Under tensor parallelism too (each rank keeps its rows / block-aligned
  columns), except for files whose layout is not cut across ranks yet
  (Qwen3-Next / Qwen3.5's DeltaNet tensors as llama.cpp writes them).
  Dense (none) on CUDA (the GGUF Triton kernels have not run on a card
  yet), with dummy weights, and for checkpoints without quantized blocks.
- dtype: bfloat16 on CUDA. On the CPU, bfloat16 only where the CPU computes
  in bf16 (AVX512-BF16, AMX, aarch64 BF16: engine/cpu_features.py), else
  float32: torch emulates bf16 on CPUs without it, 2.3x slower than fp32 on
  an AVX2-only EPYC.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.cpu_features import CpuInfo, cpu_info


@dataclass(frozen=True)
class Choice:
    value: str | None
    reason: str


def choose_dtype(device: str, cpu: CpuInfo | None = None) -> Choice:
    if device == "cuda":
        return Choice("bfloat16", "CUDA")
    cpu = cpu or cpu_info()
    if cpu.fast_bf16:
        return Choice("bfloat16", f"the CPU computes in bf16 ({', '.join(cpu.flags())})")
    return Choice("float32", f"the CPU has no bf16 arithmetic ({', '.join(cpu.flags()) or 'no AVX2'}): "
                             f"torch would emulate it, slower than fp32")


def choose_quantization(device: str, stored: dict[str, str], gguf_types, tp: int, load_format: str,
                        splits: bool = True) -> Choice:
    """stored: the checkpoint's {tensor: format} that a layer can keep as
    stored (ModelSource.stored); gguf_types: the GGUF block types GGUFBlocks
    holds; splits: whether those tensors can be cut across tensor-parallel
    ranks (ModelSource.stored_splits)."""
    blocks = sorted({f for f in stored.values() if f in gguf_types})
    if not blocks:
        return Choice(None, "no GGUF blocks in the checkpoint")
    if device != "cpu":
        return Choice(None, "the GGUF kernels for CUDA are not measured on a card yet: weights dequantized")
    if tp > 1 and not splits:
        return Choice(None, "this file's GGUF blocks are not split across tensor-parallel ranks yet: "
                            "weights dequantized")
    if load_format == "dummy":
        return Choice(None, "dummy weights")
    return Choice("gguf", f"the file's {' / '.join(blocks)} blocks stay resident (the fp32 model's weights, "
                          f"4-6x less memory, decode reads the blocks)")
