"""Triton kernels for y = x @ W^T with W kept as GGUF blocks (parallel.quant.gguf).

W is uint8 [N, row_bytes]: one row of blocks per output feature. Both kernels
dequantize tiles of W in registers (`_dequant_tile`, the layouts described in
gguf.py) and never write W out:

- `gemv` (few rows, M <= 16: decode): a program owns BLOCK_N output features
  and a range of K (split-K when the N tiles alone do not fill the GPU); it
  dequantizes each [BLOCK_N, BLOCK_K] tile once, to fp32, and reduces it
  against each of the M activation rows (CUDA-core FMAs, no tl.dot, so M = 1
  wastes nothing). Split-K partial sums land in an fp32 [splits, M, N] buffer
  summed by torch (deterministic, no atomics).
- `gemm` (many rows: prefill): [BLOCK_M, BLOCK_N] output tiles, W tiles
  dequantized to the activations' dtype and multiplied with tl.dot, fp32
  accumulation (fp32 activations: input_precision="ieee", no tf32).

A tile is a whole number of units (a 32-block; a Q4_K / Q5_K run of 64 whose
bytes hold two sub-blocks; half a Q6_K super-block) laid out so that each
quant byte is loaded once, contiguously (vector loads as wide as the
format's alignment allows: 16 bytes for Q4_K / Q5_K, 4 for Q4_1, 2 for the
18 / 22 / 34 / 210-byte blocks of Q4_0 / Q5_0 / Q8_0 / Q6_K), and broadcast over the nibbles / bit fields it holds, with the
scales loaded once per sub-block. Nothing is architecture-specific beyond
tl.dot (fp16 / bf16 mma on sm_80+): every kernel and default configuration
compiles for sm_90a (H200) and sm_121a (GB10) without register spills, with
triton 3.9 and 3.6 (tests/test_quant_gguf.py checks ptxas's report). The
tile sizes (gemv_config, gemm_config) are the largest that fit, not timed
on a GPU.

This module imports triton at import time: gguf.matmul loads it on first
use of the Triton path.
"""
import torch
import triton
import triton.language as tl

from parallel.quant.gguf import GGUFType

# name -> (kernel code, unit: the elements _dequant_tile lays out together)
_CODES = {"Q8_0": (0, 32), "Q4_0": (1, 32), "Q4_1": (2, 32), "Q5_0": (3, 32),
          "Q4_K": (4, 64), "Q5_K": (5, 64), "Q6_K": (6, 128)}


