"""Flat batch metadata that the model runner hands to every attention layer."""
from dataclasses import dataclass, field

import torch


@dataclass
class GroupMetadata:
    """Per KV-cache group (layers sharing one block pool and block tables)."""
    slot_mapping: torch.Tensor   # [T] long: flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor   # [B, max_blocks] long; unused / freed entries hold 0 and are masked


@dataclass
class AttentionMetadata:
    """One forward over a mixed batch.

    Sequences are laid out decodes first (query_len == 1), then prefills.
    seq_lens counts the context after this step's tokens are written.

    The lists are host copies (the CPU backends' per-sequence prefill loop
    and DeepSeek-V4 read them); the tensors live on the model's device (the
    GPU kernels read them: no host sync); the max_* are host ints that size
    kernel grids. The model runner fills everything; built from the lists
    alone (tests), the rest is derived here, on the CPU.
    """
    query_start_loc: list[int]          # [B + 1] offsets of each sequence's tokens in the flat batch
    seq_lens: list[int]                 # [B]
    num_decodes: int                    # the first num_decodes sequences have query_len 1
    groups: list[GroupMetadata]         # indexed by group id
    kv_caches: list = field(default_factory=list)   # indexed by layer_idx: the layer's storage
    seq_lens_t: torch.Tensor | None = None          # [B] long, same as seq_lens
    query_start_loc_t: torch.Tensor | None = None   # [B + 1] long, same as query_start_loc
    max_seq_len: int | None = None                  # max(seq_lens)
    max_query_len: int | None = None                # the longest sequence's query_len
    # Values every layer of a group computes alike in this step (a backend's
    # decode indices), computed by the first layer that needs them.
    memo: dict = field(default_factory=dict)
    # The host values are bounds fixed at a CUDA graph's capture, not this
    # step's: nothing may skip work by them.
    frozen: bool = False
    # Bidirectional spans (Gemma 3's image tokens see each other): per token of
    # the flat batch, the last key position it may see (its own position
    # outside a span; the span's last one inside). None, the usual case: causal.
    # Only prefill rows carry spans (a span lies whole in one chunk's end).
    key_limits_t: torch.Tensor | None = None        # [T] long, on the model's device

    def __post_init__(self):
        if self.seq_lens_t is None:
            self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.long)
        if self.query_start_loc_t is None:
            self.query_start_loc_t = torch.tensor(self.query_start_loc, dtype=torch.long)
        if self.max_seq_len is None:
            self.max_seq_len = max(self.seq_lens, default=0)
        if self.max_query_len is None:
            qsl = self.query_start_loc
            self.max_query_len = max((qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)), default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes
