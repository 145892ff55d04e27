"""CUDA graphs for decode and verification steps (vLLM's approach).

A decode step of a small model is mostly kernel-launch overhead on a GPU:
hundreds of small launches of a few microseconds each. The model's forward
over a decode batch is captured once per padded batch size (1, 2, 4, 8, then
every multiple of 8 up to max_num_seqs) into a CUDA graph that reads its
inputs from static device buffers; a step copies its inputs there and
replays the graph of the smallest size that holds its batch. With a
speculative config (n-gram drafts) a second set takes 1 + k rows per
sequence, for verification steps: a sequence with fewer drafts gets pad rows
after its own (the positions after its tokens, slot -1, its sequence length
counting them: its real rows keep their positions, and causal attention
keeps the pads out of their view). Pad sequences have sequence length 0 and
slot -1: the attention reads no key for them and the cache store writes
nothing (a linear-attention layer's state: they write the cache's pad slot,
kvcache/linear_state.py). Steps with a prefill chunk or prompt logprobs run
eagerly, as do those whose layer caches say they cannot be captured
(`not_capturable`, and for verification steps `spans_not_capturable(1 + k)`:
linear-attention spans longer than the state's checkpoints run per
sequence, and so do DeepSeek-V4's spans past its rollback room).
DeepSeek-V4's pool reads the same generic metadata (kvcache/dsv4_paged.py
DSV4Rows: the state slot from the per-sequence group's table, entry rows
from the entry groups' slot mappings, -1 where a row closes no window).
Under an MTP proposer the graphs capture the model's streams
(forward_streams), which the proposer reads after the replay.

The captured metadata's host-side values are fixed at capture: every
sequence counts as a decode (one row) or as a span of 1 + k rows,
seq_lens (the host list) is max_model_len for every sequence, the block
tables are max_model_len wide. A capturable backend therefore sizes its
launches from those bounds and reads the real lengths from seq_lens_t and
query_start_loc_t on the device. `emulate=True` (tests, on CPU) replays by
running the forward again over the static buffers with that same frozen
metadata and with every host sync forbidden (forbid_host_syncs), which
checks all of this without a GPU; only the capture itself needs CUDA.
"""
import logging
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.pool_plan import cache_objects

