"""The compiled CPU decode attention over dense paged K/V (kvcache.dense_cpu,
the dense-cpu backend) against the torch reference (dense-torch: SDPA over
gathered blocks): f32 / bf16 / f16 caches, head dims 64 / 128 / 256 / 512
and others (72, 80), GQA 1 to 8, ragged lengths on and across block and
partition boundaries, sliding windows, queries with row / head strides,
int32 and int64 block tables; block-table entries a sequence must not read
point at NaN blocks. A sequence's output is the same bits alone, anywhere in
a batch and at any thread count. The compiled store equals index_copy_, bit
for bit. Steps through the backend: decode-only (one call, the step's
descriptor shared by the layers), mixed (decodes in the kernel, prefill in
SDPA), and dense-torch's path when the kernel is switched off or cannot read
the cache."""
import logging

import pytest
import torch

from kvcache import dense_cpu
from kvcache.backends import backend_for, get_backend
from kvcache.dense_cache import DenseLayerCache
from kvcache.metadata import AttentionMetadata, GroupMetadata
from test_dense_triton import paged as dense_paged
from test_dense_triton import poisoned
from tq_paged import assert_close

BS = 16
P = dense_cpu.partition()                  # keys per partition (the kernel's fixed split)
TORCH, CPU = get_backend("dense-torch"), get_backend("dense-cpu")


def paged(H, D, lens, dtype=torch.float32, window=None, seed=0, backend="dense-cpu"):
    """test_dense_triton's cache (len tokens of each sequence in shuffled blocks,
    its last block NaN) on `backend`; returns (cache, block_tables [B, W] with a
    spare column, the block tables with every entry a sequence must not read
    pointing at the NaN block)."""
    c, bt, nan = dense_paged(H, D, lens, dtype, window, seed)
    c.backend = backend
    return c, bt, poisoned(bt, lens, nan, window)


def _q(B, Hq, D, seed, dtype=torch.float32):
    return torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def kernel(c, q, bt, seq_lens, scale):
    """The kernel's output (never dense-torch's: the call must run it)."""
    out = dense_cpu.decode(c, q, dense_cpu._step(bt, seq_lens), scale)
    assert out is not None
    return out


def _f32(c):
    """The same cache contents in float32 (the reference for 16-bit storage)."""
    r = DenseLayerCache(c.k.shape[0] // BS, BS, c.num_kv_heads, c.head_dim, torch.float32, 0, c.sliding_window,
                        backend="dense-torch")
    r.k.copy_(c.k)
    r.v.copy_(c.v)
    return r


LENS = [1, 16, 17, 40, P, P + 1, 2 * P + 37]


# -- decode against dense-torch -----------------------------------------------------
@pytest.mark.parametrize("H,G,D", [(2, 1, 64), (3, 3, 64), (1, 8, 128), (2, 3, 256), (1, 6, 80), (1, 2, 512),
                                   (2, 3, 72)])
@pytest.mark.parametrize("window", [None, 40, P + 20])
def test_decode_f32(H, G, D, window):
    # head dims with builds of their own (64 / 128 / 256), the run-time vector
    # path (80, 512) and, with AVX-512's 16 lanes, the scalar one (72); query
    # heads per KV head in tiles of up to 4 (1, 3, 4 + 4, 4 + 2, 2)
    c, bt, bad = paged(H, D, LENS, window=window)
    q = _q(len(LENS), H * G, D, 1)
    s = torch.tensor(LENS)
    ref = TORCH.decode(c, q, bt, s, D ** -0.5)
    assert_close(kernel(c, q, bad, s, D ** -0.5), ref, 1e-5)


