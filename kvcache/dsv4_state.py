"""Per-sequence cache state of a DeepSeek-V4 model, one entry per layer.

Every layer keeps
  window      the last sliding_window - 1 (+ max_rollback) K=V vectors, a ring
              indexed by position modulo its capacity;
and CSA / HCA layers also keep, per compressor ("compressor", and for CSA the
lightning indexer's own "indexer"):
  raw         a ring of the un-compressed projections (kv and gate, 2*d wide for
              CSA's overlapping windows, d for HCA) of the most recent tokens:
              this is the compressor's carry state; the next entry is built
              from it when its window closes;
  entries     the compressed entries emitted so far (one per `ratio` tokens),
              a growing [n, d] tensor; for the indexer these are its keys.

Nothing is stored that cannot be rebuilt from the retained raw ring, so a
rollback of k <= max_rollback tokens is: length -= k, entries truncated to
length // ratio. The stale ring slots past the new length are overwritten
before anything reads them.

The model (model_zoo/deepseek_v4.py) drives this through DSV4Batch: it reads
`length` as the position of the first new token, writes its new tokens, and
the batch's `advance()` moves each sequence on after the forward.

entry_format (e.g. "tq3", "tq4", "q8"; None = model dtype) stores the CSA/HCA
compressed KV entries in a kvcache.turboquant format: codes + fp16 norms,
K=V so one vector per entry. Reads dequantise (the reference path; a kernel
would score the rotated codes directly). Indexer keys stay in the model dtype.
"""
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvcache.turboquant import Codec


class Ring:
    """Fixed-capacity ring of per-position vectors: slot = position % capacity."""

    def __init__(self, capacity: int, dim: int, dtype=torch.float32, device=None):
        self.capacity = capacity
        self.data = torch.zeros(capacity, dim, dtype=dtype, device=device)

    @classmethod
    def over(cls, data: torch.Tensor) -> "Ring":
        """A ring on existing storage [capacity, dim] (a slot of the paged pool)."""
        ring = cls.__new__(cls)
        ring.capacity, ring.data = data.shape[0], data
        return ring

    def write(self, start: int, x: torch.Tensor) -> None:
        """Store x[i] as position start + i (only the last `capacity` survive)."""
        n = x.shape[0]
        if n > self.capacity:
            start, x, n = start + n - self.capacity, x[n - self.capacity:], self.capacity
        slots = torch.arange(start, start + n, device=self.data.device) % self.capacity
        self.data[slots] = x.to(self.data.dtype)

    def read(self, start: int, end: int) -> torch.Tensor:
        """Vectors of positions [start, end); the caller keeps end - start <= capacity
        and every position among the last `capacity` written."""
        assert 0 <= end - start <= self.capacity, (start, end, self.capacity)
        slots = torch.arange(start, end, device=self.data.device) % self.capacity
        return self.data[slots]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class Entries:
    """A growing [n, dim] tensor with amortised appends and truncation."""

    def __init__(self, dim: int, dtype=torch.float32, device=None):
        self.data = torch.zeros(16, dim, dtype=dtype, device=device)
        self.n = 0

    def append(self, x: torch.Tensor) -> None:
        need = self.n + x.shape[0]
        if need > self.data.shape[0]:
            grown = torch.zeros(max(need, 2 * self.data.shape[0]), self.data.shape[1],
                                dtype=self.data.dtype, device=self.data.device)
            grown[:self.n] = self.data[:self.n]
            self.data = grown
        self.data[self.n:need] = x.to(self.data.dtype)
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def get(self) -> torch.Tensor:
        return self.data[:self.n]

    def nbytes(self) -> int:
        """Bytes held by the live entries (not the spare capacity)."""
        return self.n * self.data.shape[1] * self.data.element_size()


class CodedEntries:
    """Entries in a TurboQuant / int8 format (kvcache.turboquant.Codec, one 'head')."""

    def __init__(self, dim: int, fmt, seed: int, dtype=torch.float32, device=None):
        self.codec = Codec(fmt, 1, dim, seed)
        self.rows = self.codec.alloc(16, device)
        self.dtype, self.n = dtype, 0

    def append(self, x: torch.Tensor) -> None:
        need = self.n + x.shape[0]
        cap = next(iter(self.rows.values())).shape[0]
        if need > cap:
            grown = self.codec.alloc(max(need, 2 * cap), next(iter(self.rows.values())).device)
            for k in grown:
                grown[k][:self.n] = self.rows[k][:self.n]
            self.rows = grown
        for k, v in self.codec.encode(x.unsqueeze(1)).items():
            self.rows[k][self.n:need] = v
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def get(self) -> torch.Tensor:
        rows = {k: v[:self.n] for k, v in self.rows.items()}
        return self.codec.dequantize(rows, torch.float32).squeeze(1).to(self.dtype)

    def nbytes(self) -> int:
        return sum(v[:self.n].numel() * v.element_size() for v in self.rows.values())


