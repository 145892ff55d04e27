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


@triton.jit
def pool_rows_kernel(kv_ring, gate_ring, slots_ptr, pos_ptr, kv_ptr, gate_ptr, bias_ptr, out_ptr,
                     s_rslot, s_rpos, s_gslot, s_gpos, s_kv, s_gate, s_bias, s_out, num_slots, cap, d,
                     RATIO: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, BD: tl.constexpr):
    """Program (row b, BD channels): the gated pooling of the window row b
    closes (dsv4_attn.DSV4Backend.pool_rows), softmax over its SPAN rows per
    channel in fp32. With OVERLAP (CSA), row t < RATIO is the previous
    window's (channel c of the first half of the width, empty for window
    0), row t >= RATIO this window's (channel d + c); the position bias is
    row t % RATIO's."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = c < d
    p = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    slot = tl.where(slot < 0, slot + num_slots, slot)            # PAD_SLOT -1: the last slot, as torch indexes
    t = tl.arange(0, SPAN)
    q = p - SPAN + 1 + t
    at = ((q % cap) + cap) % cap                                  # a ring index for every position, even < 0
    cur = (t == SPAN - 1)[:, None]
    if OVERLAP:
        ch = tl.where((t < RATIO)[:, None], c[None, :], d + c[None, :])
    else:
        ch = c[None, :] + 0 * t[:, None]
    m2 = cm[None, :]
    # The ring's rows in the raw vectors' dtype first, as the reference reads them.
    kv = tl.where(cur, tl.load(kv_ptr + b * s_kv + ch, mask=cur & m2, other=0.0),
                  tl.load(kv_ring + slot * s_rslot + at[:, None] * s_rpos + ch, mask=(~cur) & m2,
                          other=0.0).to(kv_ptr.dtype.element_ty))
    g = tl.where(cur, tl.load(gate_ptr + b * s_gate + ch, mask=cur & m2, other=0.0),
                 tl.load(gate_ring + slot * s_gslot + at[:, None] * s_gpos + ch, mask=(~cur) & m2,
                         other=0.0).to(gate_ptr.dtype.element_ty))
    g = g.to(tl.float32) + tl.load(bias_ptr + (t % RATIO)[:, None] * s_bias + ch, mask=m2, other=0.0)
    if OVERLAP:
        empty = (t < RATIO)[:, None] & ((p + 1) // RATIO <= 1)   # window 0 has no previous one
        kv = tl.where(empty, 0.0, kv)
        g = tl.where(empty, float("-inf"), g)
    w = tl.exp(g - tl.max(g, 0)[None, :])
    w = w / tl.sum(w, 0)[None, :]
    # The reference weights in the vectors' dtype and sums there; fp32 here.
    out = tl.sum(kv.to(tl.float32) * w.to(kv.dtype).to(tl.float32), 0)
    tl.store(out_ptr + b * s_out + c, out, mask=cm)
