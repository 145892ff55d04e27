"""The one place that holds both the model and the scheduler's view: builds
flat batch metadata for a scheduled step, runs one forward over the mixed
prefill + decode batch, and samples.

A step's inputs are assembled with numpy, per request at most (never per
token in Python), into a reusable host buffer that goes to the model's
device in one copy (pinned and non-blocking on CUDA): building a step reads
nothing back from the device, so the step's one host sync is the sampler's."""
from dataclasses import dataclass, field
from itertools import accumulate, chain

import numpy as np
import torch

from engine.cuda_graph import DecodeGraphs
from engine.multimodal import EncoderCache, key_limits
from engine.request import Request
from engine.sampler import DraftRow, Sampled, batch_token_logprobs, sample, sample_async
from engine.scheduler import SchedulerOutput, ScheduledRequest
from kvcache.dsv4_paged import DSV4PagedCache
from kvcache.kv_manager import KVCacheManager, KVGroup, StateCopies
from kvcache.linear_state import PAD_SLOT
from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.pool_plan import cache_objects
from parallel.state import all_reduce


class _StepBuffer:
    """Host memory for one step's integer inputs and their trip to the device.

    A step packs all its int64 arrays into one buffer (pinned on CUDA) and
    sends it in one non-blocking copy; on CPU the step's tensors are views of
    the buffer itself. Two buffers alternate, so filling one never races a
    copy still reading the other; on CUDA each copy records an event that
    reusing its buffer (two steps later, with the sampler's sync in between)
    waits on, which in practice never blocks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.events: list = [None, None]
        self.cur, self.n = 0, 0

    def host(self, n: int) -> np.ndarray:
        """The next buffer's first n int64 elements, to fill."""
        self.cur ^= 1
        i = self.cur
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        buf = self.bufs[i]
        if buf is None or buf.numel() < n:
            size = max(n, 4096, 0 if buf is None else 2 * buf.numel())
            buf = self.bufs[i] = torch.empty(size, dtype=torch.int64, pin_memory=self.pin)
        self.n = n
        return buf.numpy()[:n]

    def send(self, offs: list[int]) -> list[torch.Tensor]:
        """What host() handed out, on the device, cut at offs (parts
        [offs[i], offs[i + 1]))."""
        t = self.bufs[self.cur]
        if self.device.type == "cpu":
            a = t.numpy()
            return [torch.from_numpy(a[x:y]) for x, y in zip(offs, offs[1:])]
        d = t[:self.n].to(self.device, non_blocking=self.pin)
        if self.pin:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.events[self.cur] = ev
        return [d[x:y] for x, y in zip(offs, offs[1:])]


NO_COPIES = StateCopies()


def _model_device(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


@dataclass
class StepRecord:
    """What a step leaves for a proposer that drafts from the target's hidden
    state (MTP): the scheduled requests in batch order, their token offsets,
    and the model's pre-collapse streams at every token. The step's state
    snapshots wait for the proposer (ModelRunner.snapshot_after_head)."""
    sched: list[ScheduledRequest]
    query_start_loc: list[int]
    streams: torch.Tensor
    snapshots: tuple[torch.Tensor, torch.Tensor] | None = None   # (slots, snapshot slots) to copy


@dataclass
class StepPlan:
    """One step's inputs, host side: everything a rank needs to run the
    step's forward. The leader builds it (ModelRunner.prepare); under tensor
    parallelism it is broadcast and every rank runs it (ModelRunner.forward)."""
    buf: np.ndarray                  # the packed int64 inputs (see _pack), cut at offs
    offs: list[int]
    widths: list[int]                # block-table width per KV group
    qsl: list[int]                   # query start offsets, B + 1
    seq_lens: list[int]
    num_decodes: int
    max_query_len: int
    dsv4_seqs: list | None = None    # DeepSeek-V4's pool: (start, block tables) per sequence
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)   # hidden rows scoring prompt tokens
    pool_rows: list[tuple[int, int]] = field(default_factory=list)     # hidden rows summed for embeddings
    pool_heads: list[str | None] = field(default_factory=list)   # per pool row: a head instead (PoolingParams.head)
    graph_batch: int = 0             # > 0: a decode step padded to this captured size, replayed as a CUDA graph
    graph_rows: int = 0              # the graph's rows per sequence (1, or 1 + k for a verification step)
    patches: int = 0                 # input ids the previous step samples (asynchronous scheduling; see _send)
    shared_tokens: int = 0           # > 0: the leader shares this many sampled tokens after the step (see follow)
    copies: tuple[int, int] = (0, 0)   # state slot copies (restores, snapshots) packed after the groups (_copy)
    lora_loads: list[tuple] = field(default_factory=list)   # (slot, adapter id, LoRAAdapter) to load first
    lora_rows: list[tuple[int, int, int]] = field(default_factory=list)    # (slot, first row, end row) per request
    mm_rows: list[tuple] = field(default_factory=list)   # per image part: (first row, rows, item, item's first row)
    key_limits: np.ndarray | None = None    # [T] bidirectional spans' key limits (kvcache.metadata), or None


