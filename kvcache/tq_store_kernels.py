"""The Triton kernel behind kvcache.tq_store (see there). A module of its own
because it imports triton at import time: only tq_store loads it, on first
use.

Every division and square root is the correctly rounded one (tl.div_rn,
tl.sqrt_rn): Triton's plain `/` on fp32 is div.full.f32 (approximate, up to
2 ulp) and tl.sqrt sqrt.approx, while torch's are IEEE; int8 rows would not
match torch's bit for bit otherwise."""
import triton
import triton.language as tl

KIND_F16 = tl.constexpr(0)
KIND_INT8 = tl.constexpr(1)
KIND_TQ = tl.constexpr(2)
# fp32 x + 1.5 * 2**23 lands in [2**23, 2**24), where the spacing is 1: the
# add rounds x to an integer, to nearest even (the hardware mode), as
# torch.round does; valid for |x| < 2**22. libdevice's rint would do, but the
# interpreter has no extern functions.
RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _store_f16(y_row, x_row, D: tl.constexpr):
    d = tl.arange(0, D)
    y = tl.load(y_row + d)
    tl.store(x_row + d, y.to(tl.float16))     # fptrunc: round to nearest even (interpreter: numpy's astype, too)


@triton.jit
def _store_int8(y_row, q_row, s_row, D: tl.constexpr):
    """Codec.quantize_rotated's int8: s = max|y| / 127, q = round(y / s) in
    [-127, 127] (0 where s == 0), s stored fp16."""
    d = tl.arange(0, D)
    y = tl.load(y_row + d)
    s = tl.div_rn(tl.max(tl.abs(y), 0), 127.0)
    x = tl.div_rn(y, tl.where(s > 0, s, 1.0))
    r = (x + RNE_MAGIC) - RNE_MAGIC
    q = tl.where(s > 0, tl.minimum(tl.maximum(r, -127.0), 127.0), 0.0)
    tl.store(q_row + d, q.to(tl.int8))
    tl.store(s_row, s.to(tl.float16))


