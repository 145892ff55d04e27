"""Block pool and KV manager: refcounts, prefix hashes, LRU, sliding windows,
TurboQuant's hot group."""
import pytest
import torch

from kvcache.block_pool import BlockPool
from kvcache.kv_manager import NULL_BLOCK, KVCacheManager, KVGroup, group_layers
from kvcache.pool_plan import allocate_kv_caches, plan_kv_pool
from kvcache.spec import LayerSpec


def test_pool_refcount_and_lru():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, 111)
    pool.cache(b, 222)
    pool.free(b)
    pool.free(a)            # a freed last: evicted last
    assert pool.num_free == 4 and pool.lookup(111) == a
    c, d, e = pool.allocate(), pool.allocate(), pool.allocate()
    assert b in (c, d, e) and pool.lookup(222) is None and pool.lookup(111) == a
    pool.touch(a)
    assert pool.ref_cnt[a] == 1 and pool.num_free == 0


def test_a_hash_held_by_two_blocks_outlives_either():
    """Two requests that computed the same prefix (the second had no hit: e.g. no
    state snapshot yet) each register a block under its hash; evicting the
    first leaves the second findable."""
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, 7)
    pool.cache(b, 7)
    pool.free(a)
    pool.free(b)
    assert pool.lookup(7) == a
    assert pool.allocate() == 2 and pool.allocate() == a      # a evicted (freed first)
    assert pool.lookup(7) == b and pool.block_hash[a] is None
    assert pool.allocate() == b and pool.lookup(7) is None


def test_a_block_holding_nothing_is_reused_before_cached_ones():
    """A freed block without a hash (a partial block, a snapshot dropped with
    its rejected draft) is handed out first: taking it evicts nothing."""
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache(a, 7)
    pool.free(a)
    pool.free(b)                                   # freed after a, but holds nothing
    assert pool.allocate() == b and pool.lookup(7) == a
    pool.free(c)
    pool.free(b)
    assert [pool.allocate() for _ in range(3)] == [b, c, a] and pool.lookup(7) is None


def test_lookahead_hashes_the_token_after_each_block():
    """With an MTP head (lookahead 1) a block is registered once the token after
    it is known, and hit only by a prompt whose token there is the same."""
    kv = KVCacheManager(group_layers([LayerSpec(0, 1, 8)]), [16], 4, True, lookahead=1)
    a = list(range(100, 113))                      # 13 tokens
    assert kv.allocate("a", a, 0, 12)
    kv.cache_full_blocks("a", a[:12], 12)          # token 12 not known yet: blocks 0, 1
    assert kv.reqs["a"].num_cached == 2
    kv.cache_full_blocks("a", a, 12)
    assert kv.reqs["a"].num_cached == 3
    assert kv.find_prefix_hit("b", a + [1]) == 12
    assert kv.find_prefix_hit("e", a[:12] + [1, 2]) == 8                # token 12 differs
    assert kv.find_prefix_hit("c", a[:8] + [0] + a[9:] + [1]) == 4     # token 8 differs: block 1 is not hit
    assert kv.find_prefix_hit("d", a[:12]) == 8                        # 11 to hit, token 12 unknown


def manager(num_blocks=16, window=None, caching=True):
    specs = [LayerSpec(0, 1, 8), LayerSpec(1, 1, 8, window)] if window else [LayerSpec(0, 1, 8)]
    groups = group_layers(specs)
    return KVCacheManager(groups, [num_blocks] * len(groups), 4, caching)


def test_prefix_hit_and_sharing():
    kv = manager()
    toks = list(range(100, 118))             # 18 tokens: 4 full blocks
    assert kv.find_prefix_hit("a", toks) == 0
    assert kv.allocate("a", toks, 0, 18)
    kv.cache_full_blocks("a", toks, 18)
    hit = kv.find_prefix_hit("b", toks)
    assert hit == 16
    assert kv.allocate("b", toks, hit, 2, num_prefix_hit=hit)
    ta, tb = kv.block_table("a", 0), kv.block_table("b", 0)
    assert ta[:4] == tb[:4] and ta[4] != tb[4]
    assert all(kv.pools[0].ref_cnt[x] == 2 for x in ta[:4])
    # A different token inside block 2 breaks the chain from there on.
    other = toks[:9] + [1] + toks[10:]
    assert kv.find_prefix_hit("c", other) == 8
    kv.free("a"), kv.free("b"), kv.free("c")
    assert kv.num_used_blocks == 0


