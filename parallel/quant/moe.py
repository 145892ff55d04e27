"""Routed experts for a whole batch at once, weights kept in their stored
format: "bf16" (dense float tensors), "fp8" (fp8_block), "mxfp4" (mxfp4) or
"gguf" (GGUF blocks, gate and up in tensors of their own, each of its own
type). No Python loop over tokens.

The expert MLP (model_zoo.deepseek_v4.Experts): g, u = (x @ w13[e]^T).chunk(2);
h = silu(g.clamp(max=limit)) * u.clamp(-limit, limit); out += (h @ w2[e]^T) * weight.

1. Route: the T*k (token, slot) pairs are sorted by expert with torch ops
   (stable argsort of the flattened ids, -1 / ids off this rank last;
   bincount + cumsum give each expert's row range). Within an expert the
   pairs stay in token order, as torch.where(idx == e) gives them.
2. CPU (and backend="torch"): a loop over the experts that have tokens;
   a quantized expert is dequantized into one reused scratch buffer (w13,
   then w2 into the same buffer), then F.linear; one index_add_ of the
   weighted rows at the end. Bit for bit the per-expert math of
   Experts.forward (same rows, same order, same additions per token).
3. CUDA (backend="triton"): two grouped-GEMM launches over all experts, no
   host sync. A tile map built on the device (each expert's rows cut into
   BLOCK_M tiles; the grid is an upper bound, cdiv(T*k, BLOCK_M) +
   min(E, T*k) tiles, idle tiles return at once) gives each program one
   expert's tile of rows and a BLOCK_N slice of outputs.
   `_moe_up_kernel` gathers the tokens' rows of x, dequantizes the matching
   gate and up rows of w13[e] in registers (GGUF: gguf_triton._dequant_tile,
   tiles of whole quant units), multiplies (tl.dot, fp32
   accumulation) and applies the clamped SwiGLU in its epilogue -> h in
   sorted order [T*k, I]. `_moe_down_kernel` multiplies h by w2[e], scales
   by the pair's routing weight and stores the row at the pair's own place
   in a zeroed [T*k, H] buffer; out is its sum over the k slots (fixed
   order: deterministic, no atomics).
   Block sizes are first guesses (BLOCK_M from the mean rows per active
   expert), untuned on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.quant import fp8_block, gguf, mxfp4
from parallel.quant.fp8_block import _jit, fp8_tile, kernel_scale, mac, pick_backend, tl, triton
from parallel.quant.mxfp4 import mxfp4_tile

if triton is not None:
    from parallel.quant.gguf_triton import _CODES as GGUF_CODES, _dequant_tile

FORMATS = {"bf16": 0, "fp8": 1, "mxfp4": 2, "gguf": 3}
ACTS = {"silu": 0, "gelu_tanh": 1}     # the gate's activation: SwiGLU, or Gemma's GeGLU (gelu_tanh)


def moe_forward(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w13, w2, fmt: str, limit: float, *,
                scratch: torch.Tensor | None = None, backend: str | None = None, act: str = "silu") -> torch.Tensor:
    """x [T, H], idx [T, k] local expert ids (-1: not on this rank), w [T, k]
    routing weights -> [T, H] in x.dtype. act: the gate's activation (ACTS).
    fmt "bf16": w13 [E, 2I, H], w2 [E, H, I] (any float dtype);
        "fp8": w13 = (w8 [E, 2I, H], scale [E, ceil(2I/128), ceil(H/128)]), w2 likewise;
        "mxfp4": w13 = (packed [E, 2I, H/2], scales [E, 2I, H/32]), w2 = (packed [E, H, I/2], scales [E, H, I/32]);
        "gguf": w13 = ((gate rows uint8 [E, I, rb], type), (up rows, type), H), w2 = ((down rows [E, H, rb], type), I):
        GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K), dequantized tile by tile in registers on
        CUDA (gguf_triton._dequant_tile), one expert at a time into scratch on CPU.
    scratch: a buffer (x.dtype, >= 2*I*H elements) for the CPU path's dequantized expert."""
    if fmt not in FORMATS:
        raise ValueError(f"moe format {fmt!r}: one of {sorted(FORMATS)}")
    if act not in ACTS:
        raise ValueError(f"moe activation {act!r}: one of {sorted(ACTS)}")
    E, I2, H = _dims(w13, fmt)
    if x.shape[-1] != H or idx.shape != w.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(f"moe: x {tuple(x.shape)}, idx {tuple(idx.shape)}, w {tuple(w.shape)} for H = {H}")
    if x.shape[0] == 0 or idx.shape[1] == 0:
        return torch.zeros_like(x)
    order, counts, starts, ends = route(idx, E)
    if pick_backend(backend, x) == "triton":
        return _moe_triton(x, idx, w, w13, w2, fmt, float(limit), E, I2 // 2, H, order, counts, starts, ends, act)
    return _moe_torch(x, idx, w, w13, w2, fmt, float(limit), order, counts, scratch, act)


def _dims(w13, fmt: str) -> tuple[int, int, int]:
    if fmt == "bf16":
        return tuple(w13.shape)
    if fmt == "gguf":
        (gate, _), _, H = w13
        return gate.shape[0], 2 * gate.shape[1], H
    t = w13[0]
    E, I2, Hs = t.shape
    return E, I2, (2 * Hs if fmt == "mxfp4" else Hs)


def route(idx: torch.Tensor, E: int):
    """(order, counts, starts, ends): order [T*k] the flat pair positions
    sorted by expert (stable: token order within an expert; pairs off this
    rank last), counts / starts / ends [E] each expert's range in it."""
    flat = idx.reshape(-1)
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount: bincount reads the max back to the host on
    # CUDA, which a captured decode step cannot do.
    counts = torch.zeros(E + 1, dtype=key.dtype, device=key.device).scatter_add_(0, key, torch.ones_like(key))[:E]
    ends = counts.cumsum(0)
    return order, counts, ends - counts, ends


def _expert_weights(w13, w2, fmt: str, e: int, dtype, scratch: torch.Tensor | None):
    """(w13[e], w2[e]) as dense dtype matrices; quantized ones dequantized into
    scratch one after the other (callers finish with the first before asking
    for the second: this is a generator)."""
    if fmt == "bf16":
        yield w13[e].to(dtype)
        yield w2[e].to(dtype)
        return
    if fmt == "gguf":
        (gate, gt), (up, ut), H = w13
        (down, dt), I = w2
        w = scratch[:2 * I * H].view(2 * I, H)
        gguf.dequantize(gate[e], gt, H, dtype, out=w[:I])
        gguf.dequantize(up[e], ut, H, dtype, out=w[I:])
        yield w
        yield gguf.dequantize(down[e], dt, I, dtype, out=scratch[:H * I].view(H, I))
        return
    deq = fp8_block.dequantize if fmt == "fp8" else mxfp4.dequantize
    yield deq(w13[0][e], w13[1][e], dtype, out=scratch)
    yield deq(w2[0][e], w2[1][e], dtype, out=scratch)


def _moe_torch(x, idx, w, w13, w2, fmt, limit, order, counts, scratch, act):
    k = idx.shape[1]
    if fmt != "bf16" and scratch is None:
        _, I2, H = _dims(w13, fmt)
        scratch = torch.empty(I2 * H, dtype=x.dtype, device=x.device)
    ys, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if not c:
            continue
        rows = order[start:start + c]
        start += c
        ws = _expert_weights(w13, w2, fmt, e, x.dtype, scratch)
        g, u = F.linear(x[rows // k], next(ws)).chunk(2, dim=-1)
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        h = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
        ys.append(F.linear(h, next(ws)))
    out = torch.zeros_like(x)
    if ys:
        pairs = order[:start]
        # weights in their own dtype (Gemma 4's router gives fp32), the sum in x's
        out.index_add_(0, pairs // k, (torch.cat(ys) * w.reshape(-1)[pairs, None]).to(x.dtype))
    return out


# ---------------------------------------------------------------- CUDA: grouped GEMMs


def _tile_map(counts, starts, ends, P: int, E: int, BM: int):
    """Per program row tile: (expert or -1, first row, end of the expert's rows), int32 on the device."""
    tiles = (counts + BM - 1) // BM
    tile_end = tiles.cumsum(0)
    n = triton.cdiv(P, BM) + min(E, P)
    t = torch.arange(n, device=counts.device)
    te = torch.searchsorted(tile_end, t, right=True)
    tc = te.clamp(max=E - 1)
    r0 = starts[tc] + (t - (tile_end - tiles)[tc]) * BM
    return (torch.where(te < E, tc, -1).to(torch.int32), r0.to(torch.int32), ends[tc].to(torch.int32))


def _weight_args(wt, fmt: str):
    """(data, scale, data strides (e, n, k), scale strides (e, n, k), E8M0) for the kernels."""
    if fmt == "bf16":
        return wt, wt, wt.stride(), (0, 0, 0), False
    data, scale = wt
    if fmt == "mxfp4" and data.dtype != torch.uint8:
        data = data.view(torch.uint8)
    s, e8m0 = kernel_scale(scale)
    return data, s, data.stride(), s.stride(), e8m0


def _up_args(w13, fmt: str) -> tuple[tuple, dict]:
    """_moe_up_kernel's weight arguments (gate / whole w13, its scales, the up
    rows, their strides) and constexprs."""
    if fmt == "gguf":
        (g, gt), (u, ut), _ = w13
        return ((g, g, u, g.stride(0), g.stride(1), 1, 0, 0, 0, u.stride(0), u.stride(1)),
                dict(SCALE_E8M0=False, QT=GGUF_CODES[gt][0], TS=gguf.QTYPES[gt].type_size,
                     QTU=GGUF_CODES[ut][0], TSU=gguf.QTYPES[ut].type_size))
    d, s, dst, sst, e8 = _weight_args(w13, fmt)
    return (d, s, d, *dst, *sst, 0, 0), dict(SCALE_E8M0=e8, QT=0, TS=0, QTU=0, TSU=0)


def _down_args(w2, fmt: str) -> tuple[tuple, dict]:
    """_moe_down_kernel's weight arguments and constexprs."""
    if fmt == "gguf":
        (d, dt), _ = w2
        return (d, d, d.stride(0), d.stride(1), 1, 0, 0, 0), dict(SCALE_E8M0=False, QT=GGUF_CODES[dt][0],
                                                                   TS=gguf.QTYPES[dt].type_size)
    d, s, dst, sst, e8 = _weight_args(w2, fmt)
    return (d, s, *dst, *sst), dict(SCALE_E8M0=e8, QT=0, TS=0)


def _gguf_block_k(*types: str) -> int:
    """Tiles must hold whole units of each type (a Q6_K unit is 128 wide)."""
    return max(64, *(GGUF_CODES[t][1] for t in types))


def moe_block_m(rows_per_expert: float, block_k_up: int, f32: bool = False) -> int:
    """Row tile of both grouped launches: about the mean rows an expert gets,
    capped where the up kernel's registers run out (moe_tiles)."""
    bm = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
    return min(bm, 16 if f32 else 32 if block_k_up > 64 else 64)


def moe_tiles(kind: str, block_k: int, f32: bool = False) -> dict:
    """block_n, num_warps and num_stages of _moe_{kind}_kernel: the largest
    tiles that fit in registers on sm_90 and sm_121 (tests/test_quant_fp.py
    compiles them: at most 24 bytes of spill, where 64-wide 4-warp tiles
    spilled up to 2.9 KB). The up kernel holds two accumulators and two
    weight tiles: 32 columns, 8 warps; 128-wide K tiles (Q6_K) also need
    block_m <= 32, fp32 activations (an exact FMA dot) 16 x 16 tiles
    (moe_block_m caps the rows) and one stage with Q6_K. Not timed on a
    GPU."""
    if f32:
        return {"block_n": 16, "num_warps": 8, "num_stages": 1 if block_k > 64 else 2}
    if kind == "up":
        return {"block_n": 32, "num_warps": 8, "num_stages": 3}
    return {"block_n": 64 if block_k == 64 else 32, "num_warps": 8, "num_stages": 3}


def _check(wt, fmt: str, E: int, N: int, K: int, what: str):
    if fmt == "gguf":
        parts = wt[:2] if what == "w13" else wt[:1]
        for rows, name in parts:
            t = gguf.QTYPES[name]
            want = (E, N // len(parts), K // t.block * t.type_size)
            if K % t.block or tuple(rows.shape) != want:
                raise ValueError(f"gguf {what}: expected {name} rows {want}, got {tuple(rows.shape)}")
        return
    if fmt == "bf16":
        shapes = [((E, N, K), tuple(wt.shape))]
    elif fmt == "fp8":
        shapes = [((E, N, K), tuple(wt[0].shape)), ((E, -(-N // 128), -(-K // 128)), tuple(wt[1].shape))]
    else:
        if K % 32:
            raise ValueError(f"mxfp4 {what}: K = {K} must be a multiple of 32")
        shapes = [((E, N, K // 2), tuple(wt[0].shape)), ((E, N, K // 32), tuple(wt[1].shape))]
    for want, got in shapes:
        if want != got:
            raise ValueError(f"{fmt} {what}: expected {want}, got {got}")


def _moe_triton(x, idx, w, w13, w2, fmt, limit, E, I, H, order, counts, starts, ends, act: str = "silu",
                block_m: int | None = None):
    _check(w13, fmt, E, 2 * I, H, "w13")
    _check(w2, fmt, E, H, I, "w2")
    T, k = idx.shape
    P = T * k
    F32 = x.dtype == torch.float32
    bk_up = bk_down = 64
    if fmt == "gguf":
        (_, gt), (_, ut), _ = w13
        bk_up, bk_down = _gguf_block_k(gt, ut), _gguf_block_k(w2[0][1])
    block_m = moe_block_m(P / min(E, P), bk_up, F32) if block_m is None else block_m
    up, down = moe_tiles("up", bk_up, F32), moe_tiles("down", bk_down, F32)
    tile_e, tile_r0, tile_r1 = _tile_map(counts, starts, ends, P, E, block_m)
    order32 = order.to(torch.int32)
    tok = torch.div(order32, k, rounding_mode="floor")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rw = w.reshape(-1).contiguous()
    code = FORMATS[fmt]
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    wa, const = _up_args(w13, fmt)
    w, s, u, *strides = wa
    _moe_up_kernel[(tile_e.numel(), triton.cdiv(I, up["block_n"]))](
        x, w, s, u, h, tile_e, tile_r0, tile_r1, tok, I, H, x.stride(0), *strides, h.stride(0), limit,
        FMT=code, BM=block_m, BN=up["block_n"], BK=bk_up, F32=F32, ACT=ACTS[act], **const,
        num_warps=up["num_warps"], num_stages=up["num_stages"])
    y = torch.zeros(P, H, dtype=x.dtype, device=x.device)
    (w, s, *strides), const = _down_args(w2, fmt)
    _moe_down_kernel[(tile_e.numel(), triton.cdiv(H, down["block_n"]))](
        h, w, s, y, tile_e, tile_r0, tile_r1, order32, rw, H, I, h.stride(0), *strides, y.stride(0),
        FMT=code, BM=block_m, BN=down["block_n"], BK=bk_down, F32=F32, **const,
        num_warps=down["num_warps"], num_stages=down["num_stages"])
    return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


@_jit
def _w_tile(w_ptr, s_ptr, offs_n, k0, N, K, s_wn, s_wk, s_sn, s_sk,
            FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALE_E8M0: tl.constexpr,
            QT: tl.constexpr, TS: tl.constexpr):
    """One expert's W[offs_n, k0 : k0 + BK] as fp32 [BN, BK], zero outside N and K.
    GGUF (FMT 3): rows of QT blocks of TS bytes, s_wn bytes apart."""
    if FMT == 0:
        offs_k = k0 + tl.arange(0, BK)
        m = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :] * s_wk, mask=m,
                    other=0.0).to(tl.float32)
    elif FMT == 1:
        w = fp8_tile(w_ptr, s_ptr, offs_n, k0, N, K, s_wn, s_wk, s_sn, s_sk, BK, SCALE_E8M0)
    elif FMT == 2:
        w = mxfp4_tile(w_ptr, s_ptr, offs_n, k0, N, K, s_wn, s_wk, s_sn, s_sk, BN, BK, SCALE_E8M0)
    else:
        w = _dequant_tile(w_ptr, offs_n, offs_n < N, s_wn, k0, K, QT, TS, BN, BK)
    return w


@_jit
def _moe_up_kernel(x_ptr, w_ptr, s_ptr, u_ptr, h_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, tok_ptr, I, H,
                   stride_xt, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_ue, s_un, stride_hm, limit,
                   FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SCALE_E8M0: tl.constexpr, F32: tl.constexpr, ACT: tl.constexpr,
                   QT: tl.constexpr, TS: tl.constexpr, QTU: tl.constexpr, TSU: tl.constexpr):
    """Grid (row tiles, I / BN). h[rows, n] = act(x[tok] @ w13[e, n]^T) * (x[tok] @ w13[e, I + n]^T),
    both clamped by limit; act SiLU (ACT 0) or gelu_tanh (ACT 1). GGUF keeps gate and up apart:
    w_ptr the gate rows (type QT), u_ptr the up rows (type QTU, expert stride s_ue, row s_un)."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_e_ptr + t)
    if e >= 0:
        rows = tl.load(tile_r0_ptr + t) + tl.arange(0, BM)
        mask_m = rows < tl.load(tile_r1_ptr + t)
        tok = tl.load(tok_ptr + rows, mask=mask_m, other=0)
        x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
        we = w_ptr + e.to(tl.int64) * s_we
        se = s_ptr + e.to(tl.int64) * s_se
        offs_n = pid_n * BN + tl.arange(0, BN)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            offs_k = k0 + tl.arange(0, BK)
            xt = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < H)[None, :], other=0.0)
            wg = _w_tile(we, se, offs_n, k0, I, H, s_wn, s_wk, s_sn, s_sk, FMT, BN, BK, SCALE_E8M0, QT, TS)
            acc_g = mac(acc_g, xt, wg, F32)
            if FMT == 3:
                wu = _w_tile(u_ptr + e.to(tl.int64) * s_ue, se, offs_n, k0, I, H, s_un, s_wk, s_sn, s_sk,
                             FMT, BN, BK, SCALE_E8M0, QTU, TSU)
            else:
                wu = _w_tile(we, se, I + offs_n, k0, 2 * I, H, s_wn, s_wk, s_sn, s_sk, FMT, BN, BK, SCALE_E8M0,
                             QT, TS)
            acc_u = mac(acc_u, xt, wu, F32)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        if ACT == 0:
            hv = g / (1.0 + tl.exp(-g)) * u
        else:   # 0.5 g (1 + tanh(c (g + 0.044715 g^3))), tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            hv = g * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * z))) * u
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs_n[None, :], hv.to(h_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_n < I)[None, :])


@_jit
def _moe_down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, pair_ptr, rw_ptr, H, I,
                     stride_hm, s_we, s_wn, s_wk, s_se, s_sn, s_sk, stride_ym,
                     FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SCALE_E8M0: tl.constexpr, F32: tl.constexpr, QT: tl.constexpr, TS: tl.constexpr):
    """Grid (row tiles, H / BN). y[pair, n] = weight[pair] * (h[rows] @ w2[e, n]^T)."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_e_ptr + t)
    if e >= 0:
        rows = tl.load(tile_r0_ptr + t) + tl.arange(0, BM)
        mask_m = rows < tl.load(tile_r1_ptr + t)
        pair = tl.load(pair_ptr + rows, mask=mask_m, other=0)
        rw = tl.load(rw_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm
        we = w_ptr + e.to(tl.int64) * s_we
        se = s_ptr + e.to(tl.int64) * s_se
        offs_n = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(h_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < I)[None, :], other=0.0)
            wt = _w_tile(we, se, offs_n, k0, H, I, s_wn, s_wk, s_sn, s_sk, FMT, BN, BK, SCALE_E8M0, QT, TS)
            acc = mac(acc, a, wt, F32)
        acc = acc * rw[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (offs_n < H)[None, :])
