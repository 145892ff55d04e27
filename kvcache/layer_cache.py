"""What every per-layer paged storage format shares: its attention backend
(kvcache/backends.py, chosen by format and device), and which block columns
a decode reads."""
import torch

from kvcache.backends import AttentionBackend, backend_for
from kvcache.metadata import AttentionMetadata


class LayerCache:
    """Subclasses set block_size, group_id, sliding_window, format_kind
    ("dense" / "tq": which backends can read it) and device, and implement
    write(slot_mapping, k, v) and nbytes. Attention runs in the backend the
    registry gives for (format_kind, device), looked up on first use unless
    set (`cache.backend = name`); _decode / _prefill are its one-call entry
    points (tests, benchmarks). extra_groups: more KV-cache groups the layer
    stores into (e.g. hot tokens), whose block tables the backend also gets."""
    block_size: int
    group_id: int
    sliding_window: int | None
    format_kind: str = ""
    extra_groups: tuple = ()
    has_slots = False         # paged blocks only, no per-sequence slots to copy
    _backend: AttentionBackend | None = None

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def pool_tensors(self) -> list[torch.Tensor]:
        """The tensors of its blocks (what sleep mode discards; not its constants)."""
        raise NotImplementedError

    def pool_tensors_by_group(self) -> dict[int, list[torch.Tensor]]:
        """pool_tensors by the KV-cache group whose blocks index their rows
        (slot-major: block b's rows are b * block_size ..)."""
        return {self.group_id: self.pool_tensors()}

    @property
    def backend(self) -> AttentionBackend:
        if self._backend is None:
            self._backend = backend_for(self.format_kind, self.device)
        return self._backend

    @backend.setter
    def backend(self, b: "AttentionBackend | str | None") -> None:
        """A backend, a registered name, or None (the default for the device)."""
        self._backend = b if isinstance(b, AttentionBackend) else backend_for(self.format_kind, self.device, b)

    @property
    def attention_backends(self) -> list[str]:
        """What runs each layer's attention (one layer here), for the startup log."""
        return [self.backend.name]

    @property
    def not_capturable(self) -> str | None:
        """Why a decode step over this layer cannot be a CUDA graph (None: it can)."""
        b = self.backend
        return None if b.capturable else f"attention backend {b.name} is not capturable"

    @property
    def no_key_limits(self) -> str | None:
        """Why this layer cannot attend bidirectional spans (None: it can)."""
        b = self.backend
        return None if b.supports_key_limits else f"attention backend {b.name} has no bidirectional spans"

    def spans_not_capturable(self, rows: int) -> str | None:
        """Why a verification step (`rows` = 1 + k rows per sequence) over this layer cannot be a CUDA graph."""
        return self.not_capturable

    def store(self, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's new K/V (k, v: [T, Hkv, D])."""
        self.write(meta.groups[self.group_id].slot_mapping, k, v)

    def attention(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D] for the whole flat batch (decodes first) -> [T, Hq, D]."""
        return self.backend.forward(self, q, meta, scale)

    def _decode(self, q, block_tables, seq_lens, scale, *extra_tables):
        """q [B, Hq, D], one query token per sequence -> [B, Hq, D]."""
        return self.backend.decode(self, q, block_tables, seq_lens, scale, *extra_tables)

    def _prefill(self, q, block_table, seq_len, scale, *extra_tables):
        """q [Lq, Hq, D], the last Lq positions of one sequence -> [Lq, Hq, D]."""
        return self.backend.prefill(self, q, block_table, seq_len, scale, *extra_tables)

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
