"""The attention layer models call: writes new K/V into the layer's paged
storage and attends over the sequence's cached history."""
import torch
import torch.nn.functional as F
from torch import nn

from kvcache.dense_cache import expand_kv
from kvcache.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D].

        meta None runs one causal sequence with no cache (tests, scoring).
        """
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if meta is None:
            return self._no_cache(q, k, v).reshape(T, -1)
        cache = meta.kv_caches[self.layer_idx]
        cache.store(meta, k, v)
        return cache.attention(q, meta, self.scale).reshape(T, -1)

    def _no_cache(self, q, k, v):
        T = q.shape[0]
        pos = torch.arange(T, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if self.sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - self.sliding_window
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1)