log = logging.getLogger("tqserve.engine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, then multiples of 8, up
    to max_num_seqs (included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class HostSyncError(RuntimeError):
    pass


# Ops that read a device value on the host (a sync on CUDA, an error under
# stream capture) or build a tensor from Python data (a host-to-device copy).
_SYNCING = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::item",
            "aten::masked_select", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::_unique", "aten::_unique2",
            "aten::unique_dim", "aten::unique_consecutive", "aten::bincount"}


class _ForbidSyncs(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _SYNCING:
            raise HostSyncError(f"{func} syncs with the host")
        if name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in args[1] if i is not None):
            raise HostSyncError(f"{func} with a boolean mask syncs with the host (nonzero)")
        if name == "aten::repeat_interleave" and func._overloadname == "Tensor" and \
                (kwargs or {}).get("output_size") is None:
            raise HostSyncError(f"{func} with tensor repeats and no output_size syncs with the host")
        return func(*args, **(kwargs or {}))


@contextmanager
def forbid_host_syncs():
    """Raise HostSyncError at any torch op inside that would read a device
    value on the host or copy Python data to the device (what stream capture
    refuses). Works on any device, so a CPU run proves a step capturable as
    far as torch ops go (Triton launches are not torch ops)."""
    with _ForbidSyncs():
        yield


class DecodeGraphs:
    """Static input buffers and one graph per (padded batch size, query
    length): query length 1 for plain decodes, 1 + k for speculative
    verification steps (k drafts; a sequence with fewer is padded to 1 + k
    rows by the runner).

    groups: per KV-cache group, the widest block table a sequence can have
    (blocks of max_model_len tokens). run() takes a step's device inputs
    (padded by the runner to a captured shape) and returns the hidden states
    of all its rows."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, widths: list[int], max_model_len: int,
                 max_num_seqs: int, device: torch.device, emulate: bool = False,
                 query_lens: tuple[int, ...] = (1,), max_num_tokens: int | None = None, streams: bool = False,
                 head: bool = False, lora=None):
        self.model, self.kv_caches, self.device, self.emulate = model, kv_caches, device, emulate
        # streams: capture the model's pre-collapse streams (forward_streams), which an MTP proposer keeps;
        # head: the MTP head's chained passes (mtp_streams), whose second input, the streams
        # (model.stream_shape per row), is a static buffer too.
        self.forward = model.mtp_streams if head else model.forward_streams if streams else model
        self.sizes = capture_sizes(max_num_seqs)
        # A graph's rows stay within a step's token budget (what the KV budget
        # profiled): verification sizes of more rows are not captured.
        cap = max_num_tokens or self.sizes[-1] * max(query_lens)
        fits = {q: [b for b in self.sizes if b * q <= cap] for q in sorted(set(query_lens))}
        self.sizes_of = {q: v for q, v in fits.items() if v}
        self.query_lens = tuple(self.sizes_of)
        n, t = self.sizes[-1], max(v[-1] * q for q, v in self.sizes_of.items())
        z = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(t, **z)
        self.pos = torch.zeros(t, **z)
        self.seq_lens = torch.zeros(n, **z)
        self.qsl = {q: torch.arange(0, n * q + 1, q, **z) for q in self.query_lens}   # never written
        self.slots = [torch.full((t,), -1, **z) for _ in widths]
        self.tables = [torch.zeros(n, w, **z) for w in widths]
        # LoRA (lora: the model's parallel/lora.LoRAContext): each row's adapter
        # slot, -1 for none; the layers read it in token mode while captured.
        self.lora = lora
        self.lora_slots = torch.full((t,), -1, dtype=torch.int32, device=device) if lora is not None else None
        self.streams = None
        if head:
            dtype = next(model.parameters()).dtype
            self.streams = torch.zeros(t, *model.stream_shape, dtype=dtype, device=device)
        self.max_model_len = max_model_len
        self.graphs: dict[tuple[int, int], tuple] = {}   # (size, q) -> (graph or None if emulated, metadata, hidden)
        self.pool = None
        self.replays = 0

    def size_for(self, batch: int, q: int = 1) -> int | None:
        """The captured size a batch of this many sequences of q rows pads to."""
        return next((b for b in self.sizes_of.get(q, ()) if b >= batch), None)

    def _meta(self, b: int, q: int) -> AttentionMetadata:
        groups = [GroupMetadata(s[:b * q], t[:b]) for s, t in zip(self.slots, self.tables)]
        return AttentionMetadata(list(range(0, b * q + 1, q)), [self.max_model_len] * b, b if q == 1 else 0, groups,
                                 self.kv_caches, seq_lens_t=self.seq_lens[:b], query_start_loc_t=self.qsl[q][:b + 1],
                                 max_seq_len=self.max_model_len, max_query_len=q, frozen=True)

    def _forward(self, b: int, q: int, meta: AttentionMetadata) -> torch.Tensor:
        n = b * q
        if self.lora is not None:
            self.lora.token_slots = self.lora_slots
        try:
            if self.streams is not None:
                return self.forward(self.ids[:n], self.streams[:n], self.pos[:n], meta)
            return self.forward(self.ids[:n], self.pos[:n], meta)
        finally:
            if self.lora is not None:
                self.lora.token_slots = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Most rows first, all graphs sharing one memory pool (vLLM's order:
        smaller graphs reuse the larger ones' blocks)."""
        shapes = sorted(((b, q) for q, sizes in self.sizes_of.items() for b in sizes),
                        key=lambda bq: (bq[0] * bq[1], bq[1]), reverse=True)
        for b, q in shapes:
            meta = self._meta(b, q)
            # Warm-up, eagerly: compiles kernels and moves lazily placed
            # constants before capture; with syncs forbidden, a step that
            # cannot be captured fails here with the op's name.
            with forbid_host_syncs():
                self._forward(b, q, meta)
            if self.emulate:
                self.graphs[b, q] = (None, meta, None)
                continue
            meta.memo.clear()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self._forward(b, q, meta)
            self.pool = graph.pool()
            self.graphs[b, q] = (graph, meta, hidden)
        if not self.emulate:
            torch.cuda.synchronize(self.device)

    def run(self, b: int, q: int, ids: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor,
            groups: list[GroupMetadata], streams: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph of b sequences of q rows on a step's inputs (b * q
        rows, pads included; block tables up to their own width, which the
        captured ones bound; streams: the head's, its real rows only, pads
        keep older finite values). Returns the hidden states [b * q, hidden]:
        valid until the next run. With LoRA, set_lora_rows first."""
        graph, meta, hidden = self.graphs[b, q]
        self.replays += 1
        if streams is not None:
            self.streams[:len(streams)].copy_(streams)
        self.ids[:b * q].copy_(ids, non_blocking=True)
        self.pos[:b * q].copy_(pos, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        for s, t, g in zip(self.slots, self.tables, groups):
            s[:b * q].copy_(g.slot_mapping, non_blocking=True)
            # Columns past the step's width keep older entries: never read,
            # since a row reads only the blocks of its seq_len.
            t[:b, :g.block_tables.shape[1]].copy_(g.block_tables, non_blocking=True)
        if graph is not None:
            graph.replay()
            return hidden
        meta.memo.clear()
        with forbid_host_syncs():
            return self._forward(b, q, meta)

    def set_lora_rows(self, rows: int, lora_rows: list[tuple[int, int, int]]) -> None:
        """The next replay's adapter slot per row, of its `rows` rows: those
        of lora_rows' (slot, first row, end row), -1 (none) for the others."""
        slots = torch.full((rows,), -1, dtype=torch.int32)
        for slot, first, end in lora_rows:
            slots[first:end] = slot
        self.lora_slots[:rows].copy_(slots, non_blocking=True)


def why_not_capturable(kv_caches, rows_per_seq: int = 1) -> str | None:
    """Why decode steps over these caches (rows_per_seq > 1: verification
    steps, 1 + k rows per sequence) must stay eager (None: they can be
    captured): each layer cache says for itself."""
    return next((why for c in cache_objects(kv_caches)
                 if (why := c.spans_not_capturable(rows_per_seq) if rows_per_seq > 1 else c.not_capturable)),
                None)
