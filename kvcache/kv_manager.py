"""Block tables per request over one block pool per KV-cache group.

Layers that share an attention shape of context (all full-attention layers;
all sliding-window layers with one window) form a group with its own pool and
block tables, as in vLLM's hybrid allocator: a sliding-window group frees the
blocks that fall out of its window while the full group keeps them.

Two more group shapes serve stateful models (DeepSeek-V4, kvcache/dsv4_paged.py):
a group with ratio r holds one row per r tokens (compressed entries), so its
block covers block_size * r tokens; a per_seq group gives each sequence one
fixed-size slot (a 'block' of its own pool) for state that does not grow.

Prefix caching registers full blocks under chained hashes of their tokens (a
group with ratio r: block k under the hash of token block (k + 1) * r - 1).
Per-sequence state sums the whole prefix, so a hit needs it as it was at the
hit's end: every `snapshot_interval` tokens a step that ends there copies each
per_seq group's slot into a snapshot (ids after the live slots in the same
tensors, their own LRU pool), registered under the hash of the block that
ends there once its tokens are known; a hit resumes only where a snapshot
exists, restored into the new sequence's slot before its first step. The
copies are queued here and done by the runner in the step's forward
(`take_state_copies`), so they are ordered with the step on the device.

With an MTP head, what is cached up to position p also depends on token
p + 1 (the head's entry at p reads it): `lookahead` tokens past each block
join its hash, so a block (and a snapshot ending there) is registered once
that token is known and hit only by a prompt that has it too.

The hot group (TurboQuant's int8 copies of a few tokens, kvcache/tq_cache.py)
holds only a sequence's first block (the attention sinks) and the block of
its newest token; during a step also the block its first new token falls in
(that block's earlier tokens are read from there). The blocks a prefill
chunk passes through are never allocated: their table entries stay NULL.
"""
from dataclasses import dataclass, field
from math import lcm

import numpy as np

from kvcache.block_pool import BlockPool
from kvcache.spec import LayerSpec

NULL_BLOCK = -1   # a table entry whose block was freed (out of window); masked by attention


@dataclass
class KVGroup:
    sliding_window: int | None
    layer_ids: list[int]
    ratio: int = 1            # tokens per row: a block holds block_size * ratio tokens' worth
    per_seq: bool = False     # one slot per sequence, whatever its length
    hot: bool = False         # block 0 + the newest block only (see the module docstring)


def group_layers(specs: list[LayerSpec]) -> list[KVGroup]:
    groups: dict[tuple, KVGroup] = {}
    for s in specs:
        groups.setdefault((s.per_seq, s.sliding_window),
                          KVGroup(s.sliding_window, [], per_seq=s.per_seq)).layer_ids.append(s.layer_idx)
    # Full attention first: group 0 is the one whose capacity bounds context.
    return sorted(groups.values(), key=lambda g: (g.per_seq, g.sliding_window is not None, g.sliding_window or 0))


# Tokens between per-sequence state snapshots by default (rounded up to the
# blocks' grid): vLLM's hybrid models land near this (Qwen3.5: 528).
DEFAULT_SNAPSHOT_TOKENS = 512


