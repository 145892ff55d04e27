"""What a model asks of the KV cache, layer by layer."""
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache needs.

    sliding_window: a query at position p sees keys at positions > p - window
    (the window counts the query itself, as in transformers); None = full.
    """
    layer_idx: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    per_seq = False           # grows with context (paged blocks), not a fixed per-sequence state


@dataclass(frozen=True)
class DSV4LayerSpec:
    """One DeepSeek-V4 layer's cache needs (kvcache/dsv4_state.py, dsv4_paged.py).

    layer_type: sliding_attention | compressed_sparse_attention (CSA: ratio-r
    overlapping compressor + lightning indexer keys at index_head_dim) |
    heavily_compressed_attention (HCA: ratio-r compressor, no overlap).
    Every layer has a sliding window of K=V vectors of head_dim.
    """
    layer_idx: int
    layer_type: str
    head_dim: int
    sliding_window: int
    ratio: int = 0
    index_head_dim: int = 0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """One linear-attention layer's state (Gated DeltaNet: Qwen3-Next, Qwen3.5),
    a fixed size per sequence whatever its length (kvcache/linear_state.py):
    the last conv_kernel - 1 inputs of its causal conv over conv_dim channels,
    and a [num_heads, k_head_dim, v_head_dim] recurrent state, both fp32;
    `checkpoints` copies of them (the states after a sequence's last positions:
    1 + the tokens a speculative step may roll back)."""
    layer_idx: int
    conv_dim: int
    conv_kernel: int
    num_heads: int
    k_head_dim: int
    v_head_dim: int
    checkpoints: int = 1
    sliding_window = None
    per_seq = True

    @property
    def state_bytes(self) -> int:
        one = self.conv_dim * (self.conv_kernel - 1) + self.num_heads * self.k_head_dim * self.v_head_dim
        return 4 * self.checkpoints * one

    def with_rollback(self, max_rollback: int) -> "LinearAttentionSpec":
        return replace(self, checkpoints=1 + max_rollback)