@pytest.mark.parametrize("dtype,qdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float16), (torch.float16, torch.float32),
                                          (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("H,G,D", [(3, 3, 64), (2, 4, 128), (1, 2, 80)])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_16_bit(dtype, qdtype, H, G, D, window):
    # Against the same values in float32: within the output's rounding to
    # q's dtype (dense-torch's own 16-bit result is no closer).
    c, bt, bad = paged(H, D, LENS, dtype, window)
    q = _q(len(LENS), H * G, D, 2, qdtype)
    s = torch.tensor(LENS)
    ref = TORCH.decode(_f32(c), q.float(), bt, s, D ** -0.5)
    out = kernel(c, q, bad, s, D ** -0.5)
    assert out.dtype == qdtype
    rel = 1e-5 if qdtype == torch.float32 else 2 ** -8 if qdtype == torch.bfloat16 else 2 ** -11
    assert_close(out.float(), ref, rel)
    assert_close(TORCH.decode(c, q, bt, s, D ** -0.5).float(), ref, 4 * rel)


def test_decode_strided_queries_and_int32_tables():
    # q as the engine hands it: a view of a fused projection (row stride
    # wider than Hq * D), or with a head stride wider than D.
    H, G, D = 3, 3, 64
    c, bt, bad = paged(H, D, LENS, torch.bfloat16)
    s = torch.tensor(LENS)
    qkv = _q(len(LENS), (H * G + 2 * H), D, 3, torch.bfloat16).view(len(LENS), -1)
    q = qkv[:, :H * G * D].view(len(LENS), H * G, D)
    assert not q.is_contiguous()
    ref = kernel(c, q.contiguous(), bad, s, 0.125)
    assert torch.equal(kernel(c, q, bad, s, 0.125), ref)
    wide = _q(len(LENS), H * G, 2 * D, 4, torch.bfloat16)[..., :D]
    assert torch.equal(kernel(c, wide, bad, s, 0.125), kernel(c, wide.contiguous(), bad, s, 0.125))
    assert torch.equal(kernel(c, q, bad.int(), s.int(), 0.125), ref)
    assert torch.equal(kernel(c, q, bad[:, :-1], s, 0.125), ref)      # a table view with a row stride


def test_empty_rows_and_bad_tables():
    c, bt, bad = paged(1, 64, [40, 17])
    q = _q(2, 2, 64, 5)
    out = kernel(c, q, bad, torch.tensor([0, 17]), 0.125)
    assert not out[0].any() and torch.isfinite(out).all()                # no key: zeros
    with pytest.raises(IndexError, match="longer than its block table"):
        kernel(c, q, bt, torch.tensor([40, 10 * BS]), 0.125)
    with pytest.raises(IndexError, match="outside the cache"):
        kernel(c, q, bt + 1000, torch.tensor([40, 17]), 0.125)


# -- batch invariance ----------------------------------------------------------------
@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float32, 3 * P // 2)])
def test_batch_invariance(dtype, window):
    """A sequence's output, bit for bit: alone, first or last in batches of
    other lengths, at 1 or 2 threads."""
    lens = [3 * P + 5, 7, P, 2 * P + 1, 33]
    c, bt, bad = paged(2, 64, lens, dtype, window)
    q = _q(len(lens), 6, 64, 6, dtype)
    s = torch.tensor(lens)
    threads = torch.get_num_threads()
    try:
        full = kernel(c, q, bad, s, 0.125)
        for t in (1, 2):
            torch.set_num_threads(t)
            for i in range(len(lens)):
                alone = kernel(c, q[i:i + 1], bad[i:i + 1], s[i:i + 1], 0.125)
                assert torch.equal(alone[0], full[i])
            perm = torch.tensor([4, 2, 0, 3, 1])
            assert torch.equal(kernel(c, q[perm], bad[perm], s[perm], 0.125), full[perm])
    finally:
        torch.set_num_threads(threads)


# -- the store -------------------------------------------------------------------------
@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                     (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_store_equals_index_copy(src, dst):
    H, D, T = 3, 64, 37
    a = DenseLayerCache(8, BS, H, D, dst, 0, backend="dense-cpu")
    b = DenseLayerCache(8, BS, H, D, dst, 0, backend="dense-torch")
    g = torch.Generator().manual_seed(7)
    # k, v: views of one projection (row strides), values that round both ways, infinities
    kv = (torch.randn(T, 4 * H * D, generator=g) * 300).to(src)
    kv[0, :4] = torch.tensor([float("inf"), -float("inf"), 1e-30, -0.0]).to(src)
    k, v = kv[:, :H * D].view(T, H, D), kv[:, 2 * H * D:3 * H * D].view(T, H, D)
    slots = torch.randperm(8 * BS, generator=g)[:T]
    for c in (a, b):
        c.write(slots, k, v)
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
    assert torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))
    assert dense_cpu.store(a, slots.int(), k, v)                     # int32 slots: the kernel too
    assert not dense_cpu.store(a, torch.tensor([0, 8 * BS]), k[:2], v[:2])   # outside: not stored
    with pytest.raises((IndexError, RuntimeError)):
        a.write(torch.tensor([0, 8 * BS]), k[:2], v[:2])             # index_copy_'s error


# -- the backend ---------------------------------------------------------------------
def test_default_on_cpu(monkeypatch):
    monkeypatch.delenv("TQSERVE_ATTN_BACKEND", raising=False)
    assert backend_for("dense", "cpu") is CPU
    assert DenseLayerCache(2, BS, 1, 64, torch.float32, 0).backend is CPU


def _meta(lens, qlens, nd, bt, caches):
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(qsl, lens, nd, [GroupMetadata(torch.zeros(qsl[-1], dtype=torch.long), bt)], caches)


def test_decode_step_and_mixed_step():
    lens = [21, 3, P + 50, 36, 17]
    (c1, bt, bad), (c2, _, _) = paged(2, 64, lens, torch.bfloat16, seed=1), paged(2, 64, lens, torch.bfloat16, seed=2)
    q = _q(5, 6, 64, 8, torch.bfloat16)
    meta = _meta(lens, [1] * 5, 5, bad, [c1, c2])
    outs = [c.attention(q, meta, 0.125) for c in (c1, c2)]
    assert list(meta.memo) == [("dense-cpu", 0)]                   # one step descriptor for both layers
    for c, out in zip((c1, c2), outs):
        assert torch.equal(out, kernel(c, q, bad, torch.tensor(lens), 0.125))
    # two decodes, a chunk, a whole prompt, a chunk: decodes in the kernel, prefills in SDPA
    qlens = [1, 1, 14, 36, 2]
    q = _q(sum(qlens), 6, 64, 9, torch.bfloat16)
    meta = _meta(lens, qlens, 2, bad, [c1])
    out = c1.attention(q, meta, 0.125)
    assert torch.equal(out[:2], kernel(c1, q[:2], bad[:2], torch.tensor(lens[:2]), 0.125))
    c1.backend = "dense-torch"
    ref = c1.attention(q, _meta(lens, qlens, 2, bt, [c1]), 0.125)
    assert torch.equal(out[2:], ref[2:])
    assert_close(out[:2].float(), ref[:2].float(), 2 ** -7)


def test_falls_back_to_dense_torch(monkeypatch, caplog):
    lens = [30, P + 3]
    q = _q(2, 4, 64, 10)
    s = torch.tensor(lens)
    c, bt, _ = paged(2, 64, lens)
    ref = TORCH.decode(c, q, bt, s, 0.125)
    meta = _meta(lens, [1, 1], 2, bt, [c])
    monkeypatch.setenv("TQSERVE_DENSE_CPU", "torch")               # the switch: dense-torch's code, same bits
    assert torch.equal(CPU.decode(c, q, bt, s, 0.125), ref)
    assert torch.equal(c.attention(q, meta, 0.125), TORCH.forward(c, q, _meta(lens, [1, 1], 2, bt, [c]), 0.125))
    monkeypatch.delenv("TQSERVE_DENSE_CPU")
    c64, bt64, _ = paged(2, 64, lens, torch.float64)               # a dtype the kernel does not read
    assert torch.equal(CPU.decode(c64, q.double(), bt64, s, 0.125), TORCH.decode(c64, q.double(), bt64, s, 0.125))
    # a kernel that did not build: logged once, dense-torch's path
    def fail():
        raise RuntimeError("building the dense CPU attention kernel failed: no compiler")
    monkeypatch.setattr(dense_cpu, "_lib", fail)
    dense_cpu._kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tqserve.engine"):
            c2, bt2, _ = paged(2, 64, lens)
            assert torch.equal(CPU.decode(c2, q, bt2, s, 0.125), TORCH.decode(c2, q, bt2, s, 0.125))
        assert "no compiler" in caplog.text
    finally:
        dense_cpu._kernel.cache_clear()


# -- in the engine -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_batch_invariant_and_as_dense_torch(tmp_path, dtype, monkeypatch):
    """A tiny llama (head_dim 16: the run-time vector path) with prompts past
    one partition: a sequence's greedy tokens are the same alone and among 11
    others (logprobs are not compared: the GEMMs' bits depend on the batch's
    rows); in float32 they are dense-torch's (in bfloat16 the two round
    differently, and the random model's near ties can flip)."""
    from engine import LLM, SamplingParams
    from tiny_models import save_tiny_llama, token_prompts
    save_tiny_llama(tmp_path)
    ps = token_prompts(12, 20, 3 * P, seed=4)
    ps[5] = token_prompts(1, 2 * P + 10, 2 * P + 11, seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(prompts):
        llm = LLM(str(tmp_path), block_size=16, dtype=dtype, kv_cache_memory=16 << 20, enable_prefix_caching=False)
        assert llm.core.runner.kv_caches[0].backend.name == backend
        return llm.generate(prompts, sp)

    monkeypatch.delenv("TQSERVE_ATTN_BACKEND", raising=False)
    backend = "dense-cpu"
    batch, alone = run(ps), run([ps[5]])[0]
    assert alone.outputs[0].token_ids == batch[5].outputs[0].token_ids
    if dtype == "float32":
        monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-torch")
        backend = "dense-torch"
        ref = run(ps)
        assert [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in batch]
