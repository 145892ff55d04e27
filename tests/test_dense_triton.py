"""Triton paged attention over dense KV (kvcache.dense_triton, the
dense-triton backend) against the torch reference (dense-torch: SDPA over
gathered blocks), run on CPU by Triton's interpreter: head_dim 64/128/256
(and 80, padded to 128), GQA 1/3/8, block size 16, lengths on and across
block boundaries, batched decodes of different lengths, sliding windows,
split-K (output and log-sum-exp), fp32 and bf16 storage, chunked prefill
starting mid-sequence, a mixed decode + prefill batch in the backend's two
launches, rows without keys, and block-table entries a sequence must not
read pointing at NaN blocks. The interpreter's tl.dot multiplies bf16 as raw
bits (numpy has no bf16), so 16-bit queries are fp16 here; bf16 queries are
covered by compiling the kernels for sm_90 (H100/H200) and sm_121 (GB10)."""
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors

import pytest
import torch

from kvcache import dense_triton
from kvcache.backends import get_backend
from kvcache.dense_cache import DenseLayerCache
from kvcache.dense_triton import dense_paged_decode, dense_paged_prefill
from kvcache.metadata import AttentionMetadata, GroupMetadata
from test_backends import SPAN_LENS, SPAN_QLENS, masked_sdpa, span_meta
from tq_paged import assert_close
from triton_compile import assert_fit, spec

BS = 16


