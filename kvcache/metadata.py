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
    """
    query_start_loc: list[int]          # [B + 1] offsets of each sequence's tokens in the flat batch
    seq_lens: list[int]                 # [B]
    num_decodes: int                    # the first num_decodes sequences have query_len 1
    groups: list[GroupMetadata]         # indexed by group id
    kv_caches: list = field(default_factory=list)   # indexed by layer_idx: the layer's storage
    seq_lens_t: torch.Tensor | None = None          # [B] long, same as seq_lens

    def __post_init__(self):
        if self.seq_lens_t is None:
            self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.long)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)
