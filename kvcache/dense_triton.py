"""Triton paged attention over the dense KV formats (f32 / f16 / bf16
storage, DenseLayerCache): the dense-triton backend, the default for dense
caches on CUDA. Same math as dense-torch (dense_cache.py), which it is
tested against with Triton's interpreter on CPU (tests/test_dense_triton.py).

One kernel (dense_triton_kernels.dense_paged_attn_kernel) serves both:
- decode: one query token per sequence, one launch for the batch; a program
  holds the G query heads of one KV head (GQA: each K/V tile is loaded once
  for all G), and with split-K (flash-decoding) a sequence's key range is cut
  over several programs whose partial outputs a second kernel merges by
  log-sum-exp;
- chunked prefill: every prefilling sequence of the step in one launch
  (varlen through query_start_loc), causal over its paged prefix and the
  chunk itself (already written to the cache), or up to each row's key
  limit (bidirectional spans), tiles of (token, query head) rows.
Both read the block tables directly and honour a sliding window. The grids
come from host-side numbers only (batch size, KV heads, the block tables'
width as a bound on the keys, the longest prefill chunk: ints the model
runner computed from numpy), and nothing is read back: a decode launch
never syncs, so it can be captured in a CUDA graph.

triton is imported on the first kernel launch, never by importing this.
"""
import torch

from kvcache.backends import AttentionBackend, register_backend

LOG2E = 1.4426950408889634


def _kernels():
    from kvcache.dense_triton_kernels import dense_paged_attn_kernel, merge_splits_kernel   # imports triton
    return dense_paged_attn_kernel, merge_splits_kernel


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (last dim contiguous) into the caches' rows
    slot_mapping [T] in one launch; negative slots are skipped, with no sync
    (a padded CUDA-graph batch writes nothing for its pad rows)."""
    from kvcache.dense_triton_kernels import store_kv_kernel
    T, H, D = k.shape
    if T == 0:
        return
    store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                          v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                          H=H, H_PAD=_next_pow2(H), D=D, D_PAD=_next_pow2(D), num_warps=4 if H * D >= 2048 else 2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


def decode_splits(batch: int, kv_heads: int, max_keys: int, block_n: int, device) -> int:
    """Split-K factor for a decode: enough programs to fill the GPU (two
    waves), each with at least 4 key tiles; 1 off CUDA. Host ints only."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return max(1, min(-(-2 * _num_sms(device) // max(1, batch * kv_heads)), -(-max_keys // (4 * block_n)), 32))


def _tiles(D: int, decode: bool, G: int, f32: bool):
    """(rows, block_n, num_warps): rows of (token, query head) per program,
    keys per tile (tl.dot needs 16 at least on each side). Chosen so that
    ptxas reports no spills for sm_90 and sm_121 (fp32 queries over 16-bit
    storage excepted); not tuned on a GPU yet."""
    if decode:
        return max(16, _next_pow2(G)), (64 if D <= 128 else 32), (8 if f32 and D > 128 else 4)
    if f32:
        return (64, 32, 8) if D <= 128 else (32, 16, 8)
    return 64, (64 if D <= 64 else 32), (4 if D <= 128 else 8)


def _check(q, k_cache, v_cache, block_tables):
    assert q.dim() == 3 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape
    assert q.shape[-1] == k_cache.shape[-1] and q.shape[1] % k_cache.shape[1] == 0
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1


def dense_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int,
                       sliding_window: int | None = None, num_splits: int | None = None,
                       block_n: int | None = None, out: torch.Tensor | None = None, return_lse: bool = False):
    """One query token per sequence over its paged K/V.

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks * block_size, Hkv, D] (slot
    = block * block_size + offset), Hq = G * Hkv; block_tables: [B, W]
    integer (entries past a sequence's blocks are never read; freed ones
    must hold a valid block id, e.g. 0: they are masked by position);
    seq_lens: [B] integer on q's device, the context including the token
    being decoded (0: the row sees nothing). The keys read are bounded by
    W * block_size (the window, if smaller), which sets num_splits (None:
    decode_splits). out: [B, Hq, D] to write into (any strides, last dim
    contiguous). Returns out in q's dtype, and with return_lse its
    log-sum-exp [B, Hq] float32 (-inf, output 0, for a row without keys).
    """
    _check(q, k_cache, v_cache, block_tables)
    attn, merge = _kernels()
    B, Hq, D = q.shape
    H = k_cache.shape[1]
    G = Hq // H
    rows, bn, warps = _tiles(D, True, G, q.dtype == torch.float32)
    bn = block_n or bn
    span = block_tables.shape[1] * block_size
    if sliding_window is not None:
        span = min(span, sliding_window)
    splits = num_splits or decode_splits(B, H, span, bn, q.device)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device) if return_lse else None
    if B == 0:
        return (out, lse) if return_lse else out
    if splits == 1:
        o, ls = out, (lse if return_lse else out)
        o_st = (0, o.stride(0), o.stride(1))
        l_st = (0, lse.stride(0), lse.stride(1)) if return_lse else (0, 0, 0)
    else:
        o = torch.empty(splits, B, Hq, D, dtype=torch.float32, device=q.device)
        ls = torch.empty(splits, B, Hq, dtype=torch.float32, device=q.device)
        o_st, l_st = o.stride()[:3], ls.stride()
    dp = _next_pow2(max(D, 16))
    attn[(1, B, H * splits)](
        q, k_cache, v_cache, o, ls, block_tables, seq_lens, seq_lens, seq_lens, 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        *o_st, *l_st, block_tables.stride(0), sliding_window or 0, scale * LOG2E, splits,
        G=G, BLOCK_SIZE=block_size, D=D, D_PAD=dp, ROWS=rows, BLOCK_N=bn, DECODE=True,
        HAS_WINDOW=sliding_window is not None, F32=q.dtype == torch.float32,
        WRITE_LSE=return_lse or splits > 1, HAS_LIMITS=False, num_warps=warps)
    if splits > 1:
        lo = lse if return_lse else ls
        merge[(B, Hq)](o, ls, out, lo, *o.stride()[:3], *ls.stride(), out.stride(0), out.stride(1),
                       *((lse.stride(0), lse.stride(1)) if return_lse else (0, 0)), splits,
                       S_PAD=max(2, _next_pow2(splits)), D=D, D_PAD=dp,
                       WRITE_LSE=return_lse, num_warps=1 if dp <= 64 else 2)
    return (out, lse) if return_lse else out


