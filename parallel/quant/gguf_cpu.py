"""Compiled CPU kernels for GGUF blocks (parallel/quant/csrc/gguf_cpu.cpp).

- dequantize_into: raw uint8 [N, row_bytes] -> W [N, k] fp32 / bf16,
  bit-exact against parallel/quant/gguf.py's torch reference (fp32; bf16 is
  that value rounded once to nearest-even), threaded over rows;
- gemv: y = x @ W^T for a few rows of x (decode): each block dequantized in
  L1 and dotted with every row of x, fp32 accumulation, threaded over N; W
  is never written out.

parallel/quant/gguf.py's dequantize / matmul and GGUFBlocks.matmul
(parallel/quant/base.py) run these on CPU tensors and fall back to the torch
reference when the kernel is unavailable (reason(): no compiler, a failed
build, TQSERVE_GGUF_CPU=torch, a dtype other than fp32 / bf16).

Built like kvcache/tq_cpu.py's kernel: a plain C ABI called through ctypes
(only a C++ compiler with OpenMP, no torch headers), compiled at first use
into $TQSERVE_KERNEL_CACHE (default ~/.cache/tqserve/kernels), keyed by the
source, flags, compiler and host CPU. A failed build raises (from _lib /
build) with the compiler's output.
"""
import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

from parallel.cpp_kernel import build_shared_library

SRC = Path(__file__).resolve().parent / "csrc" / "gguf_cpu.cpp"
CXX = os.environ.get("CXX", "g++")
# -ffp-contract=off: no fused multiply-add in the dequantisation, whose fp32
# values must equal the torch reference's (the GEMV's FMAs are explicit).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17"]
# Rows of x up to which GGUFBlocks / gguf.matmul take the fused GEMV rather
# than dequantize + matmul (gemv_max_m). The GEMV decodes W once per 8 rows
# of x, so where the two cross depends on what decoding a type costs:
# Q6_K's and Q5_K's (high bits apart) are the dearest (the GEMV loses at 16
# rows), Q8_0's the cheapest (it wins at 24 rows, most on the LM heads).
# Measured on the SmolLM2 / Gemma3 layers and on random Q4_0 / Q5_K blocks:
# tests/bench/gguf_cpu_crossover.py (results/gguf_cpu_crossover.md). The
# crossover moves with the machine: on one 2-core AVX2 EPYC (commit f9d1fcf)
# at 8-24 rows, on a Zen 3 one (family 25 model 1) at 40+ rows for all but
# Q6_K and Q5_K (8 rows each; Q5_K measured there only); an earlier Zen 4
# (AVX-512) run at 16-24 rows on one thread. The limits suit the slowest.
GEMV_MAX_M = 16
GEMV_MAX_M_BY_TYPE = {"Q8_0": 24, "Q6_K": 8, "Q5_K": 8}
DTYPES = (torch.float32, torch.bfloat16)
# type -> (ggml id, elements per block, bytes per block), as parallel/quant/gguf.py's QTYPES
_TYPES = {"Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
          "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}


def gemv_max_m(qtype: str) -> int:
    return GEMV_MAX_M_BY_TYPE.get(qtype, GEMV_MAX_M)


def enabled() -> bool:
    """False when TQSERVE_GGUF_CPU=torch selects the torch path (read at every call)."""
    return os.environ.get("TQSERVE_GGUF_CPU", "kernel").lower() != "torch"


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = build_shared_library(SRC, CXX, FLAGS, "GGUF CPU kernel", "TQSERVE_GGUF_CPU=torch")
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_dequant.restype = i32
    lib.gguf_dequant.argtypes = [ptr, i64, i64, i32, i64, ptr, i64, i32, i32]
    lib.gguf_gemv.restype = i32
    lib.gguf_gemv.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, i64, ptr, i64, i32]
    lib.gguf_gemv_bf16.restype = i32
    lib.gguf_gemv_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, i64, ptr, i64, i32]
    return lib


def build() -> None:
    """Compile (or load) the kernel now; raises with the compiler's output on failure."""
    _lib()


@lru_cache(maxsize=None)
def _build_error() -> str | None:
    try:
        _lib()
    except RuntimeError as e:
        return str(e)
    return None


