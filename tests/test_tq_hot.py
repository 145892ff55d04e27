"""Hot tokens (kvcache/tq_cache.py): with the manager's hot group, a query
reads block 0 and its own block from int8 copies and every other key from
its codes, whatever the chunking; the hot group holds only block 0 and the
newest block; the plan accounts for it."""
import pytest
import torch

from kvcache.kv_manager import NULL_BLOCK, KVCacheManager, KVGroup
from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.tq_cache import TQLayerCache, merge
from kvcache.turboquant import INT8, tq

BS, H, G, D = 16, 2, 3, 64


def _run(hot, kf, vf, chunks, seed=0, lims=None):
    """One sequence through store() + attention() in the given chunks, with
    block tables from a real KVCacheManager; lims: each position's last key
    (key_limits_t; None: causal). Returns (outputs, reference)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(chunks)
    k = torch.randn(total, H, D, generator=g) * 2 + 0.5
    v = torch.randn(total, H, D, generator=g)
    q = torch.randn(total, H * G, D, generator=g)
    mgr = KVCacheManager([KVGroup(None, [0]), KVGroup(None, [0], hot=True)], [40, 6], BS, enable_caching=False)
    c = TQLayerCache(40, BS, H, D, kf, vf, 0, seed=3, hot=hot, hot_blocks=6, hot_group_id=1)
    c.set_key_mean(torch.full((H, D), 0.5))
    hk8, v_hot, yk_all, yv_all = [], [], [], []
    outs, done = [], 0
    for n in chunks:
        assert mgr.allocate("r", list(range(total)), done, n)
        tables = [mgr.block_table("r", gi) for gi in (0, 1)]
        # the hot group holds block 0, the chunk's first and last blocks only
        held = {j for j, b in enumerate(tables[1]) if b != NULL_BLOCK}
        assert held == {0, done // BS, (done + n - 1) // BS}
        slots = [torch.tensor([t[p // BS] * BS + p % BS for p in range(done, done + n)]) for t in tables]
        bts = [torch.tensor(t).clamp(min=0)[None] for t in tables]
        meta = AttentionMetadata([0, n], [done + n], int(n == 1), [GroupMetadata(s, b) for s, b in zip(slots, bts)],
                                 [c])
        if lims is not None:
            meta.key_limits_t = lims[done:done + n]
        c.store(meta, k[done:done + n], v[done:done + n])
        outs.append(c.attention(q[done:done + n], meta, D ** -0.5))
        # the reference's view of these tokens, rotated exactly as store() did
        rot = c.kc.rot_t("cpu")
        yk, yv = (k[done:done + n] - c.k_mean) @ rot, v[done:done + n] @ rot
        yk_all.append(yk)
        yv_all.append(yv)
        done += n
    yk, yv = torch.cat(yk_all), torch.cat(yv_all)
    # reference: hot positions read int8 (K; and V with "kv"), the rest coded
    rt = lambda codec, y: codec.decode(codec.quantize_rotated(y))       # noqa: E731
    kcod, vcod = rt(c.kc, yk), rt(c.vc, yv)
    i8 = c.hkc
    khot, vhot = rt(i8, yk), (rt(i8, yv) if hot == "kv" else vcod)
    ref = []
    qr = c._rotate_q(q.unsqueeze(0), D ** -0.5)[0]                   # [H, G, T, D]
    for p in range(total):
        n = p + 1 if lims is None else int(lims[p]) + 1
        pos = torch.arange(n)
        # past a query's own block (its span's keys) is hot too
        use = ((pos < BS) | (pos // BS >= p // BS))[:, None, None]
        kk, vv = torch.where(use, khot[:n], kcod[:n]), torch.where(use, vhot[:n], vcod[:n])
        s = torch.einsum("hgd,thd->hgt", qr[:, :, p], kk)
        ref.append(torch.einsum("hgt,thd->hgd", s.softmax(-1), vv))
    ref = c._finish(torch.stack(ref, 2)[None], torch.float32)[0]
    return torch.cat(outs), ref


CHUNKS = [5, 20, 1, 1, 30, 1, 16, 1, 1, 40]     # in block 0, mid-block starts, boundaries, decodes


@pytest.mark.parametrize("hot", ["k", "kv"])
@pytest.mark.parametrize("kf,vf", [(tq(4), tq(4)), (tq(3), tq(3)), (tq(4), tq(2))])
@pytest.mark.parametrize("backend", ["torch", "kernel"])
def test_hot_reads_int8_for_sink_and_own_block(monkeypatch, hot, kf, vf, backend):
    monkeypatch.setenv("TQSERVE_TQ_CPU", backend)
    out, ref = _run(hot, kf, vf, CHUNKS)
    err = float((out - ref).abs().max())
    assert err <= 2e-5 * float(ref.abs().max()), err


# Positions 0-4, 5-24, 25, 26-55, 56-67, 68-107, 108. Spans: [8, 22] from block
# 0 into 1; [30, 50] over blocks 1-3; [60, 90], which the chunk at 68 starts in
# the middle of (60-67 came in the chunk before, which ended there: 67 their limit).
SPAN_CHUNKS = [5, 20, 1, 30, 12, 40, 1]


def _span_limits():
    lims = torch.arange(sum(SPAN_CHUNKS))
    for a, b in ((8, 22), (30, 50), (60, 67), (68, 90)):
        lims[a:b + 1] = b
    return lims


@pytest.mark.parametrize("hot", ["k", "kv"])
@pytest.mark.parametrize("backend", ["torch", "kernel"])
def test_hot_key_limits_read_the_span_hot(monkeypatch, hot, backend):
    """Key limits with hot tokens: a query in a span sees the keys up to its
    limit, those from its own block on read int8 (the chunk's new rows),
    those below it as before."""
    monkeypatch.setenv("TQSERVE_TQ_CPU", backend)
    lims = _span_limits()
    out, ref = _run(hot, tq(4), tq(3), SPAN_CHUNKS, lims=lims)
    err = float((out - ref).abs().max())
    assert err <= 2e-5 * float(ref.abs().max()), err
    causal, _ = _run(hot, tq(4), tq(3), SPAN_CHUNKS)
    differs = (out - causal).abs().amax((1, 2)) > 1e-3
    assert torch.equal(differs, lims > torch.arange(len(lims)))


def test_hot_is_closer_than_codes_alone():
    """The int8 copies make attention nearer to exact K/V than codes alone."""
    torch.manual_seed(0)
    hot_out, _ = _run("kv", tq(3), tq(3), [60, 1, 1, 1])
    cold_out, _ = _run("kv", INT8, INT8, [60, 1, 1, 1])   # int8 everywhere: the hot ideal
    plain = _run_plain(tq(3), tq(3), 63)
    assert (hot_out - cold_out).norm() < (plain - cold_out).norm()


def _run_plain(kf, vf, total, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(total, H, D, generator=g) * 2 + 0.5
    v = torch.randn(total, H, D, generator=g)
    q = torch.randn(total, H * G, D, generator=g)
    c = TQLayerCache(8, BS, H, D, kf, vf, 0, seed=3)
    c.set_key_mean(torch.full((H, D), 0.5))
    slots = torch.arange(total)
    c.write(slots, k, v)
    bt = torch.arange(8)
    return torch.cat([c._prefill(q[:60], bt, 60, D ** -0.5)] +
                     [c._decode(q[p:p + 1], bt[None], torch.tensor([p + 1]), D ** -0.5) for p in (60, 61, 62)])


def test_merge_of_two_empty_passes_is_zero():
    # A row that sees no key in either pass (a captured step's pad rows):
    # output 0, not 0 / 0; one empty side leaves the other as it is.
    o1, o2 = torch.randn(3, 4), torch.randn(3, 4)
    inf = float("-inf")
    lse1, lse2 = torch.tensor([inf, 0.5, inf]), torch.tensor([inf, inf, 1.0])
    out = merge(o1, lse1, o2, lse2)
    assert torch.equal(out[0], torch.zeros(4))
    torch.testing.assert_close(out[1], o1[1], rtol=0, atol=0)
    torch.testing.assert_close(out[2], o2[2], rtol=0, atol=0)