class CompressorState:
    """Carry state (raw ring) + emitted entries of one compressor."""

    def __init__(self, ratio: int, raw_dim: int, entry_dim: int, overlap: bool, max_rollback: int,
                 dtype=torch.float32, device=None, entry_format=None, seed: int = 0):
        self.ratio = ratio
        # A window closing at the next step needs the raw vectors of its own
        # tokens and (overlap) of the previous window: < (1 + overlap) * ratio
        # tokens back from the current length, plus whatever a rollback undoes.
        cap = (2 if overlap else 1) * ratio + max_rollback
        self.raw_kv = Ring(cap, raw_dim, dtype, device)
        self.raw_gate = Ring(cap, raw_dim, dtype, device)
        self.entries = (Entries(entry_dim, dtype, device) if entry_format is None
                        else CodedEntries(entry_dim, entry_format, seed, dtype, device))

    def rollback_to(self, length: int) -> None:
        self.entries.truncate(length // self.ratio)

    def nbytes(self) -> dict[str, int]:
        return {"carry": self.raw_kv.nbytes() + self.raw_gate.nbytes(), "entries": self.entries.nbytes()}


class DSV4LayerState:
    store = None      # per-sequence tensors of its own, no pool storage (LayerView.store): torch attention

    def __init__(self, layer_type: str, head_dim: int, sliding_window: int, ratio: int = 0,
                 index_head_dim: int = 0, max_rollback: int = 0, dtype=torch.float32, device=None,
                 entry_format=None, seed: int = 0):
        self.layer_type = layer_type
        self.window = Ring(sliding_window - 1 + max_rollback, head_dim, dtype, device)
        self.compressor = self.indexer = None
        if layer_type == "compressed_sparse_attention":
            self.compressor = CompressorState(ratio, 2 * head_dim, head_dim, True, max_rollback, dtype, device,
                                              entry_format, seed)
            self.indexer = CompressorState(ratio, 2 * index_head_dim, index_head_dim, True, max_rollback,
                                           dtype, device)
        elif layer_type == "heavily_compressed_attention":
            self.compressor = CompressorState(ratio, head_dim, head_dim, False, max_rollback, dtype, device,
                                              entry_format, seed)

    def rollback_to(self, length: int) -> None:
        for c in (self.compressor, self.indexer):
            if c is not None:
                c.rollback_to(length)

    def nbytes(self) -> dict[str, int]:
        out = {"window": self.window.nbytes()}
        for name, c in (("compressor", self.compressor), ("indexer", self.indexer)):
            if c is not None:
                for k, v in c.nbytes().items():
                    out[f"{name}_{k}"] = v
        return out


class DSV4SequenceState:
    """One sequence's cache for every layer of the model (or of its MTP head)."""

    def __init__(self, layer_specs: list, max_rollback: int = 0, dtype=torch.float32, device=None,
                 entry_format: str | None = None):
        """layer_specs: the model's kv_cache_spec() (kvcache.spec.DSV4LayerSpec per layer).
        entry_format: None, or a component format name for the compressed KV entries
        (tq4, tq3, tq2, q8; see kvcache/kv_formats.py)."""
        self.max_rollback = max_rollback
        self.length = 0
        self.rollback_budget = 0   # tokens that may still be rolled back
        fmt = None
        if entry_format is not None:
            from kvcache.kv_formats import component
            fmt = component(entry_format)
        self.layers = [DSV4LayerState(s.layer_type, s.head_dim, s.sliding_window, s.ratio, s.index_head_dim,
                                      max_rollback=max_rollback, dtype=dtype, device=device,
                                      entry_format=fmt, seed=i)
                       for i, s in enumerate(layer_specs)]

    def advance(self, n: int) -> None:
        self.length += n
        self.rollback_budget = min(self.max_rollback, self.rollback_budget + n)

    def rollback(self, k: int) -> None:
        """Forget the last k tokens (k <= max_rollback and <= tokens written since)."""
        if k > self.rollback_budget:
            raise ValueError(f"cannot roll back {k} tokens (at most {self.rollback_budget} now)")
        self.length -= k
        self.rollback_budget -= k
        for layer in self.layers:
            layer.rollback_to(self.length)

    def nbytes_by_kind(self) -> dict[str, dict[str, int]]:
        """Bytes held now, per layer kind and part (summed over layers of that kind)."""
        out: dict[str, dict[str, int]] = {}
        for layer in self.layers:
            kind = out.setdefault(layer.layer_type, {})
            for part, b in layer.nbytes().items():
                kind[part] = kind.get(part, 0) + b
        return out


@dataclass
class DSV4Batch:
    """Attention metadata of a DeepSeek-V4 forward over a flat batch: sequence
    i owns tokens [query_start_loc[i], query_start_loc[i + 1]) and continues
    states[i] (its first new token is at position states[i].length)."""
    states: list[DSV4SequenceState]
    query_start_loc: list[int] = field(default_factory=list)
    # The step's leading single-token sequences, run all at once (a
    # kvcache/dsv4_paged.py DSV4Rows over tokens [0, query_start_loc[0])), or None.
    rows: Any = None
    batched: ClassVar[bool] = False     # the states, a sequence at a time (DSV4Rows: all at once)

    def __post_init__(self):
        if not self.query_start_loc:
            raise ValueError("query_start_loc is required")

    def check(self, positions: torch.Tensor) -> None:
        """Each sequence's first new token sits at its cached length."""
        for i, st in enumerate(self.states):
            a, b = self.query_start_loc[i], self.query_start_loc[i + 1]
            if b > a and int(positions[a]) != st.length:
                raise ValueError(f"sequence {i}: first position {int(positions[a])} != cached length {st.length}")

    def advance(self) -> None:
        for i, s in enumerate(self.states):
            s.advance(self.query_start_loc[i + 1] - self.query_start_loc[i])
