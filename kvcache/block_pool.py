"""A pool of fixed-size KV blocks: reference counts, prefix-cache hashes and
LRU reuse of unreferenced blocks.

The pool hands out block ids only; the tensors live in each layer's storage
and are indexed by these ids. A freed block keeps its hash (and contents)
until it is handed out again, so a later request with the same prefix can
pick it back up.
"""
from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a KV block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # hash -> the blocks holding it (insertion-ordered): two requests that
        # computed the same prefix each leave one, and either serves a hit
        # after the other is evicted.
        self.cached: dict[int, dict[int, None]] = {}
        # Unreferenced blocks, least recently freed first: allocation takes
        # from the front, so cached blocks freed last are evicted last.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            held = self.cached[h]
            del held[block]
            if not held:
                del self.cached[h]
            self.block_hash[block] = None
        self.ref_cnt[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Take a reference on a (possibly unreferenced, cached) block."""
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def free(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        assert self.ref_cnt[block] >= 0, f"block {block} freed twice"
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is None:
                # It holds nothing to reuse (a partial block, a dropped snapshot):
                # handed out before any cached block is evicted.
                self.free_queue.move_to_end(block, last=False)

    def demote(self, block: int) -> None:
        """An unreferenced block goes first in line for eviction."""
        if self.ref_cnt[block] == 0:
            self.free_queue.move_to_end(block, last=False)

    def cache(self, block: int, h: int) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = h
        self.cached.setdefault(h, {})[block] = None

    def lookup(self, h: int) -> int | None:
        held = self.cached.get(h) if self.enable_caching else None
        return next(iter(held)) if held else None

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
