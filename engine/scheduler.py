"""Continuous batching with one token budget per step (vLLM v1's shape):
running requests first (decodes and unfinished prefill chunks), then waiting
requests in the policy's order (engine/request_queue.py: fcfs, priority),
chunked when the budget is short, and with LoRA adapters at most max_loras
of them in a step (engine/lora.py: a request whose adapter finds no free
slot waits, and those behind it go ahead); preemption by recompute of the last running
request (fcfs: the newest; priority: the lowest, newest) when KV blocks run out.

A decoding request with drafts (speculative decoding) is scheduled for its
last token plus its drafts; the drafts are the first thing dropped when the
budget or the pool is short. After the step, update() counts only the
accepted positions as computed and frees the KV of the rejected ones."""
import time
from dataclasses import dataclass, field

from engine.lora import AdapterUnreadable
from engine.multimodal import chunk_end
from engine.request import Request, Status
from engine.request_queue import make_queue
from kvcache.kv_manager import KVCacheManager


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int                 # drafts included
    start: int                          # num_computed_tokens when scheduled
    spec_token_ids: list[int] = field(default_factory=list)   # drafts verified this step (the last tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)     # ended unrun: finish_reason "error", stop_reason why

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0     # prompt tokens looked up
    prefix_cache_hits: int = 0        # of which found cached
    prompt_tokens: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, policy: str = "fcfs", loras=None):
        self.kv = kv
        self.loras = loras          # engine/lora.LoRAManager with --enable-lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting = make_queue(policy)
        self.running: list[Request] = []      # in the policy's order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, start: int, n: int, budget: int, shared: int = 0, items=()) -> int:
        """Tokens of a request's next n to run from start. With state
        snapshots (kv.snapshot_interval) a chunk that passes a snapshot point
        ends on the last one it passes, so that its end state is kept, or at
        `shared` (the end of a prefix other requests' blocks share, on the
        snapshot grid) when it passes that. A chunk never ends inside an
        image's bidirectional span (items: engine/multimodal.py); 0 when the
        span does not fit the budget left (it waits for the next step)."""
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        n = min(n, budget)
        S = self.kv.snapshot_interval
        if S and n > 1:
            end = shared if start < shared < start + n else (start + n) // S * S
            if end > start:
                n = end - start
        if items:
            end = chunk_end(items, start, start + n)
            n = end - start if end - start <= budget else 0
        return n

    def _snapshot(self, s: ScheduledRequest) -> None:
        """Keep the state at the last snapshot point the step reaches: its end,
        or in a verification step any of its positions (the state keeps each
        of them for a rollback; the snapshot counts once that position's
        token is accepted, kv_manager). Where the prompt parted from others'
        and the prompt's last point (a retry's hit) are kept past the
        request's later snapshots; the others are superseded by them."""
        S = self.kv.snapshot_interval
        end = s.start + s.num_new_tokens
        m = end // S * S if S else 0
        if m > s.start and end - m <= len(s.spec_token_ids):
            rid = s.req.request_id
            kept = m in (self.kv.shared_prefix(rid), (s.req.num_prompt_tokens - 1) // S * S)
            self.kv.snapshot(rid, m, kept=kept)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.kv.free(req.request_id)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.readd(req)
        out.preempted.append(req.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1. Running requests in order; the last is preempted to make room.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            todo = req.num_tokens + req.num_placeholders - req.num_computed_tokens
            if todo == 0:               # its last token still in flight ends it (max_tokens)
                i += 1
                continue
            n = self._chunk(req.num_computed_tokens, todo, budget, items=req.mm_items)
            if n == 0:              # an image's span waits for a step with room for it
                i += 1
                continue
            spec = req.spec_token_ids[:budget - n] if n == todo else []
            while not self.kv.allocate(req.request_id, req.cache_token_ids, req.num_computed_tokens, n + len(spec)):
                if spec:
                    spec = []
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    n = 0
                    break
            if n == 0:
                break
            req.spec_token_ids = spec
            out.scheduled.append(ScheduledRequest(req, n + len(spec), req.num_computed_tokens, spec))
            self._snapshot(out.scheduled[-1])
            budget -= n + len(spec)
            i += 1
        # 2. Waiting requests in the policy's order, never by preempting others.
        skipped = []        # LoRA requests whose adapter has no slot free this step
        if self.loras is not None:
            self.loras.begin_admission()
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.peek()
                if req.lora is not None:        # its adapter needs a slot (every admission: see LoRAManager)
                    try:
                        slot = self.loras.acquire(req.lora, self.running)
                    except AdapterUnreadable as e:
                        self.waiting.pop()
                        req.finish_reason, req.stop_reason = "error", str(e)
                        self.finish(req)
                        out.failed.append(req)
                        continue
                    if slot is None:            # the requests behind it go first (vLLM's rule)
                        skipped.append(self.waiting.pop())
                        continue
                    req.lora_slot = slot
                hit = 0
                if req.cache_salt:        # (every admission: a preemption freed its blocks' record)
                    self.kv.set_salt(req.request_id, req.cache_salt)
                if req.num_computed_tokens == 0:
                    if req.reuses_prefix:
                        hit = self.kv.find_prefix_hit(req.request_id, req.cache_token_ids)
                n = self._chunk(hit, req.num_tokens - hit, budget, self.kv.shared_prefix(req.request_id),
                                req.mm_items)
                if n == 0 or not self.kv.allocate(req.request_id, req.cache_token_ids, hit, n, num_prefix_hit=hit):
                    break
                self.waiting.pop()
                if req.num_cached_tokens < 0:
                    self.stats.prefix_cache_queries += req.num_tokens
                    self.stats.prefix_cache_hits += hit
                    self.stats.prompt_tokens += req.num_prompt_tokens
                    req.num_cached_tokens = hit
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = hit
                req.status = Status.RUNNING
                self.waiting.admit(self.running, req)
                out.scheduled.append(ScheduledRequest(req, n, hit))
                self._snapshot(out.scheduled[-1])
                budget -= n
        for req in reversed(skipped):       # back at the front, in their order
            self.waiting.readd(req)
        return out

    def update(self, out: SchedulerOutput, rejected: dict[str, int] | None = None) -> None:
        """After the forward: advance computed counts by the positions whose
        KV stays (rejected: per request, draft positions whose KV goes),
        free the rejected positions' blocks, register full blocks."""
        for s in out.scheduled:
            req = s.req
            if req.status == Status.FINISHED:       # ended while its step was in flight
                continue
            req.spec_token_ids = []
            drop = rejected.get(req.request_id, 0) if rejected else 0
            req.num_computed_tokens += s.num_new_tokens - drop
            if drop:
                self.kv.truncate(req.request_id, req.num_computed_tokens)
            self.kv.cache_full_blocks(req.request_id, req.cache_token_ids, req.num_computed_tokens)

    def rollback(self, req: Request, num_tokens: int) -> None:
        """Truncate a request to its first num_tokens tokens, KV included. When
        all that is left is computed, the caller appends the next token to run
        (speculative decoding's bonus token) before the next step."""
        if not 0 < num_tokens <= req.num_tokens or num_tokens < req.num_prompt_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {req.num_tokens} tokens "
                             f"({req.num_prompt_tokens} in the prompt)")
        computed = min(req.num_computed_tokens, num_tokens)
        if req.status == Status.RUNNING:
            self.kv.truncate(req.request_id, computed)    # raises, changing nothing, if too deep
        req.truncate(num_tokens)
        req.num_computed_tokens = computed
        req.spec_token_ids = []          # drafted for the tokens just dropped

    def finish(self, req: Request) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            req.finish_reason = req.finish_reason or "abort"
            self.finish(req)
        return req
