"""The Triton kernels behind kvcache.dsv4_triton (see there). A module of its
own because it imports triton at import time."""
import triton
import triton.language as tl

from kvcache.tq_triton_kernels import LN2, _dot, _load_tile, _online


@triton.jit
def entry_attn_kernel(q_ptr, sel_ptr, count_ptr, data, scale, cb, o_ptr, lse_ptr,
                      s_qb, s_qh, s_sb, s_os, s_ob, s_oh, s_ls, s_lb,
                      s_slot, s_h, sc_slot, sc_h, H, K, per_split, sm_scale,
                      KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      BH: tl.constexpr, BN: tl.constexpr, ALL: tl.constexpr, F32: tl.constexpr):
    """Program (b, head block, split): BH query heads of sequence b over the
    entries sel[b, t], t in this split's share of [0, count[b]) (ALL: of
    [0, K)), -1 skipped; every entry read once for the BH heads (K = V, one
    vector per entry). Writes the split's normalised output o [BH, D] fp32
    and its log-sum-exp (-inf, o 0 when it used no entry).
    KIND 3: entries stored dense in the queries' dtype; 0-2: a Codec's
    f16 / int8 / TurboQuant rows (tq_triton_kernels._load_tile), read in the
    rotated domain (the caller rotates q and de-rotates o)."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hm[:, None], other=0.0)
    if ALL:
        n = K
    else:
        n = tl.load(count_ptr + b).to(tl.int32)
    lo = sp * per_split
    hi = tl.minimum(n, lo + per_split)
    m = tl.full([BH], -1e30, tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for t0 in range(lo, hi, BN):
        t = t0 + tl.arange(0, BN)
        rows = tl.load(sel_ptr + b * s_sb + t, mask=t < hi, other=-1).to(tl.int64)
        ok = rows >= 0
        rows = tl.where(ok, rows, 0)
        if KIND == 3:
            k = tl.load(data + rows[:, None] * s_slot + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        else:
            k = _load_tile(data, scale, cb, rows, 0, ok, s_slot, s_h, sc_slot, sc_h,
                           KIND, BITS, GROUP, BN, D).to(q.dtype)
        p, alpha, m, l = _online(_dot(q, tl.trans(k), F32) * sm_scale, ok[None, :], m, l)
        acc = acc * alpha[:, None] + _dot(p.to(k.dtype), k, F32)
    o = acc / tl.maximum(l, 1e-30)[:, None]
    lse = tl.where(l > 0, (m + tl.log2(tl.maximum(l, 1e-30))) * LN2, float("-inf"))
    tl.store(o_ptr + sp * s_os + b * s_ob + heads[:, None] * s_oh + d[None, :], o, mask=hm[:, None])
    tl.store(lse_ptr + sp * s_ls + b * s_lb + heads, lse, mask=hm)


@triton.jit
def index_scores_kernel(q_ptr, w_ptr, keys, rows_ptr, count_ptr, out_ptr,
                        s_qb, s_qh, s_wb, s_key, s_rb, s_ob, NH, E, sm_scale,
                        HP: tl.constexpr, DI: tl.constexpr, BE: tl.constexpr, F32: tl.constexpr):
    """Program (b, entry block): the lightning indexer's scores of sequence
    b's query against BE of its indexer keys, sum_h w_h relu(q_h . k) *
    sm_scale, -inf past count[b]; a block wholly past it reads nothing."""
    b = tl.program_id(0)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    n = tl.load(count_ptr + b).to(tl.int32)
    if tl.program_id(1) * BE < n:
        ok = e < n
        rows = tl.load(rows_ptr + b * s_rb + e, mask=ok, other=0).to(tl.int64)
        d = tl.arange(0, DI)
        k = tl.load(keys + rows[:, None] * s_key + d[None, :], mask=ok[:, None], other=0.0)
        h = tl.arange(0, HP)
        hm = h < NH
        q = tl.load(q_ptr + b * s_qb + h[:, None] * s_qh + d[None, :], mask=hm[:, None], other=0.0)
        s = tl.maximum(_dot(q, tl.trans(k), F32), 0.0) * sm_scale                   # [HP, BE]
        w = tl.load(w_ptr + b * s_wb + h, mask=hm, other=0.0)
        out = tl.where(ok, tl.sum(s * w[:, None], 0), float("-inf"))
    else:
        out = tl.full([BE], float("-inf"), tl.float32)
    tl.store(out_ptr + b * s_ob + e, out, mask=e < E)