@triton.jit
def _store_tq(y_row, c_row, s_row, cb_ptr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Codec.quantize_rotated's TurboQuant: per norm group, u = y / |y|,
    code = the number of bounds strictly below u (torch.bucketize, right=False),
    scale = |y| / |codebook[codes]| stored fp16; codes packed 8 to a
    BITS-byte little-endian word (pack_bits). cb_ptr: the 2**BITS centroids,
    then the 2**BITS - 1 bounds (fp32)."""
    NG: tl.constexpr = D // GROUP          # norm groups
    GW: tl.constexpr = GROUP // 8          # 8-code words per group
    NLEV: tl.constexpr = 1 << BITS
    g = tl.arange(0, NG)[:, None, None]
    w = tl.arange(0, GW)[None, :, None]
    i = tl.arange(0, 8)[None, None, :]
    y = tl.load(y_row + g * GROUP + w * 8 + i)                   # [NG, GW, 8]
    norm = tl.sqrt_rn(tl.sum(tl.sum(y * y, 2), 1))               # [NG]
    u = tl.div_rn(y, tl.maximum(norm, 1e-30)[:, None, None])
    code = tl.zeros([NG, GW, 8], tl.int32)
    rec = tl.zeros([NG, GW, 8], tl.float32) + tl.load(cb_ptr)
    for j in tl.static_range(NLEV - 1):     # bounds ascending: rec ends as codebook[code]
        above = u > tl.load(cb_ptr + NLEV + j)
        code += above.to(tl.int32)
        rec = tl.where(above, tl.load(cb_ptr + j + 1), rec)
    rnorm = tl.sqrt_rn(tl.sum(tl.sum(rec * rec, 2), 1))
    scale = tl.div_rn(norm, tl.maximum(rnorm, 1e-30))
    tl.store(s_row + tl.arange(0, NG), scale.to(tl.float16))
    # Disjoint bit fields: the sum is their OR. int64: 8 codes of 5 bits are 40 bits.
    word = tl.sum(code.to(tl.int64) << (BITS * i).to(tl.int64), 2)     # [NG, GW]
    base = (tl.arange(0, NG)[:, None] * GW + tl.arange(0, GW)[None, :]) * BITS
    for j in tl.static_range(BITS):
        tl.store(c_row + base + j, ((word >> (8 * j)) & 255).to(tl.uint8))


@triton.jit
def _store_part(y_row, d_row, s_row, cb_ptr, D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr):
    if KIND == KIND_TQ:
        _store_tq(y_row, d_row, s_row, cb_ptr, D, BITS, GROUP)
    elif KIND == KIND_INT8:
        _store_int8(y_row, d_row, s_row, D)
    else:
        _store_f16(y_row, d_row, D)


@triton.jit
def tq_store_kernel(yk_ptr, yv_ptr, slot_ptr, hot_slot_ptr, syk_t, syk_h, syv_t, syv_h,
                    kd_ptr, ks_ptr, kcb_ptr, skd_s, skd_h, sks_s, sks_h,
                    vd_ptr, vs_ptr, vcb_ptr, svd_s, svd_h, svs_s, svs_h,
                    hkd_ptr, hks_ptr, shkd_s, shkd_h, shks_s, shks_h,
                    hvd_ptr, hvs_ptr, shvd_s, shvd_h, shvs_s, shvs_h,
                    nkd_ptr, nks_ptr, nvd_ptr, nvs_ptr, snd_t, snd_h, sns_t, sns_h,
                    D: tl.constexpr, K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
                    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, HOT: tl.constexpr,
                    NEW_ROWS: tl.constexpr):
    """Grid (tokens, KV heads): token t's rotated K and V rows of head h
    (fp32 [D], yk / yv) into the K / V stores at row slot_mapping[t], and
    with HOT (1: "k", 2: "kv") the int8 hot copies (K, and with 2 also V) at
    row hot_slots[t]. A negative slot writes nothing (a padded row of a
    captured batch, a token without a hot block). NEW_ROWS (1: K, 2: K and
    V): every token's int8 hot rows also at row t of nk / nv ([T, H, D]
    int8, [T, H, 1] fp16 scales, both with the strides snd / sns), where a
    HOT prefill pass reads the new tokens a chunk's middle blocks hold."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    yk_row = yk_ptr + t.to(tl.int64) * syk_t + h * syk_h
    yv_row = yv_ptr + t.to(tl.int64) * syv_t + h * syv_h
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _store_part(yk_row, kd_ptr + slot * skd_s + h * skd_h, ks_ptr + slot * sks_s + h * sks_h, kcb_ptr,
                    D, K_KIND, K_BITS, K_GROUP)
        _store_part(yv_row, vd_ptr + slot * svd_s + h * svd_h, vs_ptr + slot * svs_s + h * svs_h, vcb_ptr,
                    D, V_KIND, V_BITS, V_GROUP)
    if HOT > 0:
        hs = tl.load(hot_slot_ptr + t).to(tl.int64)
        if hs >= 0:
            _store_int8(yk_row, hkd_ptr + hs * shkd_s + h * shkd_h, hks_ptr + hs * shks_s + h * shks_h, D)
            if HOT == 2:
                _store_int8(yv_row, hvd_ptr + hs * shvd_s + h * shvd_h, hvs_ptr + hs * shvs_s + h * shvs_h, D)
    if NEW_ROWS > 0:
        row = t.to(tl.int64)
        _store_int8(yk_row, nkd_ptr + row * snd_t + h * snd_h, nks_ptr + row * sns_t + h * sns_h, D)
        if NEW_ROWS == 2:
            _store_int8(yv_row, nvd_ptr + row * snd_t + h * snd_h, nvs_ptr + row * sns_t + h * sns_h, D)
