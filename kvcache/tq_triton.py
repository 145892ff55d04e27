"""Triton attention over TurboQuant-compressed paged KV blocks: the GPU
counterpart of TQLayerCache's torch path (same math, tested against it with
Triton's interpreter on CPU), the tq-triton backend (default for TurboQuant
caches on CUDA).

Decode (tq_paged_decode) is one launch, two with split-K
(tq_triton_kernels.tq_decode_kernel, then dense-triton's
merge_splits_kernel). A program takes one sequence's KV head with all of its
G query heads as rows, rotates the queries itself (a dot with the +-1
Hadamard-and-signs matrix, Codec.rot_pm1), walks its share of the key range
through the block table decoding each tile in registers (bytes loaded once
per row, codes split off by shifts, codebook lookup, fp16 norm; int8 times
its scale; fp16), keeps an online softmax, and de-rotates its normalised
output before writing it. With hot tokens one more program per (sequence,
KV head) is the HOT pass over the int8 copies of block 0 and the query's
own block, merged with the coded splits by log-sum-exp like any other
split. Nothing is materialised uncompressed, no host value is read and no
tensor is built from Python data, so a decode step can be captured in a
CUDA graph. head_dim above 128 rotates in torch (one matmul each way): its
[D, D] rotation would not fit the kernel's shared memory.

Prefill (tq_prefill) is one launch for every prefilling sequence of the
step (varlen through query_start_loc) over rotated queries, with a part
rule: ALL, or with hot tokens the CODED pass and a HOT one (a second
launch), merged by log-sum-exp. The hot pool holds block 0 and a chunk's
first and last blocks, which is every hot key of a span of up to
block_size + 1 tokens (speculative verification, short prompt tails): then
the HOT launch reads only the pool. A longer chunk passes through blocks
without a hot copy: the step's store (tq_store, the same one launch) then
also writes every new token's int8 hot rows in batch order, and the HOT
launch reads the new tokens' keys (and with hot "kv" values) from those
rows, each key's row pointer from its one source. Either way the step
stores in one launch with no host sync (capturable). Key limits
(bidirectional spans: a row sees keys up to its limit, not its position)
are one more per-row load in the ALL and HOT launches.

triton is imported on first use: importing kvcache never needs it.
"""
import torch

from kvcache.backends import AttentionBackend, register_backend
from kvcache.dense_triton import decode_splits
from kvcache.tq_cache import ALL, CODED, HOT, merge

_KIND = {"f16": 0, "int8": 1, "tq": 2}
_HOT = {"": 0, "k": 1, "kv": 2}
ROTATE_MAX_D = 128       # [D, D] 16-bit rotation: 32 KiB of shared memory at 128


def _kernels():
    from kvcache.dense_triton_kernels import merge_splits_kernel    # imports triton
    from kvcache.tq_triton_kernels import tq_attn_kernel, tq_decode_kernel
    return tq_decode_kernel, merge_splits_kernel, tq_attn_kernel


_CB: dict = {}


def _component(codec, store, device):
    """Kernel arguments for one component: (data, scale, codebook, strides, constexprs)."""
    kind = codec.fmt.kind
    data = store["x"] if kind == "f16" else store["q"] if kind == "int8" else store["codes"]
    scale = store.get("scale", data)
    if kind == "tq":
        key = (id(codec.codebook), str(device))
        if key not in _CB:     # the codebook is lru_cached per (bits, group): one copy per device
            _CB[key] = codec.codebook.to(device=device, dtype=torch.float32)
        cb, bits, group = _CB[key], codec.fmt.bits, codec.group
    else:
        cb, bits, group = data, codec.fmt.bits, codec.D
    return (data, scale, cb, (data.stride(0), data.stride(1), scale.stride(0), scale.stride(1)),
            (_KIND[kind], bits, group))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def decode_tiles(D: int):
    """(keys per tile, warps, pipeline stages) of a decode program: for
    16-bit queries, no register spills and shared memory within GB10's
    99 KiB for every format (checked by compiling for sm_90 and sm_121:
    tests/test_tq_triton.py); fp32 queries (tests, debugging) spill. Not
    tuned on a GPU yet: tests/bench/tq_triton_gpu.py --sweep times others."""
    return (32, 8, 2) if D <= 128 else (16, 8, 2) if D <= 256 else (16, 8, 1)


