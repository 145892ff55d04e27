"""DeepSeek-V4's cache in the engine's paged pool (vLLM's hybrid-allocator shape).

Two kinds of KV-cache group (kv_manager.KVGroup):

  entry groups (one per compression ratio r: CSA r=4, HCA r=128)
      paged blocks of `block_size` compressed entries, i.e. block_size * r
      tokens' worth; a sequence's table grows with context (entry w lives in
      block table[w // block_size], row w % block_size). A CSA layer's block
      holds its compressed K=V entries (head_dim) and its lightning-indexer
      keys (index_head_dim); an HCA layer's only the entries.
  the state group (per_seq)
      one fixed-size slot per running sequence, taken on its first
      allocation and freed on finish / preemption: every layer's sliding
      window ring (window - 1 + max_rollback K=V vectors) and, for CSA / HCA,
      the compressors' carry rings (raw kv + gate projections of the last
      (1 + overlap) * r + max_rollback tokens; CSA's indexer has its own).

A sequence's length is the engine's num_computed_tokens; entries visible are
length // r, so truncating to L (rollback) is: length = L, free entry blocks
past L // r. The rings are position-addressed (slot = position % capacity),
and their capacities keep max_rollback extra positions, so the window and
carry of any L >= (highest position ever written) - max_rollback are intact.

The MTP head (speculative decoding's drafter; mtp_specs, sliding window only)
keeps its window ring in the same state slot, so it needs no group or table
of its own and is freed with the sequence. `mtp_batch` views it at the MTP
cache's own length: the positions the head has processed, usually behind
the main model's by one (it predicts t + 2 from t + 1 and the state at t).
Its ring keeps max_rollback extra positions too, so rolling back the MTP
cache (rejected drafts) is only passing a smaller length to the next
mtp_batch, within max_rollback of the highest position it ever wrote; the
stale slots past that length are overwritten before anything reads them.

Prefix caching: entry blocks are cached like any group's (block k of ratio
r under the hash of token block (k + 1) * r - 1); window and carry are
per-sequence state, so a hit resumes from a snapshot of the whole slot
(num_snapshots more slots after the sequences'; kvcache/kv_manager.py),
taken every snapshot_interval tokens and restored by copy_slots (the MTP
head's ring too: with a head, snapshots wait for its pass over the step).

The model reads all of this through the same interface as the per-sequence
kvcache.dsv4_state classes (Ring / entries .n, .append, .get), so
model_zoo/deepseek_v4.py runs unchanged on either.

kv_cache_dtype: a torch dtype stores everything in it; a compressed preset
(tq4, tq3, k8v4, ...: a kv_formats.KVPolicy) stores the CSA / HCA compressed
K=V entries in the policy's K format (TurboQuant codes + fp16 norms; K=V, and
K is the sensitive one) except in protected first/last layers, and windows,
carry and indexer keys in fp16.
"""
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from kvcache.backends import backend_for
from kvcache.dsv4_state import DSV4Batch, Ring
from kvcache.kv_formats import KVPolicy
from kvcache.kv_manager import KVGroup, snapshot_grid
from kvcache.linear_state import copy_rows
from kvcache.metadata import AttentionMetadata
from kvcache.pool_plan import KVPlan, snapshot_count
from kvcache.spec import DSV4LayerSpec, LayerSpec
from kvcache.turboquant import Codec

CSA = "compressed_sparse_attention"
# The most compressed entries per sequence a captured step may gather through
# dsv4-torch (32K tokens of context at CSA's ratio 4); dsv4-triton reads only
# the entries each sequence uses and has no such bound. Not tuned on a GPU.
MAX_GRAPH_ENTRIES = 8192


def dsv4_groups(specs: list[DSV4LayerSpec]) -> list[KVGroup]:
    """Entry groups by ascending ratio (group 0 grows fastest), then the state group."""
    ratios = sorted({s.ratio for s in specs if s.ratio})
    groups = [KVGroup(None, [s.layer_idx for s in specs if s.ratio == r], ratio=r) for r in ratios]
    return groups + [KVGroup(None, [s.layer_idx for s in specs], per_seq=True)]


# ---------------------------------------------------------------- storage

