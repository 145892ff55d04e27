"""DeepSeek-V4's FP4 (MXFP4-style) weights kept as stored: e2m1 codes packed
two per byte, uint8 [N, K/2] (low nibble = even column; int8 and
float4_e2m1fn_x2 are viewed as uint8), with one E8M0 scale per 32 columns,
scales [N, K/32] (raw uint8 = 2^(s - 127), float8_e8m0fnu, or any float):
w[i, j] = e2m1(code[i, j]) * scale[i, j // 32].  0.5 + 1/32 = 0.53125 bytes per parameter.

- `pack`: codes 0..15 -> packed bytes (for tests and converters).
- `dequantize`: vectorised torch, any device, into a reused buffer; equal bit
  for bit (fp32) to model_zoo.dsv4_checkpoint.dequant_fp4.
- `matmul(x, packed, scales)`: y = x @ W^T. CPU: dequantize into `scratch`,
  then F.linear. CUDA: Triton GEMV (M <= 16, split-K) / GEMM (tl.dot) kernels
  shaped like fp8_block's (same launcher); a tile's bytes are split into their
  two nibbles, decoded through the 16-entry e2m1 table held in registers
  (eight 4-bit magnitudes x2 packed in one int32 constant, the sign from bit
  3), multiplied by their scale (E8M0 built from its bits) and interleaved
  back (join + reshape), all in registers. Nothing architecture-specific
  beyond tl.dot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.quant.fp8_block import (_jit, e8m0_f32, kernel_scale, launch, mac, out_buffer, pick_backend,
                                      scale_f32, scale_for, tl)

GROUP = 32
_CHUNK = 1 << 22           # packed bytes per table lookup in dequantize
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_PAIRS: dict = {}


def _pair_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 2]: the (even, odd) column values of each packed byte."""
    key = (dtype, str(device))
    if key not in _PAIRS:
        v = torch.tensor(E2M1, dtype=torch.float32)
        b = torch.arange(256)
        _PAIRS[key] = torch.stack([v[b & 15], v[b >> 4]], dim=-1).to(device=device, dtype=dtype)
    return _PAIRS[key]


