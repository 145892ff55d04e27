"""What a model asks of the KV cache, layer by layer."""
from dataclasses import dataclass


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