@triton.jit
def _f16(ptr, mask):
    """Little-endian fp16 at byte pointers ptr -> fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _dequant_tile(w_ptr, offs_n, mask_n, stride_wn, k0, K,
                  QT: tl.constexpr, TS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W[offs_n, k0 : k0 + BK] as fp32 [BN, BK]; zero outside N and K.

    The tile is a whole number of units (a Q8_0 / Q4_0 / Q4_1 / Q5_0 block of
    32, a Q4_K / Q5_K run of 64 whose bytes hold two sub-blocks, a Q6_K half
    super-block of 128), k0 a multiple of BK. Each unit is laid out as
    [unit, nibble / bit-field index, ..., byte]: its quant bytes are loaded
    once, contiguously, and broadcast over the fields they hold; scales are
    loaded per sub-block. The dimensions are ordered so that the flattened
    tile is in element order."""
    row = offs_n.to(tl.int64)[:, None] * stride_wn                     # [BN, 1]
    if QT == 0:                                                        # Q8_0 [BN, C, 32]
        C: tl.constexpr = BK // 32
        u = k0 // 32 + tl.arange(0, C)
        m2 = mask_n[:, None] & (u * 32 < K)[None, :]
        base = w_ptr + row + (u * TS).to(tl.int64)[None, :]            # [BN, C] block starts
        d = _f16(base, m2)
        l = tl.arange(0, 32)
        q = tl.load(base[:, :, None] + 2 + l[None, None, :], mask=m2[:, :, None], other=0)
        w = d[:, :, None] * q.to(tl.int8, bitcast=True).to(tl.float32)
    elif QT <= 3:                                                      # Q4_0 / Q4_1 / Q5_0 [BN, C, 2, 16]
        C: tl.constexpr = BK // 32
        u = k0 // 32 + tl.arange(0, C)
        m2 = mask_n[:, None] & (u * 32 < K)[None, :]
        base = w_ptr + row + (u * TS).to(tl.int64)[None, :]
        d = _f16(base, m2)[:, :, None, None]
        h = tl.arange(0, 2)
        l = tl.arange(0, 16)
        QS: tl.constexpr = 2 if QT == 1 else 4 if QT == 2 else 6
        byte = _byte(base[:, :, None, None] + QS + l[None, None, None, :], m2[:, :, None, None])
        q = (byte >> (4 * h)[None, None, :, None]) & 15               # element 16h + l
        if QT == 1:
            w = d * (q - 8).to(tl.float32)
        elif QT == 2:
            w = d * q.to(tl.float32) + _f16(base + 2, m2)[:, :, None, None]
        else:
            word = (_byte(base + 2, m2) | (_byte(base + 3, m2) << 8) | (_byte(base + 4, m2) << 16)
                    | (_byte(base + 5, m2) << 24))                     # qh, bit e -> element e
            e = (16 * h)[:, None] + l[None, :]
            hb = (word[:, :, None, None] >> e[None, None, :, :]) & 1
            w = d * ((q | (hb << 4)) - 16).to(tl.float32)
    elif QT <= 5:                                                      # Q4_K / Q5_K [BN, C, 2, 32]
        C: tl.constexpr = BK // 64
        u = k0 // 64 + tl.arange(0, C)                                 # run of 64
        cc = u % 4                                                     # its index in the super-block
        m2 = mask_n[:, None] & (u * 64 < K)[None, :]
        base = w_ptr + row + ((u // 4) * TS).to(tl.int64)[None, :]     # super-block starts
        d = _f16(base, m2)[:, :, None]
        dmin = _f16(base + 2, m2)[:, :, None]
        h = tl.arange(0, 2)
        l = tl.arange(0, 32)
        j = (2 * cc)[:, None] + h[None, :]                             # [C, 2] sub-block 0..7
        i = (j % 4)[None, :, :]
        m3 = m2[:, :, None]
        s_lo = _byte(base[:, :, None] + 4 + i, m3)                     # scales[j % 4]
        s_hi = _byte(base[:, :, None] + 8 + i, m3)                     # scales[j % 4 + 4]
        s_ex = _byte(base[:, :, None] + 12 + i, m3)                    # scales[j % 4 + 8]
        upper = (j >= 4)[None, :, :]
        sc = tl.where(upper, (s_ex & 15) | ((s_lo >> 6) << 4), s_lo & 63)
        mn = tl.where(upper, (s_ex >> 4) | ((s_hi >> 6) << 4), s_hi & 63)
        scale = (d * sc.to(tl.float32))[:, :, :, None]
        off = (dmin * mn.to(tl.float32))[:, :, :, None]
        QS: tl.constexpr = 16 if QT == 4 else 48
        b4 = base[:, :, None, None]
        m4 = m2[:, :, None, None]
        byte = _byte(b4 + QS + (32 * cc)[None, :, None, None] + l[None, None, None, :], m4)
        q = (byte >> (4 * h)[None, None, :, None]) & 15               # element 64cc + 32h + l
        if QT == 5:
            qh = _byte(b4 + 16 + l[None, None, None, :], m4)
            q = q | (((qh >> j[None, :, :, None]) & 1) << 4)
        w = scale * q.to(tl.float32) - off
    else:                                                              # Q6_K [BN, C, 2, 2, 32]
        C: tl.constexpr = BK // 128
        u = k0 // 128 + tl.arange(0, C)                                # half super-block
        hh = (u % 2)[None, :, None, None, None]
        m2 = mask_n[:, None] & (u * 128 < K)[None, :]
        base = w_ptr + row + ((u // 2) * TS).to(tl.int64)[None, :]
        d = _f16(base + 208, m2)[:, :, None, None, None]
        two = tl.arange(0, 2)
        a = two[None, None, :, None, None]                             # element 64a + 32b + l
        b = two[None, None, None, :, None]
        l = tl.arange(0, 32)[None, None, None, None, :]
        b5 = base[:, :, None, None, None]
        m5 = m2[:, :, None, None, None]
        ql = _byte(b5 + 64 * hh + 32 * b + l, m5)                     # [BN, C, 1, 2, 32]
        qh = _byte(b5 + 128 + 32 * hh + l, m5)                        # [BN, C, 1, 1, 32]
        q = ((ql >> (4 * a)) & 15) | (((qh >> (4 * a + 2 * b)) & 3) << 4)
        # sub-block (16 elements) 8hh + 4a + 2b + l // 16: two scales per run of 32
        sp = b5 + 192 + 8 * hh + 4 * a + 2 * b                        # [BN, C, 2, 2, 1]
        s0 = tl.load(sp, mask=m5, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s1 = tl.load(sp + 1, mask=m5, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = tl.where(l < 16, d * s0, d * s1) * (q - 32).to(tl.float32)
    return tl.reshape(w, (BN, BK))


@triton.jit
def gguf_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ys, stride_ym,
                     tiles_per_split,
                     QT: tl.constexpr, TS: tl.constexpr,
                     M: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (N tiles, K splits). y[split, m, n] (fp32 partial, or the output
    itself with one split) = sum over this split's K tiles."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = tl.arange(0, M_PAD)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BK))
    acc = tl.zeros((M_PAD, BN), dtype=tl.float32)
    for t in range(t0, t1):
        k0 = t * BK
        w = _dequant_tile(w_ptr, offs_n, mask_n, stride_wn, k0, K, QT, TS, BN, BK)
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        for m in tl.static_range(M):
            xm = tl.load(x_ptr + m * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], axis=1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    y = y_ptr + pid_k * stride_ys + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & mask_n[None, :])


@triton.jit
def gguf_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     QT: tl.constexpr, TS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """Grid (M tiles * N tiles,), M tiles fastest: programs that run together
    share their W tile (dequantized by each, read from L2)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for t in range(0, tl.cdiv(K, BK)):
        k0 = t * BK
        offs_k = k0 + tl.arange(0, BK)
        xt = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        w = _dequant_tile(w_ptr, offs_n, mask_n, stride_wn, k0, K, QT, TS, BN, BK)
        if F32:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1                     # interpreter: split only when asked
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _code(t: GGUFType, block_k: int) -> int:
    """The kernel code of t, checking that tiles of block_k elements hold a
    power-of-two number of its units."""
    code, unit = _CODES[t.name]
    if block_k < unit or block_k % unit or _next_pow2(block_k // unit) != block_k // unit:
        raise ValueError(f"{t.name}: block_k {block_k} must be a power-of-two multiple of {unit}")
    return code


def gemv_config(t: GGUFType, M: int) -> dict:
    """Default GEMV tiles: 16 x 256 and 4 warps for up to 4 activation rows;
    32 x 256 and 8 warps beyond (Q5_0 32 x 128; Q6_K 16 x 128 and 4 warps),
    so that the activations each program re-reads stay near the weight bytes
    it reads. Register fit checked by ptxas for sm_90 and sm_121 (no spills,
    tests/test_quant_gguf.py); not timed."""
    if M <= 4:
        return {"block_n": 16, "block_k": 256, "num_warps": 4}
    if t.name == "Q6_K":
        return {"block_n": 16, "block_k": 128, "num_warps": 4}
    return {"block_n": 32, "block_k": 128 if t.name == "Q5_0" else 256, "num_warps": 8}


def gemm_config(t: GGUFType, M: int, f32: bool = False) -> dict:
    """Default tl.dot tiles, the largest without register spills on sm_90
    and sm_121 (tests/test_quant_gguf.py): 8 warps for 64-row tiles, Q6_K
    (the bulkiest unpacking, 128-wide units) on 32 columns there; fp32
    activations (an FMA dot in exact fp32: large operands) on 16 x 32 tiles
    (Q6_K 16 x 16, one stage). Not timed."""
    block_k = max(64, _CODES[t.name][1])
    q6 = t.name == "Q6_K"
    if f32:
        return {"block_m": 16, "block_n": 16 if q6 else 32, "block_k": block_k, "num_warps": 8,
                "num_stages": 1 if q6 else 3}
    block_m = 64 if M >= 64 else 32 if M > 16 else 16
    return {"block_m": block_m, "block_n": 32 if q6 and block_m == 64 else 64, "block_k": block_k,
            "num_warps": 8 if block_m == 64 or q6 else 4, "num_stages": 3}


def gemv(x: torch.Tensor, raw: torch.Tensor, t: GGUFType, k: int, *, block_n: int | None = None,
         block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [M, k] (M <= 16, unit stride along k) -> [M, N] in x.dtype. Unset
    tiles from gemv_config; split_k None: enough K splits for about two
    programs per SM."""
    M, N = x.shape[0], raw.shape[0]
    cfg = gemv_config(t, M)
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    num_warps = num_warps or cfg["num_warps"]
    code = _code(t, block_k)
    raw = raw if raw.stride(1) == 1 else raw.contiguous()
    n_tiles = triton.cdiv(N, block_n)
    k_tiles = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = max(1, (2 * _num_sms(x.device)) // n_tiles)
    per = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    splits = triton.cdiv(k_tiles, per)
    if splits == 1:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        part, stride_ys = y, 0
    else:
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        stride_ys = part.stride(0)
    gguf_gemv_kernel[(n_tiles, splits)](
        x, raw, part, N, k, x.stride(0), raw.stride(0), stride_ys, part.stride(-2), per,
        QT=code, TS=t.type_size, M=M, M_PAD=_next_pow2(M), BN=block_n, BK=block_k,
        num_warps=num_warps)
    return y if splits == 1 else part.sum(0).to(x.dtype)


def gemm(x: torch.Tensor, raw: torch.Tensor, t: GGUFType, k: int, *, block_m: int | None = None,
         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [M, k] (unit stride along k) -> [M, N] in x.dtype, tl.dot tiles
    (unset ones from gemm_config)."""
    M, N = x.shape[0], raw.shape[0]
    cfg = gemm_config(t, M, x.dtype == torch.float32)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    num_warps = num_warps or cfg["num_warps"]
    code = _code(t, block_k)
    raw = raw if raw.stride(1) == 1 else raw.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    gguf_gemm_kernel[grid](
        x, raw, y, M, N, k, x.stride(0), raw.stride(0), y.stride(0),
        QT=code, TS=t.type_size, BM=block_m, BN=block_n, BK=block_k,
        F32=x.dtype == torch.float32, num_warps=num_warps, num_stages=cfg["num_stages"])
    return y