def _rotate(cache, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[..., D] -> rotated (and scaled), in x's dtype (TQLayerCache._rotate_q's rounding)."""
    return ((x.float() @ cache.kc.rot_t(x.device)) * scale).to(x.dtype)


def _derotate(cache, y: torch.Tensor, dtype) -> torch.Tensor:
    return (y.float() @ cache.kc.rot_t(y.device).T).to(dtype)


def tq_paged_decode(cache, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    hot_tables: torch.Tensor | None = None, num_splits: int | None = None,
                    block_n: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its compressed blocks, rotation,
    hot pass and de-rotation included.

    cache: a TQLayerCache; q: [B, Hq, D] unrotated queries (last dim
    contiguous); block_tables: [B, W] integer; seq_lens: [B] integer on q's
    device (context incl. the token being decoded; 0: the row sees nothing,
    output 0); hot_tables: the hot group's tables [B, W] when cache.hot
    (only column 0 and each query's own column are read); num_splits: coded
    key splits (None: enough programs to fill the GPU, from host ints
    only). Returns out [B, Hq, D] in q's dtype (written into `out` if given).
    """
    kernel, merge_kernel, _ = _kernels()
    B, Hq, D = q.shape
    H, bs = cache.num_kv_heads, cache.block_size
    G = Hq // H
    assert Hq == G * H and D == cache.head_dim and q.stride(2) == 1
    dev = q.device
    f32 = q.dtype == torch.float32
    hot = _HOT[cache.hot]
    assert not hot or hot_tables is not None, "hot tokens need the hot group's block tables"
    rotate = D <= ROTATE_MAX_D
    bn, warps, stages = decode_tiles(D)
    bn = block_n or bn
    span = block_tables.shape[1] * bs                  # a bound on the keys read: no sync on seq_lens
    if cache.sliding_window is not None:
        span = min(span, cache.sliding_window)
    splits = num_splits or decode_splits(B, H, max(span - cache.sink, 1), bn, dev)
    S = splits + (1 if hot else 0)
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    if rotate:
        qk, rot, q_scale, o_scale = q, cache.kc.rot_pm1(dev, q.dtype), scale * D ** -0.5, D ** -0.5
        target = out
    else:
        qk, rot, q_scale, o_scale = _rotate(cache, q, scale), q, 1.0, 1.0
        target = torch.empty_like(q)                   # rotated-domain output, de-rotated below
    if S == 1:
        o, lse = target, target
        o_st, l_st = (0, target.stride(0), target.stride(1)), (0, 0, 0)
    else:
        o = torch.empty(S, B, Hq, D, dtype=torch.float32, device=dev)
        lse = torch.empty(S, B, Hq, dtype=torch.float32, device=dev)
        o_st, l_st = o.stride()[:3], lse.stride()
    kd, ks, kcb, kst, kce = _component(cache.kc, cache.k, dev)
    vd, vs, vcb, vst, vce = _component(cache.vc, cache.v, dev)
    if hot:
        hkd, hks, _, hkst, _ = _component(cache.hkc, cache.hk, dev)
        hvc, hvstore = (cache.hvc, cache.hv) if cache.hot == "kv" else (cache.vc, cache.v)
        hvd, hvs, hvcb, hvst, hvce = _component(hvc, hvstore, dev)
        ht = hot_tables
    else:
        hkd, hks, hkst, hvd, hvs, hvcb, hvst, hvce, ht = kd, ks, kst, vd, vs, vcb, vst, vce, block_tables
    win = cache.sliding_window
    kernel[(B, H, S)](
        qk, rot, o, lse, block_tables, ht, seq_lens,
        kd, ks, kcb, vd, vs, vcb, hkd, hks, hvd, hvs, hvcb,
        qk.stride(0), qk.stride(1), *o_st, *l_st, block_tables.stride(0), ht.stride(0),
        *kst, *vst, *hkst, *hvst, win or 0, q_scale, o_scale, splits,
        G=G, BLOCK_SIZE=bs, D=D, ROWS=max(16, _next_pow2(G)), BLOCK_N=bn,
        K_KIND=kce[0], K_BITS=kce[1], K_GROUP=kce[2], V_KIND=vce[0], V_BITS=vce[1], V_GROUP=vce[2],
        HOT=hot, HV_KIND=hvce[0], HV_BITS=hvce[1], HV_GROUP=hvce[2], HAS_WINDOW=win is not None,
        F32=f32, ROTATE=rotate, PARTIAL=S > 1, num_warps=warps, num_stages=stages)
    if S > 1:
        merge_kernel[(B, Hq)](o, lse, target, target, *o.stride()[:3], *lse.stride(),
                              target.stride(0), target.stride(1), 0, 0, S,
                              S_PAD=max(2, _next_pow2(S)), D=D, D_PAD=D, WRITE_LSE=False,
                              num_warps=1 if D <= 64 else 2)
    if not rotate:
        out.copy_(_derotate(cache, target, q.dtype))
    return out


