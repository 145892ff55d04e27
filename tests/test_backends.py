"""The attention backend registry (kvcache/backends.py): defaults by storage
format and device, overrides, a registered backend taking over a cache's
attention, imports without triton; and the step inputs the backends read
(engine/model_runner.py builds them with numpy): equal to the per-token
Python construction they replaced."""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledRequest, SchedulerOutput
from kvcache import backends
from kvcache.backends import AttentionBackend, backend_for, backend_names, get_backend, register_backend
from kvcache.dense_cache import DenseLayerCache
from kvcache.kv_manager import NULL_BLOCK, KVGroup, StateCopies
from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.turboquant import tq
from tq_paged import paged_cache


def test_defaults_by_format_and_device(monkeypatch):
    monkeypatch.delenv("TQSERVE_ATTN_BACKEND", raising=False)
    assert backend_names("dense") == ["dense-cpu", "dense-torch", "dense-triton"]
    assert backend_names("tq") == ["tq-cpu", "tq-torch", "tq-triton"]
    want = {("dense", "cpu"): "dense-cpu", ("dense", "cuda"): "dense-triton", ("dense", "meta"): "dense-torch",
            ("tq", "cpu"): "tq-cpu", ("tq", "cuda:1"): "tq-triton", ("tq", "mps"): "tq-torch"}
    for (fmt, dev), name in want.items():
        b = backend_for(fmt, dev)
        assert (b.name, b.format) == (name, fmt)
        assert b is get_backend(name)           # one stateless instance per name


def test_overrides(monkeypatch):
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-torch, tq-torch")
    assert backend_for("dense", "cuda").name == "dense-torch"
    assert backend_for("tq", "cpu").name == "tq-torch"
    assert backend_for("dense", "cuda", "dense-triton").name == "dense-triton"     # explicit beats the env
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-torch")
    assert backend_for("tq", "cuda").name == "tq-triton"                           # only its own format
    with pytest.raises(ValueError, match="reads 'dense' storage"):
        backend_for("tq", "cpu", "dense-torch")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


def test_caches_take_their_backend(monkeypatch):
    monkeypatch.delenv("TQSERVE_ATTN_BACKEND", raising=False)
    c = DenseLayerCache(4, 16, 1, 64, torch.float32, 0)
    assert c.backend.name == "dense-cpu"
    assert DenseLayerCache(4, 16, 1, 64, torch.float32, 0, backend="dense-triton").backend.name == "dense-triton"
    t, _ = paged_cache(tq(4), tq(3), 1, 64, [20])
    assert t.backend.name == "tq-cpu"                 # looked up on first use
    t.backend = "tq-torch"
    assert t.backend.name == "tq-torch"
    t.backend = None
    assert t.backend.name == "tq-cpu"
    with pytest.raises(ValueError):
        c.backend = "tq-cpu"


def test_registered_backend_runs_a_cache(monkeypatch):
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    calls = []

    @register_backend("dense-test", "dense")
    class Half(AttentionBackend):
        """dense-torch's split, with outputs halved: the default forward
        calls this backend's decode and prefill."""
        def decode(self, cache, q, *a):
            calls.append("decode")
            return get_backend("dense-torch").decode(cache, q, *a) / 2

        def prefill(self, cache, q, *a):
            calls.append("prefill")
            return get_backend("dense-torch").prefill(cache, q, *a) / 2

    assert "dense-test" in backend_names("dense")
    c = DenseLayerCache(8, 16, 1, 64, torch.float32, 0)
    slots = torch.arange(40)
    c.write(slots, torch.randn(40, 1, 64), torch.randn(40, 1, 64))
    bt = torch.tensor([[0, 1, 2], [0, 1, 2]])
    meta = AttentionMetadata([0, 1, 11], [40, 30], 1, [GroupMetadata(slots[:11], bt)], [c])
    q = torch.randn(11, 2, 64)
    ref = c.attention(q, meta, 0.125)
    c.backend = "dense-test"
    torch.testing.assert_close(c.attention(q, meta, 0.125), ref / 2)
    assert calls == ["decode", "prefill"]
    with pytest.raises(ValueError, match="already registered"):
        register_backend("dense-test", "dense")(type("Other", (AttentionBackend,), {}))


def test_imports_do_not_need_triton():
    code = ("import sys, kvcache.backends as b, kvcache.dense_triton; b.backend_names(); "
            "b.backend_for('dense', 'cuda'); assert 'triton' not in sys.modules")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**env, "OMP_NUM_THREADS": "1"},
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr


# -- key limits (bidirectional spans) ------------------------------------------
# A decode; a chunk starting mid-span (the span [30, 44]'s first tokens cached
# before it); a whole prompt whose span [10, 25] crosses a block boundary.
SPAN_LENS, SPAN_QLENS, SPANS = [21, 50, 36], [1, 14, 36], [None, (30, 44), (10, 25)]


