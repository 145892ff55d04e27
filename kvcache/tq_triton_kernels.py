"""The Triton kernels behind kvcache.tq_triton (see there). A module of its
own because it imports triton at import time: only tq_triton loads it, on
first use."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _int8_rows(ptrs, scale_ptrs, mask, D: tl.constexpr):
    """[N] int8 rows (pointers to each row's first byte) times their scales -> [N, D] float32."""
    q = tl.load(ptrs[:, None] + tl.arange(0, D)[None, :], mask=mask[:, None], other=0).to(tl.float32)
    return q * tl.load(scale_ptrs, mask=mask, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _load_tile(data, scale, cb, slots, h, mask,
               s_slot, s_h, sc_slot, sc_h,
               KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               N: tl.constexpr, D: tl.constexpr):
    """[N] slots x [D] coordinates of one component -> float32 rotated vectors.

    Every byte is loaded once, as a row of [N, D * BITS / 8] bytes (no
    per-coordinate address math); the codes are split off it with shifts
    and interleaved back by joins, which keep each thread's codes in its own
    registers. The codebook (at most 32 float32 entries: one cache line or
    two) is the only gather; a whole-head norm is one scale per row."""
    row = slots[:, None] * s_slot + h * s_h
    m2 = mask[:, None]
    d = tl.arange(0, D)
    if KIND == 0:                                       # f16
        x = tl.load(data + row + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif KIND == 1:                                     # int8 * per-vector scale
        x = _int8_rows(data + slots * s_slot + h * s_h, scale + slots * sc_slot + h * sc_h, mask, D)
    else:                                               # tq: packed codes (turboquant.pack_bits)
        if BITS == 4:
            # Byte j: coordinate 2j in the low nibble, 2j + 1 in the high one.
            b = tl.load(data + row + tl.arange(0, D // 2)[None, :], mask=m2, other=0).to(tl.int32)
            code = tl.reshape(tl.join(b & 15, b >> 4), (N, D))
        elif BITS == 2:
            # Byte j: coordinates 4j .. 4j + 3 at bits 0, 2, 4, 6. join() appends
            # its axis last: the outer join is the low bit of the code index.
            b = tl.load(data + row + tl.arange(0, D // 4)[None, :], mask=m2, other=0).to(tl.int32)
            code = tl.reshape(tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, b >> 6)), (N, D))
        else:
            # 3 / 5 bits: the 8 codes of coordinates 8j..8j+7 fill bytes
            # BITS*j .. BITS*j + BITS - 1 as one little-endian word, code i at
            # bit BITS*i. Load each word's bytes once ([N, D/8] per byte), split
            # the word into its 8 codes and interleave them back to [N, D].
            j = tl.arange(0, D // 8)
            ptr = data + row + (j * BITS)[None, :]
            # 8 codes of up to 4 bits fit an int32 word; 5 bits need 40.
            WORD: tl.constexpr = tl.int64 if BITS > 4 else tl.int32
            w = tl.load(ptr, mask=m2, other=0).to(WORD)
            for i in tl.static_range(1, BITS):
                w = w | (tl.load(ptr + i, mask=m2, other=0).to(WORD) << (8 * i))
            MASK: tl.constexpr = (1 << BITS) - 1
            # The first join is the most significant digit of i = 4a + 2b + c.
            p00 = tl.join(w & MASK, (w >> (4 * BITS)) & MASK)
            p01 = tl.join((w >> BITS) & MASK, (w >> (5 * BITS)) & MASK)
            p10 = tl.join((w >> (2 * BITS)) & MASK, (w >> (6 * BITS)) & MASK)
            p11 = tl.join((w >> (3 * BITS)) & MASK, (w >> (7 * BITS)) & MASK)
            code = tl.reshape(tl.join(tl.join(p00, p10), tl.join(p01, p11)), (N, D)).to(tl.int32)
        c = tl.load(cb + code)
        if GROUP == D:                                  # one norm per vector
            s = tl.load(scale + slots * sc_slot + h * sc_h, mask=mask, other=0.0).to(tl.float32)
            x = c * s[:, None]
        else:
            s = tl.load(scale + slots[:, None] * sc_slot + h * sc_h + (d // GROUP)[None, :],
                        mask=m2, other=0.0).to(tl.float32)
            x = c * s
    return x


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b in a's dtype with fp32 accumulation, as the torch path does;
    fp32 stays exact fp32 (no tf32) so the kernels match the reference."""
    if F32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit
def _online(s, valid, m, l):
    """One tile of an online softmax in base 2: scores s (natural units) where
    valid -> (probabilities p, rescale alpha of what came before, new max, new sum)."""
    s = tl.where(valid, s * LOG2E, -1e30)
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    # where(): a row with no valid key in this tile adds nothing to l.
    p = tl.where(valid, tl.exp2(s - m_new[:, None]), 0.0)
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _slots(bt_row, vbt_row, kpos, kmask, BLOCK_SIZE: tl.constexpr, V_TABLE: tl.constexpr):
    """The K slots of key positions kpos through one block-table row, and
    the V slots (through vbt_row when V_TABLE, else the same)."""
    col = kpos // BLOCK_SIZE
    off = kpos % BLOCK_SIZE
    slots = tl.load(bt_row + col, mask=kmask, other=0).to(tl.int64) * BLOCK_SIZE + off
    if V_TABLE:
        vslots = tl.load(vbt_row + col, mask=kmask, other=0).to(tl.int64) * BLOCK_SIZE + off
    else:
        vslots = slots
    return slots, vslots


@triton.jit
def _decode_range(qr, m, l, acc, lo, hi, i_first, i_last, bt_row, vbt_row,
                  k_data, k_scale, k_cb, v_data, v_scale, v_cb, h,
                  ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                  BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                  V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                  V_TABLE: tl.constexpr, F32: tl.constexpr):
    """Online softmax (base 2) of one decode row tile over key tiles
    i_first..i_last-1 of the key range [lo, hi), which holds exactly the
    keys the query sees (a decode's rows share one position): the only mask
    is the range's end. K through bt_row, V through vbt_row when V_TABLE
    (else the same blocks)."""
    n = tl.arange(0, BLOCK_N)
    for i in range(i_first, i_last):
        kpos = lo + i * BLOCK_N + n
        kmask = kpos < hi
        slots, vslots = _slots(bt_row, vbt_row, kpos, kmask, BLOCK_SIZE, V_TABLE)
        k = _load_tile(k_data, k_scale, k_cb, slots, h, kmask, ks_slot, ks_h, ksc_slot, ksc_h,
                       K_KIND, K_BITS, K_GROUP, BLOCK_N, D)
        p, alpha, m, l = _online(_dot(qr, tl.trans(k), F32), kmask[None, :], m, l)
        v = _load_tile(v_data, v_scale, v_cb, vslots, h, kmask, vs_slot, vs_h, vsc_slot, vsc_h,
                       V_KIND, V_BITS, V_GROUP, BLOCK_N, D)
        acc = acc * alpha[:, None] + _dot(p.to(qr.dtype), v, F32)
    return m, l, acc


@triton.jit(do_not_specialize=["so_s", "sl_s", "s_bt", "s_hbt", "window", "splits"])
def tq_decode_kernel(q_ptr, rot_ptr, o_ptr, lse_ptr, bt_ptr, hbt_ptr, seq_len_ptr,
                     k_data, k_scale, k_cb, v_data, v_scale, v_cb,
                     hk_data, hk_scale, hv_data, hv_scale, hv_cb,
                     sq_b, sq_h, so_s, so_b, so_h, sl_s, sl_b, sl_h, s_bt, s_hbt,
                     ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                     hks_slot, hks_h, hksc_slot, hksc_h, hvs_slot, hvs_h, hvsc_slot, hvsc_h,
                     window, q_scale, o_scale, splits,
                     G: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                     V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                     HOT: tl.constexpr, HV_KIND: tl.constexpr, HV_BITS: tl.constexpr,
                     HV_GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr, F32: tl.constexpr,
                     ROTATE: tl.constexpr, PARTIAL: tl.constexpr):
    """A whole TurboQuant decode for one (sequence, KV head, split): grid
    (B, Hkv, splits + (HOT > 0)).

    Rows are the KV head's G query heads (padded to ROWS), so each decoded
    K/V tile serves all of them. With ROTATE the program rotates its
    queries itself: q @ rot (rot = diag(signs) * Hadamard, entries +-1, so
    exact in any dtype) * q_scale (softmax scale / sqrt(D)), and de-rotates
    its output the same way (@ rot^T * o_scale); without, q comes rotated
    and scaled and the output stays rotated (the caller de-rotates).

    Programs split < splits walk an equal share of the coded keys: every
    key <= the query (inside the window), or with hot tokens (HOT 1 = "k",
    2 = "kv") those in [BLOCK_SIZE, own block start). The program
    split == splits is the HOT pass: block 0 (the sinks) and the query's
    own block, read from the int8 hot copies through hbt_ptr (values too
    for "kv"; for "k" the coded values through bt_ptr). It never touches
    another column of the hot table.

    PARTIAL: write the normalised output (fp32) and its log-sum-exp
    (natural log; -inf for a split that saw no key) at split * so_s /
    sl_s, for merge_splits_kernel; else the final output in o's dtype."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    qpos = seq_len - 1

    g = tl.arange(0, ROWS)
    row_ok = g < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + (h * G + g)[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if ROTATE:
        qr = (_dot(q, tl.load(rot_ptr + d[:, None] * D + d[None, :]), F32) * q_scale).to(q.dtype)
    else:
        qr = q

    # -1e30: a finite "minus infinity" (no inf - inf NaNs).
    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    if split < splits:
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(qpos - window + 1, 0)
        hi = seq_len
        if HOT:
            lo = BLOCK_SIZE
            hi = qpos // BLOCK_SIZE * BLOCK_SIZE
        n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
        per_split = tl.cdiv(n_tiles, splits)
        i_first = split * per_split
        i_last = tl.minimum(i_first + per_split, n_tiles)
        m, l, acc = _decode_range(qr, m, l, acc, lo, hi, i_first, i_last, bt_row, bt_row,
                                  k_data, k_scale, k_cb, v_data, v_scale, v_cb, h,
                                  ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                                  BLOCK_SIZE, D, BLOCK_N, K_KIND, K_BITS, K_GROUP,
                                  V_KIND, V_BITS, V_GROUP, False, F32)
    elif HOT:
        hbt_row = hbt_ptr + b.to(tl.int64) * s_hbt
        vt_row = hbt_row if HOT == 2 else bt_row
        # The sinks [0, min(BLOCK_SIZE, seq_len)), then the own block from
        # max(its start, BLOCK_SIZE) (empty while the query is in block 0).
        m, l, acc = _decode_range(qr, m, l, acc, 0, tl.minimum(seq_len, BLOCK_SIZE), 0,
                                  tl.cdiv(BLOCK_SIZE, BLOCK_N), hbt_row, vt_row,
                                  hk_data, hk_scale, hk_data, hv_data, hv_scale, hv_cb, h,
                                  hks_slot, hks_h, hksc_slot, hksc_h, hvs_slot, hvs_h, hvsc_slot, hvsc_h,
                                  BLOCK_SIZE, D, BLOCK_N, 1, 8, D, HV_KIND, HV_BITS, HV_GROUP,
                                  HOT == 1, F32)
        own = tl.maximum(qpos // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE)
        m, l, acc = _decode_range(qr, m, l, acc, own, seq_len, 0, tl.cdiv(tl.maximum(seq_len - own, 0), BLOCK_N),
                                  hbt_row, vt_row,
                                  hk_data, hk_scale, hk_data, hv_data, hv_scale, hv_cb, h,
                                  hks_slot, hks_h, hksc_slot, hksc_h, hvs_slot, hvs_h, hvsc_slot, hvsc_h,
                                  BLOCK_SIZE, D, BLOCK_N, 1, 8, D, HV_KIND, HV_BITS, HV_GROUP,
                                  HOT == 1, F32)

    # A row (or split) that saw no key: output 0, log-sum-exp -inf.
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    if ROTATE:
        rot_t = tl.load(rot_ptr + d[None, :] * D + d[:, None])
        o_hi = out.to(q.dtype)
        o_rot = _dot(o_hi, rot_t, F32)
        if not F32:
            # The rest (lo) too: ~16 bits of mantissa through the 16-bit dot instead of 8 (bf16).
            o_rot += _dot((out - o_hi.to(tl.float32)).to(q.dtype), rot_t, F32)
        out = o_rot * o_scale
    o_row = o_ptr + split * so_s + b.to(tl.int64) * so_b + (h * G + g) * so_h
    tl.store(o_row[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    if PARTIAL:
        lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * LN2, -float("inf"))
        tl.store(lse_ptr + split * sl_s + b.to(tl.int64) * sl_b + (h * G + g) * sl_h, lse, mask=row_ok)


@triton.jit
def _int8_new_or_stored(new, rows, n_data, n_scale, sn_t, sn_h, snc_t, snc_h,
                        data, scale, slots, s_slot, s_h, sc_slot, sc_h, h, mask, D: tl.constexpr):
    """int8 rows times their scales -> [N, D] float32, each key's from one of
    two sources: the step's new rows (row `rows`) where `new`, else the store
    (row `slots`). The row pointer is chosen, then loaded once (two masked
    loads summed need more registers)."""
    return _int8_rows(tl.where(new, n_data + rows * sn_t + h * sn_h, data + slots * s_slot + h * s_h),
                      tl.where(new, n_scale + rows * snc_t + h * snc_h, scale + slots * sc_slot + h * sc_h), mask, D)


@triton.jit
def _prefill_ranges(q, m, l, acc, lo, hi, lo2, hi2, qpos, klim, own, bt_row, vbt_row, window, sink,
                    k_data, k_scale, k_cb, v_data, v_scale, v_cb, h,
                    ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                    ctx, q_start, nk_data, nk_scale, nks_t, nks_h, nksc_t, nksc_h,
                    nv_data, nv_scale, nvs_t, nvs_h, nvsc_t, nvsc_h,
                    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, F32: tl.constexpr, PART: tl.constexpr,
                    V_TABLE: tl.constexpr, NEW_ROWS: tl.constexpr):
    """Online softmax (base 2) of one prefill row tile over the keys [lo, hi)
    then [lo2, hi2) (one loop: a second inlined loop body spills registers),
    K through bt_row and V through vbt_row when V_TABLE (else the same
    blocks), with each row's causal (up to klim: its position, or its key
    limit), window and part masks (rows of one tile sit at different
    positions, in different blocks). NEW_ROWS: keys
    at positions >= ctx, the sequence's new tokens, come from the step's
    hot K rows (nk, int8, row q_start + position - ctx) instead of the
    blocks, and with NEW_ROWS 2 (hot "kv") their values from the hot V rows
    nv alike (a HOT pass whose chunk passes through blocks the hot group
    does not hold; with hot "k" its coded values are all in their blocks)."""
    n1 = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    n_tiles = n1 + tl.cdiv(tl.maximum(hi2 - lo2, 0), BLOCK_N)
    for i in range(0, n_tiles):
        in1 = i < n1
        kpos = tl.where(in1, lo + i * BLOCK_N, lo2 + (i - n1) * BLOCK_N) + tl.arange(0, BLOCK_N)
        kmask = kpos < tl.where(in1, hi, hi2)
        slots, vslots = _slots(bt_row, vbt_row, kpos, kmask, BLOCK_SIZE, V_TABLE)
        if NEW_ROWS:
            new = kpos >= ctx
            rows = (q_start + kpos - ctx).to(tl.int64)
            k = _int8_new_or_stored(new, rows, nk_data, nk_scale, nks_t, nks_h, nksc_t, nksc_h,
                                    k_data, k_scale, slots, ks_slot, ks_h, ksc_slot, ksc_h, h, kmask, D)
        else:
            k = _load_tile(k_data, k_scale, k_cb, slots, h, kmask, ks_slot, ks_h, ksc_slot, ksc_h,
                           K_KIND, K_BITS, K_GROUP, BLOCK_N, D)
        s = _dot(q, tl.trans(k), F32)
        valid = (kpos[None, :] <= klim[:, None]) & kmask[None, :]
        if HAS_WINDOW:
            valid = valid & (kpos[None, :] > qpos[:, None] - window)
        if PART == 1:       # CODED
            valid = valid & (kpos[None, :] >= sink) & (kpos[None, :] < own[:, None])
        elif PART == 2:     # HOT
            valid = valid & ((kpos[None, :] < sink) | (kpos[None, :] >= own[:, None]))
        p, alpha, m, l = _online(s, valid, m, l)
        if NEW_ROWS == 2:
            v = _int8_new_or_stored(new, rows, nv_data, nv_scale, nvs_t, nvs_h, nvsc_t, nvsc_h,
                                    v_data, v_scale, vslots, vs_slot, vs_h, vsc_slot, vsc_h, h, kmask, D)
        else:
            v = _load_tile(v_data, v_scale, v_cb, vslots, h, kmask, vs_slot, vs_h, vsc_slot, vsc_h,
                           V_KIND, V_BITS, V_GROUP, BLOCK_N, D)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, F32)
    return m, l, acc


@triton.jit(do_not_specialize=["seq0", "s_bt", "s_vbt", "window", "sink"])
def tq_attn_kernel(q_ptr, o_ptr, lse_ptr, bt_ptr, vbt_ptr, qsl_ptr, seq_len_ptr, klim_ptr, seq0,
                   k_data, k_scale, k_cb, v_data, v_scale, v_cb, nk_data, nk_scale, nv_data, nv_scale,
                   sq_t, sq_h, sq_g, so_t, so_h, so_g, sl_t, sl_h, sl_g, s_bt, s_vbt,
                   ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                   nks_t, nks_h, nksc_t, nksc_h, nvs_t, nvs_h, nvsc_t, nvsc_h, window, sink,
                   G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   D: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                   V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, F32: tl.constexpr, PART: tl.constexpr,
                   V_TABLE: tl.constexpr, NEW_ROWS: tl.constexpr, HAS_LIMITS: tl.constexpr):
    """Chunked prefill over compressed blocks: grid (row tiles, sequences,
    KV heads). A program takes ROWS (token, query head) rows, token-major,
    of sequence seq0 + program_id(1), whose queries are rows
    [qsl[b], qsl[b + 1]) of q (rotated, scaled) and the last of its
    seq_len[b] positions. PART (tq_cache ALL / CODED / HOT) picks the keys a
    query at position p sees besides the causal and window masks: ALL every
    one; CODED those in [sink, own(p)), own(p) the start of p's block; HOT
    the rest: [0, sink) and [own(p), p], K (and V) from the hot copies
    through bt_ptr. HOT reads the hot table at column 0 and the columns
    its rows sit in: the hot group holds the first new token's block and
    the last one's (kv_manager), not a long chunk's middle ones, so with
    NEW_ROWS the new tokens' keys come from the step's hot K rows nk
    ([T, H, D] as the flat batch) instead, and with NEW_ROWS 2 (hot "kv")
    their values from the hot V rows nv. Keys through bt_ptr,
    values through vbt_ptr when V_TABLE (HOT with hot "k": coded values).
    HAS_LIMITS: token row i sees keys up to klim[i] (a bidirectional span)
    instead of its position, the window still counting from its position;
    HOT then covers [own(p), klim] (the keys past p are in the chunk: the
    hot pool's last block or the new rows). Writes the rotated output and
    its log-sum-exp (natural log)."""
    tile = tl.program_id(0)
    b = seq0 + tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    ctx = seq_len - q_len                       # position of the first query token

    # Rows of this tile: (token, query head) pairs, token-major.
    r = tile * ROWS + tl.arange(0, ROWS)
    t = r // G
    g = r % G
    row_ok = t < q_len
    qpos = ctx + t
    own = qpos // BLOCK_SIZE * BLOCK_SIZE       # each row's block start
    d = tl.arange(0, D)
    tok = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * sq_t + h * sq_h + g[:, None] * sq_g + d[None, :],
                mask=row_ok[:, None], other=0.0)

    # Each row's last key; the key range this tile can see: [lo, hi).
    p_min = ctx + (tile * ROWS) // G
    p_max = tl.minimum(ctx + (tile * ROWS + ROWS - 1) // G, seq_len - 1)
    k_max = p_max
    klim = qpos
    if HAS_LIMITS:
        klim = tl.load(klim_ptr + tok, mask=row_ok, other=0).to(tl.int32)
        # The tile's tokens' largest limit from a load of its own: reducing
        # klim in the rows' layout spills registers in the loop (sm_90, hot
        # "kv" at head_dim 256).
        tt = (tile * ROWS) // G + tl.arange(0, ROWS)
        tt_ok = (tt <= (tile * ROWS + ROWS - 1) // G) & (tt < q_len)
        k_max = tl.maximum(p_max, tl.max(tl.load(klim_ptr + q_start + tt, mask=tt_ok, other=0).to(tl.int32), 0))
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p_min - window + 1, 0)
    hi = tl.where(p_min <= p_max, k_max + 1, lo)       # empty for a tile past the queries

    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    vbt_row = vbt_ptr + b.to(tl.int64) * s_vbt
    lo2 = lo                                            # a second range: HOT only
    hi2 = lo
    if PART == 2:
        # The sinks, then the first row's own block on (from block 1: disjoint).
        lo2 = tl.maximum(p_min // BLOCK_SIZE * BLOCK_SIZE, sink)
        hi2 = hi
        hi = tl.minimum(hi, sink)
    elif PART == 1:                                     # CODED: [sink, last row's own block), below any limit
        lo = tl.maximum(lo, sink)
        hi = tl.minimum(hi, p_max // BLOCK_SIZE * BLOCK_SIZE)
    m, l, acc = _prefill_ranges(q, m, l, acc, lo, hi, lo2, hi2, qpos, klim, own, bt_row, vbt_row, window,
                                sink, k_data, k_scale, k_cb, v_data, v_scale, v_cb, h,
                                ks_slot, ks_h, ksc_slot, ksc_h, vs_slot, vs_h, vsc_slot, vsc_h,
                                ctx, q_start, nk_data, nk_scale, nks_t, nks_h, nksc_t, nksc_h,
                                nv_data, nv_scale, nvs_t, nvs_h, nvsc_t, nvsc_h,
                                BLOCK_SIZE, BLOCK_N, D, K_KIND, K_BITS, K_GROUP, V_KIND, V_BITS, V_GROUP,
                                HAS_WINDOW, F32, PART, V_TABLE, NEW_ROWS)

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    o_row = o_ptr + tok * so_t + h * so_h + g * so_g
    tl.store(o_row[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * LN2, -float("inf"))
    tl.store(lse_ptr + tok * sl_t + h * sl_h + g * sl_g, lse, mask=row_ok)
