"""The Triton kernels behind kvcache.dense_triton (see there). A module of
its own because it imports triton at import time: only dense_triton loads
it, on first use."""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


# Arguments that change from step to step are not specialised on (value 1,
# divisibility by 16): one compiled kernel serves every batch.
@triton.jit(do_not_specialize=["seq0", "sl_s", "s_bt", "splits"])
def dense_paged_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, qsl_ptr, seq_len_ptr, klim_ptr, seq0,
                            sq_t, sq_h, sk_slot, sk_h, sv_slot, sv_h,
                            so_s, so_t, so_h, sl_s, sl_t, sl_h, s_bt, window, qk_scale, splits,
                            G: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                            DECODE: tl.constexpr, HAS_WINDOW: tl.constexpr, F32: tl.constexpr,
                            WRITE_LSE: tl.constexpr, HAS_LIMITS: tl.constexpr):
    """Grid (row tiles, sequences, KV heads * splits). A program takes ROWS
    (token, query head) rows of sequence seq0 + program_id(1), token-major,
    all of one KV head's G query heads, so each K/V tile it loads serves all
    of them; it walks the key positions it can see (causal, and the sliding
    window) BLOCK_N at a time through the block table, with an online
    softmax in base 2 (qk_scale = softmax scale * log2(e)).

    DECODE: sequence b's one query is token row b (decodes lead the flat
    batch); else its rows are [qsl[b], qsl[b + 1]). seq_len[b] counts the
    context including the queries, whose K/V are already in the cache.
    With splits > 1 the key range is cut in that many parts, each writing its
    partial output and log-sum-exp at split * so_s / sl_s (flash-decoding),
    merged by merge_splits_kernel.

    HAS_LIMITS (prefill only): token row i sees keys up to klim[i] (a
    bidirectional span; >= its position) instead of its position; the
    window still counts back from its position."""
    tile = tl.program_id(0)
    b = seq0 + tl.program_id(1)
    h = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    if DECODE:
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(qsl_ptr + b).to(tl.int32)
        q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    ctx = seq_len - q_len                       # position of the first query token

    r = tile * ROWS + tl.arange(0, ROWS)
    t = r // G
    g = r % G
    row_ok = t < q_len
    qpos = ctx + t
    tok = (q_start + t).to(tl.int64)
    qh = h * G + g                              # query head
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + tok[:, None] * sq_t + qh[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Each row's last key, and the keys this tile can see: [lo, hi).
    p_min = ctx + (tile * ROWS) // G
    p_max = tl.minimum(ctx + (tile * ROWS + ROWS - 1) // G, seq_len - 1)
    k_max = p_max
    klim = qpos
    if HAS_LIMITS:
        klim = tl.load(klim_ptr + tok, mask=row_ok, other=0).to(tl.int32)
        k_max = tl.maximum(p_max, tl.max(klim, 0))
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_min - window + 1, 0)
    hi = tl.where(p_min <= p_max, k_max + 1, lo)       # empty for a tile past the queries
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, splits)
    i_first = split * per_split
    i_last = tl.minimum(i_first + per_split, n_tiles)

    # -1e30: a finite "minus infinity" (no inf - inf NaNs).
    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for i in range(i_first, i_last):
        kpos = lo + i * BLOCK_N + n
        kmask = kpos < hi
        blk = tl.load(bt_ptr + b * s_bt + kpos // BLOCK_SIZE, mask=kmask, other=0)
        slots = blk.to(tl.int64) * BLOCK_SIZE + kpos % BLOCK_SIZE
        m2 = kmask[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slots[:, None] * sk_slot + h * sk_h + d[None, :], mask=m2, other=0.0)
        v = tl.load(v_ptr + slots[:, None] * sv_slot + h * sv_h + d[None, :], mask=m2, other=0.0)
        # Dot in the query dtype with fp32 accumulation, as the torch path
        # does; fp32 stays exact fp32 (no tf32).
        if F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        valid = (kpos[None, :] <= klim[:, None]) & kmask[None, :]
        if HAS_WINDOW:
            valid = valid & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(valid, s * qk_scale, -1e30)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        # where(): a row with no valid key in this tile adds nothing to l.
        p = tl.where(valid, tl.exp2(s - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, 1)
        if F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new

    # A row (or split) that saw no key: output 0, log-sum-exp -inf.
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    o_row = o_ptr + split * so_s + tok * so_t + qh * so_h
    tl.store(o_row[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * LN2, -float("inf"))
        tl.store(lse_ptr + split * sl_s + tok * sl_t + qh * sl_h, lse, mask=row_ok)


@triton.jit(do_not_specialize=["spl_s", "splits"])
def merge_splits_kernel(o_part, lse_part, out_ptr, lse_ptr, sp_s, sp_t, sp_h, spl_s, spl_t, spl_h,
                        so_t, so_h, sl_t, sl_h, splits,
                        S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Grid (tokens, query heads): `splits` (<= S_PAD) partial outputs (float32) and their
    log-sum-exps -> the output over the union of their keys. A split that
    saw no key has lse -inf: weight 0; a row no split saw: output 0, lse -inf."""
    t = tl.program_id(0).to(tl.int64)
    qh = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < splits
    lse = tl.load(lse_part + s * spl_s + t * spl_t + qh * spl_h, mask=s_ok, other=-float("inf"))
    mx = tl.maximum(tl.max(lse, 0), -1e30)
    w = tl.where(s_ok, tl.exp(lse - mx), 0.0)
    ws = tl.sum(w, 0)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    o = tl.load(o_part + s[:, None] * sp_s + t * sp_t + qh * sp_h + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.where(ws > 0, ws, 1.0)
    tl.store(out_ptr + t * so_t + qh * so_h + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(lse_ptr + t * sl_t + qh * sl_h, tl.where(ws > 0, mx + tl.log(tl.where(ws > 0, ws, 1.0)),
                                                          -float("inf")))


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sk_t, sk_h, sv_t, sv_h, skc_s, skc_h, svc_s, svc_h,
                    H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """Grid (tokens,): token t's K and V rows [H, D] into the caches at row
    slot_mapping[t], cast to the cache dtype (round to nearest even, as
    torch's .to()). A negative slot writes nothing: a padded row of a
    captured batch, or a token whose block is not held."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        m = (h < H) & (d < D)
        k = tl.load(k_ptr + t * sk_t + h * sk_h + d, mask=m)
        tl.store(kc_ptr + slot * skc_s + h * skc_h + d, k.to(kc_ptr.dtype.element_ty), mask=m)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=m)
        tl.store(vc_ptr + slot * svc_s + h * svc_h + d, v.to(vc_ptr.dtype.element_ty), mask=m)
