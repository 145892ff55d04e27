"""Triton attention over TurboQuant-compressed paged blocks (kvcache.tq_triton)
against the torch reference (TQLayerCache), run on CPU by Triton's
interpreter: every component format, mixed K/V formats, head_dim 64/128/256,
GQA 1 and 3, lengths crossing blocks, batched decodes of different lengths,
split-K, a sliding window and prefill chunks starting mid-sequence."""
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors

import subprocess
import sys

import pytest
import torch

from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.tq_cache import TQLayerCache
from kvcache.tq_triton import tq_paged_decode, tq_prefill
from kvcache.turboquant import F16, INT8, tq
from tq_paged import BS, assert_close, paged_cache

FORMATS = {"f16": F16, "int8": INT8, "tq2": tq(2), "tq3": tq(3), "tq4": tq(4), "tq5": tq(5), "tq4g32": tq(4, 32)}


def _close(out, ref, rel=1e-4):
    assert_close(out, ref, rel)


def _decode(c, q, bt, lens, splits, dtype=None):
    """What TQLayerCache._decode does on CUDA, on CPU tensors."""
    qr = c._rotate_q(q.unsqueeze(1), q.shape[-1] ** -0.5)
    if dtype is not None:
        qr = qr.to(dtype)
    acc = tq_paged_decode(c, qr, bt, torch.tensor(lens), num_splits=splits, block_n=16)
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
    out = c._finish(tq_prefill(c, qr, bt[0], seq_len, rows=16, block_n=16), q.dtype)[0]
    _close(out, ref)


def test_prefill_several_sequences_in_one_launch():
    lens, chunks = [40, 18, 7], [9, 18, 2]
    c, bt = paged_cache(tq(4), tq(3), 2, 64, lens, window=12)
    q = torch.randn(sum(chunks), 6, 64, generator=torch.Generator().manual_seed(11))
    qsl = [0, 9, 27, 29]
    qr = c._rotate_q(q.unsqueeze(0), 0.125)
    out = c._finish(tq_prefill(c, qr, bt, lens, qsl, rows=32, block_n=16), q.dtype)[0]
    for i in range(3):
        _close(out[qsl[i]:qsl[i + 1]], c._prefill(q[qsl[i]:qsl[i + 1]], bt[i], lens[i], 0.125))


# -- the dispatch in a mixed batch ------------------------------------------------
class _TritonTQ(TQLayerCache):
    """TQLayerCache with the dispatch lines proposed for _decode / _prefill."""

    def _decode(self, q, block_tables, seq_lens, scale):
        acc = tq_paged_decode(self, self._rotate_q(q.unsqueeze(1), scale), block_tables, seq_lens)
        return self._finish(acc, q.dtype)[:, 0]

    def _prefill(self, q, block_table, seq_len, scale):
        acc = tq_prefill(self, self._rotate_q(q.unsqueeze(0), scale), block_table, seq_len)
        return self._finish(acc, q.dtype)[0]


def test_attention_mixed_batch_matches_torch_path():
    lens, qlens = [21, 3, 50, 36], [1, 1, 14, 36]     # two decodes, a chunk, a whole prompt
    ref_c, bt = paged_cache(tq(4), INT8, 2, 64, lens, window=24)
    tri_c = _TritonTQ.__new__(_TritonTQ)
    tri_c.__dict__.update(ref_c.__dict__)              # same storage, Triton dispatch
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(qsl, lens, 2, [GroupMetadata(torch.zeros(0, dtype=torch.long), bt)])
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
dt, d, rows, splits, win, kk, kb, vk, vb = sys.argv[1:]
const = dict(G=4, BLOCK_SIZE=16, D=int(d), ROWS=int(rows), BLOCK_N=32, SPLITS=int(splits),
             K_KIND=int(kk), K_BITS=int(kb), K_GROUP=32, V_KIND=int(vk), V_BITS=int(vb), V_GROUP=int(d),
             HAS_WINDOW=win == "1", F32=dt == "fp32")
store = {0: "fp16", 1: "i8", 2: "u8"}
ptrs = dict(q_ptr=dt, o_ptr=dt, lse_ptr="fp32", bt_ptr="i64", q_start_ptr="i32", q_len_ptr="i32",
            seq_len_ptr="i32", k_data=store[int(kk)], k_scale="fp16", k_cb="fp32",
            v_data=store[int(vk)], v_scale="fp16", v_cb="fp32")
sig = {n: "constexpr" if n in const else "*" + ptrs[n] if n in ptrs else "i32" for n in k.arg_names}
src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()})
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
assert c.asm["cubin"]
"""


@pytest.mark.parametrize("args", ["bf16 128 16 4 0 2 3 1 8", "fp32 64 64 1 1 0 16 2 4"])
def test_kernel_compiles_for_sm90(args):
    # The interpreter skips Triton's type checks and lowering; compiling for
    # an H100/H200 target (no GPU needed) catches what only the GPU build sees.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _COMPILE, *args.split()], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-3000:]