def paged(H, D, lens, dtype=torch.float32, window=None, seed=0):
    """A dense cache (dense-torch backend) holding len tokens of each sequence
    in shuffled blocks, its last block NaN. Returns (cache, block_tables
    [B, W] with a spare column, nan_block)."""
    g = torch.Generator().manual_seed(seed)
    W = max(-(-L // BS) for L in lens) + 1
    nblocks = W * len(lens) + 2
    c = DenseLayerCache(nblocks, BS, H, D, dtype, 0, window, backend="dense-torch")
    bt = torch.randperm(nblocks - 1, generator=g)[:W * len(lens)].view(len(lens), W)
    slots = torch.cat([bt[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS for i, L in enumerate(lens)])
    c.write(slots, torch.randn(len(slots), H, D, generator=g) * 2 + 0.5, torch.randn(len(slots), H, D, generator=g))
    nan = nblocks - 1
    c.k[nan * BS:] = float("nan")
    c.v[nan * BS:] = float("nan")
    return c, bt, nan


def poisoned(bt, lens, nan, window=None, q_lens=None):
    """bt with every entry a sequence must not read (past its length, or
    wholly before the window of its first query) pointing at the NaN block."""
    out = bt.clone()
    for i, L in enumerate(lens):
        first = L - (1 if q_lens is None else q_lens[i])
        lo = 0 if window is None else max(0, first - window + 1)
        out[i, -(-L // BS):] = nan
        out[i, :lo // BS] = nan
    return out


def _q(T, Hq, D, seed, dtype=torch.float32):
    return torch.randn(T, Hq, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check_decode(H, G, D, lens, window=None, splits=(1, 3), dtype=torch.float32, qdtype=torch.float32, rel=1e-5):
    c, bt, nan = paged(H, D, lens, dtype, window)
    q = _q(len(lens), H * G, D, 7, qdtype)
    ref = c._decode(q, bt, torch.tensor(lens), D ** -0.5)
    bad = poisoned(bt, lens, nan, window)
    for s in splits:
        out = dense_paged_decode(q, c.k, c.v, bad, torch.tensor(lens), D ** -0.5, BS, window, num_splits=s)
        assert_close(out, ref, rel)


# -- decode -----------------------------------------------------------------------
@pytest.mark.parametrize("H,G,D", [(2, 1, 64), (2, 3, 128), (1, 8, 256)])
def test_decode(H, G, D):
    # one token, a full block, just past it, mid-block
    _check_decode(H, G, D, [1, 16, 17, 40])


def test_decode_sliding_window():
    # window 20 < most lengths: only (pos - 20, pos] counts
    _check_decode(2, 3, 64, [5, 20, 37, 64], window=20, splits=(1, 2))


@pytest.mark.parametrize("dtype,qdtype,rel", [(torch.bfloat16, torch.float32, 1e-5),
                                              (torch.bfloat16, torch.float16, 1e-2)])
def test_decode_16_bit_storage(dtype, qdtype, rel):
    _check_decode(2, 3, 64, [30, 9], dtype=dtype, qdtype=qdtype, rel=rel, splits=(2,))


def test_decode_log_sum_exp_and_empty_rows():
    lens = [40, 0, 17]                       # 0: a padding row (sees no key)
    c, bt, nan = paged(1, 64, [40, 1, 17])
    q = _q(3, 2, 64, 3)
    s = torch.tensor(lens)
    outs = [dense_paged_decode(q, c.k, c.v, bt, s, 0.125, BS, num_splits=n, return_lse=True) for n in (1, 3)]
    # reference log-sum-exp of the live rows
    for i, L in ((0, 40), (2, 17)):
        slots = bt[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS
        scores = q[i] @ c.k[slots][:, 0].T * 0.125              # [G, L]: one KV head
        for out, lse in outs:
            torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), rtol=0, atol=1e-5)
    for out, lse in outs:
        assert not out[1].any() and torch.isneginf(lse[1]).all()
        assert torch.isfinite(out).all()
    assert_close(outs[1][0], outs[0][0], 1e-5)


# -- prefill ------------------------------------------------------------------------
@pytest.mark.parametrize("H,G,D,window", [(2, 3, 64, None), (1, 1, 128, 10), (1, 8, 256, None), (2, 1, 64, 19)])
@pytest.mark.parametrize("seq_len,chunk", [(45, 13), (45, 45), (33, 1)])
def test_prefill_chunk(H, G, D, window, seq_len, chunk):
    c, bt, nan = paged(H, D, [seq_len], window=window)
    q = _q(chunk, H * G, D, seq_len + chunk)
    ref = c._prefill(q, bt[0], seq_len, D ** -0.5)
    bad = poisoned(bt, [seq_len], nan, window, [chunk])
    out = dense_paged_prefill(q, c.k, c.v, bad, torch.tensor([seq_len]), torch.tensor([0, chunk]), D ** -0.5,
                              BS, chunk, window, rows=16, block_n=16)
    assert_close(out, ref, 1e-5)


def test_head_dim_not_a_power_of_two():
    lens = [20, 35]
    c, bt, _ = paged(1, 80, lens)
    q = _q(2, 3, 80, 5)
    assert_close(dense_paged_decode(q, c.k, c.v, bt, torch.tensor(lens), 0.1, BS),
                 c._decode(q, bt, torch.tensor(lens), 0.1), 1e-5)
    q = _q(9, 3, 80, 6)
    assert_close(get_backend("dense-triton").prefill(c, q, bt[1], 35, 0.1), c._prefill(q, bt[1], 35, 0.1), 1e-5)


# -- the backend: a mixed batch in two launches ---------------------------------------
@pytest.mark.parametrize("H,G,D,window", [(2, 3, 64, None), (1, 8, 64, 24)])
def test_mixed_batch_two_launches(H, G, D, window, monkeypatch):
    lens, qlens = [21, 3, 50, 36, 17], [1, 1, 14, 36, 2]     # two decodes, a chunk, a whole prompt, a chunk
    c, bt, nan = paged(H, D, lens, window=window)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(qsl, lens, 2, [GroupMetadata(torch.zeros(0, dtype=torch.long), bt)], [c])
    q = _q(qsl[-1], H * G, D, 2)
    ref = c.attention(q, meta, D ** -0.5)
    launches = []
    kernels = dense_triton._kernels

    def counting():
        attn, merge = kernels()

        class Count:
            def __init__(self, k):
                self.k = k

            def __getitem__(self, grid):
                launches.append(grid)
                return self.k[grid]
        return Count(attn), Count(merge)
    monkeypatch.setattr(dense_triton, "_kernels", counting)
    c.backend = "dense-triton"
    bad = poisoned(bt, lens, nan, window, qlens)
    meta.groups[0].block_tables = bad
    assert_close(c.attention(q, meta, D ** -0.5), ref, 1e-5)
    assert launches == [(1, 2, H), (-(-36 * G // 64), 3, H)]     # decodes, then every prefill


@pytest.mark.parametrize("window", [None, 8])
def test_key_limits_bidirectional_span(window):
    """Key limits (meta.key_limits_t) in the prefill launch: SDPA with the
    span mask, the window from each query's own position. The whole prompt's
    first tile (64 rows, G = 3: positions 0-21) reads on to its span's end
    (25); the one-call prefill takes its rows' limits too."""
    c, bt, nan = paged(2, 64, SPAN_LENS, window=window)
    meta, pos, lim = span_meta([poisoned(bt, SPAN_LENS, nan, window, SPAN_QLENS)])
    q = _q(len(pos), 6, 64, 4)

    def kv(i, L):
        slots = bt[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS
        return c.k[slots], c.v[slots]
    ref = masked_sdpa(q, kv, meta, pos, lim, 0.125, window)
    c.backend = "dense-triton"
    out = c.attention(q, meta, 0.125)
    assert_close(out, ref, 1e-5)
    s = meta.query_start_loc[2]
    assert_close(c.backend.prefill(c, q[s:], meta.groups[0].block_tables[2], 36, 0.125, key_limit=lim[s:]),
                 ref[s:], 1e-5)
    meta.key_limits_t = None
    assert (c.attention(q, meta, 0.125) - ref).abs().amax((1, 2)).gt(1e-3).equal(lim > pos)


# -- compiling for the GPUs ---------------------------------------------------------
_DIV = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "bt_ptr", "qsl_ptr", "seq_len_ptr", "sq_t", "sq_h",
        "sk_slot", "sk_h", "sv_slot", "sv_h", "so_s", "so_t", "so_h")
# q dtype, storage, head_dim, rows, block_n, splits, decode, window, warps[,
# key limits]: the tiles dense_triton._tiles picks for split bf16 decodes,
# bf16 prefills with and without a window (and with key limits: Gemma 3's
# head_dim 256), an fp32 prefill.
_SPECS = {90: ["bf16,bf16,128,16,64,4,1,0,4", "bf16,bf16,256,64,32,1,0,1,8", "fp32,fp32,64,64,32,1,0,0,8",
               "bf16,bf16,256,64,32,1,0,1,8,1"],
          121: ["bf16,bf16,128,64,32,1,0,1,4", "bf16,bf16,256,16,32,4,1,0,4", "bf16,bf16,256,64,32,1,0,1,8,1"]}


def _attn_spec(arch, case):
    q, kv, d, rows, bn, splits, decode, win, warps, *lim = case.split(",")
    const = dict(G=4, BLOCK_SIZE=16, D=int(d), D_PAD=int(d), ROWS=int(rows), BLOCK_N=int(bn),
                 DECODE=decode == "1", HAS_WINDOW=win == "1", F32=q == "fp32", WRITE_LSE=int(splits) > 1,
                 HAS_LIMITS=lim == ["1"])
    ptrs = dict(q_ptr=q, k_ptr=kv, v_ptr=kv, o_ptr="fp32" if int(splits) > 1 else q, lse_ptr="fp32",
                bt_ptr="i64", qsl_ptr="i64", seq_len_ptr="i64", klim_ptr="i64")
    # Launches specialise 16-divisible ints and pointers: so does this.
    return spec("kvcache.dense_triton_kernels:dense_paged_attn_kernel", arch, const, ptrs, int(warps),
                floats=("qk_scale",), divisible=_DIV)


@pytest.mark.parametrize("arch", [90, 121])
def test_kernels_compile_for_gpus(arch):
    # The interpreter skips Triton's type checks and lowering; compiling for
    # H100/H200 (sm_90) and GB10 (sm_121) targets, no GPU needed, catches
    # what only the GPU build sees, and register spills.
    K = "kvcache.dense_triton_kernels:"
    specs = [_attn_spec(arch, c) for c in _SPECS[arch]]
    specs.append(spec(K + "merge_splits_kernel", arch, dict(S_PAD=8, D=128, D_PAD=128, WRITE_LSE=True),
                      dict(o_part="fp32", lse_part="fp32", out_ptr="bf16", lse_ptr="fp32"), 2))
    for src, dst in (("bf16", "bf16"), ("fp32", "bf16"), ("fp32", "fp32")):
        specs.append(spec(K + "store_kv_kernel", arch, dict(H=8, H_PAD=8, D=128, D_PAD=128),
                          dict(k_ptr=src, v_ptr=src, kc_ptr=dst, vc_ptr=dst, slot_ptr="i64"), 4))
    assert_fit([s["kernel"] for s in specs], specs)


@pytest.mark.parametrize("src, dst", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                      (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_store_equals_index_copy_and_skips_negative_slots(src, dst):
    """dense-triton's one-launch K/V store: the bits index_copy_ after .to()
    writes (round to nearest even), strided views of a fused projection as
    input, nothing written for a negative slot (a CUDA graph's pad rows)."""
    g = torch.Generator().manual_seed(0)
    T, H, D = 7, 3, 40
    kv = torch.randn(T, 2 * H * D + 8, generator=g).to(src)     # q | k | v style rows
    k, v = kv[:, 8:8 + H * D].view(T, H, D), kv[:, 8 + H * D:].view(T, H, D)
    slots = torch.tensor([5, 0, -1, 17, 3, -1, 11])
    ref = DenseLayerCache(5, 4, H, D, dst, 0, backend="dense-torch")
    keep = slots >= 0
    ref.write(slots[keep], k[keep], v[keep])
    c = DenseLayerCache(5, 4, H, D, dst, 0, backend="dense-triton")
    c.write(slots, k, v)
    assert torch.equal(c.k, ref.k) and torch.equal(c.v, ref.v)
    assert int(c.k.flatten(1).ne(0).any(1).sum()) == 5


def test_decode_only_step_shares_indices_across_layers():
    """dense-torch in a decode-only step: two layers of one group use the
    indices the first built (AttentionMetadata.memo), each its own K/V."""
    lens = [9, 33, 16]
    (c1, bt, _), (c2, _, _) = paged(2, 64, lens, seed=1), paged(2, 64, lens, seed=2)
    meta = AttentionMetadata([0, 1, 2, 3], lens, 3, [GroupMetadata(torch.zeros(3, dtype=torch.long), bt)], [c1, c2])
    q = _q(3, 6, 64, 4)
    outs = [c.attention(q, meta, 0.125) for c in (c1, c2)]
    assert list(meta.memo) == [("dense-decode", 0, None)]
    for c, out in zip((c1, c2), outs):
        assert_close(out, c._decode(q, bt, torch.tensor(lens), 0.125), 1e-5)
    assert not torch.allclose(outs[0], outs[1])
