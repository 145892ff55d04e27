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
