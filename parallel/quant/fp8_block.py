"""DeepSeek-V4's FP8 weights kept as stored: float8_e4m3fn [N, K] with one
scale per 128 x 128 block, scale [ceil(N/128), ceil(K/128)] (fp32, or E8M0:
float8_e8m0fnu / raw uint8 bytes = 2^(s - 127)):  w[i, j] = w8[i, j] * scale[i // 128, j // 128].
About 1 + 4/128^2 = 1.0002 bytes per parameter (fp32 scales).

- `dequantize`: vectorised torch, any device, into a reused buffer; equal
  bit for bit (fp32) to model_zoo.dsv4_checkpoint.dequant_fp8.
- `matmul(x, w8, scale)`: y = x @ W^T. CPU: dequantize into `scratch`, then
  F.linear. CUDA: Triton kernels that load the fp8 codes (tl.float8e4nv,
  converted in registers: a hardware cvt on sm_89+, so sm_90 H200 and sm_121
  GB10 alike) and the tile's scales, and never write W out:
  `_gemv_kernel` (M <= 16, decode: CUDA-core FMAs against each of the M rows,
  split-K over an fp32 partial buffer summed by torch) and `_gemm_kernel`
  (tl.dot tiles, fp32 accumulation; fp32 activations use
  input_precision="ieee"). Tiles never straddle a scale block: BLOCK_K
  divides 128 and starts on a multiple of itself, so a tile needs one scale
  per row (the same for 128 rows). Block sizes are first guesses, untuned.

torch._scaled_mm (torch 2.13) was considered and is not used: its
DeepSeek-style recipe (activations BlockWise1x128, weights BlockWise128x128,
fp32 scales, weight scales padded to [round_up(K/128, 4), N/128]) runs only on
sm_90 with cuBLASLt >= 12.9 ("only supported in CUDA for SM90": not on sm_121),
on CPU only tensor-wise / row-wise scales exist, and every recipe needs *both*
operands in fp8, so the activations would be rounded to e4m3 per 1 x 128
group: not exact, unlike the kernels here (W exact, activations untouched).

The Triton interpreter (TRITON_INTERPRET=1, CPU tensors) loads float8_e4m3fn
tensors as tl.float8e4nv and decodes every finite code exactly (the two NaN
codes 0x7f / 0xff come out as +-480, NaN on a GPU); tests run the kernels'
math there. triton is optional: without it only the torch paths exist.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:         # a CPU-only install: torch paths only
    triton = tl = None
    INTERPRET = False
else:
    # Triton's interpreter computes tl.dot wrongly on bf16 operands (it holds
    # them as uint16): there, `mac` multiplies the 16-bit-rounded operands in
    # fp32 instead, the same products and fp32 sums as the GPU's bf16 dot.
    INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

BLOCK = 128
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


# ---------------------------------------------------------------- torch


def scale_f32(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from float scales, float8_e8m0fnu, or raw E8M0 bytes (uint8: 2^(s - 127))."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def scale_for(s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """fp32 scales s to multiply `out` by in place: in out's dtype when every
    scale is exact there (E8M0 scales always are in bf16) and out is on the
    CPU, where a same-dtype multiply is ~20x faster than a mixed one. Either
    way the result is the fp32 product rounded once (the products of e4m3 /
    e2m1 values and such scales are exact in fp32)."""
    if out.dtype != torch.float32 and out.device.type == "cpu":
        t = s.to(out.dtype)
        if torch.equal(t.float(), s):
            return t
    return s


def out_buffer(out: torch.Tensor | None, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """`out` (a contiguous buffer of at least prod(shape) elements; its dtype
    wins) viewed as `shape`, or a new tensor."""
    n = 1
    for d in shape:
        n *= d
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not out.is_contiguous() or out.numel() < n:
        raise ValueError(f"out: need a contiguous buffer of >= {n} elements, got {tuple(out.shape)}")
    return out.view(-1)[:n].view(shape)


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """w8 [..., N, K] float8_e4m3fn, scale [..., ceil(N/128), ceil(K/128)] -> [..., N, K] in dtype
    (or out's dtype). One rounding: e4m3 -> dtype is exact, the product is
    formed in fp32. The only temporary is the column-expanded scale [nb, K]."""
    *lead, N, K = w8.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    if tuple(scale.shape) != (*lead, nb, kb):
        raise ValueError(f"fp8 scale: expected {(*lead, nb, kb)} for weight {tuple(w8.shape)}, "
                         f"got {tuple(scale.shape)}")
    out = out_buffer(out, w8.shape, dtype, w8.device)
    out.copy_(w8)
    s = scale_for(scale_f32(scale).reshape(-1, nb, kb).repeat_interleave(BLOCK, -1)[..., :K], out)   # [L, nb, K]
    o = out.view(-1, N, K)
    full = N // BLOCK
    if full:
        o[:, :full * BLOCK].view(-1, full, BLOCK, K).mul_(s[:, :full, None, :])
    if full < nb:                                      # the last, partial row block
        o[:, full * BLOCK:].mul_(s[:, full:])
    return out


def matmul(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x.dtype. backend: None (Triton on CUDA,
    torch elsewhere), "torch" (dequantize into scratch + F.linear) or "triton"."""
    if pick_backend(backend, x) == "triton":
        return _triton_matmul(x, w8, scale)
    return F.linear(x, dequantize(w8, scale, x.dtype, out=scratch))


def pick_backend(backend: str | None, x: torch.Tensor) -> str:
    if backend is None:
        return "triton" if x.is_cuda and triton is not None else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend {backend!r}: 'torch' or 'triton'")
    if backend == "triton" and triton is None:
        raise RuntimeError("backend 'triton' needs triton installed")
    return backend


def kernel_scale(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor for the kernel, whether it holds E8M0 bytes)."""
    if scale.dtype == torch.uint8:
        return scale, True
    if _E8M0 is not None and scale.dtype == _E8M0:
        return scale.view(torch.uint8), True
    return scale, False


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1                     # interpreter: split K only when asked
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def split_k(n_tiles: int, k_tiles: int, device, splits: int | None) -> tuple[int, int]:
    """(K tiles per split, splits): by default about two programs per SM."""
    if splits is None:
        splits = max(1, min(k_tiles, -(-2 * num_sms(device) // max(n_tiles, 1))))
    per = -(-k_tiles // max(1, min(splits, k_tiles)))
    return per, -(-k_tiles // per)


def gemm_tiles(M: int, f32: bool) -> dict:
    """Default GEMM tiles of the fp8 / mxfp4 kernels: the largest without
    register spills on sm_90 and sm_121 (tests/test_quant_fp.py compiles
    them): 8 warps for 64-row tiles; fp32 activations (an exact FMA dot) on
    16 x 32 tiles, 8 warps. Not timed on a GPU."""
    if f32:
        return {"block_m": 16, "block_n": 32, "num_warps": 8, "num_stages": 2}
    bm = 64 if M >= 64 else 32
    return {"block_m": bm, "block_n": 64, "num_warps": 8 if bm == 64 else 4, "num_stages": 3}


def launch(x, n: int, k: int, gemv, gemm, w_args, consts, *, block_k: int, splits=None,
           block_m=None, block_n=None, num_warps=None):
    """Shared launcher of the fp8 / mxfp4 kernels: x [..., k] -> [..., n]."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*x.shape[:-1], n)
    k_tiles = triton.cdiv(k, block_k)
    if M <= 16:
        bn = block_n or 32
        n_tiles = triton.cdiv(n, bn)
        per, splits = split_k(n_tiles, k_tiles, x.device, splits)
        if splits == 1:
            y = torch.empty(M, n, dtype=x.dtype, device=x.device)
            part, s_ys = y, 0
        else:
            part = torch.empty(splits, M, n, dtype=torch.float32, device=x.device)
            s_ys = part.stride(0)
        gemv[(n_tiles, splits)](x2, *w_args, part, n, k, x2.stride(0), s_ys, part.stride(-2), per,
                                M=M, M_PAD=next_pow2(M), BN=bn, BK=block_k, **consts, num_warps=num_warps or 4)
        y = y if splits == 1 else part.sum(0).to(x.dtype)
    else:
        f32 = x.dtype == torch.float32
        t = gemm_tiles(M, f32)
        bm, bn = block_m or t["block_m"], block_n or t["block_n"]
        y = torch.empty(M, n, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(M, bm) * triton.cdiv(n, bn),)
        gemm[grid](x2, *w_args, y, M, n, k, x2.stride(0), y.stride(0),
                   BM=bm, BN=bn, BK=block_k, F32=f32, **consts,
                   num_warps=num_warps or t["num_warps"], num_stages=t["num_stages"])
    return y.view(*x.shape[:-1], n)


def _triton_matmul(x, w8, scale, *, block_k: int = 128, splits: int | None = None,
                   block_m: int | None = None, block_n: int | None = None):
    N, K = w8.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {K}")
    if BLOCK % block_k or block_k < 16:
        raise ValueError(f"block_k {block_k} must divide {BLOCK}")
    s, e8m0 = kernel_scale(scale)
    if x.shape[:-1].numel() > 16:
        block_k = min(block_k, 64)
    return launch(x, N, K, _gemv_kernel, _gemm_kernel,
                  (w8, s, w8.stride(0), w8.stride(1), s.stride(0), s.stride(1)),
                  dict(SCALE_E8M0=e8m0), block_k=block_k, splits=splits, block_m=block_m, block_n=block_n)


# ---------------------------------------------------------------- Triton


@_jit
def e8m0_f32(b):
    """E8M0 bytes -> fp32 2^(b - 127), built from its bits (b = 0: 2^-127, a subnormal)."""
    b = b.to(tl.int32)
    v = (b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 0, 5.877471754111438e-39, v)


@_jit
def fp8_tile(w_ptr, s_ptr, offs_n, k0, N, K, s_wn, s_wk, s_sn, s_sk,
             BK: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """W[offs_n, k0 : k0 + BK] as fp32 [len(offs_n), BK], zero outside N and K.
    BK divides 128 and k0 is a multiple of BK: one scale column, one scale per row."""
    offs_k = k0 + tl.arange(0, BK)
    mask_n = offs_n < N
    m = mask_n[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :] * s_wk, mask=m,
                other=0.0).to(tl.float32)
    sp = s_ptr + (offs_n // 128) * s_sn + (k0 // 128) * s_sk
    if SCALE_E8M0:
        sc = e8m0_f32(tl.load(sp, mask=mask_n, other=127))
    else:
        sc = tl.load(sp, mask=mask_n, other=0.0).to(tl.float32)
    return w * sc[:, None]


@_jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, s_wn, s_wk, s_sn, s_sk, y_ptr, N, K, stride_xm, stride_ys, stride_ym,
                 tiles_per_split,
                 M: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SCALE_E8M0: tl.constexpr):
    """Grid (N tiles, K splits). y[split, m, n] (fp32 partial, or the output
    itself with one split) = sum over this split's K tiles."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, M_PAD)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BK))
    acc = tl.zeros((M_PAD, BN), dtype=tl.float32)
    for t in range(t0, t1):
        k0 = t * BK
        w = fp8_tile(w_ptr, s_ptr, offs_n, k0, N, K, s_wn, s_wk, s_sn, s_sk, BK, SCALE_E8M0)
        offs_k = k0 + tl.arange(0, BK)
        for m in tl.static_range(M):
            xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], axis=1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    y = y_ptr + pid_k * stride_ys + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (offs_n < N)[None, :])


@_jit
def mac(acc, x, w, F32: tl.constexpr):
    """acc [BM, BN] += x [BM, BK] @ w [BN, BK]^T (w fp32, dequantized), on tensor cores."""
    if F32:
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    if INTERPRET:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), acc)
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@_jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, s_wn, s_wk, s_sn, s_sk, y_ptr, M, N, K, stride_xm, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                 SCALE_E8M0: tl.constexpr):
    """Grid (M tiles * N tiles,), M tiles fastest: programs that run together
    share their W tile (dequantized by each, read from L2)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        xt = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        w = fp8_tile(w_ptr, s_ptr, offs_n, k0, N, K, s_wn, s_wk, s_sn, s_sk, BK, SCALE_E8M0)
        acc = mac(acc, xt, w, F32)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < N)[None, :])
