"""The Triton kernel behind kvcache.tq_triton (see there). A module of its
own because it imports triton at import time: only tq_triton loads it, on
first use."""
import triton
import triton.language as tl


@triton.jit
def _load_tile(data, scale, cb, slots, h, d, mask,
               s_slot, s_h, sc_slot, sc_h,
               KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               N: tl.constexpr, D: tl.constexpr):
    """[N] slots x [D] coordinates of one component -> float32 rotated vectors."""
    row = slots[:, None] * s_slot + h * s_h
    m2 = mask[:, None]
    if KIND == 0:                                       # f16
        x = tl.load(data + row + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif KIND == 1:                                     # int8 * per-vector scale
        q = tl.load(data + row + d[None, :], mask=m2, other=0).to(tl.float32)
        s = tl.load(scale + slots * sc_slot + h * sc_h, mask=mask, other=0.0).to(tl.float32)
        x = q * s[:, None]
    else:                                               # tq: packed codes
        # pack_bits: the 8 codes of coordinates 8j..8j+7 fill bytes
        # BITS*j .. BITS*j + BITS - 1 as one little-endian word, code i at bit
        # BITS*i. Load each word's bytes once ([N, D/8] per byte), split the
        # word into its 8 codes and interleave them back to [N, D].
        j = tl.arange(0, D // 8)
        ptr = data + row + (j * BITS)[None, :]
        # 8 codes of up to 4 bits fit an int32 word; 5 bits need 40.
        WORD: tl.constexpr = tl.int64 if BITS > 4 else tl.int32
        w = tl.load(ptr, mask=m2, other=0).to(WORD)
        for i in tl.static_range(1, BITS):
            w = w | (tl.load(ptr + i, mask=m2, other=0).to(WORD) << (8 * i))
        MASK: tl.constexpr = (1 << BITS) - 1
        # join() appends its new axis last, so the first join is the most
        # significant digit of i = 4a + 2b + c.
        p00 = tl.join(w & MASK, (w >> (4 * BITS)) & MASK)
        p01 = tl.join((w >> BITS) & MASK, (w >> (5 * BITS)) & MASK)
        p10 = tl.join((w >> (2 * BITS)) & MASK, (w >> (6 * BITS)) & MASK)
        p11 = tl.join((w >> (3 * BITS)) & MASK, (w >> (7 * BITS)) & MASK)
        code = tl.reshape(tl.join(tl.join(p00, p10), tl.join(p01, p11)), (N, D))
        c = tl.load(cb + code)
        s = tl.load(scale + slots[:, None] * sc_slot + h * sc_h + (d // GROUP)[None, :],
                    mask=m2, other=0.0).to(tl.float32)
        x = c * s
    return x


@triton.jit
def tq_attn_kernel(q_ptr, o_ptr, lse_ptr, bt_ptr, vbt_ptr, q_start_ptr, q_len_ptr, seq_len_ptr,
                   k_data, k_scale, k_cb, v_data, v_scale, v_cb,
                   sq_t, sq_h, sq_g, so_s, so_t, so_h, so_g, sl_s, sl_t, sl_h, sl_g, s_bt, s_vbt,
                   ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                   window, sink, G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                   K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                   V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, F32: tl.constexpr, PART: tl.constexpr):
    """PART (tq_cache ALL / CODED / HOT) picks the keys a query at position p
    sees besides the causal and window masks: ALL every one; CODED those in
    [sink, own(p)); HOT those below sink or in [own(p), p], where own(p) is
    the start of p's block. K is read through bt_ptr, V through vbt_ptr."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q_start = tl.load(q_start_ptr + b)
    q_len = tl.load(q_len_ptr + b)
    seq_len = tl.load(seq_len_ptr + b)
    ctx = seq_len - q_len                       # position of the first query token

    # Rows of this tile: (token, query head) pairs, token-major.
    r = tile * ROWS + tl.arange(0, ROWS)
    t = r // G
    g = r % G
    row_ok = t < q_len
    qpos = ctx + t
    own = qpos // BLOCK_SIZE * BLOCK_SIZE       # each row's block start
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q_start + t)[:, None] * sq_t + h * sq_h + g[:, None] * sq_g + d[None, :],
                mask=row_ok[:, None], other=0.0)

    # Key range this tile can see: [lo, hi), and for HOT also the sink
    # range [a_lo, a_hi) before it. A HOT pass must never touch other keys:
    # its block table is valid only at block 0 and the queries' own blocks.
    p_min = ctx + (tile * ROWS) // G
    p_max = tl.minimum(ctx + (tile * ROWS + ROWS - 1) // G, seq_len - 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_min - window + 1, 0)
    hi = tl.where(p_min <= p_max, p_max + 1, lo)       # empty for a tile past the queries
    a_lo = lo
    n_a = 0                                             # tiles in the sink range
    if PART == 1:                                       # CODED: [sink, last row's own block)
        lo = tl.maximum(lo, sink)
        hi = tl.minimum(hi, p_max // BLOCK_SIZE * BLOCK_SIZE)
    if PART == 2:                                       # HOT: [0, sink) and [first row's own block, hi)
        a_hi = tl.minimum(hi, sink)
        n_a = tl.cdiv(tl.maximum(a_hi - a_lo, 0), BLOCK_N)
        lo = tl.maximum(tl.maximum(lo, sink), p_min // BLOCK_SIZE * BLOCK_SIZE)
    # Both ranges' tiles in one index space, split evenly over SPLITS.
    n_tiles = n_a + tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, SPLITS)
    i_first = split * per_split
    i_last = tl.minimum(i_first + per_split, n_tiles)

    # -1e30: a finite "minus infinity", as in tq_cache (no inf - inf NaNs).
    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for i in range(i_first, i_last):
        if PART == 2:
            in_a = i < n_a
            start = tl.where(in_a, a_lo + i * BLOCK_N, lo + (i - n_a) * BLOCK_N)
            end = tl.where(in_a, a_hi, hi)
        else:
            start = lo + i * BLOCK_N
            end = hi
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < end
        blk = tl.load(bt_ptr + b * s_bt + kpos // BLOCK_SIZE, mask=kmask, other=0)
        slots = blk.to(tl.int64) * BLOCK_SIZE + kpos % BLOCK_SIZE
        vblk = tl.load(vbt_ptr + b * s_vbt + kpos // BLOCK_SIZE, mask=kmask, other=0)
        vslots = vblk.to(tl.int64) * BLOCK_SIZE + kpos % BLOCK_SIZE
        k = _load_tile(k_data, k_scale, k_cb, slots, h, d, kmask, ks_slot, ks_h, ksc_slot, ksc_h,
                       K_KIND, K_BITS, K_GROUP, BLOCK_N, D)
        v = _load_tile(v_data, v_scale, v_cb, vslots, h, d, kmask, vs_slot, vs_h, vsc_slot, vsc_h,
                       V_KIND, V_BITS, V_GROUP, BLOCK_N, D)
        # Dot in the query dtype, as the torch path does; fp32 stays exact
        # fp32 (no tf32) so the kernel matches the reference.
        if F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        valid = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
        if HAS_WINDOW:
            valid = valid & (kpos[None, :] > qpos[:, None] - window)
        # Rows of one tile sit in different blocks: the part rule per row.
        if PART == 1:
            valid = valid & (kpos[None, :] >= sink) & (kpos[None, :] < own[:, None])
        if PART == 2:
            valid = valid & ((kpos[None, :] < sink) | (kpos[None, :] >= own[:, None]))
        s = tl.where(valid, s, -1e30)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        # where(): a row with no valid key in this tile adds nothing to l.
        p = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, 1)
        if F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new

    # A row (or split) that saw no key: output 0, log-sum-exp -inf (weight 0
    # in any merge by log-sum-exp).
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    o_row = o_ptr + split * so_s + (q_start + t) * so_t + h * so_h + g * so_g
    tl.store(o_row[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), -float("inf"))
    tl.store(lse_ptr + split * sl_s + (q_start + t) * sl_t + h * sl_h + g * sl_g, lse, mask=row_ok)
