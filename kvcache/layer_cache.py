"""What every per-layer paged storage format shares: the split of a flat
batch into one batched decode and per-sequence prefills, and which block
columns a decode reads."""
import torch

from kvcache.metadata import AttentionMetadata, GroupMetadata


class LayerCache:
    """Subclasses set block_size, group_id, sliding_window and implement
    write(slot_mapping, k, v), nbytes, _decode(q [B, Hq, D], block_tables,
    seq_lens, scale, *extra_tables) and _prefill(q [Lq, Hq, D], block_table,
    seq_len, scale, *extra_tables), where extra_tables are the block tables of
    extra_groups (more KV-cache groups the layer stores into, e.g. hot tokens)."""
    block_size: int
    group_id: int
    sliding_window: int | None
    extra_groups: tuple = ()

    def store(self, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's new K/V (k, v: [T, Hkv, D])."""
        self.write(meta.groups[self.group_id].slot_mapping, k, v)

    def attention(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D] for the whole flat batch (decodes first) -> [T, Hq, D]."""
        group: GroupMetadata = meta.groups[self.group_id]
        extra = [meta.groups[g].block_tables for g in self.extra_groups]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], group.block_tables[:nd], meta.seq_lens_t[:nd], scale,
                                    *[t[:nd] for t in extra])
        for i in range(nd, meta.num_seqs):
            s, e = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[s:e] = self._prefill(q[s:e], group.block_tables[i], meta.seq_lens[i], scale,
                                     *[t[i] for t in extra])
        return out

    def decode_columns(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """[B, nblk] block-table columns each decoding sequence reads: all of
        its blocks, or only those of its own window for a sliding layer."""
        B, bs, dev = seq_lens.shape[0], self.block_size, seq_lens.device
        if self.sliding_window is None:
            nblk = -(-int(seq_lens.max()) // bs)
            return torch.arange(nblk, device=dev).expand(B, nblk)
        nblk = min(-(-(self.sliding_window - 1) // bs) + 1, block_tables.shape[1])
        first = ((seq_lens - self.sliding_window).clamp(min=0) // bs).clamp(max=block_tables.shape[1] - nblk)
        return first[:, None] + torch.arange(nblk, device=dev)