def span_meta(tables, bs=16, lens=SPAN_LENS, qlens=SPAN_QLENS, spans=SPANS):
    """A mixed batch (decodes first) over block tables [B, W] of block size
    bs, whose rows inside a span see up to its end: (metadata with
    key_limits_t, query positions [T], limits [T]). The kernel tests' too."""
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, qlens)])
    lim = pos.clone()
    for i, sp in enumerate(spans):
        if sp:
            seg = lim[qsl[i]:qsl[i + 1]]
            seg[(seg >= sp[0]) & (seg <= sp[1])] = sp[1]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(qlens)])
    groups = [GroupMetadata(t[seq, pos // bs] * bs + pos % bs, t) for t in tables]
    meta = AttentionMetadata(qsl, lens, sum(n == 1 for n in qlens), groups)
    meta.key_limits_t = lim
    return meta, pos, lim


def masked_sdpa(q, kv, meta, pos, lim, scale, window=None):
    """The explicit-mask reference: kv(i, L) -> sequence i's K, V [L, H, D];
    query row r sees keys <= lim[r] (and > pos[r] - window)."""
    out = torch.empty_like(q)
    qsl = meta.query_start_loc
    for i, L in enumerate(meta.seq_lens):
        s, e = qsl[i], qsl[i + 1]
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1).transpose(0, 1) for x in kv(i, L))
        kp = torch.arange(L)
        mask = kp[None] <= lim[s:e, None]
        if window is not None:
            mask &= kp[None] > pos[s:e, None] - window
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k, v, attn_mask=mask,
                                                  scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [None, 8])