def dense_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, block_size: int, max_query_len: int, sliding_window: int | None = None,
                        first_seq: int = 0, num_seqs: int | None = None, rows: int | None = None,
                        block_n: int | None = None, out: torch.Tensor | None = None, return_lse: bool = False,
                        key_limits: torch.Tensor | None = None):
    """Causal (and windowed) attention of several sequences' new tokens over
    their paged K/V, which already hold those tokens: one launch.

    q: [T, Hq, D], the flat batch; sequence i (first_seq <= i < first_seq +
    num_seqs, default: all of query_start_loc's) owns rows
    [query_start_loc[i], query_start_loc[i + 1]) and is the last of its
    seq_lens[i] positions; block_tables [B, W], seq_lens [B],
    query_start_loc [B + 1]: integer tensors on q's device. max_query_len:
    a host-side bound on those sequences' row counts (sizes the grid).
    key_limits: [T] integer on q's device, the last key position each row
    sees (bidirectional spans: AttentionMetadata.key_limits_t), None: its own.
    Writes those rows of out (default: a new tensor like q, other rows
    unset); returns out, and with return_lse the log-sum-exp [T, Hq] float32.
    """
    _check(q, k_cache, v_cache, block_tables)
    attn, _ = _kernels()
    T, Hq, D = q.shape
    H = k_cache.shape[1]
    G = Hq // H
    n_seqs = query_start_loc.shape[0] - 1 - first_seq if num_seqs is None else num_seqs
    r, bn, warps = _tiles(D, False, G, q.dtype == torch.float32)
    rows, bn = rows or r, block_n or bn
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device) if return_lse else None
    n_tiles = -(-max_query_len * G // rows)
    if n_seqs > 0 and n_tiles > 0:
        attn[(n_tiles, n_seqs, H)](
            q, k_cache, v_cache, out, lse if return_lse else out, block_tables, query_start_loc, seq_lens,
            seq_lens if key_limits is None else key_limits, first_seq, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), 0, out.stride(0), out.stride(1),
            *((0, lse.stride(0), lse.stride(1)) if return_lse else (0, 0, 0)),
            block_tables.stride(0), sliding_window or 0, scale * LOG2E, 1,
            G=G, BLOCK_SIZE=block_size, D=D, D_PAD=_next_pow2(max(D, 16)), ROWS=rows, BLOCK_N=bn,
            DECODE=False, HAS_WINDOW=sliding_window is not None, F32=q.dtype == torch.float32,
            WRITE_LSE=return_lse, HAS_LIMITS=key_limits is not None, num_warps=warps)
    return (out, lse) if return_lse else out


@register_backend("dense-triton", "dense")
class DenseTritonBackend(AttentionBackend):
    """A step in two launches: the decodes (batched, split-K) and every
    prefill chunk (varlen); no per-sequence Python loop, no host sync. The
    new K/V go in with one more (store_kv). Key limits are read by the
    prefill launch (a constexpr: the causal kernel is unchanged)."""
    capturable = True
    supports_key_limits = True

    def store(self, cache, slot_mapping, k, v):
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            return False
        if cache.k.dtype == torch.bfloat16 and k.dtype != torch.bfloat16:
            # Rounded by torch (to nearest even, as index_copy_ after .to()):
            # Triton's interpreter truncates to bf16, so its cast would be
            # checked against nothing in CI. Rare: a bf16 cache of an fp32 model.
            k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        store_kv(cache.k, cache.v, slot_mapping, k, v)
        return True

    def forward(self, cache, q, meta, scale):
        group = meta.groups[cache.group_id]
        out = torch.empty_like(q)
        nd, B = meta.num_decodes, meta.num_seqs
        if nd:
            dense_paged_decode(q[:nd], cache.k, cache.v, group.block_tables[:nd], meta.seq_lens_t[:nd], scale,
                               cache.block_size, cache.sliding_window, out=out[:nd])
        if B > nd:
            dense_paged_prefill(q, cache.k, cache.v, group.block_tables, meta.seq_lens_t, meta.query_start_loc_t,
                                scale, cache.block_size, meta.max_query_len, cache.sliding_window,
                                first_seq=nd, num_seqs=B - nd, out=out, key_limits=meta.key_limits_t)
        return out

    def decode(self, cache, q, block_tables, seq_lens, scale):
        return dense_paged_decode(q, cache.k, cache.v, block_tables, seq_lens.to(q.device), scale,
                                  cache.block_size, cache.sliding_window)

    def prefill(self, cache, q, block_table, seq_len, scale, key_limit=None):
        dev = q.device
        qsl = torch.tensor([0, q.shape[0]], device=dev)
        return dense_paged_prefill(q, cache.k, cache.v, block_table[None], torch.tensor([seq_len], device=dev),
                                   qsl, scale, cache.block_size, q.shape[0], cache.sliding_window,
                                   key_limits=key_limit)