def reason(dtype: torch.dtype = torch.float32) -> str | None:
    """None when the kernel serves CPU tensors of dtype (building it on first
    call); else why not, in words."""
    if not enabled():
        return "TQSERVE_GGUF_CPU=torch"
    if dtype not in DTYPES:
        return f"the kernel computes in float32 / bfloat16, not {dtype}"
    err = _build_error()
    return None if err is None else err


def type_id(qtype: str) -> int:
    """ggml's id of a type the kernel decodes (ValueError otherwise)."""
    if qtype not in _TYPES:
        raise ValueError(f"unsupported GGUF type {qtype!r}")
    return _TYPES[qtype][0]


def _check(raw: torch.Tensor, qtype: str, k: int) -> int:
    g = type_id(qtype)
    _, block, size = _TYPES[qtype]
    if k <= 0 or k % block:
        raise ValueError(f"{qtype}: row length {k} is not a positive multiple of the block ({block})")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != k // block * size \
            or raw.device.type != "cpu" or raw.stride(1) != 1:
        raise ValueError(f"{qtype} rows of {k}: raw must be CPU uint8 [N, {k // block * size}] with unit "
                         f"column stride, got {raw.dtype} {tuple(raw.shape)} strides {raw.stride()} on {raw.device}")
    return g


def dequantize_into(raw: torch.Tensor, qtype: str, k: int, out: torch.Tensor) -> torch.Tensor:
    """raw uint8 [N, row_bytes(qtype, k)] -> out [N, k] (float32 or bfloat16,
    unit column stride, any row stride); returns out."""
    g = _check(raw, qtype, k)
    n = raw.shape[0]
    if out.dtype not in DTYPES or tuple(out.shape) != (n, k) or out.device.type != "cpu" \
            or out.stride(1) != 1:
        raise ValueError(f"out must be a CPU float32 / bfloat16 [{n}, {k}] tensor with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if n == 0:
        return out
    rc = _lib().gguf_dequant(raw.data_ptr(), raw.stride(0), n, g, k, out.data_ptr(), out.stride(0),
                             int(out.dtype == torch.bfloat16), torch.get_num_threads())
    assert rc == 0, rc          # type and k checked above
    return out


def gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] (float32 / bfloat16) @ W^T for W = raw's rows -> [M, N],
    written into `out` when given (an [M, N] tensor with unit column stride,
    any row stride: a column range of a wider output) else a new tensor of
    x's dtype. fp32 accumulation; any M (each 8 rows of x take one more
    decoding of W, read from memory once: dequantize + F.linear is faster
    beyond gemv_max_m(qtype) rows)."""
    g = _check(raw, qtype, k)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in DTYPES or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU float32 / bfloat16 [M, {k}] tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    m, n = x.shape[0], raw.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype)
    elif tuple(out.shape) != (m, n) or out.device.type != "cpu" or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be a CPU [{m}, {n}] tensor with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if m == 0 or n == 0:
        return out
    return gemv_checked(x, raw, g, k, out)


def gemv_checked(x: torch.Tensor, raw: torch.Tensor, g: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """gemv past its argument checks, for a caller that made them once
    (GGUFBlocks at load: raw's type id g, its shape; out [M, N] as gemv's):
    a decode step runs ~120 of these, and the checks cost as much as a
    small layer's kernel."""
    m, n = x.shape[0], raw.shape[0]
    if x.dtype == out.dtype == torch.bfloat16:
        xb = x if x.stride(1) == 1 else x.contiguous()
        rc = _lib().gguf_gemv_bf16(xb.data_ptr(), xb.stride(0), m, raw.data_ptr(), raw.stride(0), n, g, k,
                                   out.data_ptr(), out.stride(0), torch.get_num_threads())
        assert rc == 0, rc
        return out
    xf = x.to(torch.float32)
    if xf.stride(1) != 1:
        xf = xf.contiguous()
    y = out if out.dtype == torch.float32 else torch.empty(m, n, dtype=torch.float32)
    rc = _lib().gguf_gemv(xf.data_ptr(), xf.stride(0), m, raw.data_ptr(), raw.stride(0), n, g, k,
                          y.data_ptr(), y.stride(0), torch.get_num_threads())
    assert rc == 0, rc
    if y is not out:
        out.copy_(y)
    return out