class DSV4LayerStorage:
    """One layer's tensors: per-slot rings [num_slots + 1, cap, dim] and, for
    CSA / HCA, entry rows [num_blocks * block_size + 1, dim]. The last slot
    (PAD_SLOT, as in kvcache/linear_state.py) and the last entry row belong to
    no sequence: a CUDA graph's pad sequences write that slot, and rows that
    close no window write that entry row (slot -1), so a batched step never
    branches on the host."""

    def __init__(self, spec: DSV4LayerSpec, num_slots: int, num_entry_blocks: int, block_size: int,
                 max_rollback: int, dtype, device, num_layers: int):
        self.spec = spec
        self.backend = backend_for("dsv4", device or "cpu")     # reads the entries in a batched step
        D, R, r = spec.head_dim, max_rollback, spec.ratio
        self.codec = None
        if isinstance(dtype, KVPolicy):
            fmt = dtype.layer_formats(LayerSpec(spec.layer_idx, 1, D), num_layers)[0]
            dtype = dtype.f16_dtype
            if r and fmt.kind != "f16":
                self.codec = Codec(fmt, 1, D, seed=spec.layer_idx)
        self.dtype = dtype

        def zeros(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)
        num_slots, num_rows = num_slots + 1, num_entry_blocks * block_size + 1
        self.window = zeros(num_slots, spec.sliding_window - 1 + R, D)
        self.state = {"window": self.window}     # per-slot tensors
        self.entries = {}                        # per-entry-row tensors
        if r:
            csa = spec.layer_type == CSA
            # Carry capacity as in dsv4_state.CompressorState: the raw vectors a
            # window closing next needs (overlap: the previous window too) + rollback.
            cap = (2 if csa else 1) * r + R
            width = 2 * D if csa else D
            self.state["comp_kv"], self.state["comp_gate"] = zeros(num_slots, cap, width), zeros(num_slots, cap, width)
            if self.codec is None:
                self.entries["comp"] = zeros(num_rows, D)
            else:   # rows of the codec's tensors (codes, norms), one 'head'
                self.coded = self.codec.alloc(num_rows, device)
                self.entries.update({f"comp_{k}": v for k, v in self.coded.items()})
            if csa:
                Di = spec.index_head_dim
                self.state["idx_kv"], self.state["idx_gate"] = (zeros(num_slots, cap, 2 * Di),
                                                                zeros(num_slots, cap, 2 * Di))
                self.entries["idx"] = zeros(num_rows, Di)

    def state_nbytes(self) -> dict[str, int]:
        """Bytes of one slot, by part."""
        return {k: v[0].numel() * v.element_size() for k, v in self.state.items()}

    def entry_block_nbytes(self, block_size: int) -> int:
        return sum(block_size * v[0].numel() * v.element_size() for v in self.entries.values())


