"""Triton attention over TurboQuant-compressed paged blocks (kvcache.tq_triton)
against the torch reference (TQLayerCache), run on CPU by Triton's
interpreter: every component format, mixed K/V formats, head_dim 64/128
(rotation inside the kernel) and 256 (rotation in torch), GQA 1 and 3,
lengths crossing blocks, batched decodes of different lengths, split-K, a
sliding window, hot tokens (the HOT program reads only block 0 and the own
block of the hot tables), rows of length 0 (a padded CUDA-graph batch) and
prefill chunks starting mid-sequence, several in one launch. The references
run the torch path (TQSERVE_TQ_CPU=torch)."""
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors

import subprocess
import sys

import pytest
import torch

from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.tq_cache import ALL, CODED, HOT, TQLayerCache
from kvcache.tq_triton import decode_tiles, prefill_tiles, tq_paged_decode, tq_prefill
from kvcache.turboquant import F16, INT8, tq
from test_backends import SPAN_LENS, masked_sdpa, span_meta
from tq_paged import BS, assert_close, paged_cache
from triton_compile import assert_fit, spec

FORMATS = {"f16": F16, "int8": INT8, "tq2": tq(2), "tq3": tq(3), "tq4": tq(4), "tq5": tq(5), "tq4g32": tq(4, 32)}


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    # The kernel is checked against the torch path itself, not the compiled
    # CPU kernel that TQLayerCache runs on CPU by default.
    monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")


def _close(out, ref, rel=1e-4):
    assert_close(out, ref, rel)


