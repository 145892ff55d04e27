"""Triton attention over TurboQuant-compressed paged blocks (kvcache.tq_triton)
against the torch reference (TQLayerCache), run on CPU by Triton's
interpreter: every component format, mixed K/V formats, head_dim 64/128/256,
GQA 1 and 3, lengths crossing blocks, batched decodes of different lengths,
split-K, a sliding window and prefill chunks starting mid-sequence; with
hot tokens, the CODED and HOT passes (output and log-sum-exp) and their
merge. The references run the torch path (TQSERVE_TQ_CPU=torch)."""
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors

import subprocess
import sys

import pytest
import torch

from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.tq_cache import CODED, HOT, TQLayerCache, merge
from kvcache.tq_triton import tq_paged_decode, tq_prefill
from kvcache.turboquant import F16, INT8, tq
from tq_paged import BS, assert_close, paged_cache

FORMATS = {"f16": F16, "int8": INT8, "tq2": tq(2), "tq3": tq(3), "tq4": tq(4), "tq5": tq(5), "tq4g32": tq(4, 32)}


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    # The kernel is checked against the torch path itself, not the compiled
    # CPU kernel that TQLayerCache runs on CPU by default.
    monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")


def _close(out, ref, rel=1e-4):
    assert_close(out, ref, rel)


def _decode(c, q, bt, lens, splits, dtype=None):
    """What TQLayerCache._decode does on CUDA, on CPU tensors."""
    qr = c._rotate_q(q.unsqueeze(1), q.shape[-1] ** -0.5)
    if dtype is not None:
        qr = qr.to(dtype)
    acc, _ = tq_paged_decode(c, qr, bt, torch.tensor(lens), num_splits=splits, block_n=16)
    return c._finish(acc, q.dtype)[:, 0]


def _check_decode(kf, vf, H, G, D, lens, window=None, splits=(1, 3)):
    c, bt = paged_cache(kf, vf, H, D, lens, window)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(7))
    ref = c._decode(q, bt, torch.tensor(lens), D ** -0.5)
    for s in splits:
        _close(_decode(c, q, bt, lens, s), ref)


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
    _check_decode(tq(4, 64), tq(3), 1, 2, 256, [20, 3], splits=(1,))


@pytest.mark.parametrize("kf,vf", [("tq4", "tq3"), ("int8", "f16")])
def test_decode_sliding_window(kf, vf):
    # window 20 < lengths: only (pos - 20, pos] counts; 5 and 20 are inside it.
    _check_decode(FORMATS[kf], FORMATS[vf], 2, 3, 64, [5, 20, 37, 64], window=20)


def test_decode_16_bit_queries():
    # GPU models run bf16: the kernel then dots in 16 bits with fp32
    # accumulation. The interpreter's tl.dot multiplies bf16 as raw uint16
    # bits (numpy has no bf16), so fp16 exercises that path here.
    c, bt = paged_cache(tq(4), tq(3), 2, 64, [30, 9])
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3))
    ref = c._decode(q, bt, torch.tensor([30, 9]), 0.125)
    _close(_decode(c, q, bt, [30, 9], 2, torch.float16), ref, rel=1e-2)


def test_decode_reads_the_stored_codes():
    # Corrupting one key's codes must change the kernel output exactly as it
    # changes the reference: the kernel reads the packed store, nothing else.
    c, bt = paged_cache(tq(3), tq(3), 1, 64, [24])
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(5))
    before = _decode(c, q, bt, [24], 1)
    slot = int(bt[0, 1]) * BS + 3                   # position 19
    c.k["codes"][slot] ^= 0b10110101
    ref = c._decode(q, bt, torch.tensor([24]), 0.125)
    after = _decode(c, q, bt, [24], 1)
    _close(after, ref)
    assert (after - before).abs().max() > 1e-3


# -- prefill --------------------------------------------------------------------
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
    qr = c._rotate_q(q.unsqueeze(0), D ** -0.5)
    out = c._finish(tq_prefill(c, qr, bt[0], seq_len, rows=16, block_n=16)[0], q.dtype)[0]
    _close(out, ref)


def test_prefill_several_sequences_in_one_launch():
    lens, chunks = [40, 18, 7], [9, 18, 2]
    c, bt = paged_cache(tq(4), tq(3), 2, 64, lens, window=12)
    q = torch.randn(sum(chunks), 6, 64, generator=torch.Generator().manual_seed(11))
    qsl = [0, 9, 27, 29]
    qr = c._rotate_q(q.unsqueeze(0), 0.125)
    out = c._finish(tq_prefill(c, qr, bt, lens, qsl, rows=32, block_n=16)[0], q.dtype)[0]
    for i in range(3):
        _close(out[qsl[i]:qsl[i + 1]], c._prefill(q[qsl[i]:qsl[i + 1]], bt[i], lens[i], 0.125))


