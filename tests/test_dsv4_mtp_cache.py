"""DeepSeek-V4's MTP head with its window cache in the paged pool
(kvcache/dsv4_paged.py: the MTP ring in each sequence's state slot).

The tiny config of test_deepseek_v4.py, its MTP weights from mtp_reference;
the pool built directly (plan_dsv4_pool, DSV4PagedCache, KVCacheManager).

  - MTP draft logits through the pool (main model via `batch`, MTP via
    `mtp_batch`; prefill then single steps, two sequences of different
    lengths in one batch, one of them chunked) == the per-sequence
    DSV4SequenceState path == the no-cache full forward;
  - rollback: 3 MTP draft positions (and the main model's rejected verify
    chunk), then the shorter length again with other tokens: bit-identical
    to never drafting; with no rollback capacity it is not (the test sees it);
  - the plan's state bytes per sequence include the MTP window and equal
    the allocated tensors' bytes per slot.
"""
import pytest
import torch

from test_deepseek_v4 import case, mtp_reference

from kvcache.dsv4_paged import DSV4PagedCache, plan_dsv4_pool
from kvcache.dsv4_state import DSV4Batch
from kvcache.kv_manager import KVCacheManager
from kvcache.pool_plan import allocate_kv_caches, kv_dtype, plan_kv_pool
from model_zoo.models import build_model

TOL = 1e-5
BS = 4          # block size (entries per block)
D, W = 32, 8    # head_dim, sliding_window of the tiny config


@pytest.fixture(scope="module")
def tiny():
    """(our model with MTP weights, the token ids of test_deepseek_v4.py)."""
    c = case(4)
    _, weights = mtp_reference(c, torch.zeros(1, 4, D), c.ids)   # weights do not depend on the streams
    ours = build_model(c.config)
    ours.load_weights(list(c.hf.state_dict().items()) + list(weights.items()))
    assert ours.mtp_loaded
    return ours, c.ids


class Pool:
    """The engine's V4 pool without the engine: block tables from a KVCacheManager."""

    def __init__(self, ours, max_rollback: int, max_num_seqs: int = 3):
        specs, mtp = ours.kv_cache_spec(), ours.mtp_cache_spec()
        self.plan = plan_dsv4_pool(specs, 64 << 20, BS, torch.float32, max_num_seqs, 128, max_rollback,
                                   mtp_specs=mtp)
        p = self.plan
        self.cache = DSV4PagedCache(specs, p.groups, p.num_blocks, BS, max_rollback, torch.float32, mtp_specs=mtp)
        self.kv = KVCacheManager(p.groups, p.num_blocks, BS, enable_caching=False, max_rollback=max_rollback)

    def tables(self, name):
        return [self.kv.block_table(name, g) for g in range(len(self.kv.groups))]

    def main(self, items, qsl):
        """items: (request name, main-model length, new tokens)."""
        for name, length, n in items:
            assert self.kv.allocate(name, [], length, n)
        return self.cache.batch([(length, self.tables(name)) for name, length, _ in items], qsl)

    def mtp(self, items, qsl):
        """items: (request name, MTP length, new positions); the slot is the main model's."""
        return self.cache.mtp_batch([(length, self.tables(name)) for name, length, _ in items], qsl)


