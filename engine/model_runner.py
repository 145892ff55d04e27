"""The one place that holds both the model and the scheduler's view: builds
flat batch metadata for a scheduled step, runs one forward over the mixed
prefill + decode batch, and samples.

A step's inputs are assembled with numpy, per request at most (never per
token in Python), into a reusable host buffer that goes to the model's
device in one copy (pinned and non-blocking on CUDA): building a step reads
nothing back from the device, so the step's one host sync is the sampler's."""
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from engine.request import Request
from engine.sampler import DraftRow, batch_token_logprobs, sample
from engine.scheduler import SchedulerOutput, ScheduledRequest
from kvcache.dsv4_paged import DSV4PagedCache
from kvcache.kv_manager import KVCacheManager
from kvcache.metadata import AttentionMetadata, GroupMetadata


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


def _model_device(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


@dataclass
class StepRecord:
    """What a step leaves for a proposer that drafts from the target's hidden
    state (MTP): the scheduled requests in batch order, their token offsets,
    and the model's pre-collapse streams at every token."""
    sched: list[ScheduledRequest]
    query_start_loc: list[int]
    streams: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, kv_caches: list):
        self.model = model
        self.kv = kv
        self.kv_caches = kv_caches     # indexed by layer, or one DSV4PagedCache
        self.device = _model_device(model)
        self.buf = _StepBuffer(self.device)
        self.keep_streams = False      # set for an MTP proposer: each step's streams go to last_step
        self.last_step: StepRecord | None = None

    def _pack(self, sched: list[ScheduledRequest], tables: list[list[list[int]]]):
        """The step's integer inputs on the device.

        tables: per KV-cache group, each sequence's block table (lists from
        the manager; NULL_BLOCK entries -1). Returns (input_ids [T],
        positions [T], query_start_loc [B + 1], seq_lens [B], logits rows
        [R], per group (slot_mapping [T], block_tables [B, W_g])) as device
        tensors, and the host side: (qsl, seq_lens) numpy, the sampled
        requests. Slots of tokens in a NULL block are negative (a hot group's
        skipped blocks: not stored); block-table entries are clamped to 0."""
        B = len(sched)
        n = np.fromiter((s.num_new_tokens for s in sched), np.int64, B)
        start = np.fromiter((s.start for s in sched), np.int64, B)
        nd = np.fromiter((len(s.spec_token_ids) for s in sched), np.int64, B)
        ends = start + n
        # A request samples when this step reaches the end of its known tokens
        # and drafts: one logits row per draft and one after the last.
        samples = ends == np.fromiter((s.req.num_tokens for s in sched), np.int64, B) + nd
        per = np.where(samples, nd + 1, 0)
        T, R = int(n.sum()), int(per.sum())
        lens = [np.fromiter(map(len, tg), np.int64, B) for tg in tables]
        widths = [int(x.max()) if B else 0 for x in lens]
        # Layout of the packed buffer.
        sizes = [T, T, B + 1, B, R] + [m for w in widths for m in (T, B * w)]
        offs = list(accumulate(sizes, initial=0))
        host = self.buf.host(offs[-1])
        part = [host[a:b] for a, b in zip(offs, offs[1:])]
        ids, pos, qsl, seq_lens, rows = part[:5]

        ids[:] = np.fromiter(chain.from_iterable(
            chain(s.req.token_ids[s.start:s.start + s.num_new_tokens - len(s.spec_token_ids)], s.spec_token_ids)
            for s in sched), np.int64, T)
        qsl[0] = 0
        np.cumsum(n, out=qsl[1:])
        seq_lens[:] = ends
        seq_of_tok = np.repeat(np.arange(B), n)
        np.add(np.arange(T), (start - qsl[:-1])[seq_of_tok], out=pos)
        first_row = np.cumsum(per) - per
        rows[:] = np.repeat(qsl[1:] - per, per) + np.arange(R) - np.repeat(first_row, per)
        bs = self.kv.block_size
        blk, off = pos // bs, pos % bs
        for g, (tg, ln, w) in enumerate(zip(tables, lens, widths)):
            slots, bt = part[5 + 2 * g], part[6 + 2 * g].reshape(B, w)
            if B == 1:
                bt[0] = tg[0]
            else:
                bt.fill(0)
                total = int(ln.sum())
                flat = np.fromiter(chain.from_iterable(tg), np.int64, total)
                first = np.cumsum(ln) - ln
                bt[np.repeat(np.arange(B), ln), np.arange(total) - np.repeat(first, ln)] = flat
            np.add(bt[seq_of_tok, blk] * bs, off, out=slots)
            np.maximum(bt, 0, out=bt)             # NULL_BLOCK -> 0, masked by position

        d = self.buf.send(offs)
        groups = [(d[5 + 2 * g], d[6 + 2 * g].view(B, w)) for g, w in enumerate(widths)]
        sampled = [sched[i].req for i in np.flatnonzero(samples)]
        return d[:5], groups, (qsl, seq_lens, n), sampled

    def _build_dsv4(self, sched: list[ScheduledRequest]):
        """Stateful (DeepSeek-V4) pool: the metadata is per-sequence views of
        it, built from the manager's Python lists (DSV4PagedCache.batch)."""
        (ids, pos, _, _, rows), _, (qsl, _, _), sampled = self._pack(sched, [])
        qsl = qsl.tolist()
        seqs = [(s.start, [self.kv.block_table(s.req.request_id, g) for g in range(len(self.kv.groups))])
                for s in sched]
        return ids, pos, self.kv_caches.batch(seqs, qsl), qsl, rows, sampled

    def _build(self, sched: list[ScheduledRequest]):
        """Returns (input_ids, positions, metadata, query_start_loc as a list,
        logits rows [R] on the device, the R requests that sample)."""
        if isinstance(self.kv_caches, DSV4PagedCache):
            return self._build_dsv4(sched)
        tables = [[self.kv.block_table(s.req.request_id, g) for s in sched] for g in range(len(self.kv.groups))]
        (ids, pos, qsl_t, seq_lens_t, rows), groups, (qsl, seq_lens, n), sampled = self._pack(sched, tables)
        B = len(sched)
        num_decodes = int(np.count_nonzero(n == 1))      # they lead (execute sorts them first)
        qsl_list = qsl.tolist()
        meta = AttentionMetadata(qsl_list, seq_lens.tolist(), num_decodes,
                                 [GroupMetadata(s, bt) for s, bt in groups], self.kv_caches,
                                 seq_lens_t=seq_lens_t, query_start_loc_t=qsl_t,
                                 max_seq_len=int(seq_lens.max()) if B else 0,
                                 max_query_len=int(n.max()) if B else 0)
        return ids, pos, meta, qsl_list, rows, sampled

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[list[int], list[dict | None]]]:
        """Run one step. Returns {request_id: (tokens, logprobs)} for requests
        whose step reached the end of their known tokens: one token, or with
        drafts the accepted drafts and the token after them. Fills prompt
        logprobs on the request objects as a side effect."""
        # Decodes first, as the attention metadata expects.
        sched = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, qsl, rows, sampled = self._build(sched)
        if self.keep_streams:
            streams = self.model.forward_streams(input_ids, positions, meta)
            self.last_step = StepRecord(sched, qsl, streams)
            hidden = self.model.collapse(streams)
        else:
            hidden = self.model(input_ids, positions, meta)
        for i, s in enumerate(sched):
            req = s.req
            if req.prompt_logprobs is not None and s.start < req.num_prompt_tokens:
                self._prompt_logprobs(req, s, hidden[qsl[i]:qsl[i + 1]])
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        if not any(r.spec_token_ids for r in sampled):
            tokens, lps = sample(logits, sampled)
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

    def _prompt_logprobs(self, req: Request, s: ScheduledRequest, hidden: torch.Tensor) -> None:
        # Position p predicts token p + 1; only prompt tokens are scored.
        end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        n = end - s.start
        if n <= 0:
            return
        # Positions scored before a preemption are not scored again; scoring
        # continues only where the list left off.
        first = len(req.prompt_logprobs) - 1 - s.start
        if not 0 <= first < n:
            return
        logp = torch.log_softmax(self.model.compute_logits(hidden[first:n]).float(), dim=-1)
        targets = req.token_ids[s.start + first + 1:s.start + n + 1]
        # One host transfer for the chunk, not one per position.
        req.prompt_logprobs.extend(batch_token_logprobs(logp, targets, req.params.prompt_logprobs))