def test_allocation_fails_cleanly():
    kv = manager(num_blocks=4)
    assert kv.allocate("a", [1] * 12, 0, 12)
    assert not kv.allocate("b", [2] * 8, 0, 8)       # needs 2, has 1
    assert kv.block_table("b", 0) == [] and kv.pools[0].num_free == 1


def test_sliding_window_frees_out_of_window_blocks():
    kv = manager(num_blocks=64, window=8)
    toks = list(range(200))
    kv.allocate("a", toks, 0, 20)
    for n in range(20, 200):
        assert kv.allocate("a", toks, n, 1)
        live = [b for b in kv.block_table("a", 1) if b != NULL_BLOCK]
        assert len(live) <= 8 // 4 + 2                # window plus the partial blocks at each end
    assert len(kv.block_table("a", 0)) == 50          # the full group keeps everything
    assert kv.pools[1].num_blocks - kv.pools[1].num_free <= 4


def test_plan_bytes_from_real_tensors():
    specs = [LayerSpec(i, 3, 64, 512 if i % 2 else None) for i in range(4)]
    plan = plan_kv_pool(specs, 64 << 20, 16, torch.float16, max_num_seqs=8, max_num_batched_tokens=256)
    caches = allocate_kv_caches(specs, plan, torch.float16)
    assert plan.bytes_per_token == 2 * (2 * 3 * 64 * 2)          # two full layers, K and V, f16
    assert plan.compression_ratio == 1.0
    f32 = plan_kv_pool(specs, 64 << 20, 16, torch.float32, max_num_seqs=8, max_num_batched_tokens=256)
    assert f32.f16_bytes_per_token == plan.bytes_per_token and f32.compression_ratio == 0.5
    assert sum(c.nbytes for c in caches) == plan.total_bytes <= 64 << 20
    # Sliding layers get only what their windows need; the rest grows context.
    assert plan.num_blocks[1] == 8 * (-(-511 // 16) + 2) + 256 // 16
    assert plan.capacity_tokens == ((64 << 20) - 288 * 24576) // 24576 * 16


def test_hot_group_holds_first_and_newest_block_and_shares_block_0():
    """TurboQuant's hot group: block 0 and the newest block only (a chunk's
    middle blocks stay NULL, older ones are freed); a prefix hit adopts the
    cached block 0; truncating into a block it no longer holds is refused."""
    kv = KVCacheManager([KVGroup(None, [0]), KVGroup(None, [0], hot=True)], [16, 6], 4, True)
    toks = list(range(100, 130))
    assert kv.allocate("a", toks, 0, 14)                    # blocks 0..3
    hot = kv.block_table("a", 1)
    assert [b != NULL_BLOCK for b in hot] == [True, False, False, True]
    kv.cache_full_blocks("a", toks, 14)
    assert kv.allocate("a", toks, 14, 1) and kv.block_table("a", 1)[3] == hot[3]   # same block
    kv.cache_full_blocks("a", toks, 15)
    assert kv.allocate("a", toks, 15, 3)                    # 15..17: crosses into block 4
    assert [b != NULL_BLOCK for b in kv.block_table("a", 1)] == [True, False, False, True, True]
    kv.cache_full_blocks("a", toks, 18)
    assert kv.allocate("a", toks, 18, 1)                    # block 3 is behind the newest: freed
    assert [b != NULL_BLOCK for b in kv.block_table("a", 1)] == [True, False, False, False, True]
    assert kv.pools[1].num_free == 6 - 2
    hit = kv.find_prefix_hit("b", toks[:13] + [7, 7, 7])
    assert hit == 12
    assert kv.allocate("b", toks[:13] + [7, 7, 7], hit, 4, num_prefix_hit=hit)
    tb = kv.block_table("b", 1)
    assert tb[0] == kv.block_table("a", 1)[0] and tb[1:3] == [NULL_BLOCK, NULL_BLOCK] and tb[3] != NULL_BLOCK
    assert kv.block_table_array("b", 1).tolist() == tb and kv.block_table_array("b", 0).tolist() == \
        kv.block_table("b", 0)                              # adopted entries mirrored too
    kv.free("a")
    kv.free("b")
    assert kv.pools[1].num_free == 6
    nc = KVCacheManager([KVGroup(None, [0]), KVGroup(None, [0], hot=True)], [16, 6], 4, False)
    assert nc.allocate("c", toks, 0, 10)
    nc.truncate("c", 9)                                     # within the newest block
    with pytest.raises(ValueError, match="already freed"):
        nc.truncate("c", 5)                                 # block 1 has no hot copy
    # Rolled back to a block boundary past the newest block (drafts that
    # crossed two blocks, all rejected): the next block is new, and freed
    # again once decoding leaves it.
    assert nc.allocate("d", toks, 0, 13)
    for n in range(13, 20):
        assert nc.allocate("d", toks, n, 1)
    nc.truncate("d", 12)
    for n in range(12, 17):
        assert nc.allocate("d", toks, n, 1)
    assert [b != NULL_BLOCK for b in nc.block_table("d", 1)] == [True, False, False, False, True]
    assert nc.pools[1].num_free == 6 - 2 - 2               # c's two blocks, d's two


@pytest.mark.parametrize("seed", range(4))
def test_tables_and_free_counts_through_random_steps(seed):
    """Random chunks, decodes, rollbacks and frees over full, sliding-window
    and hot groups (no prefix caching, so no block is shared): after every
    call each table (and its array) holds the blocks the next query reads,
    every entry below the window of the last step's first token is NULL (its
    block went back to the pool), and each pool's free count is its size
    minus what the tables hold. A step looks only at the blocks that left the window since
    the last one: a block it skipped would stay in its table here."""
    import random
    rng = random.Random(seed)
    groups = [KVGroup(None, [0]), KVGroup(6, [1]), KVGroup(None, [2], hot=True)]
    kv = KVCacheManager(groups, [400, 400, 400], 4, enable_caching=False)
    toks = list(range(300))
    lens: dict[str, int] = {}
    start: dict[str, int] = {}             # first position of the request's last step
    for _ in range(400):
        rid = rng.choice("abc")
        n = lens.get(rid, 0)
        op = rng.random()
        if rid in lens and op < 0.1:
            kv.free(rid)
            del lens[rid], start[rid]
        elif n and op < 0.3:
            back = rng.randint(1, min(6, n))
            try:
                kv.truncate(rid, n - back)
                lens[rid] = n - back
            except ValueError:              # into a block already freed: refused, nothing changed
                pass
        else:
            new = rng.choice([1, 1, 1, 2, 5, 13])
            if n + new > len(toks):
                continue
            assert kv.allocate(rid, toks, n, new)
            lens[rid], start[rid] = n + new, n
        for gi, (g, pool) in enumerate(zip(groups, kv.pools)):
            held = 0
            for r, m in lens.items():
                table = kv.block_table(r, gi)
                assert kv.block_table_array(r, gi).tolist() == table     # what a step's inputs copy
                gone = kv._window_start_block(g, start[r])
                assert all(b == NULL_BLOCK for b in table[int(g.hot):gone]), (seed, r, gi, gone, table)
                # What the next query (position m) reads.
                need = [0, m // 4] if g.hot else range(kv._window_start_block(g, m), len(table))
                assert all(table[j] != NULL_BLOCK for j in need if j < len(table)), (seed, r, gi, m, table)
                held += sum(b != NULL_BLOCK for b in table)
            assert pool.num_free == pool.num_blocks - held, (seed, gi)
    for r in list(lens):
        kv.free(r)
    assert all(p.num_free == p.num_blocks for p in kv.pools)


def test_remembered_tokens_follow_the_cache():
    """remember_tokens (engine/prefix_store.py): each registered block's
    (parent, tokens) give its hash again; entries of evicted blocks are
    pruned as the table grows, never those still cached; a salted chain is
    not known (its root hash differs between processes)."""
    kv = KVCacheManager(group_layers([LayerSpec(0, 1, 8)]), [8], 4, True)
    kv.remember_tokens = True
    pruned = 0
    for i in range(600):                       # far more blocks than the pool: old ones evicted
        rid, toks = f"r{i}", [i, i + 1, i + 2, i + 3] * 2 + [1]
        assert kv.allocate(rid, toks, 0, len(toks))
        before = len(kv.block_tokens)
        kv.cache_full_blocks(rid, toks, len(toks))
        if len(kv.block_tokens) < before:      # pruned just now: what is cached (this request's too) stays
            pruned += 1
            assert set(kv.pools[0].cached) <= set(kv.block_tokens)
        kv.free(rid)
    cached = {h for h in kv.pools[0].cached}
    assert pruned and len(kv.block_tokens) <= 2 * len(cached) + 1024 and cached <= set(kv.block_tokens)
    for h in cached:
        parent, tokens = kv.block_tokens[h]
        assert hash((parent, tokens)) == h and kv.chain_known(h)
    kv.set_salt("s", "tenant")
    toks = [9] * 9
    assert kv.allocate("s", toks, 0, 9)
    kv.cache_full_blocks("s", toks, 9)
    assert not kv.chain_known(kv.reqs["s"].hashes[1])
