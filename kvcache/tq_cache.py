"""Paged KV storage for one layer in TurboQuant / int8 / f16 component formats,
and attention that reads the compressed blocks directly: a compiled kernel on
CPU (tq_cpu.py), Triton on GPU (tq_triton.py), and the torch implementation
here (_attend_torch), which both are tested against.

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
"""
import torch

from kvcache import tq_cpu
from kvcache.layer_cache import LayerCache
from kvcache.tq_triton import tq_paged_decode, tq_prefill   # loads triton only on first GPU call
from kvcache.turboquant import Codec, ComponentFormat

NEG = -1e30   # finite "minus infinity": a fully masked chunk is wiped exactly by the next rescale


class TQLayerCache(LayerCache):
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 k_fmt: ComponentFormat, v_fmt: ComponentFormat, group_id: int,
                 sliding_window: int | None = None, seed: int = 0,
                 device: str | torch.device = "cpu", chunk_tokens: int = 512):
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

    def set_key_mean(self, mean: torch.Tensor) -> None:
        """mean: [num_kv_heads, head_dim], subtracted from every key written after this."""
        self.k_mean = mean.to(device=self.signs.device, dtype=torch.float32).view(self.num_kv_heads,
                                                                                  self.head_dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k_mean is not None:
            k = k.float() - self.k_mean
        for store, codec, x in ((self.k, self.kc, k), (self.v, self.vc, v)):
            rows = codec.encode(x)
            for name, t in store.items():
                t.index_copy_(0, slot_mapping, rows[name])

    def _rows(self, store: dict, slots: torch.Tensor) -> dict:
        return {name: t.index_select(0, slots) for name, t in store.items()}

    def dequantized(self, slots: torch.Tensor, dtype=torch.float32):
        """Unrotated K, V at the given slots (tests and debugging only)."""
        k = self.kc.dequantize(self._rows(self.k, slots), dtype)
        if self.k_mean is not None:
            k = k + self.k_mean.to(dtype)
        return k, self.vc.dequantize(self._rows(self.v, slots), dtype)

    # -- attention ---------------------------------------------------------
    def _attend(self, qr, cols, block_tables, qpos, seq_lens):
        """CPU attention over compressed blocks: the compiled kernel
        (kvcache/tq_cpu.py), or the torch reference with TQSERVE_TQ_CPU=torch."""
        if tq_cpu.enabled(self.head_dim):
            return tq_cpu.attend(self, qr, cols, block_tables, qpos, seq_lens)
        return self._attend_torch(qr, cols, block_tables, qpos, seq_lens)

    def _attend_torch(self, qr, cols, block_tables, qpos, seq_lens):
        """Online-softmax attention over compressed blocks (the reference).

        qr: [B, H, G, Lq, D] rotated, scaled queries; cols: [B, nblk] block
        columns to read (in block-table order); qpos: [B, Lq] query positions;
        seq_lens: [B]. Returns the rotated-domain output [B, H, G, Lq, D].
        """
        B, H, G, Lq, D = qr.shape
        bs, dev = self.block_size, qr.device
        m = torch.full((B, H, G, Lq, 1), NEG, dtype=qr.dtype, device=dev)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qr)
        qf = qr.reshape(B, H, G * Lq, D)
        offs = torch.arange(bs, device=dev)
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
            blocks = block_tables.gather(1, cc.clamp(max=width - 1))
            slots = (blocks.unsqueeze(-1) * bs + offs).flatten()
            kpos = (cc.unsqueeze(-1) * bs + offs).flatten(1)                      # [B, n]
            k = self.kc.decode(self._rows(self.k, slots), qr.dtype).view(B, n, H, D).transpose(1, 2)
            v = self.vc.decode(self._rows(self.v, slots), qr.dtype).view(B, n, H, D).transpose(1, 2)
            s = torch.matmul(qf, k.transpose(-1, -2)).view(B, H, G, Lq, n)
            valid = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < seq_lens[:, None, None])
            if self.sliding_window is not None:
                valid &= kpos[:, None, :] > qpos[:, :, None] - self.sliding_window
            s = s.masked_fill(~valid[:, None, None], NEG)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            pv = torch.matmul(p.view(B, H, G * Lq, n), v).view(B, H, G, Lq, D)
            acc = acc * alpha + pv
            m = m_new
        return acc / l

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

    def _decode(self, q, block_tables, seq_lens, scale):
        seq_lens = seq_lens.to(q.device)
        if q.is_cuda:
            acc = tq_paged_decode(self, self._rotate_q(q.unsqueeze(1), scale), block_tables, seq_lens)
            return self._finish(acc, q.dtype)[:, 0]
        cols = self.decode_columns(block_tables, seq_lens)
        acc = self._attend(self._rotate_q(q.unsqueeze(1), scale), cols, block_tables,
                           (seq_lens - 1)[:, None], seq_lens)
        return self._finish(acc, q.dtype)[:, 0]

    def _prefill(self, q, block_table, seq_len, scale):
        if q.is_cuda:
            acc = tq_prefill(self, self._rotate_q(q.unsqueeze(0), scale), block_table, seq_len)
            return self._finish(acc, q.dtype)[0]
        Lq = q.shape[0]
        start = seq_len - Lq
        lo = 0 if self.sliding_window is None else max(0, start - self.sliding_window + 1)
        bs, dev = self.block_size, q.device
        first, last = lo // bs, -(-seq_len // bs)
        cols = torch.arange(first, last, device=dev)[None]
        qpos = torch.arange(start, seq_len, device=dev)[None]
        acc = self._attend(self._rotate_q(q.unsqueeze(0), scale), cols, block_table[None], qpos,
                           torch.tensor([seq_len], device=dev))
        return self._finish(acc, q.dtype)[0]
