"""Paged KV storage for one layer in TurboQuant / int8 / f16 component formats,
and attention that reads the compressed blocks directly: a compiled kernel on
CPU (tq_cpu.py, backend tq-cpu), Triton on GPU (tq_triton.py, tq-triton), and
the torch implementation here (_attend_torch; backend tq-torch), which both
are tested against. The cache picks its backend by device from the registry
(kvcache/backends.py) on first use.

Same interface as DenseLayerCache (write / attention / nbytes). K and V are
stored rotated (see turboquant.py); attention rotates the query once, scores
against decoded keys one chunk of blocks at a time with an online softmax
(running max and sum), accumulates the weighted value vectors in the rotated
domain and de-rotates once per query head at the end. Only one chunk of
blocks (chunk_blocks * block_size tokens; the kernels: one block) is ever
decoded at a time; a sequence's whole history is never materialised
uncompressed.

Keys may be stored centred: set_key_mean(mu) subtracts a per-head constant
before encoding. q.(k - mu) shifts every score of a query by the same q.mu,
so softmax and the output are unchanged, while the codebook no longer spends
its levels on an offset that all keys of a head share (small models' keys
carry a large one: engine/kv_calibration.py measures it).

Hot tokens (hot="k" or "kv", full-attention layers only): each sequence's
first block (the attention sinks) and the block a query sits in are also
held int8, in a small pool of their own (the manager's hot group: keeps a
sequence's block 0 and its newest block, kv_manager.KVGroup.hot).
A query reads those keys (and, with "kv", values) int8 and every other key
from its codes: two passes over disjoint key sets (CODED, HOT) whose
outputs merge by log-sum-exp. Which copy a key is read from depends only on
the query's position, so chunking, batching and prefix hits do not change
a result. Small models lean on these few tokens: SmolLM2 k4v4 +3.3% -> ~1%
perplexity (tests/bench/results/kv_levers_*).

Key limits (a bidirectional span, AttentionBackend's key_limit): a query at
p sees keys up to its limit L >= p instead of p. The keys past p lie in the
query's own chunk, so the HOT part is [0, sink) and [own block start, L]:
every key of the chunk's blocks from the query's own one on is read int8
(the CODED part, below the own block, is unchanged). All backends honour it.
"""
import torch

from kvcache.backends import AttentionBackend, register_backend
from kvcache.layer_cache import LayerCache
from kvcache.turboquant import INT8, Codec, ComponentFormat

NEG = -1e30   # finite "minus infinity": a fully masked chunk is wiped exactly by the next rescale
# Which keys one attention pass reads, for a query at position p (block size
# bs, sink = the hot first block's tokens, 0 without hot tokens):
ALL = 0       # every key <= p (and inside the sliding window)
CODED = 1     # keys in [sink, (p // bs) * bs): the compressed ones
HOT = 2       # keys < sink or in [(p // bs) * bs, p]: read from the hot stores


def _put(store: dict, slots: torch.Tensor, rows: dict) -> None:
    for name, t in store.items():
        t.index_copy_(0, slots, rows[name])


def merge(o1, lse1, o2, lse2):
    """Attention over two disjoint key sets -> over their union (o: [..., D],
    lse: [...]; either side may be empty: lse -inf, o 0; both: output 0,
    e.g. a captured step's pad rows, whose NaN would reach the next layer's
    store)."""
    m = torch.maximum(lse1, lse2).clamp_min(NEG)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2).clamp_min(1e-30)).to(o1.dtype)


