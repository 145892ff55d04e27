"""Prefix caching for models with per-sequence state (Qwen3-Next / Qwen3.5's
linear attention, DeepSeek-V4's window and compressor rings): state snapshots
on a token grid (kvcache/kv_manager.py), restored into a hit's slot.

Every engine test compares against the same engine with prefix caching off:
a hit must change nothing but the work done."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from kvcache.kv_manager import KVCacheManager, KVGroup
from kvcache.pool_plan import SNAPSHOT_SHARE, SNAPSHOTS_PER_SEQ
from server.plan import SNAPSHOT_NOTE
from test_server_process import free_port
from test_spec_decode import partly_right
from tiny_models import conversation, save_tiny_deepseek_v4, save_tiny_qwen3_next, token_prompts

BS = 4


# -- the manager ------------------------------------------------------------------------------
def hybrid_manager(snapshots=4, interval=8, slots=4):
    groups = [KVGroup(None, [0]), KVGroup(None, [1], per_seq=True)]
    return KVCacheManager(groups, [32, slots], BS, True, num_snapshots=snapshots, snapshot_interval=interval)


def run_chunk(kv, rid, toks, start, n, hit=0):
    """What the scheduler and runner do for one step of rid: allocate, snapshot
    at a grid end, take the step's copies, register what it computed."""
    assert kv.allocate(rid, toks, start, n, num_prefix_hit=hit)
    if (start + n) % kv.snapshot_interval == 0:
        kv.snapshot(rid, start + n)
    copies = kv.take_state_copies()
    kv.cache_full_blocks(rid, toks, start + n)
    return copies


def test_snapshots_restore_and_register():
    kv = hybrid_manager()
    base = kv.snapshot_base[1]
    a = list(range(100, 121))                        # 21 tokens
    assert kv.find_prefix_hit("a", a) == 0
    c = run_chunk(kv, "a", a, 0, 16)
    slot_a = kv.block_table("a", 1)[0]
    assert c.restores == [] and len(c.snapshots) == 1 and c.snapshots[0][0] == slot_a
    snap = c.snapshots[0][1] - base                   # snapshot ids follow the sequences' slots
    assert 0 <= snap < 4
    assert kv.snapshots[1].ref_cnt[snap] == 0 and kv.snapshots[1].block_hash[snap] is not None
    run_chunk(kv, "a", a, 16, 5)
    # b shares 18 tokens: blocks 0..3 cached and the state at 16 -> hit 16, restored
    b = a[:18] + [7, 8, 9, 10, 11]
    assert kv.find_prefix_hit("b", b) == 16 and kv.shared_prefix("b") == 16
    c = run_chunk(kv, "b", b, 16, 7, hit=16)
    assert c.restores == [(base + snap, kv.block_table("b", 1)[0])]
    assert kv.block_table("b", 0)[:4] == kv.block_table("a", 0)[:4]
    assert kv.snapshots[1].ref_cnt[snap] == 0       # released once the step took the copy
    # a prompt sharing 12 tokens: blocks cached to 8 on the grid, no snapshot at 8 (a's chunk ended at 16)
    d = a[:12] + [1] * 9
    assert kv.find_prefix_hit("d", d) == 0 and kv.shared_prefix("d") == 8
    for r in "abd":
        kv.free(r)
    assert kv.num_used_blocks == 0 and all(n == 0 for n in kv.snapshots[1].ref_cnt)


def test_snapshot_registered_only_when_its_tokens_are_computed():
    kv = hybrid_manager()
    a = list(range(50, 70))
    assert kv.allocate("a", a, 0, 8)
    kv.snapshot("a", 8)                               # taken, step not finished
    kv.take_state_copies()
    snap = kv.reqs["a"].snaps[0][2]
    kv.cache_full_blocks("a", a, 4)                   # not there yet
    assert kv.snapshots[1].ref_cnt[snap] == 1 and kv.snapshots[1].block_hash[snap] is None
    kv.free("a")                                      # preempted first: freed, never registered
    assert kv.snapshots[1].ref_cnt[snap] == 0 and kv.find_prefix_hit("x", a) == 0


