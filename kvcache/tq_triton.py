"""Triton kernels for attention over TurboQuant-compressed paged KV blocks:
the GPU counterpart of TQLayerCache._attend (same math, tested against it
with Triton's interpreter on CPU).

One kernel serves decode and chunked prefill. A program takes a tile of
query rows of one sequence and one KV head, where a row is one (token,
query head) pair of that KV head's G query heads, so every K/V tile it
decodes is shared by all of them. It walks the sequence's key positions
through the block table, decodes each tile of keys and values in registers
(unpacking the b-bit codes, codebook lookup, per-group fp16 scale; or int8
times a per-vector scale; or fp16), and keeps an online softmax. Nothing is
materialised uncompressed in memory. Decode can split the key range of a
sequence over several programs (flash-decoding); the partial results are
merged by their log-sum-exp in torch.

Every call returns the output and its log-sum-exp, so that passes over
disjoint key sets merge (tq_cache.merge): with hot tokens, a CODED pass over
the compressed keys and a HOT pass over the int8 copies of the sink block and
the query's own block, through the hot group's block table (valid only at
those blocks: a program only visits the key tiles its part can see).

The caller rotates and scales the queries (TQLayerCache._rotate_q) and
de-rotates the output (TQLayerCache._finish): the kernels work entirely in
the rotated domain; TQTritonBackend below (tq-triton, the default for
TurboQuant caches on CUDA) does both around them. triton is imported lazily
so that importing kvcache never needs it.
"""
import torch

from kvcache.backends import AttentionBackend, register_backend
from kvcache.tq_cache import CODED, HOT, merge

_KIND = {"f16": 0, "int8": 1, "tq": 2}


def _kernel():
    from kvcache.tq_triton_kernels import tq_attn_kernel   # imports triton
    return tq_attn_kernel


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


def _launch(cache, q, q_t, out, o_t, lse, l_t, block_tables, v_tables, q_start, q_len, seq_len,
            n_row_tiles, rows, block_n, splits, part, num_warps=8):
    """q / out: tensors with the head dims at (h, g) and tokens at stride q_t /
    o_t; lse: out without D, tokens at stride l_t. With splits > 1 the
    kernel writes partial results and this returns them merged: (output
    [T, H, G, D] float32, lse [T, H, G]) for the caller to copy."""
    kernel = _kernel()
    H, D = cache.num_kv_heads, cache.head_dim
    G = q.shape[2]
    dev = q.device
    kc, k, vc, v = cache.part_stores(part)
    kd, ks, kcb, kst, kce = _component(kc, k, dev)
    vd, vs, vcb, vst, vce = _component(vc, v, dev)
    sq_h, sq_g = q.stride(1), q.stride(2)
    win = cache.sliding_window
    if splits == 1:
        o, o_strides = out, (0, o_t, out.stride(1), out.stride(2))
        part_lse, l_strides = lse, (0, l_t, lse.stride(1), lse.stride(2))
    else:
        # Partial outputs [S, T, H, G, D] float32 and their log-sum-exp [S, T, H, G].
        T = out.numel() // (H * G * D)
        o = torch.empty(splits, T, H, G, D, dtype=torch.float32, device=dev)
        part_lse = torch.empty(splits, T, H, G, dtype=torch.float32, device=dev)
        o_strides = (o.stride(0), o.stride(1), o.stride(2), o.stride(3))
        l_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2), part_lse.stride(3))
    grid = (n_row_tiles, block_tables.shape[0], H * splits)
    kernel[grid](q, o, part_lse, block_tables, v_tables, q_start, q_len, seq_len,
                 kd, ks, kcb, vd, vs, vcb,
                 q_t, sq_h, sq_g, *o_strides, *l_strides, block_tables.stride(0), v_tables.stride(0),
                 *kst, *vst, win or 0, cache.sink, G=G, BLOCK_SIZE=cache.block_size,
                 D=D, ROWS=rows, BLOCK_N=block_n, SPLITS=splits,
                 K_KIND=kce[0], K_BITS=kce[1], K_GROUP=kce[2],
                 V_KIND=vce[0], V_BITS=vce[1], V_GROUP=vce[2],
                 HAS_WINDOW=win is not None, F32=q.dtype == torch.float32, PART=part, num_warps=num_warps)
    if splits == 1:
        return None
    # Merge the splits by log-sum-exp. An empty split (or row) has lse -inf:
    # weight 0; the clamp keeps a row no split saw at max -1e30 (not -inf - -inf).
    mx = part_lse.amax(0).clamp_min(-1e30)
    w = torch.exp(part_lse - mx)
    ws = w.sum(0)
    # ws >= 1 (the max split weighs 1) unless no split saw a key: then 0 / 1 = 0.
    merged = (o * w.unsqueeze(-1)).sum(0) / ws.clamp_min(1.0).unsqueeze(-1)          # [T, H, G, D]
    return merged, mx + torch.log(ws)                     # lse -inf where ws == 0


