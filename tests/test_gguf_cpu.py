"""The compiled CPU kernels for GGUF blocks (parallel/quant/gguf_cpu.py,
parallel/quant/csrc/gguf_cpu.cpp) against the torch reference
(parallel/quant/gguf.py, backend="torch"), and how gguf.dequantize /
gguf.matmul / GGUFBlocks.matmul choose between them.

Blocks are random bytes everywhere, with random finite fp16 scales (d, dmin:
subnormals, zeros, negatives, up to 65504 included): every bit pattern of
the quantized fields.

Tolerances:
  - dequantize_into == the reference bit for bit (fp32 compared as int32 bit
    patterns, so -0.0 != +0.0); bf16 output == the fp32 reference rounded
    once (bf16 bit patterns compared).
  - gemv vs F.linear(x, W) in fp32, W the reference's: elementwise
    |y - ref| <= 2 k 2^-24 (|x| @ |W|^T), the bound on summing the same k
    fp32 products in any two orders (fused or not): sum-order differences
    only. bf16 x / y: that plus one bf16 rounding of y (2^-8 |ref|).
"""
import logging
import platform
from functools import lru_cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import parallel.quant.gguf as gguf
from parallel.quant import base, gguf_cpu
from parallel.quant.base import GGUFBlocks, QuantizedTensor
from parallel.quant.gguf import QTYPES, dequantize, row_bytes

TYPES = list(QTYPES)
# offsets of the fp16 scales in a block
_F16 = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    gguf_cpu.build()        # a failed build fails every test here, with the compiler's output


def blocks(name: str, n: int, nblocks: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    t = QTYPES[name]
    k = nblocks * t.block
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, row_bytes(name, k)), dtype=np.uint8)
    b = raw.reshape(n, nblocks, t.type_size)
    for off in _F16[name]:
        h = rng.integers(0, 1 << 16, (n, nblocks), dtype=np.uint16)
        h[(h & 0x7C00) == 0x7C00] ^= 0x4000          # no inf / nan
        b[..., off:off + 2] = h.view(np.uint8).reshape(n, nblocks, 2)
    return torch.from_numpy(raw), k


def matches_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float = 1e-6) -> None:
    """y = F.linear(x, w) up to summation order (a layer multiplies its weight
    in tiles), relative to the output's scale: random blocks reach 1e6."""
    ref = F.linear(x, w.to(x.dtype))
    assert y.shape == ref.shape and y.dtype == ref.dtype
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), err


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def check_gemv(y, x, w):
    """y vs F.linear(x, w) in fp32: sum-order differences only (module docstring)."""
    xf = x.float()
    ref = F.linear(xf, w)
    k = w.shape[1]
    bound = 2 * k * 2.0 ** -24 * F.linear(xf.double().abs(), w.double().abs())
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ref.double().abs()
    err = (y.double() - ref.double()).abs()
    assert y.shape == ref.shape
    assert bool((err <= bound).all()), (err - bound).max().item()


SHAPES = [(1, 1), (7, 2), (13, 3), (1037, 3)]     # (rows, blocks per row); the last runs threaded


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_bit_exact(name):
    for i, (n, nb) in enumerate(SHAPES):
        raw, k = blocks(name, n, nb, seed=i)
        ref = dequantize(raw, name, k, backend="torch")
        got = gguf_cpu.dequantize_into(raw, name, k, torch.full((n, k), float("nan")))
        assert same_bits(got, ref), (name, n, k)
        got16 = gguf_cpu.dequantize_into(raw, name, k, torch.empty(n, k, dtype=torch.bfloat16))
        assert same_bits(got16, ref.to(torch.bfloat16)), (name, n, k)
        # the default backend on CPU is the kernel
        assert same_bits(dequantize(raw, name, k), ref)
        assert same_bits(dequantize(raw, name, k, torch.bfloat16), ref.to(torch.bfloat16))


