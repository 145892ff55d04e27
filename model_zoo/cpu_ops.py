"""Compiled CPU row ops for the model layers (model_zoo/csrc/cpu_ops.cpp):
RMSNorm (Llama and Gemma forms, over rows or per head), neox rotary
embedding, SiLU / GELU-tanh gate times up.

A decode step's rows are a few hundred values: the torch versions of these
layers cost 3-10 dispatched ops each (an RMSNorm ~14 us on a 2-core EPYC),
which summed to ~3 ms of a ~13 ms SmolLM2 step; one ctypes call costs ~1 us.
The kernels compute what the torch code in model_zoo/layers.py computes,
rounding to bf16 where torch rounds, so the two agree to fp32 rounding (bf16:
to an occasional last-bit difference where a reduction's order differs).

layers.CpuOp dispatches to them for CPU tensors of fp32 / bf16 (runs());
everything else (CUDA, fp16, TQSERVE_CPU_OPS=torch, no compiler) runs the
torch code. Built like the other CPU kernels (parallel/cpp_kernel.py): a
plain C ABI compiled with g++ at first use and cached; a failed build is
logged once and the torch code runs.
"""
import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from parallel.cpp_kernel import build_shared_library

log = logging.getLogger(__name__)

SRC = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
CXX = os.environ.get("CXX", "g++")
# -ffp-contract=off: a product then a sum, each rounded, as torch's separate ops;
# no errno / traps from math functions, so that loops calling floor vectorise
# (neither changes a finite result).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC", "-std=c++17"]
_DTYPES = (torch.float32, torch.bfloat16)
SILU, GELU_TANH = 0, 1


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL | None:
    try:
        lib = build_shared_library(SRC, CXX, FLAGS, "CPU row-ops kernel", "TQSERVE_CPU_OPS=torch")
    except RuntimeError as e:
        log.warning("%s; the torch code runs instead", e)
        return None
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.cpu_rms_norm.restype = i32
    lib.cpu_rms_norm.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i32, ptr, i32, f32, f32, i32, i32]
    lib.cpu_rope.restype = i32
    lib.cpu_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, i32, i32]
    lib.cpu_act_and_mul.restype = i32
    lib.cpu_act_and_mul.argtypes = [ptr, i64, i64, i64, ptr, i32, i32, i32]
    return lib


# TQSERVE_CPU_OPS=torch runs the torch code everywhere. Read once: runs() is
# called a few hundred times per decode step (tests set ENABLED directly).
ENABLED = os.environ.get("TQSERVE_CPU_OPS", "kernel").lower() != "torch"


def runs(x: torch.Tensor) -> bool:
    """Whether the kernels serve x: a CPU fp32 / bf16 tensor with unit last
    stride that autograd does not track (KV calibration differentiates
    through the layers: the kernels have no backward), the kernel built, ENABLED."""
    return (ENABLED and x.is_cpu and x.dtype in _DTYPES and not x.requires_grad and x.stride(-1) == 1
            and _lib() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over x's last dim -> a new contiguous tensor of x's shape.
    Llama: weight * normed.to(dtype); gemma: (normed * (1 + weight)).to(dtype).
    x: [..., d] whose leading dims flatten to at most two strides (a row
    range, or heads of a projection's output rows)."""
    d = x.shape[-1]
    if x.dim() == 1:
        outer, inner, so, si = 1, 1, d, d
    elif x.dim() == 2:
        outer, inner, so, si = x.shape[0], 1, x.stride(0), d
    else:
        x3 = x.reshape(-1, x.shape[-2], d) if x.dim() > 3 else x
        outer, inner, so, si = x3.shape[0], x3.shape[1], x3.stride(0), x3.stride(1)
    w = weight if weight.dtype in _DTYPES and weight.is_contiguous() else weight.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = _lib().cpu_rms_norm(x.data_ptr(), outer, inner, so, si, out.data_ptr(), d, x.dtype == torch.bfloat16,
                             w.data_ptr(), w.dtype == torch.bfloat16, 1.0, eps, int(gemma), torch.get_num_threads())
    assert rc == 0, rc
    return out


def rope(x: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H * head_dim] (rows at any stride) -> x * cos + roll(x, head_dim / 2) * sin,
    a new [T, H * head_dim]; cos / sin [T, 1, head_dim] in x's dtype (layers.RotaryEmbedding)."""
    T, width = x.shape
    if cos.dtype != x.dtype or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    out = torch.empty(T, width, dtype=x.dtype)
    rc = _lib().cpu_rope(x.data_ptr(), T, x.stride(0), width // head_dim, head_dim, cos.data_ptr(), sin.data_ptr(),
                         cos.stride(0), out.data_ptr(), x.dtype == torch.bfloat16, torch.get_num_threads())
    assert rc == 0, rc
    return out


def act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    """x [..., 2h] = [gate | up] -> act(gate) * up [..., h] (act SILU or GELU_TANH)."""
    h = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * h)
    out = torch.empty(*x.shape[:-1], h, dtype=x.dtype)
    rc = _lib().cpu_act_and_mul(x2.data_ptr(), x2.shape[0], x2.stride(0), h, out.data_ptr(), act,
                                x.dtype == torch.bfloat16, torch.get_num_threads())
    assert rc == 0, rc
    return out