def test_key_limits_dense_and_every_backend(window, monkeypatch):
    """dense-torch and dense-cpu honour key limits (SDPA with the span mask;
    the window counts from the query's own position), and so does every
    dense and TurboQuant backend by its flag (their own tests check the
    numbers)."""
    monkeypatch.delenv("TQSERVE_ATTN_BACKEND", raising=False)
    g = torch.Generator().manual_seed(0)
    W = 5
    c = DenseLayerCache(3 * W, 16, 2, 64, torch.float32, 0, window)
    bt = torch.randperm(3 * W, generator=g).view(3, W)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    meta, pos, lim = span_meta([bt])
    q = torch.randn(len(pos), 6, 64, generator=g)

    def kv(i, L):
        slots = bt[i, torch.arange(L) // 16] * 16 + torch.arange(L) % 16
        return c.k[slots], c.v[slots]
    ref = masked_sdpa(q, kv, meta, pos, lim, 0.125, window)
    for name in ("dense-torch", "dense-cpu"):
        c.backend = name
        assert c.no_key_limits is None
        torch.testing.assert_close(c.attention(q, meta, 0.125), ref, rtol=1e-5, atol=1e-5)
    meta.key_limits_t = None
    assert (c.attention(q, meta, 0.125) - ref).abs().amax((1, 2)).gt(1e-3).equal(lim > pos)
    for fmt in ("dense", "tq"):
        assert all(get_backend(n).supports_key_limits for n in backend_names(fmt))



# -- the step inputs (ModelRunner.prepare / inputs) -------------------------------------------
BS = 4


class _KV:
    """The manager's view the runner reads: block tables per (request, group)."""
    def __init__(self, tables, per_seq=()):
        self.tables, self.block_size = tables, BS
        self.groups = [KVGroup(None, [], per_seq=g in per_seq) for g in range(len(next(iter(tables.values()))))]

    def block_table(self, rid, g):
        return self.tables[rid][g]

    def block_table_array(self, rid, g):
        return np.asarray(self.tables[rid][g], np.int64)

    def take_state_copies(self):
        return StateCopies()


def _build(runner, sched):
    """(input_ids, positions, metadata, query_start_loc, logits rows, sampled requests)."""
    plan, sampled, _, _ = runner.prepare(SchedulerOutput(sched))
    ids, pos, meta, rows = runner.inputs(plan)
    return ids, pos, meta, plan.qsl, rows, sampled


def _reference(sched, kv):
    """The per-token Python construction the runner used before numpy."""
    ids, pos, qsl, lens, rows = [], [], [0], [], []
    slots, tables = [[] for _ in kv.groups], [[] for _ in kv.groups]
    for s in sched:
        req, a, n = s.req, s.start, s.num_new_tokens
        ids += req.token_ids[a:a + n]
        pos += range(a, a + n)
        qsl.append(qsl[-1] + n)
        lens.append(a + n)
        if a + n == req.num_tokens:
            rows.append(qsl[-1] - 1)
        for g in range(len(kv.groups)):
            t = kv.block_table(req.request_id, g)
            slots[g] += [t[0] if kv.groups[g].per_seq else t[p // BS] * BS + p % BS for p in range(a, a + n)]
            tables[g].append(t)
    bts = []
    for g in range(len(kv.groups)):
        bt = torch.zeros(len(sched), max(map(len, tables[g])), dtype=torch.long)
        for i, t in enumerate(tables[g]):
            bt[i, :len(t)] = torch.tensor(t).clamp(min=0)
        bts.append(bt)
    return ids, pos, qsl, lens, rows, slots, bts


def _sched(specs, vocab=1000, per_seq=()):
    """specs: (request id, tokens known, start, new tokens, tables per group);
    per_seq: the groups that hold one state slot per sequence."""
    out, tables = [], {}
    for rid, known, start, n, tbl in specs:
        req = SimpleNamespace(request_id=rid, token_ids=list(range(7 * len(rid), 7 * len(rid) + known)),
                              num_tokens=known, num_placeholders=0, prompt_logprobs=None, pooling=None, lora=None,
                              mm_items=[])
        out.append(ScheduledRequest(req, n, start))
        tables[rid] = tbl
    return out, _KV(tables, per_seq)


def test_step_inputs_match_the_python_construction():
    N = NULL_BLOCK
    specs = [   # two decodes, a prefill chunk that does not sample, a whole prompt; a hot-like group with
        # NULLs; a per-sequence state group (one slot each: every token of a sequence maps to it)
        ("a", 10, 9, 1, [[3, 5, 8], [3, N, 8], [2]]),
        ("bb", 5, 4, 1, [[1, 2], [1, 2], [0]]),
        ("ccc", 30, 6, 9, [[4, 6, 7, 9], [4, 6, N, 9], [3]]),
        ("dddd", 7, 0, 7, [[10, 11], [10, 11], [1]]),
    ]
    sched, kv = _sched(specs, per_seq=(2,))
    runner = ModelRunner(torch.nn.Linear(1, 1), kv, [])
    assert runner.device == torch.device("cpu")
    ids, pos, meta, qsl, rows, sampled = _build(runner, sched)
    r_ids, r_pos, r_qsl, r_lens, r_rows, r_slots, r_bts = _reference(sched, kv)
    assert ids.tolist() == r_ids and pos.tolist() == r_pos and qsl == r_qsl == meta.query_start_loc
    assert meta.seq_lens == r_lens and meta.seq_lens_t.tolist() == r_lens
    assert meta.query_start_loc_t.tolist() == r_qsl
    assert (meta.num_decodes, meta.max_seq_len, meta.max_query_len) == (2, 15, 9)
    assert rows.tolist() == r_rows and [r.request_id for r in sampled] == ["a", "bb", "dddd"]
    for g, gm in enumerate(meta.groups):
        assert gm.slot_mapping.tolist() == r_slots[g]
        assert torch.equal(gm.block_tables, r_bts[g])
        assert gm.block_tables.is_contiguous()
    assert min(meta.groups[1].slot_mapping.tolist()) < 0          # tokens in a NULL block: not stored
    assert meta.groups[2].slot_mapping.tolist() == [2, 0] + [3] * 9 + [1] * 7
    # The next step fills the other buffer: this step's tensors stay as they were.
    before = [t.clone() for t in (ids, pos, meta.groups[0].slot_mapping, meta.groups[1].block_tables)]
    sched2, kv2 = _sched([("e", 3, 0, 3, [[0], [0]])])
    runner.kv = kv2
    _build(runner, sched2)
    after = (ids, pos, meta.groups[0].slot_mapping, meta.groups[1].block_tables)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_step_inputs_decode_only_and_growth():
    # A decode-only batch, then one larger than the first buffer: it grows.
    specs = [(f"r{i}", 50, 49, 1, [list(range(i, i + 13))]) for i in range(5)]
    sched, kv = _sched(specs)
    runner = ModelRunner(torch.nn.Linear(1, 1), kv, [])
    _, pos, meta, _, rows, _ = _build(runner, sched)
    assert pos.tolist() == [49] * 5 and meta.num_decodes == 5 and rows.tolist() == [0, 1, 2, 3, 4]
    big = [("x", 3000, 0, 3000, [list(range(750))])]
    sched, kv = _sched(big)
    runner.kv = kv
    for _ in range(2):
        ids, pos, meta, _, rows, _ = _build(runner, sched)
        assert pos.tolist() == list(range(3000)) and meta.num_decodes == 0 and rows.tolist() == [2999]
        assert meta.groups[0].slot_mapping.tolist() == list(range(3000))