_ROWS: dict = {}


def _decode_rows(B: int, device):
    """Decode's query starts (0..B-1) and lengths (1), kept per (B, device):
    no allocation per layer and step."""
    key = (B, str(device))
    if key not in _ROWS:
        _ROWS[key] = (torch.arange(B, dtype=torch.int32, device=device),
                      torch.ones(B, dtype=torch.int32, device=device))
    return _ROWS[key]


def _auto_splits(batch: int, heads: int, max_len: int, block_n: int, device) -> int:
    """Enough programs to fill the GPU, each with at least 4 key tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * sms // (batch * heads)), -(-max_len // (4 * block_n)), 64))


def tq_paged_decode(cache, qr: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    num_splits: int | None = None, block_n: int = 32, part: int = 0,
                    v_tables: torch.Tensor | None = None):
    """One query token per sequence over its compressed blocks.

    cache: a TQLayerCache; qr: [B, H, G, 1, D] rotated, scaled queries (as
    TQLayerCache._rotate_q(q.unsqueeze(1), scale)); block_tables: [B, W] long,
    the keys' (and values') tables; seq_lens: [B] (context incl. the token
    being decoded); part: tq_cache ALL / CODED / HOT, which keys and stores
    (TQLayerCache.part_stores); v_tables: the values' tables when they
    differ. Returns (rotated-domain output [B, H, G, 1, D] in qr's dtype,
    log-sum-exp [B, H, G, 1] float32), like _attend: a row that sees no key
    has output 0 and lse -inf.
    """
    B, H, G, Lq, D = qr.shape
    assert Lq == 1 and H == cache.num_kv_heads and D == cache.head_dim
    dev = qr.device
    seq_lens = torch.as_tensor(seq_lens, device=dev).to(torch.int32)
    block_tables = block_tables.to(dev)
    v_tables = block_tables if v_tables is None else v_tables.to(dev)
    rows = max(16, _next_pow2(G))
    # Upper bound on the keys read, without a host sync on seq_lens.
    span = block_tables.shape[1] * cache.block_size
    if cache.sliding_window is not None:
        span = min(span, cache.sliding_window)
    if part == 2:                              # HOT: the sink block and the query's own
        span = min(span, cache.sink + cache.block_size)
    splits = num_splits or _auto_splits(B, H, span, block_n, dev)
    out = torch.empty_like(qr)
    lse = torch.empty(B, H, G, 1, dtype=torch.float32, device=dev)
    q_start, q_len = _decode_rows(B, dev)
    merged = _launch(cache, qr, qr.stride(0), out, out.stride(0), lse, lse.stride(0), block_tables,
                     v_tables, q_start, q_len, seq_lens, 1, rows, block_n, splits, part)
    if merged is not None:
        out.copy_(merged[0].unsqueeze(3))
        lse.copy_(merged[1].unsqueeze(3))
    return out, lse


def tq_prefill(cache, qr: torch.Tensor, block_tables: torch.Tensor, seq_lens,
               query_start_loc=None, rows: int | None = None, block_n: int | None = None,
               part: int = 0, v_tables: torch.Tensor | None = None):
    """Causal (and windowed) attention of new tokens over the compressed prefix.

    The new tokens must already be written to the cache. qr: [1, H, G, T, D]
    rotated, scaled queries (TQLayerCache._rotate_q(q.unsqueeze(0), scale)),
    the tokens of one or more sequences back to back. One sequence:
    block_tables [W] and seq_lens an int (its last T tokens are the queries).
    Several: block_tables [B, W], seq_lens [B] and query_start_loc [B + 1].
    part / v_tables (shaped like block_tables): as in tq_paged_decode. A HOT
    prefill needs hot blocks at every column its queries sit in; the engine's
    hot group skips a chunk's middle blocks, so TQLayerCache runs a prefill's
    HOT pass in torch (_hot_prefill) and only the CODED pass here.
    Returns (rotated-domain output [1, H, G, T, D] in qr's dtype, log-sum-exp
    [1, H, G, T] float32; -inf with output 0 for a row that sees no key).
    """
    one, H, G, T, D = qr.shape
    assert one == 1 and H == cache.num_kv_heads and D == cache.head_dim
    dev = qr.device
    v_tables = block_tables if v_tables is None else v_tables
    if block_tables.dim() == 1:
        block_tables, v_tables = block_tables[None], v_tables[None]
        seq_lens, query_start_loc = [int(seq_lens)], [0, T]
    qsl = [int(x) for x in query_start_loc]
    lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    out = torch.empty_like(qr)
    lse = torch.empty(1, H, G, T, dtype=torch.float32, device=dev)
    if T == 0:
        return out, lse
    # Tiles that compile without register spills on sm_90 (checked with
    # ptxas for tq3/tq4/int8): smaller ones for head_dim 256 and up.
    rows = rows or (64 if D <= 128 else 32)
    block_n = block_n or (32 if D <= 128 else 16)
    i32 = dict(dtype=torch.int32, device=dev)
    n_row_tiles = -(-max(lens) * G // rows)
    _launch(cache, qr, qr.stride(3), out, out.stride(3), lse, lse.stride(3), block_tables.to(dev),
            v_tables.to(dev), torch.tensor(qsl[:-1], **i32), torch.tensor(lens, **i32),
            torch.as_tensor(seq_lens).to(**i32), n_row_tiles, rows, block_n, 1, part)
    return out, lse


@register_backend("tq-triton", "tq")
class TQTritonBackend(AttentionBackend):
    """One batched decode launch (two with hot tokens: CODED and HOT passes,
    merged by log-sum-exp) and one launch per prefill sequence (its HOT pass
    in torch, TQLayerCache._hot_prefill)."""

    def decode(self, cache, q, block_tables, seq_lens, scale, hot_tables=None):
        seq_lens = seq_lens.to(q.device)
        qr = cache._rotate_q(q.unsqueeze(1), scale)
        if not cache.hot:
            acc, _ = tq_paged_decode(cache, qr, block_tables, seq_lens)
        else:
            v_hot = cache.hot_v_tables(hot_tables, block_tables)
            acc = merge(*tq_paged_decode(cache, qr, block_tables, seq_lens, part=CODED),
                        *tq_paged_decode(cache, qr, hot_tables, seq_lens, part=HOT, v_tables=v_hot))
        return cache._finish(acc, q.dtype)[:, 0]

    def prefill(self, cache, q, block_table, seq_len, scale, hot_table=None):
        qr = cache._rotate_q(q.unsqueeze(0), scale)
        if cache.hot:
            hot = cache._hot_prefill(qr, block_table, hot_table, seq_len)
            if (seq_len - 1) // cache.block_size <= 1:      # no coded block between the hot ones
                return cache._finish(hot[0], q.dtype)[0]
            coded = tq_prefill(cache, qr, block_table, seq_len, part=CODED)
            return cache._finish(merge(*coded, *hot), q.dtype)[0]
        acc, _ = tq_prefill(cache, qr, block_table, seq_len)
        return cache._finish(acc, q.dtype)[0]
