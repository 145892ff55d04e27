"""Per-sequence state of linear-attention layers (kvcache.spec.LinearAttentionSpec):
one slot per running sequence, the slot id being the sequence's one 'block'
in the layer group's pool (a per_seq group of kv_manager). A slot is reused
by the next sequence as it is: the layer starts from zeros when the
sequence's first token is in the step (start 0), so nothing is cleared on
free, and a preempted sequence recomputes its state from the start.

A slot holds spec.checkpoints copies of the state: the state after position
p is at index p % checkpoints, so a step writes the states after each of its
last `checkpoints` positions and the next step reads the one after its start
- 1. A rollback of up to checkpoints - 1 tokens (rejected speculative
drafts) is then only a smaller start: nothing is copied back. Without
speculation there is one copy.

One more slot than the pool hands out, the last (PAD_SLOT = -1, as torch
indexes), belongs to no sequence: a CUDA graph's pad rows point there, so
their state writes land in it and not in a running sequence's slot. nbytes
counts the sequences' slots; the pool plan reserves the pad slot apart.

The state is not block-addressable (it sums the whole prefix): prefix
caching resumes from snapshots of whole slots (num_snapshots more slots
after the sequences', before the pad slot; kvcache/kv_manager.py), which
copy_slots takes and restores."""
import torch

from kvcache.spec import LinearAttentionSpec

PAD_SLOT = -1


def copy_rows(tensors, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Rows dst of every tensor become copies of its rows src (slot copies of per-sequence state)."""
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


class LinearStateCache:
    has_slots = True              # per-sequence slots: copy_slots

    def __init__(self, spec: LinearAttentionSpec, num_slots: int, group_id: int,
                 device: str | torch.device = "cpu"):
        self.spec, self.group_id = spec, group_id
        self.checkpoints = P = spec.checkpoints
        self.num_slots = num_slots           # the sequences' and the snapshots'
        n = num_slots + 1
        self.conv = torch.zeros(n, P, spec.conv_dim, spec.conv_kernel - 1, dtype=torch.float32, device=device)
        self.recurrent = torch.zeros(n, P, spec.num_heads, spec.k_head_dim, spec.v_head_dim,
                                     dtype=torch.float32, device=device)

    # Its layer's decode is torch ops over the slots the block tables name,
    # which a capture's warm-up checks for host syncs like any other.
    not_capturable = None
    attention_backends = ["gated-delta-torch"]     # the model's delta rule (model_zoo/gated_delta.py)

    def spans_not_capturable(self, rows: int) -> str | None:
        # Spans of one length up to `checkpoints` rows (a verification step) run a
        # token at a time from device lengths (qwen3_next.GatedDeltaNet._rows);
        # longer ones per sequence over the host's.
        if rows <= self.checkpoints:
            return None
        return f"linear-attention spans of {rows} rows > {self.checkpoints} checkpoints run per sequence"

    @property
    def nbytes(self) -> int:
        return sum(t[:self.num_slots].numel() * t.element_size() for t in self.pool_tensors())

    def pool_tensors(self) -> list[torch.Tensor]:
        """Its slots (what sleep mode discards)."""
        return [self.conv, self.recurrent]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots dst become copies of slots src (all checkpoints)."""
        copy_rows((self.conv, self.recurrent), src, dst)

    def slots(self, meta) -> torch.Tensor:
        """[B] slot of each sequence of the step."""
        return meta.groups[self.group_id].block_tables[:, 0]