def drive(ours, seqs, schedule, main_meta, mtp_meta):
    """MTP draft logits of each sequence at positions [0, len - 1), computed
    as speculative decoding does: after the main model has run positions
    [0, L), the MTP head runs every position t < L it has not yet run, with
    the token t + 1 and the main model's streams at t.

    schedule: per step, per sequence the main model's new tokens (0: not in
    this step). main_meta / mtp_meta(items, qsl) make the metadata, items
    (sequence index, cached length, new tokens) of the sequences in the step."""
    S = len(seqs)
    main_len, mtp_len = [0] * S, [0] * S
    held = [torch.zeros(0, 4, D) for _ in range(S)]   # streams of positions [mtp_len, main_len)
    out = [[] for _ in range(S)]
    with torch.no_grad():
        for step in schedule:
            run = [i for i in range(S) if step[i]]
            qsl = [0]
            for i in run:
                qsl.append(qsl[-1] + step[i])
            ids = torch.cat([seqs[i][main_len[i]:main_len[i] + step[i]] for i in run])
            pos = torch.cat([torch.arange(main_len[i], main_len[i] + step[i]) for i in run])
            streams = ours.forward_streams(ids, pos, main_meta([(i, main_len[i], step[i]) for i in run], qsl))
            for k, i in enumerate(run):
                held[i] = torch.cat([held[i], streams[qsl[k]:qsl[k + 1]]])
                main_len[i] += step[i]
            todo = [min(main_len[i], len(seqs[i]) - 1) - mtp_len[i] for i in range(S)]
            run = [i for i in range(S) if todo[i] > 0]
            if not run:
                continue
            qsl = [0]
            for i in run:
                qsl.append(qsl[-1] + todo[i])
            next_ids = torch.cat([seqs[i][mtp_len[i] + 1:mtp_len[i] + 1 + todo[i]] for i in run])
            st = torch.cat([held[i][:todo[i]] for i in run])
            pos = torch.cat([torch.arange(mtp_len[i], mtp_len[i] + todo[i]) for i in run])
            lg = ours.compute_logits(ours.mtp_forward(next_ids, st, pos,
                                                      mtp_meta([(i, mtp_len[i], todo[i]) for i in run], qsl)))
            for k, i in enumerate(run):
                out[i].append(lg[qsl[k]:qsl[k + 1]])
                held[i] = held[i][todo[i]:]
                mtp_len[i] += todo[i]
    assert mtp_len == [len(s) - 1 for s in seqs]
    return [torch.cat(o) for o in out]


def full_mtp(ours, ids):
    """MTP draft logits with no cache: one causal forward of each."""
    with torch.no_grad():
        streams = ours.forward_streams(ids, torch.arange(len(ids)), None)
        return ours.compute_logits(ours.mtp_forward(ids[1:], streams[:-1], torch.arange(len(ids) - 1), None))


def close(got, want, what, tol=TOL):
    diff = (got - want).abs().max().item()
    print(f"{what}: max |logit diff| = {diff:.2e} (logit scale {want.abs().max().item():.1f})")
    assert diff < tol, f"{what}: {diff:.2e}"


def test_mtp_through_the_pool_matches_per_sequence_state(tiny):
    ours, a = tiny
    b = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(7))
    seqs = [a, b]
    # prefill (a: 30, b: 13), then a decodes one token a step while b prefills
    # chunks of 5 and then decodes; b finishes first and a runs alone
    schedule = [(30, 13)]
    la, lb = 30, 13
    while la < len(a):
        nb = min(5 if lb < 33 else 1, len(b) - lb)
        schedule.append((1, nb))
        la, lb = la + 1, lb + nb
    assert lb == len(b) and any(s[1] == 0 for s in schedule)

    pool = Pool(ours, max_rollback=3)
    names = ["a", "b"]
    paged = drive(ours, seqs, schedule,
                  lambda items, qsl: pool.main([(names[i], L, n) for i, L, n in items], qsl),
                  lambda items, qsl: pool.mtp([(names[i], L, n) for i, L, n in items], qsl))
    assert [pool.tables(n)[-1][0] for n in names] == [0, 1]   # two slots, both MTP and main state

    states = [ours.new_state(3) for _ in seqs]
    mtp_states = [ours.new_state(3, mtp=True) for _ in seqs]
    per_seq = drive(ours, seqs, schedule,
                    lambda items, qsl: DSV4Batch([states[i] for i, _, _ in items], qsl),
                    lambda items, qsl: DSV4Batch([mtp_states[i] for i, _, _ in items], qsl))
    for name, ids, got, want in zip(names, seqs, paged, per_seq):
        close(got, want, f"sequence {name}: paged vs DSV4SequenceState")
        close(got, full_mtp(ours, ids), f"sequence {name}: paged vs no-cache forward")