class PagedEntries:
    """A sequence's entries in paged rows: the dsv4_state.Entries interface."""

    def __init__(self, data: torch.Tensor, table: torch.Tensor, block_size: int, n: int):
        self.data, self.table, self.block_size, self.n = data, table, block_size, n

    def _rows(self, a: int, b: int) -> torch.Tensor:
        i = torch.arange(a, b, device=self.table.device)
        return self.table[i // self.block_size] * self.block_size + i % self.block_size

    def append(self, x: torch.Tensor) -> None:
        self.data.index_copy_(0, self._rows(self.n, self.n + x.shape[0]), x.to(self.data.dtype))
        self.n += x.shape[0]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def get(self) -> torch.Tensor:
        return self.data.index_select(0, self._rows(0, self.n))

    def rows(self) -> torch.Tensor:
        """[n] the pool rows of the entries, in entry order."""
        return self._rows(0, self.n)


class PagedCodedEntries(PagedEntries):
    """Entries in a TurboQuant / int8 format: data is the codec's dict of row tensors."""

    def __init__(self, codec: Codec, data: dict, table: torch.Tensor, block_size: int, n: int, dtype):
        super().__init__(data, table, block_size, n)
        self.codec, self.dtype = codec, dtype

    def append(self, x: torch.Tensor) -> None:
        rows = self._rows(self.n, self.n + x.shape[0])
        for k, v in self.codec.encode(x.unsqueeze(1)).items():
            self.data[k].index_copy_(0, rows, v)
        self.n += x.shape[0]

    def get(self) -> torch.Tensor:
        rows = self._rows(0, self.n)
        got = {k: v.index_select(0, rows) for k, v in self.data.items()}
        return self.codec.dequantize(got, torch.float32).squeeze(1).to(self.dtype)


@dataclass
class CompressorView:
    ratio: int
    raw_kv: Ring
    raw_gate: Ring
    entries: PagedEntries


@dataclass
class LayerView:
    layer_type: str
    window: Ring
    compressor: CompressorView | None = None
    indexer: CompressorView | None = None
    store: "DSV4LayerStorage | None" = None     # the pool's tensors (its backend reads entries by row)


class SequenceView:
    """One sequence's cache for one forward: what the model reads as a DSV4SequenceState."""

    def __init__(self, length: int, layers: list[LayerView]):
        self.length, self.layers = length, layers

    def advance(self, n: int) -> None:
        self.length += n


@dataclass
class DSV4Rows:
    """Metadata of a step whose B sequences all have q rows, laid out
    sequence by sequence (decodes: q = 1; verification: 1 + k): device
    tensors only, so the step has no host sync and a CUDA graph can capture
    it. The model runs it a row at a time for all sequences
    (model_zoo/deepseek_v4.py Attention._rows); positions give each row's
    place, and the first row's is the sequence's cached length."""
    layers: list[DSV4LayerStorage]
    q: int
    block_size: int
    slots: torch.Tensor                  # [B] state slot (PAD_SLOT -1 for a graph's pad sequences)
    tables: dict[int, torch.Tensor]      # ratio -> [B, W] entry block tables (past a sequence's blocks: masked)
    entry_rows: dict[int, torch.Tensor]  # ratio -> [B * q] entry row each row's closing window goes to, or -1
    query_start_loc: list[int]
    closes: set | None = None            # (ratio, row) where some window closes; None: unknown (a graph)
    batched: ClassVar[bool] = True
    memo: dict = field(default_factory=dict)

    def may_close(self, ratio: int, row: int) -> bool:
        return self.closes is None or (ratio, row) in self.closes

    def check(self, positions: torch.Tensor) -> None:
        """Nothing to compare on the host: the lengths are the positions."""

    def advance(self) -> None:
        """The engine's lengths move on; nothing here holds one."""

    def once(self, key, make):
        """make(), computed by the first layer that asks in this step (what
        every layer computes alike: masks, entry indices)."""
        v = self.memo.get(key)
        if v is None:
            v = self.memo[key] = make()
        return v

    def entry_index(self, ratio: int) -> torch.Tensor:
        """[B, W * block_size] entry rows of every sequence's table, in entry order."""
        t = self.tables[ratio]
        return self.once(("entries", ratio), lambda: (t[:, :, None] * self.block_size
                                                      + torch.arange(self.block_size, device=t.device)).flatten(1))


class DSV4PagedCache:
    """All layers' storage; `batch` builds the model's metadata for one step."""

    has_slots = True              # per-sequence slots: copy_slots

    def __init__(self, specs: list[DSV4LayerSpec], groups: list[KVGroup], num_blocks: list[int],
                 block_size: int, max_rollback: int, dtype, device=None,
                 mtp_specs: list[DSV4LayerSpec] | None = None, capacity: int = 0, num_snapshots: int = 0):
        """mtp_specs: the MTP head's mtp_cache_spec(), kept per slot beside the
        main layers; capacity: the longest context a sequence may reach (the
        plan's), which bounds what a CUDA graph's step reads; num_snapshots:
        slots after the sequences' for prefix caching's state snapshots."""
        self.specs, self.groups, self.block_size, self.device = specs, groups, block_size, device
        self.max_rollback, self.capacity = max_rollback, capacity
        self.state_group = len(groups) - 1
        self.group_of_ratio = {g.ratio: gi for gi, g in enumerate(groups) if not g.per_seq}
        num_slots = num_blocks[self.state_group] + num_snapshots
        self.layers = [DSV4LayerStorage(s, num_slots, num_blocks[self.group_of_ratio[s.ratio]] if s.ratio else 0,
                                        block_size, max_rollback, dtype, device, len(specs)) for s in specs]
        self.mtp_specs = list(mtp_specs or [])
        self.mtp_layers = [DSV4LayerStorage(s, num_slots, 0, block_size, max_rollback, dtype, device, len(specs))
                           for s in _check_mtp(self.mtp_specs)]

    @property
    def nbytes(self) -> int:
        """Bytes of the sequences' slots and entry rows (the pad slot and the
        discard row apart, as the plan reserves them)."""
        return sum(t[:-1].numel() * t.element_size() for t in self.pool_tensors())

    def pool_tensors(self) -> list[torch.Tensor]:
        """Every layer's rings and entry rows (what sleep mode discards)."""
        return [t for layer in self.layers + self.mtp_layers
                for t in (*layer.state.values(), *layer.entries.values())]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots dst become copies of slots src (every layer's rings)."""
        copy_rows((t for layer in self.layers + self.mtp_layers for t in layer.state.values()), src, dst)

    # Steps whose sequences all have q rows, q within the rings' rollback room
    # (decodes, verification steps), run batched from device tensors
    # (DSV4Rows: capturable); others per sequence from host lists (batch).
    def batches_spans(self, q: int) -> bool:
        return 1 <= q <= 1 + self.max_rollback

    @property
    def attention_backends(self) -> list[str]:
        """Per layer: the backend reading its entries, or the model's torch sliding window."""
        return [layer.backend.name if layer.spec.ratio else "sliding-window-torch" for layer in self.layers]

    @property
    def not_capturable(self) -> str | None:
        # A graph's step through a backend that gathers whole tables (dsv4-torch)
        # reads each sequence's table at its bound, an eager one only what the
        # step's longest table holds: past this many entries, eager wins.
        ratios = [s.ratio for s in self.specs if s.ratio]
        bound = self.capacity // min(ratios) if ratios else 0
        if bound > MAX_GRAPH_ENTRIES and any(layer.backend.gathers_whole_table for layer in self.layers):
            return (f"DeepSeek-V4 decode graphs would read {bound} compressed entries per sequence and layer "
                    f"(context capacity {self.capacity}; at most {MAX_GRAPH_ENTRIES}: lower max_model_len), "
                    f"so its batched steps run eagerly")
        return None

    def spans_not_capturable(self, rows: int) -> str | None:
        if not self.batches_spans(rows):
            return f"DeepSeek-V4 spans of {rows} rows > 1 + max_rollback ({self.max_rollback}) run per sequence"
        return self.not_capturable

    def rows(self, meta: AttentionMetadata, B: int | None = None, mtp: bool = False) -> "DSV4Rows":
        """The batched view of a step the engine laid out for batches_spans
        (or of its first B sequences, single-token ones): the generic
        metadata's per-group tables and slot mappings (entry groups: the row
        of the entry a token's window closes, or -1); mtp: the MTP head's
        layers (a CUDA graph of its chained passes)."""
        g, q = meta.groups, meta.max_query_len
        if B is None:
            B = meta.num_seqs
        else:
            q = 1
        closes = None
        if not meta.frozen:
            # Which ratios' windows close at which row somewhere in the batch
            # (an eager step's host lengths): the others skip the pooling.
            pos = np.asarray(meta.seq_lens[:B], np.int64)[:, None] - q + np.arange(q)
            closes = {(r, j) for r in self.group_of_ratio for j in range(q) if ((pos[:, j] + 1) % r == 0).any()}
        return DSV4Rows(self.mtp_layers if mtp else self.layers, q, self.block_size,
                        g[self.state_group].block_tables[:B, 0],
                        {r: g[gi].block_tables[:B] for r, gi in self.group_of_ratio.items()},
                        {r: g[gi].slot_mapping[:B * q] for r, gi in self.group_of_ratio.items()},
                        meta.query_start_loc[:B + 1], closes)

    def _view(self, layer: DSV4LayerStorage, slot: int, length: int, tables: dict[int, torch.Tensor]) -> LayerView:
        st, s = layer.state, layer.spec
        view = LayerView(s.layer_type, Ring.over(st["window"][slot]), store=layer)
        if s.ratio:
            table, bs, n = tables[s.ratio], self.block_size, length // s.ratio
            entries = (PagedEntries(layer.entries["comp"], table, bs, n) if layer.codec is None else
                       PagedCodedEntries(layer.codec, layer.coded, table, bs, n, layer.dtype))
            view.compressor = CompressorView(s.ratio, Ring.over(st["comp_kv"][slot]), Ring.over(st["comp_gate"][slot]),
                                             entries)
            if s.layer_type == CSA:
                view.indexer = CompressorView(s.ratio, Ring.over(st["idx_kv"][slot]), Ring.over(st["idx_gate"][slot]),
                                              PagedEntries(layer.entries["idx"], table, bs, n))
        return view

    def batch(self, seqs: list[tuple[int, list[list[int]]]], query_start_loc: list[int],
              meta: AttentionMetadata | None = None) -> DSV4Batch:
        """seqs: per sequence (num_computed_tokens, its block table per group).
        With the step's generic metadata, its leading decodes run all at once
        (DSV4Batch.rows) and the views cover the other sequences."""
        nd = meta.num_decodes if meta is not None else 0
        rows = self.rows(meta, nd) if nd else None
        seqs, query_start_loc = seqs[nd:], query_start_loc[nd:]
        states = []
        for length, tables in seqs:
            slot = tables[self.state_group][0]
            by_ratio = {r: torch.tensor(tables[gi], dtype=torch.long, device=self.device)
                        for r, gi in self.group_of_ratio.items()}
            states.append(SequenceView(length, [self._view(layer, slot, length, by_ratio) for layer in self.layers]))
        return DSV4Batch(states, query_start_loc, rows)

    def mtp_batch(self, seqs: list[tuple[int, list[list[int]]]], query_start_loc: list[int]
                  ) -> "DSV4Batch | DSV4Rows":
        """The MTP head's metadata (for mtp_forward): seqs as for `batch`, but each
        length is the MTP cache's own (positions the head has processed for
        that sequence). A smaller length than last time rolls it back. Spans of
        one length batches_spans takes (chained drafts: one row each) run
        every sequence at once (DSV4Rows over the head's window rings)."""
        if not self.mtp_layers:
            raise ValueError("this pool was built without mtp_specs")
        n = np.diff(query_start_loc)
        if len(seqs) and (n == n[0]).all() and self.batches_spans(int(n[0])):
            slots = torch.tensor([t[self.state_group][0] for _, t in seqs], dtype=torch.long, device=self.device)
            return DSV4Rows(self.mtp_layers, int(n[0]), self.block_size, slots, {}, {}, list(query_start_loc),
                            set())
        states = []
        for length, tables in seqs:
            slot = tables[self.state_group][0]
            states.append(SequenceView(length, [self._view(layer, slot, length, {}) for layer in self.mtp_layers]))
        return DSV4Batch(states, query_start_loc)


def _check_mtp(mtp_specs: list[DSV4LayerSpec]) -> list[DSV4LayerSpec]:
    for i, s in enumerate(mtp_specs):
        # Entry groups are sized for the main layers' context; an MTP layer
        # with compressed entries would need its own tables.
        if s.ratio:
            raise ValueError(f"MTP layer of type {s.layer_type} is not supported (sliding window only)")
        # Attention reads meta.states[i].layers[layer_idx]: views are in layer_idx order.
        if s.layer_idx != i:
            raise ValueError(f"MTP layer specs must be numbered 0..{len(mtp_specs) - 1}, got {s.layer_idx} at {i}")
    return mtp_specs


# ---------------------------------------------------------------- planning

@dataclass
class DSV4Plan(KVPlan):
    """KVPlan for V4: the last group is the per-sequence state (a 'block' is one
    slot); capacity is the longest context one sequence can hold."""
    capacity: int = 0
    state_bytes_per_seq: int = 0
    kind_bytes_per_token: dict | None = None
    state_bytes_by_part: dict | None = None
    max_rollback: int = 0
    prefix_caching: bool = False
    mtp_specs: list | None = None   # the MTP head's layers, in the state slot (allocate_kv_caches)
    pad_bytes: int = 0              # the pad slot and discard entry rows (DSV4LayerStorage), not in total_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.capacity

    @property
    def bytes_per_token(self) -> float:
        """Pool bytes one more token of context costs (entries + indexer keys, all layers)."""
        return sum(self.kind_bytes_per_token.values())

    def bytes_per_token_by_kind(self) -> dict[str, float]:
        return dict(self.kind_bytes_per_token)


def _per_token(block_bytes: int, tokens: int) -> float:
    q, r = divmod(block_bytes, tokens)
    return q if r == 0 else block_bytes / tokens


def plan_dsv4_pool(specs: list[DSV4LayerSpec], budget_bytes: int, block_size: int, dtype: torch.dtype,
                   max_num_seqs: int, max_model_len: int, max_rollback: int = 0,
                   mtp_specs: list[DSV4LayerSpec] | None = None, snapshots: bool = False,
                   snapshot_tokens: int | None = None) -> DSV4Plan:
    """Slots for max_num_seqs sequences; the rest to entry groups sized for a
    common context capacity C (+ one partly filled block per running sequence
    in each group, so that concurrency never costs more than C tokens' worth).
    Bytes are measured on a one-block, one-slot storage of each layer.
    mtp_specs: the MTP head's layers, whose windows share the state slot."""
    groups = dsv4_groups(specs)
    probe = [DSV4LayerStorage(s, 1, 1, block_size, max_rollback, dtype, None, len(specs)) for s in specs]
    mtp_specs = list(mtp_specs or [])
    mtp_probe = [DSV4LayerStorage(s, 1, 0, block_size, max_rollback, dtype, None, len(specs))
                 for s in _check_mtp(mtp_specs)]
    layer_block = {s.layer_idx: p.entry_block_nbytes(block_size) for s, p in zip(specs, probe)}
    f16_probe = [DSV4LayerStorage(s, 1, 1, block_size, 0, torch.bfloat16, None, len(specs)) for s in specs]
    f16_per_token = sum(p.entry_block_nbytes(block_size) / (block_size * s.ratio)
                        for s, p in zip(specs, f16_probe) if s.ratio)
    state_by_part: dict[str, dict[str, int]] = {}
    for s, p in zip(specs, probe):
        kind = state_by_part.setdefault(s.layer_type, {})
        for part, b in p.state_nbytes().items():
            kind[part] = kind.get(part, 0) + b
    for p in mtp_probe:
        mtp = state_by_part.setdefault("mtp", {})
        for part, b in p.state_nbytes().items():
            mtp[part] = mtp.get(part, 0) + b
    state_bytes = sum(sum(p.state_nbytes().values()) for p in probe + mtp_probe)
    entry_groups = groups[:-1]
    block_bytes = [sum(layer_block[i] for i in g.layer_ids) for g in entry_groups] + [state_bytes]
    per_token = sum(b / (block_size * g.ratio) for g, b in zip(entry_groups, block_bytes))
    slack = sum(max_num_seqs * b for b in block_bytes[:-1])
    pad = state_bytes + sum(p.entry_block_nbytes(1) for p in probe)    # pad slot, discard rows
    rest = budget_bytes - max_num_seqs * state_bytes - slack - pad
    interval = snapshot_grid(groups, block_size, snapshot_tokens) if snapshots else 0
    num_snapshots = snapshot_count(budget_bytes, state_bytes, max_num_seqs, rest) if interval else 0
    rest -= num_snapshots * state_bytes
    if entry_groups:
        capacity = min(int(rest / per_token), max_model_len) if rest > 0 else 0
        if capacity < 1:
            raise ValueError(f"KV cache budget {budget_bytes} bytes is too small for {max_num_seqs} DeepSeek-V4 "
                             f"sequences ({state_bytes} bytes of window/carry state each, {slack} bytes of "
                             f"block slack); raise kv_cache_memory or lower max_num_seqs")
    else:   # sliding layers only: nothing grows with context
        capacity = max_model_len
    num_blocks = [-(-capacity // (block_size * g.ratio)) + max_num_seqs for g in entry_groups] + [max_num_seqs]
    kinds: dict[str, float] = {}
    for s in specs:
        if s.ratio:
            kinds[s.layer_type] = kinds.get(s.layer_type, 0) + _per_token(layer_block[s.layer_idx],
                                                                        block_size * s.ratio)
    return DSV4Plan(groups, num_blocks, block_bytes, block_size,
                    {s.layer_idx: _per_token(layer_block[s.layer_idx], block_size * s.ratio) if s.ratio else 0
                     for s in specs},
                    capacity=capacity, state_bytes_per_seq=state_bytes, kind_bytes_per_token=kinds,
                    state_bytes_by_part=state_by_part, max_rollback=max_rollback,
                    f16_bytes_per_token=f16_per_token, mtp_specs=mtp_specs or None, pad_bytes=pad,
                    prefix_caching=num_snapshots > 0, num_snapshots=num_snapshots,
                    snapshot_interval=interval if num_snapshots else 0)