@dataclass
class StepHandle:
    """A launched step (ModelRunner.launch): what collect() needs to end it."""
    plan: StepPlan
    sampled: list[Request]           # requests that sample, in logits-row order
    jobs: list                       # prompt-logprob jobs (request, first position, end)
    logits: torch.Tensor | None
    prompt: list[torch.Tensor]
    pool_jobs: list = field(default_factory=list)         # embedding jobs (request, chunk start)
    pooled: list[torch.Tensor] = field(default_factory=list)   # their rows' summed states
    out: Sampled | None = None       # without drafts: the tokens, on their way to the host


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager | None, kv_caches: list, followers=None,
                 graphs: DecodeGraphs | None = None, head_graphs: DecodeGraphs | None = None,
                 groups: list[KVGroup] | None = None, block_size: int = 0, lora=None, lora_manager=None):
        """kv None (a follower rank): groups and block_size give the pool's layout.
        lora: the model's adapter slots (model_zoo/lora.ModelLoRA) with
        --enable-lora; lora_manager (the leader's): which adapter each holds."""
        self.model = model
        self.lora = lora
        self.lora_manager = lora_manager
        self.graphs = graphs           # captured decode steps (CUDA graphs), or None: always eager
        self.head_graphs = head_graphs   # captured chained MTP head passes, or None
        self.kv = kv                   # the leader's block tables (None on a follower rank)
        self._layout = (groups, block_size)
        self.followers = followers     # tensor parallel: where the leader sends each step's plan
        self.kv_caches = kv_caches     # indexed by layer, or one DSV4PagedCache
        self.device = _model_device(model)
        self.buf = _StepBuffer(self.device)
        self.keep_streams = False      # set for an MTP proposer: each step's streams go to last_step
        self.last_step: StepRecord | None = None
        self.sched: list[ScheduledRequest] = []   # the prepared step's requests, in batch order
        self.prev_tokens: torch.Tensor | None = None   # the step in flight's sampled tokens (see _send)
        self.share_tokens = False      # asynchronous scheduling under TP: followers need each step's tokens
        self.slot_caches = [c for c in cache_objects(kv_caches) if c.has_slots]   # per-sequence state
        self.encoder_cache = EncoderCache()   # images' encoder rows, by content hash

    @property
    def groups(self) -> list[KVGroup]:
        return self.kv.groups if self.kv is not None else self._layout[0]

    @property
    def block_size(self) -> int:
        return self.kv.block_size if self.kv is not None else self._layout[1]

    def _pack(self, sched: list[ScheduledRequest], tables: list[list[np.ndarray]],
              pad_to: int = 0, rows_per_seq: int = 0, prev_rows: dict[str, int] | None = None,
              copies: StateCopies | None = None) -> tuple[StepPlan, list]:
        """The step's integer inputs, packed into the step buffer.

        tables: per KV-cache group, each sequence's block table (the
        manager's arrays; NULL_BLOCK entries -1). The buffer holds input_ids [T],
        positions [T], query_start_loc [B + 1], seq_lens [B], logits rows
        [R], then per group slot_mapping [T] and block_tables [B, W_g], then
        the state copies' sources and destinations (restores, then snapshots).
        Slots of tokens in a NULL block are negative (a hot group's skipped
        blocks: not stored); block-table entries are clamped to 0.

        For a CUDA graph (pad_to > 0): rows_per_seq q, the graph's query
        length, gives every sequence q rows, its tokens then pad rows at the
        positions after them (slot -1: not stored; sequence length start + q,
        so each real row keeps its position, and causal attention keeps the
        pad rows out of the real rows' view); pad_to - B more sequences of q
        rows each, id 0 at position 0, sequence length 0 and slot -1, which
        read and write nothing (a per-sequence state's pad rows write its pad
        slot, which no sequence reads). Returns the plan and the requests
        that sample, in row order.

        A request's last token may still be in flight (num_placeholders:
        asynchronous scheduling): its id is written 0, and the buffer ends
        with the ids' rows [K] and their rows in the previous step's sampled
        tokens [K] (prev_rows: request id -> that row), for _send to fill in
        on the device."""
        B = len(sched)
        n = np.fromiter((s.num_new_tokens for s in sched), np.int64, B)
        start = np.fromiter((s.start for s in sched), np.int64, B)
        nd = np.fromiter((len(s.spec_token_ids) for s in sched), np.int64, B)
        ends = start + n
        # A request samples when this step reaches the end of its known tokens
        # and drafts: one logits row per draft and one after the last.
        samples = ends == np.fromiter((s.req.num_tokens + s.req.num_placeholders for s in sched), np.int64, B) + nd
        pending = [i for i, s in enumerate(sched) if s.start + s.num_new_tokens > s.req.num_tokens] \
            if prev_rows is not None else []
        per = np.where(samples, nd + 1, 0)
        T, R = int(n.sum()), int(per.sum())
        P = max(pad_to - B, 0)
        q = rows_per_seq or 1
        m = np.full(B, q, np.int64) if pad_to else n           # rows of each sequence
        Tm = int(m.sum()) + P * q
        lens = [np.fromiter(map(len, tg), np.int64, B) for tg in tables]
        widths = [int(x.max()) if B else 0 for x in lens]
        # Layout of the packed buffer.
        K = len(pending)
        copies = copies or NO_COPIES
        cr, cs = len(copies.restores), len(copies.snapshots)
        sizes = [Tm, Tm, B + P + 1, B + P, R] + [k for w in widths for k in (Tm, (B + P) * w)] + \
            [cr, cr, cs, cs] + [K, K] * bool(K)
        offs = list(accumulate(sizes, initial=0))
        host = self.buf.host(offs[-1])
        part = [host[a:b] for a, b in zip(offs, offs[1:])]
        ids, pos, qsl, seq_lens, rows = part[:5]

        qsl[0] = 0
        np.cumsum(m, out=qsl[1:B + 1])
        seq_lens[:B] = start + m
        tok_ids = np.fromiter(chain.from_iterable(
            chain(s.req.token_ids[s.start:s.start + s.num_new_tokens - len(s.spec_token_ids)], s.spec_token_ids,
                  (0,) * (s.start + s.num_new_tokens - s.req.num_tokens - len(s.spec_token_ids)))
            for s in sched), np.int64, T)
        seq_of_tok = np.repeat(np.arange(B), n)
        if pad_to:
            seq_of_row = np.repeat(np.arange(B), m)
            pos[:B * q] = np.arange(B * q) - qsl[:B][seq_of_row] + start[seq_of_row]
            real = np.arange(T) + (qsl[:B] - (np.cumsum(n) - n))[seq_of_tok]   # each token's row
            tok_pos = pos[real]
            ids[:] = 0
            ids[real] = tok_ids
        else:
            tok_pos = pos[:T]
            np.add(np.arange(T), (start - qsl[:B])[seq_of_tok], out=tok_pos)
            ids[:T] = tok_ids
        if K:
            last = np.cumsum(n)[pending] - 1                     # each pending token's index in tok_ids
            part[-2][:] = real[last] if pad_to else last
            part[-1][:] = [prev_rows[sched[i].req.request_id] for i in pending]
        first_row = np.cumsum(per) - per
        rows[:] = np.repeat(qsl[:B] + n - per, per) + np.arange(R) - np.repeat(first_row, per)
        for g, (tg, ln, w) in enumerate(zip(tables, lens, widths)):
            slots, bt = part[5 + 2 * g], part[6 + 2 * g].reshape(B + P, w)
            if pad_to:
                slots[:] = -1
                tok_slots = np.empty(T, np.int64)
                self._fill_group(g, tg, ln, tok_pos, seq_of_tok, tok_slots, bt[:B])
                slots[real] = tok_slots
            else:
                self._fill_group(g, tg, ln, tok_pos, seq_of_tok, slots[:T], bt[:B])
            # A per-sequence state's pad rows go to the cache's pad slot.
            bt[B:] = PAD_SLOT if self.groups[g].per_seq else 0
        if P:
            pos[B * q:] = 0
            qsl[B + 1:] = B * q + np.arange(1, P + 1) * q
            seq_lens[B:] = 0
        c = 5 + 2 * len(tables)
        for i, pairs in ((c, copies.restores), (c + 2, copies.snapshots)):
            if pairs:
                part[i][:], part[i + 1][:] = zip(*pairs)

        plan = StepPlan(host, offs, widths, qsl[:B + 1].tolist(), seq_lens[:B].tolist(),
                        num_decodes=int(np.count_nonzero(n == 1)),      # they lead (prepare sorts them first)
                        max_query_len=int(n.max()) if B else 0, graph_batch=pad_to, graph_rows=q if pad_to else 0,
                        patches=K, copies=(cr, cs))
        return plan, [sched[i].req for i in np.flatnonzero(samples)]

    def _fill_group(self, g: int, tg: list[np.ndarray], ln: np.ndarray, pos: np.ndarray, seq_of_tok: np.ndarray,
                    slots: np.ndarray, bt: np.ndarray) -> None:
        """Group g's block tables [B, W] and slot mapping [T] (filled in place)
        from its per-sequence tables tg (lengths ln), for tokens at pos of
        sequence seq_of_tok."""
        bs = self.block_size
        bt.fill(0)
        for i, t in enumerate(tg):      # the manager's arrays: a copy per row, not per entry
            bt[i, :len(t)] = t
        r = self.groups[g].ratio
        if self.groups[g].per_seq:
            slots[:] = bt[seq_of_tok, 0]      # a per-sequence state: its one slot
        elif r > 1:
            # One row per r tokens (DeepSeek-V4's compressed entries): the token
            # that closes window w writes entry w; the others write nothing, nor
            # does one past its table (an MTP head's chained positions: the head
            # keeps no entries).
            closes = ((pos + 1) % r == 0) & (pos // r // bs < ln[seq_of_tok])
            e = pos[closes] // r
            slots[:] = -1
            slots[closes] = bt[seq_of_tok[closes], e // bs] * bs + e % bs
        else:
            np.add(bt[seq_of_tok, pos // bs] * bs, pos % bs, out=slots)
        np.maximum(bt, 0, out=bt)             # NULL_BLOCK -> 0, masked by position

    def mtp_metadata(self, seqs: list[tuple[int, list[np.ndarray]]], qsl: list[int]):
        """Attention metadata of an MTP head's pass: sequence i's tokens
        qsl[i]..qsl[i + 1] at positions from seqs[i][0] (its block tables per
        group: seqs[i][1]); sequences of one token first. DeepSeek-V4's pool
        builds its own (the head's ring in the state slot)."""
        if isinstance(self.kv_caches, DSV4PagedCache):
            return self.kv_caches.mtp_batch(seqs, qsl)
        q = np.asarray(qsl, np.int64)
        n = np.diff(q)
        seq_lens, groups = self._mtp_arrays(seqs, qsl)
        groups = [GroupMetadata(torch.from_numpy(s).to(self.device), torch.from_numpy(bt).to(self.device))
                  for s, bt in groups]
        return AttentionMetadata(list(qsl), seq_lens.tolist(), int(np.count_nonzero(n == 1)), groups,
                                 self.kv_caches, seq_lens_t=torch.from_numpy(seq_lens).to(self.device),
                                 query_start_loc_t=torch.from_numpy(q).to(self.device))

    def _mtp_arrays(self, seqs: list[tuple[int, list[np.ndarray]]], qsl: list[int], pad_to: int = 0):
        """An MTP head pass's sequence lengths [B] and per group (slot
        mapping [T], block tables [B, W]), numpy; pad_to: B padded with pad
        sequences of one row (length 0, slot -1, per-sequence groups' pad
        slot), as a decode graph's."""
        B, q = len(seqs), np.asarray(qsl, np.int64)
        n = np.diff(q)
        P = max(pad_to - B, 0)
        start = np.fromiter((s for s, _ in seqs), np.int64, B)
        seq_of_tok = np.repeat(np.arange(B), n)
        pos = np.arange(int(q[-1])) + (start - q[:-1])[seq_of_tok]
        groups = []
        for g in range(len(self.groups)):
            tg = [t[g] for _, t in seqs]
            ln = np.fromiter(map(len, tg), np.int64, B)
            slots, bt = np.full(len(pos) + P, -1, np.int64), np.zeros((B + P, int(ln.max())), np.int64)
            self._fill_group(g, tg, ln, pos, seq_of_tok, slots[:len(pos)], bt[:B])
            bt[B:] = PAD_SLOT if self.groups[g].per_seq else 0
            groups.append((slots, bt))
        return np.concatenate([start + n, np.zeros(P, np.int64)]), groups

    def mtp_replay(self, ids: list[int], streams: torch.Tensor, starts: list[int], tables: list[list[np.ndarray]]
                   ) -> torch.Tensor | None:
        """A chained MTP head pass (one row per sequence: ids at positions
        starts, the previous pass's streams) replayed as a CUDA graph, or None
        when none was captured for its size or its tables are wider. Returns
        the head's streams [len(ids), ...], valid until the next replay."""
        g, B = self.head_graphs, len(ids)
        b = g.size_for(B) if g is not None else None
        if b is None or any(len(t[i]) > w.shape[1] for t in tables for i, w in enumerate(g.tables)):
            return None
        seq_lens, groups = self._mtp_arrays(list(zip(starts, tables)), list(range(B + 1)), pad_to=b)
        pad = np.zeros(b, np.int64)
        pad[:B] = ids
        pos = np.zeros(b, np.int64)
        pos[:B] = starts
        dev = self.device
        h = g.run(b, 1, torch.from_numpy(pad).to(dev), torch.from_numpy(pos).to(dev),
                  torch.from_numpy(seq_lens).to(dev),
                  [GroupMetadata(torch.from_numpy(s).to(dev), torch.from_numpy(bt).to(dev)) for s, bt in groups],
                  streams=streams)
        return h[:B]

    def reserve_mtp_positions(self, req: Request, n: int) -> bool:
        """Blocks for n positions past req's computed length, which an MTP
        head's chained drafts write before they are scheduled (the next step
        verifies there anyway). DeepSeek-V4's head keeps them in its ring."""
        return isinstance(self.kv_caches, DSV4PagedCache) or \
            self.kv.allocate(req.request_id, req.cache_token_ids, req.num_computed_tokens, n)

    def prepare(self, out: SchedulerOutput, prev: StepHandle | None = None
                ) -> tuple[StepPlan, list[Request], list[tuple[Request, int, int]], list[tuple[Request, int]]]:
        """The leader's half of a step: the plan every rank runs, the requests
        that sample (in logits-row order), the prompt-logprob jobs (request,
        first position, end) in plan.prompt_rows order and the embedding jobs
        (request, chunk start) in plan.pool_rows order. prev: the step still
        in flight whose tokens this one's placeholders are."""
        # Decodes first, as the attention metadata expects; within each, the
        # rows of one LoRA adapter together (one slice per adapter, no gather).
        sched = sorted(out.scheduled, key=lambda s: (s.num_new_tokens != 1,
                                                     -1 if s.req.lora is None else s.req.lora_slot))
        groups = range(len(self.groups))
        tables = [[self.kv.block_table_array(s.req.request_id, g) for s in sched] for g in groups]
        prev_rows = {r.request_id: i for i, r in enumerate(prev.sampled)} if prev is not None else None
        plan, sampled = self._pack(sched, tables, *self._graph_shape(sched, tables), prev_rows=prev_rows,
                                   copies=self.kv.take_state_copies())
        if isinstance(self.kv_caches, DSV4PagedCache) and not plan.graph_batch and not self._uniform(sched):
            # DeepSeek-V4's pool runs steps of one span length from the
            # packed tables (DSV4Rows); others as per-sequence views of it,
            # built from the manager's lists (DSV4PagedCache.batch).
            plan.dsv4_seqs = [(s.start, [t[i] for t in tables]) for i, s in enumerate(sched)]
        jobs, pool_jobs = [], []
        if self.lora_manager is not None:
            plan.lora_loads = self.lora_manager.take_pending()
        for i, s in enumerate(sched):
            req = s.req
            if req.lora is not None:
                plan.lora_rows.append((req.lora_slot, plan.qsl[i], plan.qsl[i + 1]))
            if req.pooling is not None and (span := req.pooling.rows(s.start, s.num_new_tokens,
                                                                     req.num_prompt_tokens)):
                plan.pool_rows.append((plan.qsl[i] + span[0] - s.start, plan.qsl[i] + span[1] - s.start))
                plan.pool_heads.append(req.pooling.head)
                pool_jobs.append((req, s.start))
            if req.mm_items and s.start < req.mm_items[-1].end:
                self._plan_images(plan, i, s)
            if req.prompt_logprobs is None or s.start >= req.num_prompt_tokens:
                continue
            # Position p predicts token p + 1; only prompt tokens are scored.
            n = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1) - s.start
            # Positions scored before a preemption are not scored again;
            # scoring continues only where the list left off.
            first = len(req.prompt_logprobs) - 1 - s.start
            if n > 0 and 0 <= first < n:
                plan.prompt_rows.append((plan.qsl[i] + first, plan.qsl[i] + n))
                jobs.append((req, s.start + first, s.start + n))
        self.sched = sched
        return plan, sampled, jobs, pool_jobs

    def _plan_images(self, plan: StepPlan, i: int, s: ScheduledRequest) -> None:
        """Sequence i's image rows in this chunk (plan.mm_rows) and its
        bidirectional spans' key limits (plan.key_limits, positions elsewhere)."""
        a, b = s.start, s.start + s.num_new_tokens
        row = plan.qsl[i]
        for it in s.req.mm_items:
            lo, hi = max(it.offset, a), min(it.end, b)
            if lo < hi:
                plan.mm_rows.append((row + lo - a, hi - lo, it, lo - it.offset))
        lim = key_limits(s.req.mm_items, a, b - a)
        if lim is not None:
            if plan.key_limits is None:
                plan.key_limits = plan.buf[plan.offs[1]:plan.offs[1] + plan.qsl[-1]].copy()   # the positions
            plan.key_limits[row:row + b - a] = lim

    def _images(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [N], embeddings [N, H]) that replace the plan's image
        placeholders' embeddings; each image encoded once (encoder_cache)."""
        rows, embeds = [], []
        for row, n, item, first in plan.mm_rows:
            rows.append(torch.arange(row, row + n))
            embeds.append(self.encoder_cache.get(item, self.model.embed_images)[first:first + n])
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    def _uniform(self, sched: list[ScheduledRequest]) -> bool:
        """A DeepSeek-V4 step its pool runs batched: every sequence the same
        number of rows, within its rollback room (verification steps)."""
        q = sched[0].num_new_tokens if sched else 0
        return all(s.num_new_tokens == q for s in sched) and self.kv_caches.batches_spans(q)

    def _graph_shape(self, sched: list[ScheduledRequest], tables) -> tuple[int, int]:
        """(captured batch size, rows per sequence) this step replays at, or
        (0, 0): eager. Decodes only (one known token each; no prompt logprob
        to score) whose block tables
        fit the captured width: with no drafts, the one-row graphs; with
        drafts, those of 1 + k rows when captured (k drafts at most, every
        sequence's rows within max_model_len)."""
        g = self.graphs
        if g is None:
            return 0, 0
        for s in sched:
            if s.num_new_tokens - len(s.spec_token_ids) != 1 or s.req.pooling is not None or (
                    s.req.prompt_logprobs is not None and s.start < s.req.num_prompt_tokens - 1) or (
                    s.req.mm_items and s.start < s.req.mm_items[-1].end):
                return 0, 0
        q = max((s.num_new_tokens for s in sched), default=1)
        if q > 1:
            q = g.query_lens[-1]
            if q == 1 or any(s.num_new_tokens > q or s.start + q > g.max_model_len for s in sched):
                return 0, 0
        if any(len(t) > w.shape[1] for tg, w in zip(tables, g.tables) for t in tg):
            return 0, 0
        b = g.size_for(len(sched), q)
        return (b, q) if b else (0, 0)

    def stage(self, plan: StepPlan) -> StepPlan:
        """A plan received from the leader, moved into this rank's step buffer."""
        host = self.buf.host(len(plan.buf))
        host[:] = plan.buf
        plan.buf = host
        return plan

    def _send(self, plan: StepPlan) -> list[torch.Tensor]:
        """The plan's packed inputs on the device, with the ids of tokens the
        previous step sampled (its placeholders) read from its output there."""
        d = self.buf.send(plan.offs)
        if plan.patches:
            d[0].index_copy_(0, d[-2], self.prev_tokens.index_select(0, d[-1]))
        return d

    def _copy(self, plan: StepPlan, d: list[torch.Tensor], snapshots: bool) -> None:
        """The plan's state slot copies: restores before the forward, snapshots
        after it (with an MTP proposer, after its head: snapshot_after_head)."""
        if plan.copies[snapshots]:
            c = 5 + 2 * len(plan.widths) + 2 * snapshots
            if snapshots and self.keep_streams:
                self.last_step.snapshots = (d[c], d[c + 1])
                return
            self._copy_slots(d[c], d[c + 1])

    def _copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for cache in self.slot_caches:
            cache.copy_slots(src, dst)

    def snapshot_after_head(self, step: StepRecord) -> None:
        """A step's state snapshots, once the MTP head has run over the step's
        kept positions: its cache (DeepSeek-V4's ring in the slot) at position
        p reads token p + 1, known only after the step (kv_manager lookahead)."""
        if step.snapshots is not None:
            self._copy_slots(*step.snapshots)
            step.snapshots = None

    def inputs(self, plan: StepPlan, d: list[torch.Tensor] | None = None):
        """(input_ids, positions, attention metadata, logits rows) on the device
        (d: the plan's inputs already sent)."""
        d = self._send(plan) if d is None else d
        ids, pos, qsl_t, seq_lens_t, rows = d[:5]
        B = len(plan.seq_lens)
        groups = [GroupMetadata(d[5 + 2 * g], d[6 + 2 * g].view(B, w)) for g, w in enumerate(plan.widths)]
        meta = AttentionMetadata(plan.qsl, plan.seq_lens, plan.num_decodes, groups, self.kv_caches,
                                 seq_lens_t=seq_lens_t, query_start_loc_t=qsl_t,
                                 max_seq_len=max(plan.seq_lens, default=0), max_query_len=plan.max_query_len)
        if plan.key_limits is not None:
            meta.key_limits_t = torch.from_numpy(plan.key_limits).to(self.device)
        if plan.dsv4_seqs is not None:      # DeepSeek-V4's decodes all at once, the rest per sequence
            meta = self.kv_caches.batch(plan.dsv4_seqs, plan.qsl, meta)
        return ids, pos, meta, rows

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
        """What every rank runs (its collectives in the same order on all):
        the model over the step, the logits of the plan's prompt-logprob rows,
        then of its sampling rows (None when nothing samples); and the sums
        of the plan's pool rows' states (no collective: every rank has them),
        or a classifier's head's outputs for its row (_head)."""
        d = self._send(plan)
        self._copy(plan, d, snapshots=False)
        for load in plan.lora_loads:
            self.lora.load(*load)
        if plan.graph_batch:
            b = plan.graph_batch
            groups = [GroupMetadata(d[5 + 2 * g], d[6 + 2 * g].view(b, w)) for g, w in enumerate(plan.widths)]
            if self.lora is not None:
                self.graphs.set_lora_rows(b * plan.graph_rows, plan.lora_rows)
            hidden = self.graphs.run(b, plan.graph_rows, d[0], d[1], d[3], groups)
            if self.keep_streams:
                # The graph's output, valid until the next replay: the proposer
                # reads it after this step (plan.qsl: the padded rows' layout).
                self.last_step = StepRecord(self.sched, plan.qsl, hidden)
                hidden = self.model.collapse(hidden)
            self._copy(plan, d, snapshots=True)
            rows = d[4]
            return (self.model.compute_logits(hidden[rows]) if len(rows) else None), [], []
        input_ids, positions, meta, rows = self.inputs(plan, d)
        if plan.lora_rows:
            self.lora.ctx.set_rows(plan.lora_rows, self.device)
        try:
            if self.keep_streams:
                streams = self.model.forward_streams(input_ids, positions, meta)
                self.last_step = StepRecord(self.sched, plan.qsl, streams)
                hidden = self.model.collapse(streams)
            elif plan.mm_rows:
                hidden = self.model(input_ids, positions, meta, mm_embeds=self._images(plan))
            else:
                hidden = self.model(input_ids, positions, meta)
        finally:
            if plan.lora_rows:      # the head passes and graphs after it run the base model
                self.lora.ctx.batch = None
        self._copy(plan, d, snapshots=True)
        prompt = [self.model.compute_logits(hidden[a:b]) for a, b in plan.prompt_rows]
        pooled = [hidden[a:b].float().sum(0) if head is None else self._head(head, hidden[a:b])
                  for (a, b), head in zip(plan.pool_rows, plan.pool_heads)]
        return (self.model.compute_logits(hidden[rows]) if len(rows) else None), prompt, pooled

    def _head(self, head: str, row: torch.Tensor) -> torch.Tensor:
        """A classifier's outputs for its pooled row: the LM head's logits (a
        collective under tensor parallelism) or the score head's (replicated)."""
        return (self.model.compute_logits(row) if head == "logits" else self.model.score(row))[0].float()

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[list[int], list[dict | None]]]:
        """Run one step. Returns {request_id: (tokens, logprobs)} for requests
        whose step reached the end of their known tokens: one token, or with
        drafts the accepted drafts and the token after them. Fills prompt
        logprobs on the request objects as a side effect."""
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput, prev: StepHandle | None = None, sample: bool = True) -> StepHandle:
        """A step up to its sampled tokens on the device (no host sync without
        drafts). prev: the step still in flight, whose tokens this one's
        placeholders are (read on the device, so prev need not be collected).
        sample=False: the forward only; sample_step() samples it later (after
        prev's tokens reach the requests on the host)."""
        plan, sampled, jobs, pool_jobs = self.prepare(out, prev)
        if plan.patches:
            self.prev_tokens = self.sample_step(prev).tokens
        if self.share_tokens:
            plan.shared_tokens = len(sampled)
        if self.followers is None:
            logits, prompt, pooled = self.forward(plan)
        else:
            with self.followers.lock:      # no heartbeat between the plan and its collectives
                self.followers.send_plan(plan)
                logits, prompt, pooled = self.forward(plan)
        h = StepHandle(plan, sampled, jobs, logits, prompt, pool_jobs, pooled)
        if sample:
            self.sample_step(h)
        return h

    def sample_step(self, h: StepHandle) -> Sampled | None:
        """Sample a launched step's tokens on the device, once (h.out; None
        with drafts: collect() verifies them). A request that ended since the
        step was launched keeps its row, whose token is dropped (a completed
        grammar's mask allows EOS only)."""
        if h.out is None and h.sampled and not any(r.spec_token_ids for r in h.sampled):
            with torch.inference_mode():
                h.out = sample_async(h.logits, h.sampled)
            if h.plan.shared_tokens:
                self.followers.share(h.out.tokens)
        return h.out

    def follow(self, plan: StepPlan) -> None:
        """A follower rank's step: the leader's plan through the forward; then,
        when the leader shares the step's sampled tokens, they become what the
        next step's placeholders read on this rank's device (prev_tokens)."""
        self.forward(self.stage(plan))
        if plan.shared_tokens:
            self.prev_tokens = all_reduce(torch.zeros(plan.shared_tokens, dtype=torch.int64, device=self.device))

    def collect(self, h: StepHandle) -> dict[str, tuple[list[int], list[dict | None]]]:
        """A launched step's results, as execute() returns them (waits for its tokens)."""
        sampled, logits = h.sampled, h.logits
        for (req, start), v in zip(h.pool_jobs, h.pooled):
            # A chunk from position 0 starts the pool again (after a preemption too).
            req.pooled = v if start == 0 or req.pooled is None else req.pooled + v
        with torch.inference_mode():
            for (req, a, b), lg in zip(h.jobs, h.prompt):
                logp = torch.log_softmax(lg.float(), dim=-1)
                # One host transfer for the chunk, not one per position.
                req.prompt_logprobs.extend(batch_token_logprobs(logp, req.token_ids[a + 1:b + 1],
                                                                req.params.prompt_logprobs))
            if not sampled:
                return {}
            if h.out is not None:
                tokens, lps = h.out.result()
                return {r.request_id: ([t], [lp]) for r, t, lp in zip(sampled, tokens, lps)}
            views, drafts = [], []
            for r in sampled:
                d = r.spec_token_ids
                views += [DraftRow(r, d[:j]) if j else r for j in range(len(d) + 1)]
                drafts += [*d, -1]
            tokens, lps = sample(logits, views, drafts)
        res, i = {}, 0
        for r in sampled:
            # Accepted drafts are the rows whose token is their draft; the
            # first other row's token (or the last row's) ends the run.
            k = len(r.spec_token_ids)
            m = next((j for j in range(k) if tokens[i + j] != drafts[i + j]), k) + 1
            res[r.request_id] = (tokens[i:i + m], lps[i:i + m])
            i += k + 1
        return res