def _bytes(packed: torch.Tensor) -> torch.Tensor:
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., N, K] e2m1 codes 0..15 -> [..., N, K/2] uint8, low nibble = even column."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """packed [..., N, K/2], scales [..., N, K/G] -> [..., N, K] in dtype (or
    out's dtype): a byte -> value-pair table lookup, then one multiply by the
    scales in fp32 (one rounding). G = K / scales.shape[-1] (32 for DeepSeek-V4)."""
    b = _bytes(packed)
    *lead, N, half = b.shape
    K = 2 * half
    groups = scales.shape[-1]
    if tuple(scales.shape[:-1]) != (*lead, N) or not groups or K % groups:
        raise ValueError(f"fp4 scales: expected {(*lead, N)} x (K / group) for weight {tuple(b.shape)} "
                         f"(K = {K}), got {tuple(scales.shape)}")
    out = out_buffer(out, (*lead, N, K), dtype, b.device)
    table = _pair_table(out.dtype, b.device)
    rows, o = b.reshape(-1, half), out.view(-1, half, 2)
    step = max(1, _CHUNK // max(half, 1))             # bounds the int32 index temporary
    for r in range(0, rows.shape[0], step):
        torch.index_select(table, 0, rows[r:r + step].reshape(-1).int(), out=o[r:r + step].view(-1, 2))
    out.view(-1, N, groups, K // groups).mul_(scale_for(scale_f32(scales), out).reshape(-1, N, groups, 1))
    return out


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor | None = None,
           backend: str | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x.dtype. backend: None (Triton on CUDA,
    torch elsewhere), "torch" (dequantize into scratch + F.linear) or "triton"."""
    if pick_backend(backend, x) == "triton":
        return _triton_matmul(x, packed, scales)
    return F.linear(x, dequantize(packed, scales, x.dtype, out=scratch))


def _triton_matmul(x, packed, scales, *, block_k: int | None = None, splits: int | None = None,
                   block_m: int | None = None, block_n: int | None = None):
    b = _bytes(packed)
    N, K = b.shape[0], 2 * b.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {K}")
    if K % GROUP or tuple(scales.shape) != (N, K // GROUP):
        raise ValueError(f"the Triton path needs K % {GROUP} == 0 and scales [N, K/{GROUP}]: "
                         f"weight [{N}, {K}], scales {tuple(scales.shape)}")
    if block_k is None:
        block_k = 128 if x.shape[:-1].numel() <= 16 else 64
    if block_k % GROUP or block_k & (block_k - 1):
        raise ValueError(f"block_k {block_k}: a power-of-two multiple of {GROUP}")
    s, e8m0 = kernel_scale(scales)
    return launch(x, N, K, _gemv_kernel, _gemm_kernel,
                  (b, s, b.stride(0), b.stride(1), s.stride(0), s.stride(1)),
                  dict(SCALE_E8M0=e8m0), block_k=block_k, splits=splits, block_m=block_m, block_n=block_n)


# ---------------------------------------------------------------- Triton


@_jit
def e2m1_f32(c):
    """e2m1 codes (int32, 0..15) -> fp32: the magnitude from the register table, bit 3 the sign.
    The table: the magnitudes x2 (0, 1, 2, 3, 4, 6, 8, 12) as the nibbles of
    0xC8643210, written as the int32 it is (-932957680; >> is arithmetic, the
    nibble read is unaffected)."""
    mag = ((-932957680 >> ((c & 7) * 4)) & 15).to(tl.float32) * 0.5
    return tl.where((c & 8) != 0, -mag, mag)


@_jit
def mxfp4_tile(p_ptr, s_ptr, offs_n, k0, N, K, s_pn, s_pk, s_sn, s_sk,
               BN: tl.constexpr, BK: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """W[offs_n, k0 : k0 + BK] as fp32 [BN, BK], zero outside N and K; k0 and
    BK are multiples of 32 (the tile holds whole scale groups)."""
    j = k0 // 2 + tl.arange(0, BK // 2)                # packed byte columns
    m = (offs_n < N)[:, None] & (j < K // 2)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    b = tl.load(p_ptr + rows * s_pn + j[None, :] * s_pk, mask=m, other=0).to(tl.int32)
    sp = s_ptr + rows * s_sn + (j // 16)[None, :] * s_sk       # columns 2j, 2j+1 -> group j // 16
    if SCALE_E8M0:
        sc = e8m0_f32(tl.load(sp, mask=m, other=127))
    else:
        sc = tl.load(sp, mask=m, other=0.0).to(tl.float32)
    lo = e2m1_f32(b & 15) * sc
    hi = e2m1_f32(b >> 4) * sc
    return tl.reshape(tl.join(lo, hi), (BN, BK))


@_jit
def _gemv_kernel(x_ptr, p_ptr, s_ptr, s_pn, s_pk, s_sn, s_sk, y_ptr, N, K, stride_xm, stride_ys, stride_ym,
                 tiles_per_split,
                 M: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SCALE_E8M0: tl.constexpr):
    """Grid (N tiles, K splits), as fp8_block._gemv_kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, M_PAD)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BK))
    acc = tl.zeros((M_PAD, BN), dtype=tl.float32)
    for t in range(t0, t1):
        k0 = t * BK
        w = mxfp4_tile(p_ptr, s_ptr, offs_n, k0, N, K, s_pn, s_pk, s_sn, s_sk, BN, BK, SCALE_E8M0)
        offs_k = k0 + tl.arange(0, BK)
        for m in tl.static_range(M):
            xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], axis=1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    y = y_ptr + pid_k * stride_ys + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (offs_n < N)[None, :])


@_jit
def _gemm_kernel(x_ptr, p_ptr, s_ptr, s_pn, s_pk, s_sn, s_sk, y_ptr, M, N, K, stride_xm, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                 SCALE_E8M0: tl.constexpr):
    """Grid (M tiles * N tiles,), M tiles fastest, as fp8_block._gemm_kernel."""
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
        w = mxfp4_tile(p_ptr, s_ptr, offs_n, k0, N, K, s_pn, s_pk, s_sn, s_sk, BN, BK, SCALE_E8M0)
        acc = mac(acc, xt, w, F32)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < N)[None, :])
