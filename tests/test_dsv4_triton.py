"""DeepSeek-V4's Triton kernels (kvcache/dsv4_triton.py: the dsv4-triton
backend) against the torch reference (dsv4-torch): under Triton's
interpreter on CPU (CI), on the GPU where tests/gpu/run.sh runs this file
with TRITON_INTERPRET=0, and compiled for the GPUs without one. 16-bit cases
run in fp16 under the interpreter: its tl.dot gets bf16 wrong (Triton 3.9,
numpy has no bf16), so bf16 runs only on the GPU, and is compiled here."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is first imported: CPU tensors

from types import SimpleNamespace

import pytest
import torch

from kvcache import dsv4_triton
from kvcache.backends import backend_for, get_backend
from kvcache.turboquant import Codec, ComponentFormat
from triton_compile import assert_fit, spec

DEV = "cuda" if os.environ["TRITON_INTERPRET"] == "0" and torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16
TORCH, TRITON = get_backend("dsv4-torch"), get_backend("dsv4-triton")
FORMATS = {"tq4": ComponentFormat("tq", 4), "tq3g32": ComponentFormat("tq", 3, 32), "q8": ComponentFormat("int8", 8),
           "f16": ComponentFormat("f16")}


def _store(fmt: str, N: int, D: int, dtype, g) -> SimpleNamespace:
    """A layer's entry rows as DSV4LayerStorage holds them: dense in dtype, or a Codec's rows."""
    x = torch.randn(N, D, generator=g).to(DEV)
    if fmt == "dense":
        return SimpleNamespace(codec=None, entries={"comp": x.to(dtype)})
    codec = Codec(FORMATS[fmt], 1, D, seed=3)
    coded = codec.alloc(N, DEV)
    for k, v in codec.encode(x.unsqueeze(1)).items():
        coded[k].copy_(v)
    return SimpleNamespace(codec=codec, coded=coded, entries={})


def _step(B, H, D, W, dtype, g):
    q = torch.randn(B, H, D, generator=g).to(DEV, dtype)
    wkeys = torch.randn(B, W, D, generator=g).to(DEV, dtype)
    wmask = torch.rand(B, W, generator=g) < 0.7
    wmask[:2] = False                          # rows that see no window key (row 1 of the HCA test: only the sink)
    return q, wkeys, wmask.to(DEV), torch.randn(H, generator=g).to(DEV)


def _close(a, b, dtype):
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


def test_cuda_default_and_override(monkeypatch):
    assert backend_for("dsv4", "cuda") is TRITON and backend_for("dsv4", "cpu") is TORCH
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dsv4-torch")
    assert backend_for("dsv4", "cuda") is TORCH


@pytest.mark.parametrize("fmt,dtype", [("dense", torch.float32), ("dense", HALF), ("tq4", torch.float32),
                                       ("tq3g32", HALF), ("q8", torch.float32), ("f16", torch.float32)])
@pytest.mark.parametrize("splits", [1, 3])
def test_hca_rows_to_count(monkeypatch, fmt, dtype, splits):
    # HCA: a sequence's table in entry order, used up to its count (0 for one row; past the count,
    # rows point anywhere: -7 would fail a read).
    monkeypatch.setattr(dsv4_triton, "decode_splits", lambda *a: splits)
    g = torch.Generator().manual_seed(0)
    B, H, D, E, N = 4, 20, 64, 70, 300
    store = _store(fmt, N, D, dtype, g)
    q, wkeys, wmask, sinks = _step(B, H, D, 9, dtype, g)
    rows = torch.randperm(N, generator=g)[:B * E].view(B, E)
    rows[2, 33:] = -7
    rows, count = rows.to(DEV), torch.tensor([E, 0, 33, 1], device=DEV)
    out = TRITON.attend(q, wkeys, wmask, store, rows, count, sinks, 0.125)
    ref = TORCH.attend(q, wkeys, wmask, store, rows.clamp(min=0), count, sinks, 0.125)
    assert out.dtype == dtype
    _close(out, ref, dtype)


@pytest.mark.parametrize("fmt,dtype", [("dense", torch.float32), ("tq4", HALF)])
def test_csa_picks_with_gaps(fmt, dtype):
    # CSA: top-k rows, -1 where the pick was not visible (count None: all k columns).
    g = torch.Generator().manual_seed(1)
    B, H, D, K, N = 3, 4, 32, 24, 100
    store = _store(fmt, N, D, dtype, g)
    q, wkeys, wmask, sinks = _step(B, H, D, 5, dtype, g)
    sel = torch.randint(0, N, (B, K), generator=g)
    sel[1, 10:] = -1
    sel[2] = -1
    sel = sel.to(DEV)
    _close(TRITON.attend(q, wkeys, wmask, store, sel, None, sinks, 0.2),
           TORCH.attend(q, wkeys, wmask, store, sel, None, sinks, 0.2), dtype)


@pytest.mark.parametrize("fmt,dtype", [("dense", torch.float32), ("tq4", HALF)])
def test_prefill_rows_share_a_table(fmt, dtype):
    # A prefill chunk: n rows of one sequence, one window [W, D] for all (a causal band), one
    # table expanded over the rows (stride 0), each row's count its own; CSA's picks from the
    # indexer's scores over that same expanded table.
    g = torch.Generator().manual_seed(3)
    n, H, D, E, N, W = 12, 4, 32, 40, 90, 20
    store = _store(fmt, N, D, dtype, g)
    q, _, _, sinks = _step(n, H, D, W, dtype, g)
    wkeys = torch.randn(W, D, generator=g).to(DEV, dtype)
    wmask = (torch.arange(W)[None, :] <= torch.arange(n)[:, None] + W - n).to(DEV)
    rows = torch.randperm(N, generator=g)[:E].to(DEV)[None].expand(n, -1)
    count = torch.arange(n, device=DEV) * 3
    _close(TRITON.attend(q, wkeys, wmask, store, rows, count, sinks, 0.3),
           TORCH.attend(q, wkeys, wmask, store, rows, count, sinks, 0.3), dtype)
    qi, w = torch.randn(n, 8, 16, generator=g).to(DEV, dtype), torch.randn(n, 8, generator=g).to(DEV)
    keys = torch.randn(N, 16, generator=g).to(DEV, dtype)
    out, ref = TRITON.index_scores(qi, w, keys, rows, count), TORCH.index_scores(qi, w, keys, rows, count)
    fin = ~torch.isinf(ref)
    assert torch.equal(fin, ~torch.isinf(out))
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("overlap,ratio,d", [(True, 4, 16), (False, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_pool_rows(overlap, ratio, d, dtype):
    # The window each row closes, from the carry ring and the row's own raw vectors: CSA (overlap:
    # the previous window's first half, empty at window 0: pos 3) and HCA; a pad row's slot -1.
    g = torch.Generator().manual_seed(4)
    width, cap = (2 if overlap else 1) * d, (2 if overlap else 1) * ratio + 3
    kv_ring, gate_ring = (torch.randn(6, cap, width, generator=g).to(DEV, dtype) for _ in range(2))
    slots, pos = torch.tensor([0, 3, -1, 2], device=DEV), torch.tensor([3, 7, 40, 31], device=DEV)
    kv, gate = (torch.randn(4, width, generator=g).to(DEV, dtype) for _ in range(2))
    bias = torch.randn(ratio, width, generator=g).to(DEV)
    args = (kv_ring, gate_ring, slots, pos, kv, gate, bias, ratio, overlap)
    out, ref = TRITON.pool_rows(*args), TORCH.pool_rows(*args)
    assert out.dtype == ref.dtype == dtype
    _close(out, ref, dtype)


@pytest.mark.parametrize("qdt,kdt", [(torch.float32, torch.float32), (HALF, HALF), (torch.bfloat16, torch.float16)])
def test_index_scores(qdt, kdt):
    g = torch.Generator().manual_seed(2)
    B, h, d, E, N = 3, 8, 16, 150, 400       # E: two blocks of 64 and a partial one
    q = torch.randn(B, h, d, generator=g).to(DEV, qdt)
    w = torch.randn(B, h, generator=g).to(DEV)
    keys = torch.randn(N, d, generator=g).to(DEV, kdt)
    rows = torch.randint(0, N, (B, E), generator=g).to(DEV)
    count = torch.tensor([150, 0, 70], device=DEV)
    out = TRITON.index_scores(q, w, keys, rows, count)
    ref = TORCH.index_scores(q, w, keys, rows, count)
    assert torch.equal(torch.isinf(out), torch.arange(E, device=DEV)[None, :] >= count[:, None])
    fin = ~torch.isinf(ref)
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


# -- compiling for the GPUs (DeepSeek-V4-Flash's shapes: 512-dim entries, 64 index heads of 128) ----------
# (query dtype, D, KIND (3: dense), bits, norm group)
_ENTRIES = [("bf16", 512, 3, 16, 512), ("bf16", 512, 2, 4, 512), ("bf16", 512, 2, 3, 32), ("bf16", 512, 2, 5, 512),
            ("bf16", 512, 1, 8, 512), ("bf16", 128, 2, 4, 128), ("bf16", 128, 2, 3, 32), ("fp16", 128, 1, 8, 128),
            ("bf16", 256, 2, 4, 256), ("bf16", 64, 3, 16, 64), ("bf16", 64, 2, 4, 64), ("bf16", 128, 3, 16, 128)]


def _entry_spec(arch, dt, D, kind, bits, group):
    bh, bn, warps, stages = dsv4_triton.entry_tiles(D, kind != 3)
    data = {3: dt, 0: "fp16", 1: "i8", 2: "u8"}[kind]
    const = dict(KIND=kind, BITS=bits, GROUP=group, D=D, BH=bh, BN=bn, ALL=False, F32=False)
    ptrs = dict(q_ptr=dt, sel_ptr="i64", count_ptr="i64", data=data, scale="fp16", cb="fp32", o_ptr="fp32",
                lse_ptr="fp32")
    return spec("kvcache.dsv4_triton_kernels:entry_attn_kernel", arch, const, ptrs, warps, stages, ("sm_scale",))


def _pool_spec(arch, span, ratio, overlap):
    bd, warps = dsv4_triton.pool_tiles(span)
    const = dict(RATIO=ratio, SPAN=span, OVERLAP=overlap, BD=bd)
    ptrs = dict(kv_ring="bf16", gate_ring="bf16", slots_ptr="i64", pos_ptr="i64", kv_ptr="bf16", gate_ptr="bf16",
                bias_ptr="fp32", out_ptr="fp32")
    return spec("kvcache.dsv4_triton_kernels:pool_rows_kernel", arch, const, ptrs, warps)


# V4-Flash's compressors: CSA (ratio 4, overlapping: 8 rows), HCA (ratio 128)
_POOLS = [(8, 4, True), (128, 128, False)]


def _index_spec(arch):
    const = dict(HP=64, DI=128, BE=64, F32=False)
    ptrs = dict(q_ptr="bf16", w_ptr="fp32", keys="bf16", rows_ptr="i64", count_ptr="i64", out_ptr="fp32")
    return spec("kvcache.dsv4_triton_kernels:index_scores_kernel", arch, const, ptrs, 4, floats=("sm_scale",))


@pytest.mark.parametrize("arch", [90, 121])
def test_kernels_compile_for_gpus(arch):
    # None spills with the pinned Triton; with 3.6 (the H200 machine's: device_env_check.sh runs this
    # file there) 512-dim coded tiles spill 8-32 bytes in every tile shape tried.
    import triton
    wide = [c for c in _ENTRIES if c[1] > 256 and c[2] != 3]
    rest = [c for c in _ENTRIES if c not in wide]
    old = tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9)
    assert_fit(rest + ["index"] + _POOLS, [_entry_spec(arch, *c) for c in rest] + [_index_spec(arch)]
               + [_pool_spec(arch, *c) for c in _POOLS])
    assert_fit(wide, [_entry_spec(arch, *c) for c in wide], max_spill=32 if old else 0)