def snapshot_grid(groups: list[KVGroup], block_size: int, tokens: int | None) -> int:
    """Tokens between state snapshots: `tokens` (a multiple of the span every
    group's blocks end on), or by default the first such multiple >= 512."""
    span = block_size * lcm(*(g.ratio for g in groups if not g.per_seq))
    if tokens is None:
        return -(-DEFAULT_SNAPSHOT_TOKENS // span) * span
    if tokens <= 0 or tokens % span:
        raise ValueError(f"mamba_block_size {tokens}: state snapshots must fall where every KV group's blocks end, "
                         f"a positive multiple of {span} tokens here")
    return tokens


@dataclass
class _ReqBlocks:
    tables: list[list[int]]                     # per group
    hashes: list[int] = field(default_factory=list)   # chained hash of each full block
    num_cached: int = 0                         # full blocks already registered in the pools
    high: int = 0                               # highest num_computed + num_new ever allocated
    # Per group: table entries in [hot, freed) are NULL_BLOCK, so a step looks
    # only at the blocks that left the window since the last (O(1) a decode,
    # not O(context)).
    freed: list[int] = field(default_factory=list)
    # Per group: the table as int64, kept in step with `tables` where it
    # changes, so a step's inputs copy arrays instead of converting lists.
    arrays: list[np.ndarray] = field(default_factory=list)
    # State snapshots taken and not yet registered: (tokens, group, snapshot id, kept).
    snaps: list[tuple[int, int, int, bool]] = field(default_factory=list)
    # The last one registered that a newer one supersedes: (group, snapshot id, hash).
    superseded: tuple[int, int, int] | None = None
    shared: int = 0          # tokens whose blocks find_prefix_hit found cached (state aside)
    root: int = 0            # the hash chain's start: a request's cache salt (set_salt)

    def mirror(self, gi: int, spans) -> None:
        """Copy table gi's entries in spans [(a, b), ...] into its array."""
        table = self.tables[gi]
        arr = self.arrays[gi]
        if len(arr) < len(table):
            grown = np.empty(max(2 * len(arr), len(table), 16), np.int64)
            grown[:len(arr)] = arr
            arr = self.arrays[gi] = grown
        for a, b in spans:
            if a < b:
                arr[a:b] = table[a:b]


@dataclass
class StateCopies:
    """Slot copies a step does on the device: restores (snapshot -> a hit's new
    slot) before its forward, snapshots (slot -> snapshot) after it."""
    restores: list[tuple[int, int]] = field(default_factory=list)    # (src, dst)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    held: list[tuple[int, int]] = field(default_factory=list)    # the restores' (group, snapshot id)


class KVCacheManager:
    def __init__(self, groups: list[KVGroup], num_blocks: list[int], block_size: int,
                 enable_caching: bool = True, max_rollback: int | None = None,
                 num_snapshots: int = 0, snapshot_interval: int = 0, lookahead: int = 0):
        """max_rollback: how far truncate() may go back from the highest position
        ever allocated (ring-buffered state keeps only that many extra positions);
        None for position-addressed storage. num_snapshots, snapshot_interval:
        per per_seq group, the state snapshots prefix caching resumes from
        (ids num_blocks[g]..; see the module docstring) and the tokens between
        them (a multiple of every group's block span). lookahead: tokens past a
        block that its cached contents depend on (1 with an MTP head)."""
        self.groups = groups
        self.lookahead = lookahead
        self.block_size = block_size
        self.pools = [BlockPool(n, enable_caching) for n in num_blocks]
        self.enable_caching = enable_caching
        self.max_rollback = max_rollback
        self.reqs: dict[str, _ReqBlocks] = {}
        self.snapshot_interval = snapshot_interval if num_snapshots and enable_caching else 0
        if enable_caching and not self.snapshot_interval and any(g.per_seq for g in groups):
            raise ValueError("prefix caching over per-sequence state needs state snapshots")
        self.snapshots = {gi: BlockPool(num_snapshots) for gi, g in enumerate(groups) if g.per_seq} \
            if self.snapshot_interval else {}
        self.snapshot_base = {gi: num_blocks[gi] for gi in self.snapshots}
        self.copies = StateCopies()
        # A hit ends where every group's blocks end, and with snapshots on their grid:
        # a multiple of this many token blocks.
        self.hit_unit = (snapshot_grid(groups, block_size, self.snapshot_interval) if self.snapshot_interval
                         else block_size * lcm(*(g.ratio for g in groups if not g.per_seq))) // block_size
        # With remember_tokens (a prefix cache kept in a file, engine/prefix_store.py): each
        # registered hash's (parent hash, tokens), from which the hash is computed again.
        self.remember_tokens = False
        self.block_tokens: dict[int, tuple[int, tuple]] = {}

    def _blocks(self, req_id: str) -> _ReqBlocks:
        rb = self.reqs.get(req_id)
        if rb is None:
            rb = self.reqs[req_id] = _ReqBlocks([[] for _ in self.groups], freed=[int(g.hot) for g in self.groups],
                                                arrays=[np.empty(0, np.int64) for _ in self.groups])
        return rb

    # -- prefix cache ---------------------------------------------------------
    def _hashes(self, token_ids: list[int], num_full: int, rb: _ReqBlocks) -> list[int]:
        bs, la = self.block_size, self.lookahead
        while len(rb.hashes) < num_full:
            i = len(rb.hashes)
            parent = rb.hashes[-1] if rb.hashes else rb.root
            rb.hashes.append(hash((parent, tuple(token_ids[i * bs:(i + 1) * bs + la]))))
        return rb.hashes

    def _hashable(self, token_ids: list[int], num_tokens: int) -> int:
        """Full blocks among the first num_tokens whose hash is known (lookahead)."""
        return min(num_tokens, len(token_ids) - self.lookahead) // self.block_size

    def _blocks_needed(self, g: KVGroup, num_tokens: int) -> int:
        """Blocks of group g that positions [0, num_tokens) occupy."""
        if g.per_seq:
            return 1
        return -(-(num_tokens // g.ratio) // self.block_size)

    def _window_start_block(self, g: KVGroup, num_tokens: int) -> int:
        """First block a query at position num_tokens still needs in group g."""
        if g.hot:
            return num_tokens // self.block_size
        if g.sliding_window is None:
            return 0
        return max(0, num_tokens - g.sliding_window + 1) // self.block_size

    def _kept(self, g: KVGroup, num_tokens: int, num_blocks: int) -> list[int]:
        """Block indices < num_blocks that group g holds for a query at num_tokens."""
        first = self._window_start_block(g, num_tokens)
        return [j for j in range(num_blocks) if j >= first or (g.hot and j == 0)]

    @staticmethod
    def _wanted(g: KVGroup, j: int, first: int, need_total: int) -> bool:
        """Whether new table entry j gets a block (a hot group skips a chunk's middle)."""
        return not g.hot or j in (0, first, need_total - 1)

    def set_salt(self, req_id: str, salt) -> None:
        """Start the request's hash chain from its cache salt (vLLM's
        cache_salt), before its blocks are looked up or registered: only
        requests with the same salt share prefix blocks (a tenant's prompts
        are not found, nor timed, by another's). Any hashable salt: the
        engine adds the request's LoRA adapter to it."""
        rb = self._blocks(req_id)
        root = hash(("cache_salt", salt)) if salt else 0
        if root != rb.root:
            rb.root, rb.hashes = root, []

    def find_prefix_hit(self, req_id: str, token_ids: list[int]) -> int:
        """Number of leading tokens whose KV (and state) is cached in every
        group (a multiple of hit_unit blocks, leaving at least one token to
        compute)."""
        rb = self._blocks(req_id)
        if not self.enable_caching:
            return 0
        u = self.hit_unit
        hashes = self._hashes(token_ids, self._hashable(token_ids, len(token_ids) - 1), rb)
        n = len(hashes) // u * u
        # Groups that keep every block: their run of cached blocks bounds the hit.
        rest = []
        for gi, g in enumerate(self.groups):
            if g.per_seq or g.hot or g.sliding_window is not None:
                rest.append(gi)
                continue
            r, pool, k = g.ratio, self.pools[gi], 0
            while k < n // r and pool.lookup(hashes[(k + 1) * r - 1]) is not None:
                k += 1
            n = min(n, k * r // u * u)
        rb.shared = n * self.block_size
        # The others need only what a query at the hit's end reads (the window,
        # the first blocks they keep, the state there).
        while n > 0 and not all(self._hit_ok(gi, hashes, n) for gi in rest):
            n -= u
        return n * self.block_size

    def shared_prefix(self, req_id: str) -> int:
        """Tokens (on the hit grid) whose blocks the last find_prefix_hit found
        cached, state snapshots aside: where another request's prompt and this
        one part. The scheduler ends a chunk there, so that the state there is
        kept too (vLLM's shared-prefix checkpoint) and the next request that
        shares the prefix hits all of it."""
        return self.reqs[req_id].shared if req_id in self.reqs else 0

    def _hit_ok(self, gi: int, hashes: list[int], n: int) -> bool:
        """Whether group gi holds what a hit of n token blocks needs."""
        g = self.groups[gi]
        if g.per_seq:
            return self.snapshots[gi].lookup(hashes[n - 1]) is not None
        return all(self.pools[gi].lookup(hashes[(j + 1) * g.ratio - 1]) is not None
                   for j in self._kept(g, n * self.block_size, n // g.ratio))

    # -- allocation -----------------------------------------------------------
    def allocate(self, req_id: str, token_ids: list[int], num_computed: int, num_new: int,
                 num_prefix_hit: int = 0) -> bool:
        """Make every group's table cover positions [0, num_computed + num_new).

        num_prefix_hit (only on a request's first allocation) adopts the cached
        blocks found by find_prefix_hit. Returns False, changing nothing, when
        a pool has too few free blocks.
        """
        rb = self._blocks(req_id)
        bs = self.block_size
        end = num_computed + num_new
        hit_blocks = num_prefix_hit // bs
        plans = []
        for gi, g in enumerate(self.groups):
            pool, table = self.pools[gi], rb.tables[gi]
            first = self._window_start_block(g, num_computed)
            need_total = self._blocks_needed(g, end)
            # A per-sequence group adopts no block: its new slot gets the snapshot's state.
            adopting = hit_blocks > 0 and not table and not g.per_seq
            adopt = self._kept(g, num_computed, hit_blocks // g.ratio) if adopting else []
            live = [b for b in table[rb.freed[gi]:first] if b != NULL_BLOCK]
            start = hit_blocks // g.ratio if adopting else len(table)
            new = sum(1 for j in range(start, need_total) if self._wanted(g, j, first, need_total))
            # Cached blocks sitting unreferenced in the free queue are not free to us.
            adopt_from_free = sum(1 for j in adopt if pool.ref_cnt[pool.lookup(self._hash_of(rb, g, j))] == 0)
            avail = pool.num_free - adopt_from_free + sum(1 for b in live if pool.ref_cnt[b] == 1)
            if max(new, 0) > avail:
                return False
            plans.append((gi, first, need_total, adopt))
        for gi, first, need_total, adopt in plans:
            g = self.groups[gi]
            pool, table = self.pools[gi], rb.tables[gi]
            grown_from = len(table)
            if hit_blocks and not table and not g.per_seq:
                table.extend([NULL_BLOCK] * (hit_blocks // g.ratio))
                for j in adopt:
                    b = pool.lookup(self._hash_of(rb, g, j))
                    pool.touch(b)
                    table[j] = b
            restore = hit_blocks and g.per_seq and not table
            was_freed, gone = rb.freed[gi], min(first, len(table))
            for j in range(was_freed, gone):
                if table[j] != NULL_BLOCK:
                    pool.free(table[j])
                    table[j] = NULL_BLOCK
            rb.freed[gi] = max(was_freed, gone)
            while len(table) < need_total:
                table.append(pool.allocate() if self._wanted(g, len(table), first, need_total) else NULL_BLOCK)
            if restore:
                snaps = self.snapshots[gi]
                snap = snaps.lookup(rb.hashes[hit_blocks - 1])     # find_prefix_hit found it just now
                snaps.touch(snap)         # held until the runner queues the copy (take_state_copies)
                self.copies.restores.append((self.snapshot_base[gi] + snap, table[0]))
                self.copies.held.append((gi, snap))
            rb.mirror(gi, [(was_freed, gone), (grown_from, len(table))])
        if hit_blocks:
            rb.num_cached = max(rb.num_cached, hit_blocks)
        rb.high = max(rb.high, end)
        return True

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Forget positions >= num_tokens (speculative-decoding rollback): free
        the blocks past them. Ring-buffered state (max_rollback) is intact only
        within max_rollback of the highest position ever written."""
        rb = self.reqs[req_id]
        if num_tokens < rb.num_cached * self.block_size:
            # Registered blocks may be shared, and their contents would now be
            # overwritten: that would need copy-on-write. Blocks past the last
            # registered one belong to this request alone (the scheduler
            # registers blocks only once their tokens are accepted).
            raise ValueError(f"cannot roll back to {num_tokens} tokens: the first "
                             f"{rb.num_cached * self.block_size} are in the prefix cache")
        if self.max_rollback is not None and num_tokens < rb.high - self.max_rollback:
            raise ValueError(f"cannot roll back to {num_tokens} tokens: state keeps only "
                             f"{self.max_rollback} positions before {rb.high}")
        for snap in [x for x in rb.snaps if x[0] > num_tokens]:   # of a rejected position: never registered
            rb.snaps.remove(snap)
            self.snapshots[snap[1]].free(snap[2])
        for gi, g in enumerate(self.groups):
            table = rb.tables[gi]
            keep = self._blocks_needed(g, num_tokens)
            if NULL_BLOCK in table[self._window_start_block(g, num_tokens):keep]:
                raise ValueError(f"cannot roll back to {num_tokens} tokens: window blocks already freed")
            while len(table) > keep:
                b = table.pop()
                if b != NULL_BLOCK:
                    self.pools[gi].free(b)
            rb.freed[gi] = max(int(g.hot), min(rb.freed[gi], len(table)))

    @staticmethod
    def _hash_of(rb: _ReqBlocks, g: KVGroup, j: int) -> int:
        """The hash block j of group g is registered under: that of the last token block it covers."""
        return rb.hashes[(j + 1) * g.ratio - 1]

    def cache_full_blocks(self, req_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register blocks that became full (their KV is written) and
        snapshots whose tokens are now computed, for reuse."""
        if not self.enable_caching:
            return
        rb = self.reqs[req_id]
        num_full = self._hashable(token_ids, num_computed)
        if num_full > rb.num_cached:
            self._hashes(token_ids, num_full, rb)
            for gi, g in enumerate(self.groups):
                if g.per_seq:
                    continue
                table, r = rb.tables[gi], g.ratio
                for j in range(rb.num_cached // r, num_full // r):
                    if table[j] != NULL_BLOCK:
                        self.pools[gi].cache(table[j], self._hash_of(rb, g, j))
            if self.remember_tokens:        # (after registering: the pruning keeps what is cached)
                self._remember(rb, token_ids, rb.num_cached, num_full)
            rb.num_cached = num_full
        while rb.snaps and rb.snaps[0][0] <= num_full * self.block_size:
            n, gi, snap, kept = rb.snaps.pop(0)
            pool, h = self.snapshots[gi], rb.hashes[n // self.block_size - 1]
            if pool.lookup(h) is None:
                pool.cache(snap, h)
            pool.free(snap)
            # The request's previous snapshot (a chunk's or a decode's end on the
            # way here) goes first in line for eviction: its latest (a next turn's
            # hit) and the kept ones (where its prompt parted from others', its
            # prompt's last point: a retry's hit) outlive it.
            old, rb.superseded = rb.superseded, None if kept else (gi, snap, h)
            if old is not None and self.snapshots[old[0]].block_hash[old[1]] == old[2]:
                self.snapshots[old[0]].demote(old[1])

    def _remember(self, rb: _ReqBlocks, token_ids: list[int], first: int, end: int) -> None:
        bs, la = self.block_size, self.lookahead
        for i in range(first, end):
            parent = rb.hashes[i - 1] if i else rb.root
            self.block_tokens[rb.hashes[i]] = (parent, tuple(token_ids[i * bs:(i + 1) * bs + la]))
        cached = sum(len(p.cached) for p in self.pools)
        if len(self.block_tokens) > 2 * cached + 1024:      # evicted blocks' entries go, now and then
            self.block_tokens = {h: v for h, v in self.block_tokens.items()
                                 if any(h in p.cached for p in self.pools)}

    def chain_known(self, h: int, memo: dict[int, bool] | None = None) -> bool:
        """Whether block hash h's tokens, and its parents' up to an unsalted
        start (root 0), are remembered: its hash can be computed again. memo:
        answers so far (one walk per chain over many blocks)."""
        memo = {} if memo is None else memo
        path = []
        while h != 0 and h not in memo:
            entry = self.block_tokens.get(h)
            if entry is None or len(path) > len(self.block_tokens):
                break
            path.append(h)
            h = entry[0]
        known = h == 0 or memo.get(h, False)
        memo.update((x, known) for x in path)
        return known

    def snapshot(self, req_id: str, end: int, kept: bool = False) -> None:
        """Keep each per-sequence group's state at `end` tokens (on the
        snapshot grid) as the step being scheduled leaves it: its last
        position, or one of the last positions whose states the slot keeps for
        a rollback. The copy is queued for the step; cache_full_blocks
        registers it once `end` tokens are computed, truncate drops it if
        they are not. Skipped when every snapshot is in use. kept: not
        superseded by the request's later snapshots (see cache_full_blocks)."""
        rb = self.reqs[req_id]
        for gi, pool in self.snapshots.items():
            if pool.num_free:
                snap = pool.allocate()
                rb.snaps.append((end, gi, snap, kept))
                self.copies.snapshots.append((rb.tables[gi][0], self.snapshot_base[gi] + snap))

    def take_state_copies(self) -> StateCopies:
        """The slot copies queued since the last call, for the step being
        prepared (the runner does them in its forward, every rank alike).
        The restores' snapshots are released: nothing can take them before
        the step that copies them is on the device."""
        c = self.copies
        if c.restores or c.snapshots:      # (most steps have none: nothing to allocate)
            self.copies = StateCopies()
            for gi, snap in c.held:
                self.snapshots[gi].free(snap)
        return c

    def free(self, req_id: str) -> None:
        rb = self.reqs.pop(req_id, None)
        if rb is None:
            return
        for _, gi, snap, _ in rb.snaps:   # taken, never registered: its tokens were not all computed
            self.snapshots[gi].free(snap)
        for gi, table in enumerate(rb.tables):
            # Free the tail first so that the prefix stays cached longest.
            for b in reversed(table):
                if b != NULL_BLOCK:
                    self.pools[gi].free(b)

    def block_table(self, req_id: str, group: int) -> list[int]:
        return self.reqs[req_id].tables[group]

    def block_table_array(self, req_id: str, group: int) -> np.ndarray:
        """block_table as an int64 array (a view, valid until the next allocate)."""
        rb = self.reqs[req_id]
        return rb.arrays[group][:len(rb.tables[group])]

    @property
    def usage(self) -> float:
        used = sum(p.num_blocks - p.num_free for p in self.pools)
        return used / sum(p.num_blocks for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return sum(p.num_blocks - p.num_free for p in self.pools)

    def reset_prefix_cache(self) -> None:
        for p in (*self.pools, *self.snapshots.values()):
            p.reset_prefix_cache()