def test_dequantize_views():
    # raw rows 3..10 of a larger matrix; out: rows of a wider buffer (columns 5..5+k)
    raw, k = blocks("Q5_K", 16, 2, seed=9)
    part = raw[3:10]
    buf = torch.zeros(7, k + 9)
    gguf_cpu.dequantize_into(part, "Q5_K", k, buf[:, 5:5 + k])
    assert same_bits(buf[:, 5:5 + k], dequantize(part, "Q5_K", k, backend="torch"))
    assert not buf[:, :5].any() and not buf[:, 5 + k:].any()
    # gguf.dequantize into a column slice (non-unit row stride of out): same values
    out = torch.empty(7, 2 * k)[:, ::2]
    assert same_bits(dequantize(part, "Q5_K", k, out=out), dequantize(part, "Q5_K", k, backend="torch"))
    with pytest.raises(ValueError):
        gguf_cpu.dequantize_into(part, "Q5_K", k, torch.empty(7, k, dtype=torch.float16))
    with pytest.raises(ValueError):
        gguf_cpu.dequantize_into(part[:, :-1], "Q5_K", k, torch.empty(7, k))


@pytest.mark.parametrize("name", TYPES)
def test_gemv(name):
    g = torch.Generator().manual_seed(1)
    for i, (n, nb) in enumerate([(1, 1), (13, 3), (300, 2)]):
        raw, k = blocks(name, n, nb, seed=10 + i)
        w = dequantize(raw, name, k, backend="torch")
        for m in (1, 3, 8, 11, 20):        # 11, 20: two and three passes of 8 rows
            x = torch.randn(m, k, generator=g)
            check_gemv(gguf_cpu.gemv(x, raw, name, k), x, w)
        for m in (1, 3, 11):
            xb = torch.randn(m, k, generator=g).to(torch.bfloat16)
            y = gguf_cpu.gemv(xb, raw, name, k)
            assert y.dtype == torch.bfloat16
            check_gemv(y, xb, w)
            # bf16 in and out (gguf_gemv_bf16): the fp32 product rounded once, bit for bit
            assert same_bits(y, gguf_cpu.gemv(xb.float(), raw, name, k).to(torch.bfloat16)), (name, n, m)


def test_gemv_into_columns_and_strided_x():
    raw, k = blocks("Q4_1", 40, 3, seed=3)
    w = dequantize(raw, "Q4_1", k, backend="torch")
    x = torch.randn(3, 2 * k)[:, ::2]                 # unit stride missing: copied
    y = torch.full((3, 50), 7.0)
    gguf_cpu.gemv(x, raw, "Q4_1", k, out=y[:, 4:44])
    check_gemv(y[:, 4:44], x, w)
    assert (y[:, :4] == 7).all() and (y[:, 44:] == 7).all()
    assert gguf_cpu.gemv(torch.empty(0, k), raw, "Q4_1", k).shape == (0, 40)
    xb, yb = x.to(torch.bfloat16), torch.full((3, 50), 7.0, dtype=torch.bfloat16)     # bf16: the same
    gguf_cpu.gemv(xb, raw, "Q4_1", k, out=yb[:, 4:44])
    assert same_bits(yb[:, 4:44], gguf_cpu.gemv(xb.float(), raw, "Q4_1", k).to(torch.bfloat16))
    assert (yb[:, :4] == 7).all() and (yb[:, 44:] == 7).all()


def test_matmul_backends():
    raw, k = blocks("Q6_K", 48, 2, seed=4)
    w = dequantize(raw, "Q6_K", k, backend="torch")
    x = torch.randn(1, 3, k)
    y = gguf.matmul(x, raw, "Q6_K", k)                     # M = 3: the fused GEMV
    assert y.shape == (1, 3, 48)
    check_gemv(y.view(3, 48), x.view(3, k), w)
    x = torch.randn(4, 5, k)                               # M = 20 > Q6_K's gemv_max_m: dequantize + F.linear, exact
    assert torch.equal(gguf.matmul(x, raw, "Q6_K", k), F.linear(x, w))
    assert torch.equal(gguf.matmul(x, raw, "Q6_K", k, backend="cpu"), F.linear(x, w))
    with pytest.raises(ValueError):
        gguf.matmul(x, raw, "Q6_K", k, backend="nope")