def _check_decode(kf, vf, H, G, D, lens, window=None, splits=(1, 3), hot=""):
    c, bt, *ht = paged_cache(kf, vf, H, D, lens, window, hot=hot)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(7))
    seq_lens = torch.tensor(lens)
    ref = c._decode(q, bt, seq_lens, D ** -0.5, *ht)
    if hot:
        # Every hot column but 0 and the own one poisoned: reading one is NaN.
        ht = [_poisoned(c, ht[0], [[0, (L - 1) // BS] for L in lens])]
    for s in splits:
        _close(tq_paged_decode(c, q, bt, seq_lens, D ** -0.5, *ht, num_splits=s, block_n=16), ref)


def _poisoned(c, ht, hot_cols):
    """ht with every column but hot_cols[b] pointing at a block of NaN int8
    copies: a HOT pass that decodes a tile it must not see turns NaN (for
    "kv": a masked key's NaN score is dropped, a NaN value is not)."""
    spare = sorted(set(range(c.hk["q"].shape[0] // BS)) - set(ht.flatten().tolist()))[0]
    for store in (c.hk, c.hv):
        if store:
            store["scale"][spare * BS:(spare + 1) * BS] = float("nan")
    out = torch.full_like(ht, spare)
    for b, cols in enumerate(hot_cols):
        out[b, cols] = ht[b, cols]
    return out


# -- decode ---------------------------------------------------------------------
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_every_format(fmt, G):
    # lengths: one token, just past a block, mid-block, exactly two blocks + 1
    _check_decode(FORMATS[fmt], FORMATS[fmt], 2, G, 64, [1, 17, 40, 33])


@pytest.mark.parametrize("kf,vf", [("int8", "tq4"), ("tq4", "tq3"), ("tq3", "f16"), ("tq4g32", "tq2")])
@pytest.mark.parametrize("G", [1, 3])
def test_decode_mixed_formats_head_dim_128(kf, vf, G):
    _check_decode(FORMATS[kf], FORMATS[vf], 2, G, 128, [5, 31, 50], splits=(1, 2))


def test_decode_head_dim_256():
    # Above 128 the queries are rotated (and the output de-rotated) in torch.
    _check_decode(tq(4, 64), tq(3), 1, 2, 256, [20, 3], splits=(1, 2))


@pytest.mark.parametrize("kf,vf", [("tq4", "tq3"), ("int8", "f16")])
def test_decode_sliding_window(kf, vf):
    # window 20 < lengths: only (pos - 20, pos] counts; 5 and 20 are inside it.
    _check_decode(FORMATS[kf], FORMATS[vf], 2, 3, 64, [5, 20, 37, 64], window=20)


# hot, K format, V format, G, head_dim
HOT_CASES = [("k", "tq4", "tq4", 1, 64), ("kv", "tq3", "tq3", 3, 64), ("kv", "int8", "tq4", 1, 128),
             ("k", "tq3", "int8", 3, 128)]


@pytest.mark.parametrize("hot,kf,vf,G,D", HOT_CASES)
def test_decode_hot_tokens(hot, kf, vf, G, D):
    # Own blocks: block 0 (1, 15, 16: the sink itself), 1 (17), 2 (33), 4 (80).
    _check_decode(FORMATS[kf], FORMATS[vf], 2, G, D, [1, 15, 16, 17, 33, 80], splits=(1, 2), hot=hot)


def test_decode_16_bit_queries():
    # GPU models run bf16: the kernel then rotates, dots and de-rotates in 16
    # bits with fp32 accumulation. The interpreter's tl.dot multiplies bf16
    # as raw uint16 bits (numpy has no bf16), so fp16 exercises that path here.
    c, bt = paged_cache(tq(4), tq(3), 2, 64, [30, 9])
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3))
    ref = c._decode(q, bt, torch.tensor([30, 9]), 0.125)
    for s in (1, 2):
        out = tq_paged_decode(c, q.half(), bt, torch.tensor([30, 9]), 0.125, num_splits=s)
        _close(out.float(), ref, rel=1e-2)


def test_decode_reads_the_stored_codes():
    # Corrupting one key's codes must change the kernel output exactly as it
    # changes the reference: the kernel reads the packed store, nothing else.
    c, bt = paged_cache(tq(3), tq(3), 1, 64, [24])
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(5))
    lens = torch.tensor([24])
    before = tq_paged_decode(c, q, bt, lens, 0.125)
    slot = int(bt[0, 1]) * BS + 3                   # position 19
    c.k["codes"][slot] ^= 0b10110101
    after = tq_paged_decode(c, q, bt, lens, 0.125)
    _close(after, c._decode(q, bt, lens, 0.125))
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("hot", ["", "kv"])
def test_decode_rows_of_length_zero(hot):
    # A CUDA graph's pad rows: seq_len 0, block table of zeros -> output 0,
    # and the real rows as without them.
    c, bt, *ht = paged_cache(tq(4), tq(3), 2, 64, [30, 9], hot=hot)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, bt.shape[1], dtype=bt.dtype)
    lens = torch.tensor([30, 9, 0, 0])
    for s in (1, 2):
        out = tq_paged_decode(c, q, torch.cat([bt, pad]), lens, 0.125, *[torch.cat([t, pad]) for t in ht],
                              num_splits=s)
        assert (out[2:] == 0).all()
        _close(out[:2], c._decode(q[:2], bt, lens[:2], 0.125, *ht))


# -- prefill --------------------------------------------------------------------
def _flat_prefill(c, q, bt, lens, qsl, part=ALL, **kw):
    """tq_prefill on [T, Hq, D] rows -> rotated (out, lse) in the torch path's layout."""
    qr = ((q.float() @ c.kc.rot_t(q.device)) * q.shape[-1] ** -0.5).to(q.dtype)
    out, lse = tq_prefill(c, qr, bt, torch.tensor(lens), torch.tensor(qsl), max(b - a for a, b in zip(qsl, qsl[1:])),
                          part=part, **kw)
    return out, lse


@pytest.mark.parametrize("kf,vf,H,G,D,window", [
    ("tq4", "tq3", 2, 3, 64, None),
    ("int8", "tq4", 1, 1, 128, None),
    ("tq4g32", "f16", 2, 1, 64, 10),
    ("tq2", "int8", 1, 3, 64, 19),
])
@pytest.mark.parametrize("seq_len,chunk", [(45, 13), (45, 45), (33, 1)])
def test_prefill_chunk(kf, vf, H, G, D, window, seq_len, chunk):
    c, bt = paged_cache(FORMATS[kf], FORMATS[vf], H, D, [seq_len], window)
    q = torch.randn(chunk, H * G, D, generator=torch.Generator().manual_seed(seq_len + chunk))
    ref = c._prefill(q, bt[0], seq_len, D ** -0.5)
    out, _ = _flat_prefill(c, q, bt, [seq_len], [0, chunk], rows=16, block_n=16)
    _close((out.float() @ c.kc.rot_t("cpu").T), ref)


def test_prefill_several_sequences_in_one_launch():
    # Decode rows lead the flat batch (first_seq 1): only the prefills' rows are written.
    lens, chunks = [5, 40, 18, 7], [1, 9, 18, 2]
    c, bt = paged_cache(tq(4), tq(3), 2, 64, lens, window=12)
    q = torch.randn(sum(chunks), 6, 64, generator=torch.Generator().manual_seed(11))
    qsl = [0, 1, 10, 28, 30]
    qr = ((q @ c.kc.rot_t("cpu")) * 0.125)
    out, _ = tq_prefill(c, qr, bt, torch.tensor(lens), torch.tensor(qsl), 18, first_seq=1, rows=32, block_n=16)
    out = out @ c.kc.rot_t("cpu").T
    for i in range(1, 4):
        _close(out[qsl[i]:qsl[i + 1]], c._prefill(q[qsl[i]:qsl[i + 1]], bt[i], lens[i], 0.125))


@pytest.mark.parametrize("hot,kf,vf,G,D", HOT_CASES)
def test_prefill_coded_part(hot, kf, vf, G, D):
    # The CODED pass of a hot layer: keys in [block 0's end, own block start),
    # output and log-sum-exp. Chunks starting on a block boundary (32, 0),
    # mid-block (23, 33), one token.
    lens, chunks = [45, 50, 20, 34], [13, 27, 20, 1]
    c, bt, _ = paged_cache(FORMATS[kf], FORMATS[vf], 2, D, lens, hot=hot)
    qsl = [0]
    for n in chunks:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], 2 * G, D, generator=torch.Generator().manual_seed(6))
    out, lse = _flat_prefill(c, q, bt, lens, qsl, CODED, rows=32, block_n=16)
    qr = c._rotate_q(q.unsqueeze(0), D ** -0.5)
    for i, L in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        ref, ref_lse = c._attend_torch(qr[:, :, :, s:e], torch.arange(-(-L // BS))[None], bt[i:i + 1],
                                       torch.arange(L - (e - s), L)[None], torch.tensor([L]), CODED)
        _close(out[s:e].view(e - s, 2, G, D).permute(1, 2, 0, 3)[None], ref)
        # Rows that see no key: -inf in both (assert_close compares infs exactly).
        torch.testing.assert_close(lse[s:e].view(e - s, 2, G).permute(1, 2, 0)[None], ref_lse, rtol=0, atol=1e-4)


@pytest.mark.parametrize("hot,kf,vf,G,D,span", [(*c, s) for c in HOT_CASES for s in ("short", "long")])
def test_prefill_hot_part(hot, kf, vf, G, D, span):
    # The HOT pass. Short spans (at most BS + 1 tokens, a verification
    # step): one token; inside one block; BS + 1 tokens over two blocks;
    # from block 0 into block 1; a whole prompt inside block 0. Long chunks
    # (the new tokens' int8 rows given, as store() returns them: keys, and
    # values with "kv"): from mid-block 0 over three blocks; a whole prompt
    # of 40; 20 tokens from mid-block 1.
    # Every hot column but 0 and the chunk's first and last is poisoned (NaN
    # if read): the hot group holds no others.
    lens, chunks = ([45, 44, 50, 20, 5], [1, 4, BS + 1, 9, 5]) if span == "short" else ([50, 40, 43], [45, 40, 20])
    c, bt, ht = paged_cache(FORMATS[kf], FORMATS[vf], 2, D, lens, hot=hot)
    qsl = [0]
    for n in chunks:
        qsl.append(qsl[-1] + n)
    cols = [sorted({0, (L - n) // BS, (L - 1) // BS}) for L, n in zip(lens, chunks)]
    q = torch.randn(qsl[-1], 2 * G, D, generator=torch.Generator().manual_seed(8))
    qr = ((q.float() @ c.kc.rot_t("cpu")) * D ** -0.5).to(q.dtype)
    new_rows = None
    if span == "long":
        # Each chunk's rows as store() returns them: hot K, hot V with "kv" (else
        # coded V, which the kernel does not read). The paged cache's hot
        # copies of every block are those rows (the poisoned table hides them).
        pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, chunks)])
        seq = torch.cat([torch.full((n,), i) for i, n in enumerate(chunks)])
        hs, vs = ht[seq, pos // BS] * BS + pos % BS, bt[seq, pos // BS] * BS + pos % BS
        new_rows = ({n: t[hs] for n, t in c.hk.items()},
                    {n: t[hs] for n, t in c.hv.items()} if hot == "kv" else {n: t[vs] for n, t in c.v.items()})
    out, lse = tq_prefill(c, qr, bt, torch.tensor(lens), torch.tensor(qsl), max(chunks), part=HOT,
                          hot_tables=_poisoned(c, ht, cols), new_rows=new_rows, rows=32, block_n=16)
    qr5 = c._rotate_q(q.unsqueeze(0), D ** -0.5)
    for i, L in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        ref, ref_lse = c._attend_torch(qr5[:, :, :, s:e], torch.arange(-(-L // BS))[None], ht[i:i + 1],
                                       torch.arange(L - (e - s), L)[None], torch.tensor([L]), HOT,
                                       c.hot_v_tables(ht[i:i + 1], bt[i:i + 1]))
        _close(out[s:e].view(e - s, 2, G, D).permute(1, 2, 0, 3)[None], ref)
        torch.testing.assert_close(lse[s:e].view(e - s, 2, G).permute(1, 2, 0)[None], ref_lse, rtol=0, atol=1e-4)


# -- the tq-triton backend in a mixed batch -----------------------------------------
@pytest.mark.parametrize("hot,window", [("", 24), ("k", None), ("kv", None)])
def test_attention_mixed_batch_matches_torch_path(hot, window):
    # qlens 1, 1, 14, 36: two decodes, a chunk from mid-sequence, a whole prompt.
    lens, qlens = [21, 3, 50, 36], [1, 1, 14, 36]
    ref_c, *tables = paged_cache(tq(4), INT8, 2, 64, lens, window=window, hot=hot)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, qlens)])
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(qlens)])
    groups = [GroupMetadata(t[seq, pos // BS] * BS + pos % BS, t) for t in tables]
    meta = AttentionMetadata(qsl, lens, 2, groups)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(qsl[-1], 6, 64, generator=g)
    # The step's own K/V through store(): a hot prefill reads its chunk's rows from there.
    ref_c.store(meta, torch.randn(qsl[-1], 2, 64, generator=g), torch.randn(qsl[-1], 2, 64, generator=g))
    tri_c = TQLayerCache.__new__(TQLayerCache)
    tri_c.__dict__.update(ref_c.__dict__)              # same storage, the CUDA default backend
    tri_c.backend = "tq-triton"
    _close(tri_c.attention(q, meta, 0.125), ref_c.attention(q, meta, 0.125))


@pytest.mark.parametrize("hot,window", [("", None), ("", 8), ("k", None), ("kv", None)])
def test_attention_key_limits(hot, window):
    # Bidirectional spans (test_backends.span_meta: a chunk starting mid-span,
    # a whole prompt whose first row tile ends before its span does) in the
    # ALL / HOT launches == the torch path; without hot tokens also == SDPA
    # with the span mask (the window counts from each query's own position).
    ref_c, *tables = paged_cache(tq(4), INT8, 2, 64, SPAN_LENS, window=window, hot=hot)
    meta, pos, lim = span_meta(tables)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(pos), 6, 64, generator=g)
    ref_c.store(meta, torch.randn(len(pos), 2, 64, generator=g), torch.randn(len(pos), 2, 64, generator=g))
    tri_c = TQLayerCache.__new__(TQLayerCache)
    tri_c.__dict__.update(ref_c.__dict__)
    tri_c.backend = "tq-triton"
    out = tri_c.attention(q, meta, 0.125)
    _close(out, ref_c.attention(q, meta, 0.125))
    if not hot:
        bt = tables[0]

        def kv(i, L):
            return ref_c.dequantized(bt[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS)
        _close(out, masked_sdpa(q, kv, meta, pos, lim, 0.125, window))
    meta.key_limits_t = None
    assert (tri_c.attention(q, meta, 0.125) - out).abs().amax((1, 2)).gt(1e-3).equal(lim > pos)


@pytest.mark.parametrize("hot", ["k", "kv"])
def test_prefill_hot_part_key_limits(hot):
    # A short span's HOT launch (pool only) with key limits: spans [30, 40]
    # over blocks 1-2 (a BS + 1 chunk from 28) and [12, 18] from block 0 into
    # 1; every hot column but 0 and the chunk's first and last poisoned.
    lens, chunks = [45, 20], [BS + 1, 9]
    c, bt, ht = paged_cache(tq(4), tq(3), 2, 64, lens, hot=hot)
    qsl = [0, chunks[0], sum(chunks)]
    pos = torch.cat([torch.arange(L - n, L) for L, n in zip(lens, chunks)])
    lim = pos.clone()
    lim[2:13], lim[chunks[0] + 1:chunks[0] + 8] = 40, 18
    cols = [sorted({0, (L - n) // BS, (L - 1) // BS}) for L, n in zip(lens, chunks)]
    q = torch.randn(qsl[-1], 6, 64, generator=torch.Generator().manual_seed(9))
    qr = (q @ c.kc.rot_t("cpu")) * 0.125
    out, lse = tq_prefill(c, qr, bt, torch.tensor(lens), torch.tensor(qsl), max(chunks), part=HOT,
                          hot_tables=_poisoned(c, ht, cols), rows=32, block_n=16, key_limits=lim)
    qr5 = c._rotate_q(q.unsqueeze(0), 0.125)
    for i, L in enumerate(lens):
        s, e = qsl[i], qsl[i + 1]
        args = (qr5[:, :, :, s:e], torch.arange(-(-L // BS))[None], ht[i:i + 1], pos[None, s:e],
                torch.tensor([L]), HOT, c.hot_v_tables(ht[i:i + 1], bt[i:i + 1]))
        ref, ref_lse = c._attend_torch(*args, lim[None, s:e])
        _close(out[s:e].view(e - s, 2, 3, 64).permute(1, 2, 0, 3)[None], ref)
        torch.testing.assert_close(lse[s:e].view(e - s, 2, 3).permute(1, 2, 0)[None], ref_lse, rtol=0, atol=1e-4)
        causal, _ = c._attend_torch(*args)
        assert (ref - causal).abs().amax((0, 1, 2, 4)).gt(1e-3).equal(lim[s:e] > pos[s:e])


def test_import_does_not_need_triton():
    code = "import sys, kvcache.tq_triton, kvcache.tq_cache, kvcache.tq_store; assert 'triton' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr


# -- compiling for the GPUs ---------------------------------------------------------
_STORE = {0: "fp16", 1: "i8", 2: "u8"}


def _decode_spec(arch, dt, D, k, v, hot):
    (kk, kb, kg), (vk, vb, vg) = k, v
    kg, vg = kg or D, vg or D                           # 0: one norm per head
    bn, warps, stages = decode_tiles(D)
    hv = (1, 8, D) if hot == 2 else (vk, vb, vg)
    const = dict(G=4, BLOCK_SIZE=16, D=D, ROWS=16, BLOCK_N=bn, K_KIND=kk, K_BITS=kb, K_GROUP=kg, V_KIND=vk,
                 V_BITS=vb, V_GROUP=vg, HOT=hot, HV_KIND=hv[0], HV_BITS=hv[1], HV_GROUP=hv[2], HAS_WINDOW=hot == 0,
                 F32=dt == "fp32", ROTATE=D <= 128, PARTIAL=True)
    ptrs = dict(q_ptr=dt, rot_ptr=dt, o_ptr="fp32", lse_ptr="fp32", bt_ptr="i64", hbt_ptr="i64", seq_len_ptr="i64",
                k_data=_STORE[kk], k_scale="fp16", k_cb="fp32", v_data=_STORE[vk], v_scale="fp16", v_cb="fp32",
                hk_data="i8", hk_scale="fp16", hv_data=_STORE[hv[0]], hv_scale="fp16", hv_cb="fp32")
    return spec("kvcache.tq_triton_kernels:tq_decode_kernel", arch, const, ptrs, warps, stages, ("q_scale", "o_scale"))


def _prefill_spec(arch, dt, D, k, v, part, limits=False):
    (kk, kb, kg), (vk, vb, vg) = k, v
    kg, vg = kg or D, vg or D                           # 0: one norm per head
    rows, bn, warps, stages = prefill_tiles(D, part)
    const = dict(G=4, BLOCK_SIZE=16, D=D, ROWS=rows, BLOCK_N=bn, K_KIND=kk, K_BITS=kb, K_GROUP=kg, V_KIND=vk,
                 V_BITS=vb, V_GROUP=vg, HAS_WINDOW=part == ALL, F32=dt == "fp32", PART=part,
                 V_TABLE=part == HOT and vk != 1, NEW_ROWS=0 if part != HOT else 1 if vk != 1 else 2,
                 HAS_LIMITS=limits)
    # HOT: hot "k" (coded V through its own table; new K rows of a long chunk) or "kv" (int8 V;
    # new K and V rows): the long-chunk variants, which hold the most.
    ptrs = dict(q_ptr=dt, o_ptr=dt, lse_ptr="fp32", bt_ptr="i64", vbt_ptr="i64", qsl_ptr="i64", seq_len_ptr="i64",
                klim_ptr="i64", nk_data="i8", nk_scale="fp16", nv_data="i8", nv_scale="fp16",
                k_data=_STORE[kk], k_scale="fp16", k_cb="fp32", v_data=_STORE[vk], v_scale="fp16", v_cb="fp32")
    return spec("kvcache.tq_triton_kernels:tq_attn_kernel", arch, const, ptrs, warps, stages)


TQ4, TQ3, TQ2, TQ5G32, Q8, F16K = (2, 4, 0), (2, 3, 0), (2, 2, 0), (2, 5, 32), (1, 8, 0), (0, 16, 0)
# bf16 / fp16 queries (what GPU models run) over the presets' formats: the
# tiles tq_triton picks must compile without spills within the card's shared
# memory. (dtype, head_dim, K, V, hot 0/1/2 or prefill part[, key limits])
_DECODES = [("bf16", 128, TQ4, TQ4, 0), ("bf16", 128, TQ4, TQ4, 1), ("bf16", 128, TQ3, TQ3, 1),
            ("bf16", 128, Q8, TQ4, 2), ("fp16", 64, TQ2, F16K, 0), ("bf16", 256, TQ5G32, TQ3, 0),
            ("bf16", 512, (2, 5, 0), (2, 5, 0), 0)]
_PREFILLS = [("bf16", 128, TQ4, TQ3, CODED), ("bf16", 128, Q8, TQ4, ALL), ("bf16", 256, TQ5G32, TQ3, ALL),
             ("bf16", 512, TQ4, TQ3, ALL), ("bf16", 128, Q8, TQ4, HOT), ("bf16", 128, Q8, Q8, HOT),
             ("bf16", 256, Q8, TQ4, HOT), ("bf16", 256, TQ4, TQ3, ALL, True), ("bf16", 256, Q8, Q8, HOT, True)]


@pytest.mark.parametrize("arch", [90, 121])
def test_kernels_compile_for_gpus(arch):
    # H100/H200 (sm_90) and GB10 (sm_121) targets, no GPU needed.
    specs = [_decode_spec(arch, *c) for c in _DECODES] + [_prefill_spec(arch, *c) for c in _PREFILLS]
    assert_fit(_DECODES + _PREFILLS, specs)
