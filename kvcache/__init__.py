"""Paged KV cache: block pool, per-layer storage formats, attention backends."""