def _layer():
    """A GGUFBlocks layer of 64 x 512: Q4_K rows 0..40, Q6_K rows 40..56, dense rows 56..64."""
    q, k = blocks("Q4_K", 40, 2, seed=5)
    kk, _ = blocks("Q6_K", 16, 2, seed=6)
    v = torch.randn(8, k, generator=torch.Generator().manual_seed(7))
    layer = GGUFBlocks(64, k)
    layer.load("q", 0, QuantizedTensor("Q4_K", q, (40, k)), torch.device("cpu"), torch.float32)
    layer.load("k", 40, QuantizedTensor("Q6_K", kk, (16, k)), torch.device("cpu"), torch.float32)
    layer.load("v", 56, v, torch.device("cpu"), torch.float32)
    w = torch.cat([dequantize(q, "Q4_K", k, backend="torch"), dequantize(kk, "Q6_K", k, backend="torch"), v])
    return layer, w, k


def test_gguf_blocks_matmul(monkeypatch):
    layer, w, k = _layer()
    assert gguf_cpu.gemv_max_m("Q4_K") == 16 and gguf_cpu.gemv_max_m("Q6_K") == 8
    calls, gemv = [], gguf_cpu.gemv_checked
    monkeypatch.setattr(gguf_cpu, "gemv_checked", lambda x, raw, g, k, out: (calls.append(out.shape[1]),
                                                                               gemv(x, raw, g, k, out))[1])
    # M = 1, 2, 8: the fused GEMV for both quantized shards; 16: for the Q4_K
    # rows only (Q6_K's GEMV stops at 8 rows), the Q6_K rows in a tile.
    for shape, gemv_cols in [((1, k), [40, 16]), ((2, k), [40, 16]), ((2, 4, k), [40, 16]), ((16, k), [40])]:
        x = torch.randn(shape)
        calls.clear()
        y = layer.matmul(None, x)
        assert y.shape == (*shape[:-1], 64) and calls == gemv_cols
        check_gemv(y.reshape(-1, 64), x.reshape(-1, k), w)
    x = torch.randn(1, 17, k)                              # M = 17: dequantized tiles + matmuls
    matches_linear(layer.matmul(None, x), x, w)
    xb = torch.randn(2, k).to(torch.bfloat16)
    yb = layer.matmul(None, xb)
    assert yb.dtype == torch.bfloat16
    wb = w.clone()
    wb[56:] = w[56:].to(torch.bfloat16).float()           # the dense shard multiplies in x's dtype
    check_gemv(yb, xb, wb)


def test_gguf_blocks_matmul_in_tiles(monkeypatch):
    """M > 16 rows, 7 weight rows per tile: tiles end inside each shard and at
    its end (40 Q4_K, 16 Q6_K, 8 dense rows), fp32 and bf16."""
    layer, w, k = _layer()
    monkeypatch.setattr(base, "TILE_ELEMENTS", 7 * k)
    x = torch.randn(3, 9, k)
    matches_linear(layer.matmul(None, x), x, w)
    xb = torch.randn(20, k).to(torch.bfloat16)
    matches_linear(layer.matmul(None, xb), xb, w, rel=1e-2)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_portable_build(monkeypatch):
    """8 floats per vector, FMA on ymm, software fp16 conversion (a build
    without AVX-512 and F16C, as on AVX2 machines): the same results."""
    monkeypatch.setattr(gguf_cpu, "FLAGS", gguf_cpu.FLAGS + ["-mno-avx512f", "-mno-f16c"])
    monkeypatch.setattr(gguf_cpu, "_lib", lru_cache(gguf_cpu._lib.__wrapped__))   # this variant, cached on disk
    g = torch.Generator().manual_seed(2)
    for name in TYPES:
        raw, k = blocks(name, 9, 3, seed=20)
        ref = dequantize(raw, name, k, backend="torch")
        assert same_bits(gguf_cpu.dequantize_into(raw, name, k, torch.empty(9, k)), ref), name
        assert same_bits(gguf_cpu.dequantize_into(raw, name, k, torch.empty(9, k, dtype=torch.bfloat16)),
                         ref.to(torch.bfloat16)), name
        for m in (1, 3, 8):
            x = torch.randn(m, k, generator=g)
            check_gemv(gguf_cpu.gemv(x, raw, name, k), x, ref)