def prefill_tiles(D: int, part: int = ALL):
    """(rows, keys per tile, warps, stages) of a prefill program, chosen as
    decode_tiles'. A HOT pass serves short spans ((1 + k) x G rows for a
    verification step), keeps two key ranges live and reads at most a block
    or two of keys per range: half the rows, 16 keys a tile (32 spills
    registers on sm_90 with int8 values from two sources, hot "kv")."""
    rows, bn, warps, stages = (64, 32, 8, 2) if D <= 128 else (32, 16, 8, 2) if D <= 256 else (16, 16, 8, 1)
    if part == HOT:
        return max(16, rows // 2), 16, warps, stages
    return rows, bn, warps, stages


def tq_prefill(cache, qr: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, max_query_len: int, first_seq: int = 0,
               num_seqs: int | None = None, part: int = ALL, hot_tables: torch.Tensor | None = None,
               new_rows: tuple | None = None, rows: int | None = None, block_n: int | None = None,
               key_limits: torch.Tensor | None = None):
    """Causal (and windowed) attention of several sequences' new tokens over
    their compressed prefix, which already holds those tokens: one launch.

    qr: [T, Hq, D] rotated, scaled queries (the flat batch); sequence i
    (first_seq <= i < first_seq + num_seqs, default all) owns rows
    [query_start_loc[i], query_start_loc[i + 1]) and is the last of its
    seq_lens[i] positions; block_tables [B, W], seq_lens [B],
    query_start_loc [B + 1]: integer tensors on qr's device; max_query_len:
    a host bound on those sequences' row counts (sizes the grid). part:
    tq_cache ALL, CODED or HOT (hot_tables: the hot group's [B, W]). HOT
    reads the hot copies of block 0 and of the blocks its queries sit in;
    the hot group holds a chunk's first and last blocks, so that is right
    for sequences of at most block_size + 1 new tokens. A longer chunk
    passes through blocks the hot group skips: new_rows, the step's rows as
    tq_store(new_rows=True) or TQLayerCache.write return them ([T, H, ...]
    as the flat batch), supply every new token's int8 key, and with hot
    "kv" its int8 value (with "k" its coded value is in its block).
    key_limits: [T] integer on qr's device, the last key each row sees
    (bidirectional spans: AttentionMetadata.key_limits_t; None: its own
    position); with HOT the keys past a row's position are read hot too.
    Returns (rotated output [T, Hq, D] in qr's dtype, log-sum-exp [T, Hq]
    float32, -inf with output 0 for a row that sees no key); only those
    sequences' rows are written.
    """
    assert part in (ALL, CODED, HOT)
    assert part != HOT or hot_tables is not None, "a HOT pass reads the hot group's block tables"
    _, _, kernel = _kernels()
    T, Hq, D = qr.shape
    H = cache.num_kv_heads
    G = Hq // H
    assert D == cache.head_dim and Hq == G * H
    dev = qr.device
    n_seqs = query_start_loc.shape[0] - 1 - first_seq if num_seqs is None else num_seqs
    r, bn, warps, stages = prefill_tiles(D, part)
    rows, bn = rows or r, block_n or bn
    out = torch.empty_like(qr)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=dev)
    n_tiles = -(-max_query_len * G // rows)
    if n_seqs <= 0 or n_tiles <= 0:
        return out, lse
    kc, k, vc, v = cache.part_stores(part)
    kd, ks, kcb, kst, kce = _component(kc, k, dev)
    vd, vs, vcb, vst, vce = _component(vc, v, dev)
    kt, vt = (hot_tables, cache.hot_v_tables(hot_tables, block_tables)) if part == HOT else (block_tables,) * 2
    nkd, nks, nkst = nvd, nvs, nvst = kd, ks, kst
    new = 0
    if new_rows is not None:
        assert part == HOT, "new rows serve a HOT pass"
        new = _HOT[cache.hot]                   # 1: new keys; 2 ("kv"): new keys and values
        nkd, nks, _, nkst, _ = _component(kc, new_rows[0], dev)
        if new == 2:
            nvd, nvs, _, nvst, _ = _component(vc, new_rows[1], dev)
    win = cache.sliding_window
    # Query head h * G + g of token t sits at t * stride(0) + (h * G + g) * stride(1).
    kernel[(n_tiles, n_seqs, H)](
        qr, out, lse, kt, vt, query_start_loc, seq_lens, seq_lens if key_limits is None else key_limits, first_seq,
        kd, ks, kcb, vd, vs, vcb, nkd, nks, nvd, nvs,
        qr.stride(0), G * qr.stride(1), qr.stride(1), out.stride(0), G * out.stride(1), out.stride(1),
        lse.stride(0), G * lse.stride(1), lse.stride(1), kt.stride(0), vt.stride(0),
        *kst, *vst, *nkst, *nvst, win or 0, cache.sink, G=G, BLOCK_SIZE=cache.block_size, D=D, ROWS=rows,
        BLOCK_N=bn, K_KIND=kce[0], K_BITS=kce[1], K_GROUP=kce[2], V_KIND=vce[0], V_BITS=vce[1], V_GROUP=vce[2],
        HAS_WINDOW=win is not None, F32=qr.dtype == torch.float32, PART=part, V_TABLE=vt is not kt,
        NEW_ROWS=new, HAS_LIMITS=key_limits is not None, num_warps=warps, num_stages=stages)
    return out, lse


@register_backend("tq-triton", "tq")
class TQTritonBackend(AttentionBackend):
    """A step in two to four launches: the decodes (one batched launch, plus
    the split merge), every prefill chunk's coded keys (one launch), and
    with hot tokens their HOT pass (one more). The new K/V go in with one
    more (kvcache/tq_store.py), which also keeps the new tokens' int8 rows
    for the HOT launch when a chunk is longer than hot_span_rows. No host
    sync: decode-only and verification steps can be captured. Key limits
    (bidirectional spans) reach the ALL and HOT launches; the CODED one
    needs none (its keys lie below each query's own block)."""
    capturable = True
    supports_key_limits = True

    def hot_span_rows(self, cache) -> int:
        """Rows per sequence whose HOT pass reads only the hot pool: block_size
        + 1 new tokens sit in at most two blocks, the two the hot group holds
        besides block 0 (kvcache/kv_manager.py)."""
        return cache.block_size + 1

    def store(self, cache, slot_mapping, k, v, hot_slots=None):
        from kvcache.tq_store import tq_store
        tq_store(cache, slot_mapping, k, v, hot_slots)
        return True

    def store_new_rows(self, cache, slot_mapping, k, v, hot_slots):
        """The store, keeping the new tokens' int8 hot rows (K; V with "kv")."""
        from kvcache.tq_store import tq_store
        return tq_store(cache, slot_mapping, k, v, hot_slots, new_rows=True)

    def forward(self, cache, q, meta, scale):
        group = meta.groups[cache.group_id]
        hot = meta.groups[cache.extra_groups[0]].block_tables if cache.hot else None
        out = torch.empty_like(q)
        nd, B = meta.num_decodes, meta.num_seqs
        if nd:
            tq_paged_decode(cache, q[:nd], group.block_tables[:nd], meta.seq_lens_t[:nd], scale,
                            None if hot is None else hot[:nd], out=out[:nd])
        if B > nd:
            self._prefills(cache, q, scale, out, group.block_tables, hot, meta.seq_lens_t, meta.query_start_loc_t,
                           meta.query_start_loc, nd, meta.max_query_len,
                           cache.new_rows if cache.reads_new_rows(meta) else None, meta.key_limits_t)
        return out

    def _prefills(self, cache, q, scale, out, block_tables, hot_tables, seq_lens_t, qsl_t, qsl, first,
                  max_query_len, new_rows, key_limits=None):
        """Sequences first.. of the flat batch, each a chunk over its prefix;
        new_rows: the step's rows from store() when a chunk is longer than
        hot_span_rows (None: none is); key_limits: [T] as the flat batch."""
        t0 = qsl[first]
        qr = torch.empty_like(q)
        qr[t0:] = _rotate(cache, q[t0:], scale)
        o, lse = tq_prefill(cache, qr, block_tables, seq_lens_t, qsl_t, max_query_len, first_seq=first,
                            part=CODED if cache.hot else ALL, key_limits=None if cache.hot else key_limits)
        if not cache.hot:
            out[t0:] = _derotate(cache, o[t0:], q.dtype)
            return
        ho, hlse = tq_prefill(cache, qr, block_tables, seq_lens_t, qsl_t, max_query_len, first_seq=first,
                              part=HOT, hot_tables=hot_tables, new_rows=new_rows, key_limits=key_limits)
        out[t0:] = _derotate(cache, merge(o[t0:], lse[t0:], ho[t0:], hlse[t0:]), q.dtype)

    def decode(self, cache, q, block_tables, seq_lens, scale, hot_tables=None):
        return tq_paged_decode(cache, q, block_tables, seq_lens.to(q.device), scale, hot_tables)

    def prefill(self, cache, q, block_table, seq_len, scale, hot_table=None, key_limit=None):
        dev = q.device
        out = torch.empty_like(q)
        # One sequence: the next prefill of the step's rows from store(), as tq-torch reads them.
        rows = cache.next_chunk_rows() if cache.hot and q.shape[0] > self.hot_span_rows(cache) else None
        self._prefills(cache, q, scale, out, block_table[None], None if hot_table is None else hot_table[None],
                       torch.tensor([seq_len], device=dev), torch.tensor([0, q.shape[0]], device=dev),
                       [0, q.shape[0]], 0, q.shape[0], rows, key_limit)
        return out
