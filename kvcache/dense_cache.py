"""Uncompressed (f32 / f16 / bf16) paged KV storage for one layer, and its
torch attention backend (dense-torch: SDPA over gathered blocks, the
reference the compiled CPU backend, dense_cpu.py, and the Triton backend,
dense_triton.py, are tested against).

This is the reference format: TurboQuant formats keep the same interface
(write / attention / nbytes) so the pool never changes shape for them.
"""
import torch
import torch.nn.functional as F

from kvcache.backends import AttentionBackend, backend_for, register_backend
from kvcache.layer_cache import LayerCache


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[L, Hkv, D] -> [L, Hq, D]: SDPA's own enable_gqa with a mask takes a
    slow path on CPU (~10x)."""
    return x.repeat_interleave(num_heads // x.shape[1], dim=1) if x.shape[1] != num_heads else x


class DenseLayerCache(LayerCache):
    format_kind = "dense"

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, group_id: int, sliding_window: int | None = None,
                 device: str | torch.device = "cpu", backend: str | None = None):
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_id = group_id
        self.sliding_window = sliding_window
        self.k = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.backend = backend_for(self.format_kind, self.k.device, backend)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool_tensors())

    def pool_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # A backend with a store of its own (dense-cpu: both in one compiled
        # call, bitwise the same) writes them; it returns False when it cannot.
        if self.backend.store(self, slot_mapping, k, v):
            return
        self.k.index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def _gather(self, block_table: torch.Tensor, first_block: int, num_blocks: int, dtype):
        """K/V [L, H, D] for blocks [first_block, first_block + num_blocks) of one block table."""
        bs = self.block_size
        cols = block_table[..., first_block:first_block + num_blocks]
        slots = (cols.unsqueeze(-1) * bs + torch.arange(bs, device=cols.device)).flatten()
        return (self.k.index_select(0, slots).to(dtype), self.v.index_select(0, slots).to(dtype))

    def _window_blocks(self, lo_pos: int, hi_pos: int) -> tuple[int, int]:
        """Blocks that hold key positions [lo_pos, hi_pos)."""
        bs = self.block_size
        first = lo_pos // bs
        return first, (hi_pos + bs - 1) // bs - first


@register_backend("dense-torch", "dense")
class DenseTorchBackend(AttentionBackend):
    """SDPA over the gathered blocks: one batched decode, one call per prefill.
    Runs on any device; its decode reads seq_lens.max() back (a sync on CUDA,
    where dense-triton is the default)."""
    supports_key_limits = True

    def forward(self, cache, q, meta, scale):
        if meta.num_decodes != meta.num_seqs:
            return super().forward(cache, q, meta, scale)
        # A decode-only step: the batch needs no split, and the read indices,
        # the same for every layer of a group and window, are computed once.
        key = ("dense-decode", cache.group_id, cache.sliding_window)
        index = meta.memo.get(key)
        if index is None:
            index = meta.memo[key] = self._decode_index(cache, meta.groups[cache.group_id].block_tables,
                                                        meta.seq_lens_t.to(q.device))
        return self._attend(cache, q, *index, scale)

    def decode(self, cache, q, block_tables, seq_lens, scale):
        return self._attend(cache, q, *self._decode_index(cache, block_tables, seq_lens.to(q.device)), scale)

    @staticmethod
    def _decode_index(cache, block_tables, seq_lens):
        """(slots [B * L] of the keys each sequence reads, valid-key mask [B, 1, 1, L])."""
        bs, dev = cache.block_size, block_tables.device
        cols = cache.decode_columns(block_tables, seq_lens)
        blocks = block_tables.gather(1, cols)
        offs = torch.arange(bs, device=dev)
        slots = (blocks.unsqueeze(-1) * bs + offs).flatten()
        pos = (cols.unsqueeze(-1) * bs + offs).flatten(1)
        valid = pos < seq_lens[:, None]
        if cache.sliding_window is not None:
            valid &= pos > (seq_lens[:, None] - 1 - cache.sliding_window)
        return slots, valid[:, None, None, :]

    @staticmethod
    def _attend(cache, q, slots, mask, scale):
        B, Hq, D = q.shape
        H, L = cache.num_kv_heads, mask.shape[-1]
        # index_select is ~10x faster than advanced indexing on CPU; the
        # [B, H, L, D] views need no copy.
        k = cache.k.index_select(0, slots).view(B, L, H, D).transpose(1, 2).to(q.dtype)
        v = cache.v.index_select(0, slots).view(B, L, H, D).transpose(1, 2).to(q.dtype)
        # GQA without copying K/V: a KV head's G query heads act as G queries.
        o = F.scaled_dot_product_attention(q.view(B, H, Hq // H, D), k, v, attn_mask=mask, scale=scale)
        return o.reshape(B, Hq, D)

    def prefill(self, cache, q, block_table, seq_len, scale, key_limit=None):
        Lq = q.shape[0]
        start = seq_len - Lq
        lo = 0 if cache.sliding_window is None else max(0, start - cache.sliding_window + 1)
        first, nblk = cache._window_blocks(lo, seq_len)
        k, v = cache._gather(block_table, first, nblk, q.dtype)         # [L, H, D]
        kpos = torch.arange(first * cache.block_size, (first + nblk) * cache.block_size, device=q.device)
        qpos = torch.arange(start, seq_len, device=q.device)
        mask = kpos[None, :] <= (qpos if key_limit is None else key_limit)[:, None]
        if cache.sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - cache.sliding_window
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale)
        return o.transpose(0, 1)