def _boom(*a, **kw):
    raise AssertionError("the compiled kernel was called")


def _fallback_calls(raw, name, k):
    """The entry points that take the kernel when it is there, with it out of reach."""
    w = dequantize(raw, name, k, backend="torch")
    assert torch.equal(dequantize(raw, name, k), w)
    x = torch.randn(2, k)
    assert torch.equal(gguf.matmul(x, raw, name, k), F.linear(x, w))
    layer, lw, lk = _layer()
    for m in (2, 20):
        x = torch.randn(m, lk)
        matches_linear(layer.matmul(None, x), x, lw)


def test_fallback_when_the_build_fails(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TQSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_cpu, "FLAGS", gguf_cpu.FLAGS + ["-include", "/nonexistent.h"])
    monkeypatch.setattr(gguf_cpu, "_lib", lru_cache(gguf_cpu._lib.__wrapped__))
    monkeypatch.setattr(gguf_cpu, "_build_error", lru_cache(gguf_cpu._build_error.__wrapped__))
    with pytest.raises(RuntimeError, match="TQSERVE_GGUF_CPU=torch"):
        gguf_cpu.build()
    assert not list(tmp_path.iterdir())                   # no partial library left behind
    assert "building the GGUF CPU kernel failed" in gguf_cpu.reason(torch.float32)
    raw, k = blocks("Q4_1", 10, 2, seed=8)
    with pytest.raises(RuntimeError, match="TQSERVE_GGUF_CPU=torch"):
        dequantize(raw, "Q4_1", k, backend="cpu")          # asked for explicitly: the build error
    monkeypatch.setattr(gguf, "_FALLBACK_LOGGED", set())
    monkeypatch.setattr(gguf_cpu, "dequantize_into", _boom)
    monkeypatch.setattr(gguf_cpu, "gemv", _boom)
    with caplog.at_level(logging.WARNING, logger="parallel.quant.gguf"):
        _fallback_calls(raw, "Q4_1", k)
        _fallback_calls(raw, "Q4_1", k)
    lines = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
    assert len(lines) == 1 and "building the GGUF CPU kernel failed" in lines[0], lines


def test_torch_path_selected_by_env(monkeypatch, caplog):
    monkeypatch.setenv("TQSERVE_GGUF_CPU", "torch")
    assert gguf_cpu.reason() == "TQSERVE_GGUF_CPU=torch"
    monkeypatch.setattr(gguf, "_FALLBACK_LOGGED", set())
    monkeypatch.setattr(gguf_cpu, "dequantize_into", _boom)
    monkeypatch.setattr(gguf_cpu, "gemv", _boom)
    raw, k = blocks("Q8_0", 6, 2, seed=9)
    with caplog.at_level(logging.WARNING, logger="parallel.quant.gguf"):
        _fallback_calls(raw, "Q8_0", k)
    assert sum("TQSERVE_GGUF_CPU=torch" in r.getMessage() for r in caplog.records) == 1


def test_fp16_takes_the_torch_path():
    raw, k = blocks("Q4_K", 5, 1, seed=11)
    assert gguf_cpu.reason(torch.float16) is not None
    assert torch.equal(dequantize(raw, "Q4_K", k, torch.float16),
                       dequantize(raw, "Q4_K", k, backend="torch").to(torch.float16))


def test_scratch_made_under_inference_mode_is_writable_outside():
    """The engine first makes the shared buffer inside inference mode; layers
    called outside it (tests, calibration) still write into it."""
    from parallel.quant import base
    base._SCRATCH.clear()
    with torch.inference_mode():
        base.scratch(64, torch.float32, torch.device("cpu")).zero_()
    base.scratch(32, torch.float32, torch.device("cpu")).fill_(1.0)