class TQLayerCache(LayerCache):
    format_kind = "tq"

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 k_fmt: ComponentFormat, v_fmt: ComponentFormat, group_id: int,
                 sliding_window: int | None = None, seed: int = 0,
                 device: str | torch.device = "cpu", chunk_tokens: int = 512,
                 hot: str = "", hot_blocks: int = 0, hot_group_id: int | None = None):
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_id = group_id
        self.sliding_window = sliding_window
        self.k_fmt, self.v_fmt = k_fmt, v_fmt
        self.chunk_blocks = max(1, chunk_tokens // block_size)
        # One rotation per layer (deterministic seed), shared by K and V so
        # the query is rotated once.
        self.kc = Codec(k_fmt, num_kv_heads, head_dim, seed)
        self.vc = Codec(v_fmt, num_kv_heads, head_dim, seed)
        self.signs = self.kc.signs.to(device)
        n = num_blocks * block_size
        self.k = self.kc.alloc(n, device)
        self.v = self.vc.alloc(n, device)
        self.k_mean = None
        # Hot tokens: int8 copies in the hot group's blocks (same rotation).
        if hot not in ("", "k", "kv"):
            raise ValueError(f"hot must be '', 'k' or 'kv', got {hot!r}")
        if hot and sliding_window is not None:
            raise ValueError("hot tokens are for full-attention layers")
        self.hot = hot
        self.sink = block_size if hot else 0
        self.extra_groups = (hot_group_id,) if hot else ()
        self.hk, self.hv = {}, {}
        if hot:
            self.hkc = Codec(INT8, num_kv_heads, head_dim, seed)
            self.hk = self.hkc.alloc(hot_blocks * block_size, device)
            if hot == "kv":
                self.hvc = Codec(INT8, num_kv_heads, head_dim, seed)
                self.hv = self.hvc.alloc(hot_blocks * block_size, device)

    @property
    def device(self) -> torch.device:
        return self.signs.device

    def part_stores(self, part: int):
        """(K codec, K store, V codec, V store) a pass over `part` reads."""
        if part != HOT:
            return self.kc, self.k, self.vc, self.v
        if self.hot == "kv":
            return self.hkc, self.hk, self.hvc, self.hv
        return self.hkc, self.hk, self.vc, self.v

    def hot_v_tables(self, hot_tables, block_tables):
        """The tables a HOT pass reads values through: hot ones with "kv",
        else the coded values' own."""
        return hot_tables if self.hot == "kv" else block_tables

    def set_key_mean(self, mean: torch.Tensor) -> None:
        """mean: [num_kv_heads, head_dim], subtracted from every key written after this."""
        self.k_mean = mean.to(device=self.signs.device, dtype=torch.float32).view(self.num_kv_heads,
                                                                                  self.head_dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool_tensors())

    def pool_tensors(self) -> list[torch.Tensor]:
        return [t for d in (self.k, self.v, self.hk, self.hv) for t in d.values()]

    def pool_tensors_by_group(self) -> dict[int, list[torch.Tensor]]:
        groups = {self.group_id: [t for d in (self.k, self.v) for t in d.values()]}
        if self.hot:            # the hot copies live in the hot group's blocks
            groups[self.extra_groups[0]] = [t for d in (self.hk, self.hv) for t in d.values()]
        return groups

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              hot_slots: torch.Tensor | None = None):
        """Encode new K/V [T, Hkv, D] into their slots, and with hot_slots
        also the hot copies (a negative slot: no hot block, not stored).
        Returns the new tokens' rows as a hot pass reads them (K hot rows, V
        hot or coded rows) when hot_slots is given."""
        if self.k_mean is not None:
            k = k.float() - self.k_mean
        rot = self.kc.rot_t(k.device)
        yk, yv = k.float() @ rot, v.float() @ rot          # rotate once for both copies
        kr, vr = self.kc.quantize_rotated(yk), self.vc.quantize_rotated(yv)
        _put(self.k, slot_mapping, kr)
        _put(self.v, slot_mapping, vr)
        if hot_slots is None:
            return None
        hk = self.hkc.quantize_rotated(yk)
        hv = self.hvc.quantize_rotated(yv) if self.hot == "kv" else vr
        keep = hot_slots >= 0
        sel = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        for store, rows in ((self.hk, hk), (self.hv, hv)):
            if store:
                _put(store, hot_slots if sel is None else hot_slots[sel],
                     rows if sel is None else {n: t[sel] for n, t in rows.items()})
        return hk, hv

    def store(self, meta, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = meta.groups[self.group_id].slot_mapping
        hot_slots = meta.groups[self.extra_groups[0]].slot_mapping if self.hot else None
        if not self.reads_new_rows(meta):
            # A backend with a store of its own (tq-triton: one launch, no sync) writes them.
            if not self.backend.store(self, slots, k, v, hot_slots):
                self.write(slots, k, v, hot_slots)
            return
        # A hot prefill passes through blocks without a hot copy: its HOT pass reads
        # the new rows ([T, ...] as the flat batch: tq-triton's HOT launch) and each
        # prefill's (in batch order, next_chunk_rows: _hot_prefill).
        self.new_rows = self.backend.store_new_rows(self, slots, k, v, hot_slots)
        self._prefill_qsl = meta.query_start_loc[meta.num_decodes:]     # sliced on demand: next_chunk_rows
        self._next_chunk = 0

    def reads_new_rows(self, meta) -> bool:
        """Whether this step's HOT passes read the new tokens' rows from
        store() (write returns them): a prefill longer than the backend's
        hot_span_rows passes through blocks the hot group does not hold."""
        if not self.hot:
            return False
        # Decodes have one row, so with a prefill the longest row count is a prefill's.
        return meta.num_prefills > 0 and meta.max_query_len > self.backend.hot_span_rows(self)

    def next_chunk_rows(self) -> tuple[dict, dict | None]:
        """The next prefill's new rows (hot K; hot V, or coded V (tq-torch) or
        None (tq-triton) with hot "k") from store(), in batch order."""
        a, b = self._prefill_qsl[self._next_chunk:self._next_chunk + 2]
        self._next_chunk += 1
        return tuple(r and {n: t[a:b] for n, t in r.items()} for r in self.new_rows)

    def attention(self, q: torch.Tensor, meta, scale: float) -> torch.Tensor:
        # The prefills read store()'s chunks in batch order; from the first again at
        # each call, so a layer that shares this cache (Gemma 4's KV sharing) reads them too.
        self._next_chunk = 0
        return super().attention(q, meta, scale)

    def _rows(self, store: dict, slots: torch.Tensor) -> dict:
        return {name: t.index_select(0, slots) for name, t in store.items()}

    def dequantized(self, slots: torch.Tensor, dtype=torch.float32):
        """Unrotated K, V at the given slots (tests and debugging only)."""
        k = self.kc.dequantize(self._rows(self.k, slots), dtype)
        if self.k_mean is not None:
            k = k + self.k_mean.to(dtype)
        return k, self.vc.dequantize(self._rows(self.v, slots), dtype)

    # -- attention (the math the backends share) ------------------------------
    def _attend_torch(self, qr, cols, block_tables, qpos, seq_lens, part=ALL, v_tables=None, klim=None):
        """Online-softmax attention over compressed blocks (the reference).

        qr: [B, H, G, Lq, D] rotated, scaled queries; cols: [B, nblk] block
        columns to read (in block-table order); qpos: [B, Lq] query positions;
        seq_lens: [B]; part: which keys (ALL / CODED / HOT) from which stores
        (part_stores); v_tables: the values' block tables when they differ
        from the keys' (hot keys with coded values); klim: [B, Lq] the last
        key each query sees (None: its own position). Returns the rotated-domain
        output [B, H, G, Lq, D] in qr's dtype and its log-sum-exp [B, H, G, Lq]
        float32 (-inf, with output 0, for a row that sees no key).
        """
        kc, ks, vc, vs = self.part_stores(part)
        v_tables = block_tables if v_tables is None else v_tables
        B, H, G, Lq, D = qr.shape
        bs, dev = self.block_size, qr.device
        m = torch.full((B, H, G, Lq, 1), NEG, dtype=qr.dtype, device=dev)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qr)
        qf = qr.reshape(B, H, G * Lq, D)
        offs = torch.arange(bs, device=dev)
        klim = qpos if klim is None else klim
        # Every chunk has the same length (the last one padded with masked
        # blocks), so a sequence's arithmetic never depends on its batch.
        C = self.chunk_blocks
        pad = -cols.shape[1] % C
        if pad:
            cols = torch.cat([cols, cols[:, -1:] + torch.arange(1, pad + 1, device=dev)], 1)
        width = block_tables.shape[1]
        n = C * bs
        for c0 in range(0, cols.shape[1], C):
            cc = cols[:, c0:c0 + C]
            kslots, vslots = ((t.gather(1, cc.clamp(max=width - 1)).unsqueeze(-1) * bs + offs).flatten()
                              for t in (block_tables, v_tables))
            kpos = (cc.unsqueeze(-1) * bs + offs).flatten(1)[:, None, :]            # [B, 1, n]
            k = kc.decode(self._rows(ks, kslots), qr.dtype).view(B, n, H, D).transpose(1, 2)
            v = vc.decode(self._rows(vs, vslots), qr.dtype).view(B, n, H, D).transpose(1, 2)
            s = torch.matmul(qf, k.transpose(-1, -2)).view(B, H, G, Lq, n)
            valid = (kpos <= klim[:, :, None]) & (kpos < seq_lens[:, None, None])
            if self.sliding_window is not None:
                valid &= kpos > qpos[:, :, None] - self.sliding_window
            own = (qpos // bs * bs)[:, :, None]                                  # the query's block start
            if part == CODED:
                valid &= (kpos >= self.sink) & (kpos < own)
            elif part == HOT:
                valid &= (kpos < self.sink) | (kpos >= own)
            s = s.masked_fill(~valid[:, None, None], NEG)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            pv = torch.matmul(p.view(B, H, G * Lq, n), v).view(B, H, G, Lq, D)
            acc = acc * alpha + pv
            m = m_new
        seen = m > NEG / 2
        lse = torch.where(seen, m + torch.log(l), float("-inf")).squeeze(-1).float()
        return torch.where(seen, acc / l, 0.0), lse

    def _rotate_q(self, q, scale):
        """[B, Lq, Hq, D] -> [B, H, G, Lq, D] rotated and scaled."""
        B, Lq, Hq, D = q.shape
        H = self.num_kv_heads
        qr = (q.float() @ self.kc.rot_t(q.device)) * scale     # rotate(q): one matmul
        return qr.view(B, Lq, H, Hq // H, D).permute(0, 2, 3, 1, 4).to(q.dtype)

    def _finish(self, acc, dtype):
        """[B, H, G, Lq, D] rotated -> [B, Lq, Hq, D] (one de-rotation per query head)."""
        B, H, G, Lq, D = acc.shape
        o = acc.float() @ self.kc.rot_t(acc.device).T            # unrotate(acc)
        return o.permute(0, 3, 1, 2, 4).reshape(B, Lq, H * G, D).to(dtype)

    def _hot_prefill(self, qr, block_table, hot_table, seq_len, new_rows, klim=None):
        """The HOT pass of a prefill chunk: each query attends to block 0
        and to its own block up to itself (with klim [Lq]: from its own
        block up to its limit, W blocks at most), rows before the chunk from
        the hot pool, the chunk's own rows new_rows (hot K, hot or coded V)
        from store() (their middle blocks have no hot block). Block-banded,
        so [nb, bs, (1 + W) * bs] scores at most (W = 1 without limits).
        Returns (out [1, H, G, Lq, D], lse [1, H, G, Lq])."""
        new_k, new_v = new_rows
        _, H, G, Lq, D = qr.shape
        bs, dev, f32 = self.block_size, qr.device, torch.float32
        start = seq_len - Lq
        b0 = start // bs
        nb = -(-seq_len // bs) - b0
        before = start - b0 * bs                      # own-block rows written by earlier steps
        # Each padded query row's last key (its position, or its limit), and
        # how many blocks from its own one on any query reaches.
        lim = b0 * bs + torch.arange(nb * bs, device=dev)
        W = 1
        if klim is not None:
            W = int((klim // bs - lim[before:before + Lq] // bs).max()) + 1
            lim[before:before + Lq] = klim
        lim = lim.view(nb, bs)
        kc, k_store, vc, v_store = self.part_stores(HOT)
        v_table = self.hot_v_tables(hot_table, block_table)

        def rows(pos):   # [n, H, D] K and V at positions < start, from the pools
            ks = hot_table[pos // bs] * bs + pos % bs
            vs = v_table[pos // bs] * bs + pos % bs
            return kc.decode(self._rows(k_store, ks), f32), vc.decode(self._rows(v_store, vs), f32)

        nk, nv = kc.decode(new_k, f32), vc.decode(new_v, f32)
        own_k = torch.zeros((nb + W - 1) * bs, H, D, dtype=f32, device=dev)    # W - 1 blocks of padding
        own_v = torch.zeros_like(own_k)
        if before:
            own_k[:before], own_v[:before] = rows(b0 * bs + torch.arange(before, device=dev))
        own_k[before:before + Lq], own_v[before:before + Lq] = nk, nv
        # Block 0 (read by queries in later blocks): stored rows, then the chunk's.
        n_old = min(bs, start)
        sink_k = torch.zeros(bs, H, D, dtype=f32, device=dev)
        sink_v = torch.zeros_like(sink_k)
        if n_old:
            sink_k[:n_old], sink_v[:n_old] = rows(torch.arange(n_old, device=dev))
        n_new = min(bs, seq_len) - n_old
        sink_k[n_old:n_old + n_new], sink_v[n_old:n_old + n_new] = nk[:n_new], nv[:n_new]

        q = torch.zeros(H, G, nb * bs, D, dtype=f32, device=dev)
        q[:, :, before:before + Lq] = qr[0].float()
        q = q.view(H, G, nb, bs, D)
        blk = b0 + torch.arange(nb, device=dev)
        s = [torch.einsum("hgnqd,khd->hgnqk", q, sink_k).masked_fill((blk == 0)[:, None, None], float("-inf"))]

        def band(x, w):     # [nb, bs, H, D]: block n + w for the queries of block n
            return x[w * bs:(w + nb) * bs].view(nb, bs, H, D)

        for w in range(W):
            kpos = (blk[:, None] + w) * bs + torch.arange(bs, device=dev)              # [nb, bs]
            s_w = torch.einsum("hgnqd,nkhd->hgnqk", q, band(own_k, w))
            s.append(s_w.masked_fill(kpos[:, None, :] > lim[:, :, None], float("-inf")))
        s = torch.cat(s, -1)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1))
        o = torch.einsum("hgnqk,khd->hgnqd", p[..., :bs], sink_v)
        for w in range(W):
            o = o + torch.einsum("hgnqk,nkhd->hgnqd", p[..., (w + 1) * bs:(w + 2) * bs], band(own_v, w))
        o = o.reshape(H, G, nb * bs, D)[:, :, before:before + Lq]
        lse = lse.reshape(H, G, nb * bs)[:, :, before:before + Lq]
        return o[None].to(qr.dtype), lse[None]


@register_backend("tq-torch", "tq")
class TQTorchBackend(AttentionBackend):
    """The reference: TQLayerCache._attend_torch (chunks of blocks, online
    softmax in torch), one batched decode and one call per prefill; runs on
    any device. tq-cpu (tq_cpu.py) is this with attend / attend_passes in
    the compiled kernel. Key limits: the ALL pass takes them as klim; a hot
    cache's CODED pass needs none (its keys lie below each query's own
    block) and its HOT pass (_hot_prefill) reads the band of blocks up to
    each limit."""
    supports_key_limits = True

    def hot_span_rows(self, cache) -> int:
        """Rows per sequence up to which a prefill's HOT pass reads only the
        hot pool (none here: every one runs TQLayerCache._hot_prefill)."""
        return 0

    def store_new_rows(self, cache, slot_mapping, k, v, hot_slots):
        """Store a step with a prefill whose HOT pass reads the new tokens'
        rows, and return them as TQLayerCache.write does (hot K, hot or
        coded V; [T, ...] as the flat batch)."""
        return cache.write(slot_mapping, k, v, hot_slots)

    def attend(self, cache, qr, cols, block_tables, qpos, seq_lens, part=ALL, v_tables=None, klim=None):
        """One pass (TQLayerCache._attend_torch's contract) -> (acc, lse)."""
        return cache._attend_torch(qr, cols, block_tables, qpos, seq_lens, part, v_tables, klim)

    def attend_passes(self, cache, qr, passes, qpos, seq_lens, klim=None):
        """The union of disjoint passes [(part, cols, block_tables, v_tables)] -> (acc, lse)."""
        outs = [self.attend(cache, qr, c, t, qpos, seq_lens, part, v, klim) for part, c, t, v in passes]
        if len(outs) == 1:
            return outs[0]
        return merge(*outs[0], *outs[1]), torch.logaddexp(outs[0][1], outs[1][1])

    def decode(self, cache, q, block_tables, seq_lens, scale, hot_tables=None):
        seq_lens = seq_lens.to(q.device)
        qr = cache._rotate_q(q.unsqueeze(1), scale)
        qpos = (seq_lens - 1)[:, None]
        cols = cache.decode_columns(block_tables, seq_lens)
        if not cache.hot:
            acc, _ = self.attend(cache, qr, cols, block_tables, qpos, seq_lens)
            return cache._finish(acc, q.dtype)[:, 0]
        # Hot pass: block 0 and the query's own block (a masked block 1 when
        # they are the same); coded pass: the blocks between. The compiled
        # kernel runs both in one call (one online softmax).
        own = (seq_lens - 1) // cache.block_size
        hot_cols = torch.stack([torch.zeros_like(own), own.clamp(min=1)], 1)
        passes = [(HOT, hot_cols, hot_tables, cache.hot_v_tables(hot_tables, block_tables))]
        if cols.shape[1] > 1:
            passes.append((CODED, cols[:, 1:], block_tables, None))
        acc, _ = self.attend_passes(cache, qr, passes, qpos, seq_lens)
        return cache._finish(acc, q.dtype)[:, 0]

    def prefill(self, cache, q, block_table, seq_len, scale, hot_table=None, key_limit=None):
        qr = cache._rotate_q(q.unsqueeze(0), scale)
        Lq = q.shape[0]
        start = seq_len - Lq
        bs, dev = cache.block_size, q.device
        lens = torch.tensor([seq_len], device=dev)
        qpos = torch.arange(start, seq_len, device=dev)[None]
        if cache.hot:
            # Coded pass over blocks 1 up to the last query's own block;
            # the hot pass (block 0 + each query's own block) in torch.
            hot = cache._hot_prefill(qr, block_table, hot_table, seq_len, cache.next_chunk_rows(), key_limit)
            cols = torch.arange(1, max(1, (seq_len - 1) // bs), device=dev)[None]
            if cols.shape[1] == 0:
                return cache._finish(hot[0], q.dtype)[0]
            coded = self.attend(cache, qr, cols, block_table[None], qpos, lens, CODED)
            return cache._finish(merge(*coded, *hot), q.dtype)[0]
        lo = 0 if cache.sliding_window is None else max(0, start - cache.sliding_window + 1)
        cols = torch.arange(lo // bs, -(-seq_len // bs), device=dev)[None]
        klim = None if key_limit is None else key_limit[None]
        acc, _ = self.attend(cache, qr, cols, block_table[None], qpos, lens, klim=klim)
        return cache._finish(acc, q.dtype)[0]