def test_a_rejected_positions_snapshot_is_dropped():
    """A verification step over positions 6..9 passes the grid point 8 and
    snapshots there; its token at 7 is rejected (truncate to 7): that snapshot
    is dropped, and the one the next step takes at 8 is what gets registered."""
    kv = hybrid_manager()
    a = list(range(30, 40))
    run_chunk(kv, "a", a, 0, 4)
    assert kv.allocate("a", a, 4, 6)                   # 4..9: 2 known + 3 drafts + 1
    kv.snapshot("a", 8)
    first = kv.take_state_copies().snapshots[0][1]
    kv.truncate("a", 7)                               # position 7's token rejected
    assert kv.reqs["a"].snaps == [] and kv.snapshots[1].ref_cnt[first - kv.snapshot_base[1]] == 0
    assert kv.allocate("a", a, 7, 1)
    kv.snapshot("a", 8)
    second = kv.take_state_copies().snapshots[0][1]
    kv.cache_full_blocks("a", a, 8)
    assert kv.snapshots[1].lookup(kv.reqs["a"].hashes[1]) + kv.snapshot_base[1] == second


def test_a_requests_superseded_snapshots_go_first():
    """A long prompt's chunk ends each leave a snapshot: once a later one of
    the same request is registered, the earlier go first in line for
    eviction, except where its prompt parted from another's (kept): under
    pressure the latest (a next turn's) and the kept one survive."""
    kv = hybrid_manager(snapshots=4)
    a = list(range(100, 134))                          # 34 tokens: grid points 8, 16, 24, 32
    assert kv.allocate("a", a, 0, 8)
    kv.snapshot("a", 8, kept=True)                     # where a parted from an earlier prompt
    kv.take_state_copies()
    kv.cache_full_blocks("a", a, 8)
    for start in (8, 16, 24):
        run_chunk(kv, "a", a, start, 8)
    kv.free("a")
    run_chunk(kv, "b", [7] * 12, 0, 8)                 # another request's snapshots evict two
    run_chunk(kv, "c", [9] * 12, 0, 8)
    assert kv.find_prefix_hit("q", a + [1]) == 32
    hashes = kv.reqs["q"].hashes
    alive = [n for n in (8, 16, 24, 32) if kv.snapshots[1].lookup(hashes[n // BS - 1]) is not None]
    assert alive == [8, 32]


def test_least_recently_used_snapshots_go_first():
    kv = hybrid_manager(snapshots=2)
    prompts = [[i] * 12 for i in range(3, 6)]
    for i, p in enumerate(prompts):
        run_chunk(kv, f"r{i}", p, 0, 8)
        kv.free(f"r{i}")
    hits = [kv.find_prefix_hit(f"q{i}", p) for i, p in enumerate(prompts)]
    assert hits == [0, 8, 8]                          # 2 snapshots: the first one was evicted
    # every snapshot in use by steps not yet done: nothing taken, nothing fails
    for r in ("x", "y", "z"):
        assert kv.allocate(r, [9] * 8, 0, 8)
        kv.snapshot(r, 8)
    assert len(kv.take_state_copies().snapshots) == 2


def test_ratio_groups_register_where_their_blocks_end():
    """DeepSeek-V4's shape: entry groups of ratio 2 and 4 (a block of each
    covers 8 and 16 tokens) and the state: hits end on 16-token multiples."""
    groups = [KVGroup(None, [0], ratio=2), KVGroup(None, [1], ratio=4), KVGroup(None, [0, 1], per_seq=True)]
    kv = KVCacheManager(groups, [16, 16, 4], BS, True, num_snapshots=4, snapshot_interval=16)
    a = list(range(60, 95))                           # 35 tokens
    run_chunk(kv, "a", a, 0, 32)
    assert len(kv.block_table("a", 0)) == 4 and len(kv.block_table("a", 1)) == 2
    h = kv.reqs["a"].hashes
    assert [kv.pools[0].block_hash[b] for b in kv.block_table("a", 0)] == [h[1], h[3], h[5], h[7]]
    assert [kv.pools[1].block_hash[b] for b in kv.block_table("a", 1)] == [h[3], h[7]]
    # blocks cached to 16 on the grid, but the state only at 32 (the chunk's end), which needs all 32 tokens
    assert kv.find_prefix_hit("b", a[:30] + [1, 2, 3]) == 0 and kv.shared_prefix("b") == 16
    assert kv.find_prefix_hit("c", a) == 32
    assert kv.allocate("c", a, 32, 3, num_prefix_hit=32)
    assert kv.block_table("c", 1) == kv.block_table("a", 1) and kv.block_table("c", 0)[:4] == kv.block_table("a", 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        KVCacheManager(groups, [16, 16, 4], BS, True, num_snapshots=4, snapshot_interval=24)


# -- the engine -------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    save_tiny_qwen3_next(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4_state")
    save_tiny_deepseek_v4(path)
    return str(path)


def one_by_one(llm, prompts, sp=GREEDY):
    """Run the prompts one after another: (outputs, each request's cached tokens)."""
    outs, hits = [], []
    for p in prompts:
        o = llm.generate([p], sp)[0]
        outs.append(o)
        hits.append(o.num_cached_tokens)
    return outs, hits


def assert_same(a, b, tol=2e-5):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        worst = max(abs(lx[t] - ly[t]) for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs) for t in lx)
        assert worst < tol, worst


@pytest.mark.parametrize("family,kv", [("qwen3_next", "auto"), ("qwen3_next", "tq4"), ("deepseek_v4", "auto")])
def test_hits_resume_from_the_state_and_change_nothing(family, kv, tiny_qwen3_next, tiny_v4):
    """Three prompts share a 41-token system prompt: the second one's first
    chunk ends where its blocks stop matching the first's (40 on the grid),
    so the third hits 40 tokens; a follow-up turn (the third's prompt, its
    output and more) hits where its last decode crossed the grid. Tokens and
    logprobs equal the engine without prefix caching (tq4: TurboQuant codes and
    the hot group's first and newest blocks adopted beside the state)."""
    # The first prompt's last grid point lies past the system prompt's (users' lengths).
    if family == "qwen3_next":
        path, grid, args = tiny_qwen3_next, 8, dict(dtype="float32", quantization="none", block_size=BS)
        system, prompts = conversation(256, seed=3)
    else:   # blocks of 2 entries at ratios 4 and 16: every group's blocks end every 32 tokens
        path, grid, args = tiny_v4, 32, dict(block_size=2)
        system, prompts = conversation(128, seed=5, users=(24, 31))
    args.update(max_num_seqs=2, mamba_block_size=grid, kv_cache_dtype=kv)
    cached = LLM(path, **args)
    plain = LLM(path, enable_prefix_caching=False, **args)
    outs, hits = one_by_one(cached, prompts)
    junction = len(system) // grid * grid
    assert hits == [0, 0, junction]
    follow = prompts[2] + list(outs[2].outputs[0].token_ids) + [5, 6, 7]
    out2, hit2 = one_by_one(cached, [follow])
    # the last snapshot of the third request: where its decode last reached the grid
    assert hit2 == [(len(prompts[2]) + 24 - 1) // grid * grid] and hit2[0] > junction
    assert_same(outs + out2, plain.generate(prompts + [follow], GREEDY))
    kv = cached.core.kv
    assert kv.num_used_blocks == 0 and all(n == 0 for p in kv.snapshots.values() for n in p.ref_cnt)


def test_batched_async_and_preempted(tiny_qwen3_next):
    """Many requests sharing prefixes at once, asynchronous scheduling, a KV
    pool small enough to preempt, 3 snapshots for 12 requests (evictions):
    every output equals the engine without prefix caching, and hits happen."""
    args = dict(dtype="float32", quantization="none", block_size=BS, max_num_seqs=4, mamba_block_size=8,
                max_num_batched_tokens=32)
    system, _ = conversation(256, seed=9)
    prompts = [system[:n] + u for n, u in zip([41, 30, 17, 41] * 3, token_prompts(12, 3, 20, seed=4))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = LLM(tiny_qwen3_next, enable_prefix_caching=False, **args).generate(prompts, sp)
    llm = LLM(tiny_qwen3_next, async_scheduling=True, kv_cache_memory=450_000, max_model_len=128, **args)
    assert llm.core.plan.num_snapshots == 3
    out = llm.generate(prompts, sp)
    assert_same(ref, out, tol=1e-4)     # batch shapes differ from the reference's: fp32 rounding
    st = llm.core.get_stats()
    print(f"hits {st.prefix_cache_hits_total} tokens, {st.num_preemptions_total} preemptions")
    assert st.prefix_cache_hits_total > 0 and st.num_preemptions_total > 0
    kv = llm.core.kv
    assert kv.num_used_blocks == 0 and all(n == 0 for p in kv.snapshots.values() for n in p.ref_cnt)


def test_verification_steps_snapshot_accepted_positions(tiny_qwen3_next):
    """Drafts with 0..3 correct tokens then wrong ones: a verification step
    that passes a grid point snapshots the state there (one of the slot's
    checkpoints), kept only if that position's token is accepted. A follow-up
    turn hits where its decode last passed the grid, as without drafts, and
    every output equals the run without drafts."""
    args = dict(dtype="float32", quantization="none", block_size=BS, max_num_seqs=2, mamba_block_size=8)
    system, prompts = conversation(256, seed=12)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = LLM(tiny_qwen3_next, **args)
    ref, ref_hits = one_by_one(plain, prompts, sp)
    follow = prompts[2] + list(ref[2].outputs[0].token_ids) + [5, 6, 7]
    ref2, ref_hit2 = one_by_one(plain, [follow], sp)
    llm = LLM(tiny_qwen3_next, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **args)
    llm.core.proposer = partly_right(prompts + [follow], [o.outputs[0].token_ids for o in ref + ref2])
    out, hits = one_by_one(llm, prompts + [follow], sp)
    assert hits == ref_hits + ref_hit2 and ref_hits == [0, 0, 40] and ref_hit2[0] > 40
    assert_same(ref + ref2, out, tol=1e-4)
    st = llm.core.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens_total < st.spec_decode_num_draft_tokens_total


def test_tensor_parallel_ranks_copy_the_state_too(tiny_qwen3_next):
    """Two ranks (tests/tp_engine_run.py --shared-prefix): the follower does the
    leader's slot copies from the step's plan. Hits happen, and tokens equal
    one rank without prefix caching (greedy, seeded and penalty rows), with
    and without asynchronous scheduling."""
    from tp_engine_run import parse, run
    def run_ranks(*flags):
        out = subprocess.run([sys.executable, str(Path(__file__).parent / "tp_engine_run.py"), tiny_qwen3_next,
                              str(free_port()), "--shared-prefix", *flags], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    want = run(parse([tiny_qwen3_next, "29500", "--shared-prefix", "--no-prefix-caching"]), ranks=1)
    for flags in ((), ("--async-scheduling",)):
        got = run_ranks(*flags)
        # prompt 3 is prompt 0 again: it hits prompt 0's last snapshot
        hits = got["hits"]
        assert hits[:3] == [0, 0, 40] and hits[3] > 40 and hits[4] == 40 and got["used_blocks"] == 0
        assert got["outputs"] == want["outputs"]


def test_the_capacity_planner_says_what_snapshots_take():
    assert f"{SNAPSHOTS_PER_SEQ} per running sequence" in SNAPSHOT_NOTE
    assert f"at most {SNAPSHOT_SHARE:.0%} of the KV memory" in SNAPSHOT_NOTE


# -- with an MTP head -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v4_with_mtp(tmp_path_factory):
    from test_deepseek_v4 import case, save_with_mtp
    path = tmp_path_factory.mktemp("v4_mtp_state")
    save_with_mtp(case(4), path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_next_with_mtp(tmp_path_factory):
    from test_hybrid_mtp import saved
    return saved("qwen3_next", tmp_path_factory)


def recording(llm):
    """Wrap the proposer: (tag[0], token ids, drafts) of every draft list it makes."""
    seen, tag, propose = [], [None], llm.core.proposer.propose

    def rec(reqs, room):
        out = propose(reqs, room)
        seen.extend((tag[0], list(r.token_ids), d) for r, d in zip(reqs, out) if d)
        return out
    llm.core.proposer.propose = rec
    return seen, tag


@pytest.mark.parametrize("family", ["deepseek_v4", "qwen3_next"])
def test_mtp_head_resumes_exactly_at_hits(family, v4_with_mtp, qwen3_next_with_mtp):
    """With an MTP head drafting, snapshots hold the head's cache too (taken
    after its pass over the step) and what is cached up to a position is
    hashed with the token after it (the head's entry there read it). Prompts:
    three sharing a system prompt (the third hits the junction); a follow-up
    turn hitting the snapshot that the third request's last step took (the
    step that finished it); one that leaves the third's prompt exactly at a
    snapshot point (it hits an earlier one: the head's last entry there read
    the third's next token). Every draft after a hit equals the MTP
    head's over the whole sequence without a cache, and tokens equal the
    engine without drafts or caching."""
    if family == "deepseek_v4":
        from test_spec_decode_mtp import check_drafts
        path, grid, args = v4_with_mtp, 32, dict(block_size=2)
        system, prompts = conversation(128, seed=5, users=(24, 31))
    else:
        from test_hybrid_mtp import ReferenceMTP
        p, hf, sd = qwen3_next_with_mtp
        path, grid, args = str(p), 8, dict(dtype="float32", quantization="none", block_size=BS)
        system, prompts = conversation(256, seed=3)
    args.update(max_num_seqs=2, mamba_block_size=grid)
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **args)
    assert llm.core.plan.num_snapshots > 0
    c = prompts[2]
    m = (len(c) - 1) // grid * grid                   # the third prompt's last snapshot point
    parted = c[:m] + [(c[m] + 1) % 100, 9, 10]
    end = -(-(len(c) + 8) // grid) * grid             # where the third request's last step ends
    sps = [SamplingParams(temperature=0, max_tokens=12 if i != 2 else end - len(c) + 1, ignore_eos=True)
           for i in range(3)]
    seen, tag = recording(llm)
    outs = []
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        tag[0] = i
        outs += llm.generate([p], sp)
    follow = c + list(outs[2].outputs[0].token_ids) + [5, 6, 7]
    for i, q in ((3, follow), (4, parted)):
        tag[0] = i
        outs += llm.generate([q], sps[0])
    hits = [o.num_cached_tokens for o in outs]
    junction = len(system) // grid * grid
    assert hits[:3] == [0, 0, junction] and hits[3] == end and junction <= hits[4] < m, hits
    plain = LLM(path, enable_prefix_caching=False, **args)
    ref = plain.generate(prompts + [follow, parted], sps + [sps[0]] * 2)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    checked = 0
    for i, ids, drafts in seen:
        if i < 2:
            continue
        if family == "deepseek_v4":
            check_drafts(llm.core.model, ids, drafts)
        else:
            want, margins = ReferenceMTP(hf, sd).drafts(ids, len(drafts))
            n = next((j for j, g in enumerate(margins) if g <= 1e-3), len(drafts))   # near-ties aside
            assert drafts[:n] == want[:n], (len(ids), drafts, want)
        checked += 1
    assert checked >= 10
    kv = llm.core.kv
    assert kv.num_used_blocks == 0 and all(n == 0 for p in kv.snapshots.values() for n in p.ref_cnt)


def test_mtp_batched_and_preempted(qwen3_next_with_mtp):
    """MTP drafts with prefix caching, many requests sharing prefixes at once
    in a pool small enough to preempt, few snapshots (evictions): every output
    equals the engine without drafts or caching; hits and preemptions happen."""
    p, _, _ = qwen3_next_with_mtp
    args = dict(dtype="float32", quantization="none", block_size=BS, max_num_seqs=4, mamba_block_size=8,
                max_num_batched_tokens=32)
    system, _ = conversation(256, seed=9)
    prompts = [system[:n] + u for n, u in zip([41, 30, 17, 41] * 3, token_prompts(12, 3, 20, seed=4))]
    sp = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    ref = LLM(str(p), enable_prefix_caching=False, **args).generate(prompts, sp)
    llm = LLM(str(p), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              kv_cache_memory=1_300_000, max_model_len=128, **args)
    out = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    st = llm.core.get_stats()
    print(f"{llm.core.plan.num_snapshots} snapshots, hits {st.prefix_cache_hits_total} tokens, "
          f"{st.num_preemptions_total} preemptions, {st.spec_decode_num_draft_tokens_total} draft tokens")
    assert st.prefix_cache_hits_total > 0 and st.num_preemptions_total > 0
    assert st.spec_decode_num_draft_tokens_total > 0
    kv = llm.core.kv
    assert kv.num_used_blocks == 0 and all(n == 0 for p in kv.snapshots.values() for n in p.ref_cnt)