# -- hot tokens: the CODED and HOT passes ------------------------------------------
LSE_ATOL = 1e-4          # log-sum-exps are O(10)

HOT_CASES = [            # hot, K format, V format, G, head_dim
    ("k", "tq4", "tq4", 1, 64),
    ("kv", "tq3", "tq3", 3, 64),
    ("kv", "int8", "tq4", 1, 128),
    ("k", "tq3", "int8", 3, 128),
]


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


def _check_part(out, lse, ref, ref_lse):
    _close(out, ref)
    # Rows that see no key: -inf in both (assert_close compares infs exactly).
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=LSE_ATOL)


@pytest.mark.parametrize("hot,kf,vf,G,D", HOT_CASES)
def test_decode_parts(hot, kf, vf, G, D):
    # Own blocks: block 0 (1, 15, 16: the sink itself), 1 (17), 2 (33), 4 (80).
    lens = [1, 15, 16, 17, 33, 80]
    c, bt, ht = paged_cache(FORMATS[kf], FORMATS[vf], 2, D, lens, hot=hot)
    B = len(lens)
    seq_lens = torch.tensor(lens)
    qr = c._rotate_q(torch.randn(B, 1, 2 * G, D, generator=torch.Generator().manual_seed(4)), D ** -0.5)
    qpos, cols = (seq_lens - 1)[:, None], c.decode_columns(bt, seq_lens)
    vt = ht if hot == "kv" else bt
    hp = _poisoned(c, ht, [[0, (L - 1) // BS] for L in lens])
    vp = hp if hot == "kv" else bt
    for part, tables, v_tables, ref_tables, ref_v in ((CODED, bt, None, bt, None), (HOT, hp, vp, ht, vt)):
        ref, ref_lse = c._attend_torch(qr, cols, ref_tables, qpos, seq_lens, part, ref_v)
        for splits in (1, 2):
            out, lse = tq_paged_decode(c, qr, tables, seq_lens, num_splits=splits, part=part,
                                       v_tables=v_tables)
            _check_part(out, lse, ref, ref_lse)


@pytest.mark.parametrize("hot,kf,vf,G,D", HOT_CASES)
def test_prefill_parts(hot, kf, vf, G, D):
    # Chunks starting on a block boundary (32, 0), mid-block (23, 33), one token.
    lens, chunks = [45, 50, 20, 34], [13, 27, 20, 1]
    c, bt, ht = paged_cache(FORMATS[kf], FORMATS[vf], 2, D, lens, hot=hot)
    qsl = [0]
    for n in chunks:
        qsl.append(qsl[-1] + n)
    qr = c._rotate_q(torch.randn(1, qsl[-1], 2 * G, D, generator=torch.Generator().manual_seed(6)), D ** -0.5)
    starts = [L - n for L, n in zip(lens, chunks)]
    hp = _poisoned(c, ht, [[0, *range(s // BS, (L - 1) // BS + 1)] for s, L in zip(starts, lens)])
    vt, vp = (ht, hp) if hot == "kv" else (bt, bt)
    for part, tables, v_tables, ref_tables, ref_v in ((CODED, bt, bt, bt, bt), (HOT, hp, vp, ht, vt)):
        out, lse = tq_prefill(c, qr, tables, lens, qsl, rows=32, block_n=16, part=part, v_tables=v_tables)
        for i, (s, L) in enumerate(zip(starts, lens)):
            qi = qr[:, :, :, qsl[i]:qsl[i + 1]]
            ref, ref_lse = c._attend_torch(qi, torch.arange(-(-L // BS))[None], ref_tables[i:i + 1],
                                           torch.arange(s, L)[None], torch.tensor([L]), part, ref_v[i:i + 1])
            _check_part(out[:, :, :, qsl[i]:qsl[i + 1]], lse[:, :, :, qsl[i]:qsl[i + 1]], ref, ref_lse)


def test_prefill_parts_one_sequence():
    # The 1-D form (one block table, an int length), as TQLayerCache calls it.
    c, bt, ht = paged_cache(tq(4), tq(3), 1, 64, [40], hot="kv")
    qr = c._rotate_q(torch.randn(1, 19, 2, 64, generator=torch.Generator().manual_seed(8)), 0.125)
    qpos, cols = torch.arange(21, 40)[None], torch.arange(3)[None]
    for part, tables in ((CODED, bt), (HOT, ht)):
        ref = c._attend_torch(qr, cols, tables[:1], qpos, torch.tensor([40]), part)
        _check_part(*tq_prefill(c, qr, tables[0], 40, part=part, v_tables=tables[0]), *ref)


@pytest.mark.parametrize("hot", ["k", "kv"])
def test_decode_merged_parts_match_cpu_decode(hot):
    lens = [1, 17, 33, 80]
    c, bt, ht = paged_cache(tq(4), tq(3), 2, 64, lens, hot=hot)
    q = torch.randn(len(lens), 6, 64, generator=torch.Generator().manual_seed(9))
    seq_lens = torch.tensor(lens)
    qr = c._rotate_q(q.unsqueeze(1), 0.125)
    v_hot = ht if hot == "kv" else bt
    acc = merge(*tq_paged_decode(c, qr, bt, seq_lens, num_splits=2, part=CODED),
                *tq_paged_decode(c, qr, ht, seq_lens, part=HOT, v_tables=v_hot))
    _close(c._finish(acc, q.dtype)[:, 0], c._decode(q, bt, seq_lens, 0.125, ht))


# -- the tq-triton backend in a mixed batch -----------------------------------------
# Hot tokens: decodes only (a hot prefill's reference needs the chunk from store()).
@pytest.mark.parametrize("hot,window,qlens", [("", 24, [1, 1, 14, 36]), ("kv", None, [1, 1, 1, 1])])
def test_attention_mixed_batch_matches_torch_path(hot, window, qlens):
    lens = [21, 3, 50, 36]          # with qlens 1, 1, 14, 36: two decodes, a chunk, a whole prompt
    ref_c, *tables = paged_cache(tq(4), INT8, 2, 64, lens, window=window, hot=hot)
    tri_c = TQLayerCache.__new__(TQLayerCache)
    tri_c.__dict__.update(ref_c.__dict__)              # same storage, the CUDA default backend
    tri_c.backend = "tq-triton"
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    groups = [GroupMetadata(torch.zeros(0, dtype=torch.long), t) for t in tables]
    meta = AttentionMetadata(qsl, lens, sum(n == 1 for n in qlens), groups)
    q = torch.randn(qsl[-1], 6, 64, generator=torch.Generator().manual_seed(2))
    _close(tri_c.attention(q, meta, 0.125), ref_c.attention(q, meta, 0.125))


def test_import_does_not_need_triton():
    code = "import sys, kvcache.tq_triton, kvcache.tq_cache; assert 'triton' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvcache.tq_triton_kernels import tq_attn_kernel as k
dt, d, rows, splits, win, kk, kb, vk, vb, part = sys.argv[1:]
const = dict(G=4, BLOCK_SIZE=16, D=int(d), ROWS=int(rows), BLOCK_N=32, SPLITS=int(splits),
             K_KIND=int(kk), K_BITS=int(kb), K_GROUP=32, V_KIND=int(vk), V_BITS=int(vb), V_GROUP=int(d),
             HAS_WINDOW=win == "1", F32=dt == "fp32", PART=int(part))
store = {0: "fp16", 1: "i8", 2: "u8"}
ptrs = dict(q_ptr=dt, o_ptr=dt, lse_ptr="fp32", bt_ptr="i64", vbt_ptr="i64", q_start_ptr="i32",
            q_len_ptr="i32", seq_len_ptr="i32", k_data=store[int(kk)], k_scale="fp16", k_cb="fp32",
            v_data=store[int(vk)], v_scale="fp16", v_cb="fp32")
sig = {n: "constexpr" if n in const else "*" + ptrs[n] if n in ptrs else "i32" for n in k.arg_names}
src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()})
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
assert c.asm["cubin"]
"""


# dtype head_dim rows splits window K kind/bits V kind/bits part: a split decode
# of the HOT pass, a windowed fp32 prefill, a CODED bf16 prefill.
@pytest.mark.parametrize("args", ["bf16 128 16 4 0 1 8 2 3 2", "fp32 64 64 1 1 0 16 2 4 0",
                                  "bf16 64 64 1 0 2 4 2 3 1"])
def test_kernel_compiles_for_sm90(args):
    # The interpreter skips Triton's type checks and lowering; compiling for
    # an H100/H200 target (no GPU needed) catches what only the GPU build sees.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _COMPILE, *args.split()], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