def speculate(ours, ids, pool, name, drafts: bool, verify: bool):
    """Prefill 40 tokens, MTP over positions 0..38; optionally 3 MTP draft
    positions 39..41 (wrong tokens, made-up streams) and the main model
    verifying 3 wrong tokens at 40..42, all rejected (kv.truncate to 40);
    then MTP from length 39 again, token by token with the right tokens.
    Returns the MTP logits of positions 39..51."""
    P = 40

    def main(tok, start):
        n = len(tok)
        return ours.forward_streams(tok, torch.arange(start, start + n), pool.main([(name, start, n)], [0, n]))

    def mtp(tok, streams, start):
        n = len(tok)
        meta = pool.mtp([(name, start, n)], [0, n])
        return ours.compute_logits(ours.mtp_forward(tok, streams, torch.arange(start, start + n), meta))

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        s = main(ids[:P], 0)
        mtp(ids[1:P], s[:-1], 0)
        last = s[-1:]
        if drafts:
            wrong = torch.randint(0, 128, (3,), generator=g)
            fake = torch.randn(3, 1, 4, D, generator=g)
            for k in range(3):                  # MTP cache length 39 -> 42
                mtp(wrong[k:k + 1], fake[k], P - 1 + k)
            if verify:
                main(wrong, P)
                pool.kv.truncate(name, P)
        outs = []
        for t in range(P, P + 13):              # MTP length 39 again: the rollback
            outs.append(mtp(ids[t:t + 1], last, t - 1))
            last = main(ids[t:t + 1], t)
    return torch.cat(outs)


def test_mtp_rollback_is_a_shorter_length(tiny):
    ours, ids = tiny
    pool = Pool(ours, max_rollback=3)
    want = speculate(ours, ids, pool, "straight", drafts=False, verify=False)
    got = speculate(ours, ids, pool, "drafted", drafts=True, verify=True)
    assert torch.equal(got, want), (got - want).abs().max()
    close(got, full_mtp(ours, ids[:53])[39:], "MTP after rollback vs no-cache forward")   # positions 39..51
    # The ring's max_rollback extra positions are what keeps it intact: without
    # them the drafts overwrite window positions 32..34, which position 39 reads.
    tight = Pool(ours, max_rollback=0)
    want = speculate(ours, ids, tight, "straight", drafts=False, verify=False)
    got = speculate(ours, ids, tight, "drafted", drafts=True, verify=False)
    assert not torch.equal(got, want)



@pytest.mark.parametrize("kv", ["f32", "bf16", "tq4"])
def test_plan_counts_the_mtp_window(tiny, kv):
    ours, _ = tiny
    specs, mtp = ours.kv_cache_spec(), ours.mtp_cache_spec()
    cdtype, R = kv_dtype(kv, torch.float32), 3
    size = 4 if kv == "f32" else 2      # windows are 16-bit under a compressed preset
    without = plan_kv_pool(specs, 1 << 20, BS, cdtype, 4, 32, max_model_len=128, max_rollback=R)
    plan = plan_kv_pool(specs, 1 << 20, BS, cdtype, 4, 32, max_model_len=128, max_rollback=R, mtp_specs=mtp)
    cache = allocate_kv_caches(specs, plan, cdtype)
    assert len(cache.mtp_layers) == 1
    slots = plan.num_blocks[-1]
    state = [t for layer in cache.layers + cache.mtp_layers for t in layer.state.values()]
    assert all(t.shape[0] == slots + 1 for t in state)      # + the pad slot
    assert sum(t[:-1].numel() * t.element_size() for t in state) == slots * plan.state_bytes_per_seq
    assert cache.nbytes == plan.total_bytes
    mtp_window = (W - 1 + R) * D * size
    assert plan.state_bytes_per_seq - without.state_bytes_per_seq == mtp_window
    assert plan.state_bytes_by_part["mtp"] == {"window": mtp_window}
    assert {k: v for k, v in plan.state_bytes_by_part.items() if k != "mtp"} == without.state_bytes_by_part
    if kv == "f32":   # the same ring as the per-sequence MTP state's
        assert ours.new_state(R, mtp=True).nbytes_by_kind() == {"sliding_attention": {"window": mtp_window}}
    # without mtp_specs: no MTP storage, and mtp_batch says so
    plain = allocate_kv_caches(specs, without, cdtype)
    assert plain.mtp_layers == [] and plain.nbytes == without.total_bytes
    with pytest.raises(ValueError, match="mtp_specs"):
        plain.mtp_batch([(0, [[], [], [0]])], [0, 1])


def test_mtp_specs_must_be_sliding_and_numbered(tiny):
    ours, _ = tiny
    specs = ours.kv_cache_spec()
    with pytest.raises(ValueError, match="sliding window only"):
        plan_dsv4_pool(specs, 1 << 20, BS, torch.float32, 2, 128, mtp_specs=[specs[1]])
    with pytest.raises(ValueError, match="numbered"):
        plan_dsv4_pool(specs, 1 << 20, BS, torch.float32, 2, 128, mtp_specs=[specs[0]] * 2)
