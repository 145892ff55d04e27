"""GGUF blocks kept quantized (parallel.quant.gguf): torch dequantisation
against gguf-py's numpy dequantizer (bit-exact in fp32) on built blocks and on
real tensors of the two shipped GGUF files; the matmul's torch path against
F.linear; the Triton kernels (GEMV for M <= 16, tl.dot GEMM above), run on
CPU by Triton's interpreter, against the torch path.

Tolerances: dequantize == gguf-py exactly (same fp32 operations in the same
order). Triton vs torch in fp32: max |diff| <= 1e-5 * max |ref| (the kernels
sum in another order and may fuse multiply-adds; ~1e-7 seen). fp16
activations: 1e-2 (W and x rounded to fp16 in both, fp32 accumulation)."""
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from model_zoo.gguf_file import GGUFFile  # noqa: E402
from parallel.quant.gguf import QTYPES, dequantize, matmul, qtype_name, row_bytes  # noqa: E402

SIX = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


def _blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes]: gguf-py's quantizer on gaussian rows where it has
    one (Q8_0, Q4_0, Q4_1, Q5_0), else random bytes with sane fp16 d / dmin."""
    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), Q[name])
    except NotImplementedError:
        pass
    t = QTYPES[name]
    raw = rng.integers(0, 256, (n, row_bytes(name, k)), dtype=np.uint8)
    b = raw.reshape(n, -1, t.type_size)
    for off in ([208] if name == "Q6_K" else [0, 2]):           # d (and dmin)
        f = rng.uniform(-0.05, 0.05, b.shape[:2]).astype(np.float16)
        b[..., off:off + 2] = f.view(np.uint8).reshape(*b.shape[:2], 2)
    return raw


# -- formats ----------------------------------------------------------------------
def test_types_match_gguf_py():
    for name, t in QTYPES.items():
        assert t.ggml_type == int(Q[name])
        assert (t.block, t.type_size) == gguf.constants.GGML_QUANT_SIZES[Q[name]]
        assert qtype_name(Q[name]) == name and qtype_name(int(Q[name])) == name
    assert set(SIX) <= set(QTYPES)
    assert qtype_name(Q.F32) is None and qtype_name(Q.Q2_K) is None and qtype_name(None) is None


@pytest.mark.parametrize("name,bpp", [("Q8_0", 1.0625), ("Q4_0", 0.5625), ("Q4_1", 0.625),
                                      ("Q4_K", 0.5625), ("Q5_K", 0.6875), ("Q6_K", 0.8203125),
                                      ("Q5_0", 0.6875)])
def test_bytes_per_parameter(name, bpp):
    assert row_bytes(name, 2048) / 2048 == bpp == QTYPES[name].bytes_per_param


def test_row_bytes_rejects_partial_blocks():
    with pytest.raises(ValueError):
        row_bytes("Q4_K", 640)
    with pytest.raises(ValueError):
        row_bytes("Q8_0", 48)
    with pytest.raises(ValueError):
        row_bytes("Q3_K", 256)


# -- dequantize -----------------------------------------------------------------
@pytest.mark.parametrize("name", list(QTYPES))
def test_dequantize_equals_gguf_py(name):
    raw = _blocks(name, 24, 512)
    ref = gguf.quants.dequantize(raw, Q[name])
    got = dequantize(torch.from_numpy(raw), name, 512)
    assert got.dtype == torch.float32 and got.shape == (24, 512)
    assert torch.equal(got, torch.from_numpy(ref))
    # another dtype: one rounding of the exact fp32 values; into a given buffer
    out = torch.full((24, 512), float("nan"), dtype=torch.bfloat16)
    assert dequantize(torch.from_numpy(raw), name, 512, torch.bfloat16, out=out) is out
    assert torch.equal(out, torch.from_numpy(ref).to(torch.bfloat16))


def test_dequantize_in_chunks(monkeypatch):
    # Row ranges processed a chunk at a time land in the right rows.
    import parallel.quant.gguf as g
    monkeypatch.setattr(g, "_CHUNK", 3 * 256)
    raw = _blocks("Q6_K", 10, 256)
    assert torch.equal(dequantize(torch.from_numpy(raw), "Q6_K", 256),
                       torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K)))


def test_dequantize_checks_shapes():
    raw = torch.from_numpy(_blocks("Q4_0", 4, 64))
    with pytest.raises(ValueError):
        dequantize(raw, "Q4_0", 96)                       # row_bytes disagree
    with pytest.raises(ValueError):
        dequantize(raw.view(torch.int8), "Q4_0", 64)
    with pytest.raises(ValueError):
        dequantize(raw, "Q4_0", 64, torch.float32, out=torch.empty(4, 64, dtype=torch.float16))


# Resolver -> the types its file has among QTYPES.
_FILES = {"smollm2_135m_path": {"Q4_1", "Q8_0"},
          "gemma3_270m_path": {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}}


@pytest.fixture(scope="module")
def real_tensors():
    """(file, tensor name, type name, raw uint8 [64, row_bytes], k): the first
    tensor of each supported type in each shipped GGUF file that is installed
    (model_zoo.gguf_file: the header in one pass)."""
    import model_zoo.resolve as resolve
    from model_zoo.source import ModelLoadError
    out = []
    for fn, expected in _FILES.items():
        try:
            path = getattr(resolve, fn)()
        except ModelLoadError:
            continue
        seen = set()
        for t in GGUFFile(path).tensors:
            name = qtype_name(t.tensor_type)
            if name is None or name in seen:
                continue
            seen.add(name)
            raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)[:64].copy()
            out.append((path.name, t.name, name, raw, int(t.shape[0])))
        assert seen == expected, (path.name, seen)
    if not out:
        pytest.skip("neither shipped GGUF package is installed")
    return out


def test_dequantize_real_tensors(real_tensors):
    for fname, tname, name, raw, k in real_tensors:
        ref = gguf.quants.dequantize(raw, Q[name])
        got = dequantize(torch.from_numpy(raw), name, k)
        assert torch.equal(got, torch.from_numpy(ref)), (fname, tname, name)


# -- matmul, torch path ---------------------------------------------------------
@pytest.mark.parametrize("name", SIX)
def test_matmul_torch_path(name):
    raw = torch.from_numpy(_blocks(name, 48, 512, seed=1))
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(0))
    w = dequantize(raw, name, 512)
    ref = F.linear(x, w)
    assert torch.equal(matmul(x, raw, name, 512, backend="torch"), ref)
    # a shared buffer larger than the layer: its head is used
    buf = torch.empty(48 * 512 + 100)
    assert torch.equal(matmul(x, raw, name, 512, buf), ref)
    assert torch.equal(buf[:48 * 512].view(48, 512), w)
    with pytest.raises(ValueError):
        matmul(x, raw, name, 512, torch.empty(10))


# -- Triton kernels under the interpreter ---------------------------------------
def _close(y, ref, rel):
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("M", [1, 32])
@pytest.mark.parametrize("name", list(QTYPES))
def test_triton_matches_torch(name, M):
    N, K = 40, 512                       # N not a multiple of the N tile: masked rows
    raw = torch.from_numpy(_blocks(name, N, K, seed=2))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    ref = matmul(x, raw, name, K, backend="torch")
    y = matmul(x, raw, name, K, backend="triton")
    assert y.shape == (M, N) and y.dtype == torch.float32
    _close(y, ref, 1e-5)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_1"])
def test_gemv_split_k_and_few_rows(name):
    from parallel.quant import gguf_triton
    N, K = 16, 1024
    raw = torch.from_numpy(_blocks(name, N, K, seed=3))
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(3))        # M = 6
    ref = matmul(x, raw, name, K, backend="torch")
    _close(matmul(x, raw, name, K, backend="triton"), ref, 1e-5)
    # K split in 3 (8 tiles of 128: 3 + 3 + 2), partial sums added by torch
    y = gguf_triton.gemv(x.reshape(6, K), raw, QTYPES[name], K, block_n=16, block_k=128, split_k=3)
    _close(y.view(2, 3, N), ref, 1e-5)


def test_legacy_k_not_a_multiple_of_the_tile():
    # K = 96: three 32-blocks, GEMM tiles of 64 overhang K; GEMV tiles of 256 too.
    # Rows 4..27 of a larger matrix (a tensor-parallel shard: a view at an offset).
    raw = torch.from_numpy(_blocks("Q8_0", 32, 96, seed=4))[4:28]
    for M in (3, 20):
        x = torch.randn(M, 96, generator=torch.Generator().manual_seed(M))
        _close(matmul(x, raw, "Q8_0", 96, backend="triton"), matmul(x, raw, "Q8_0", 96, backend="torch"), 1e-5)


@pytest.mark.parametrize("M", [2, 32])
def test_triton_fp16_activations(M):
    # GPU models run 16-bit: GEMV dequantizes to fp32 and reads x as fp32;
    # GEMM rounds W tiles to x's dtype for tl.dot. (The interpreter's tl.dot
    # mishandles bf16, so fp16 stands in for it here.)
    name, N, K = "Q5_K", 32, 256
    raw = torch.from_numpy(_blocks(name, N, K, seed=5))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(5)).half()
    ref = F.linear(x.float(), dequantize(raw, name, K))
    y = matmul(x, raw, name, K, backend="triton")
    assert y.dtype == torch.float16
    _close(y, ref, 1e-2)


def test_triton_real_tensors(real_tensors):
    # One 32-row slice of each real tensor type, GEMV (M=1) and GEMM (M=17).
    for fname, tname, name, raw, k in real_tensors:
        raw = torch.from_numpy(raw[:32])
        for M in (1, 17):
            x = torch.randn(M, k, generator=torch.Generator().manual_seed(M))
            ref = matmul(x, raw, name, k, backend="torch")
            _close(matmul(x, raw, name, k, backend="triton"), ref, 1e-5)


def test_triton_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    raw = torch.from_numpy(_blocks("Q8_0", 4, 32))
    with pytest.raises(RuntimeError):
        matmul(torch.randn(1, 32), raw, "Q8_0", 32, backend="triton")


# -- routed experts as GGUF blocks: the grouped Triton kernels (moe._moe_triton) ----------
@pytest.mark.parametrize("gate, down, act", [("Q4_K", "Q6_K", "silu"), ("Q8_0", "Q8_0", "gelu_tanh"),
                                             ("Q4_0", "Q4_1", "silu"), ("Q5_K", "Q5_0", "silu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_triton_matches_torch(gate, down, act, dtype):
    """moe_forward over GGUF experts: the two grouped launches (tiles
    dequantized in registers, gate and up from their own tensors, up of
    another type than gate) against the torch path (each expert dequantized
    in turn). Tokens routed to 0, 1 or several experts, ids off this rank."""
    from parallel.quant import moe
    E, I, H, T, k = 5, 256, 256, 9, 2
    up = "Q6_K" if gate == "Q4_K" else gate
    rows = lambda name, n, kk, seed: torch.from_numpy(  # noqa: E731
        np.stack([_blocks(name, n, kk, seed=seed + e) for e in range(E)]))
    w13 = ((rows(gate, I, H, 10), gate), (rows(up, I, H, 20), up), H)
    w2 = ((rows(down, H, I, 30), down), I)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(dtype)
    idx = torch.randint(0, E, (T, k), generator=g)
    idx[0, 1] = idx[0, 0]                  # one token twice through one expert
    idx[3, 0] = -1                         # an expert of another rank
    idx[4] = 4                             # expert 4 only here: others may see no token
    w = torch.rand(T, k, generator=g)
    # bf16 against the fp32 path: Triton's interpreter truncates to bf16 where a GPU rounds.
    ref = moe.moe_forward(x.float(), idx, w, w13, w2, "gguf", 7.0, backend="torch", act=act)
    out = moe.moe_forward(x, idx, w, w13, w2, "gguf", 7.0, backend="triton", act=act)
    assert out.dtype == dtype and out.shape == (T, H)
    _close(out, ref, 1e-5 if dtype == torch.float32 else 2e-2)


def test_grouped_experts_refuse_wrong_rows():
    from parallel.quant import moe
    t = "Q8_0"
    gate = torch.zeros(2, 64, 64 // 32 * 34, dtype=torch.uint8)
    w13 = ((gate, t), (gate[:, :32], t), 64)
    w2 = ((torch.zeros(2, 64, 2 * 34, dtype=torch.uint8), t), 64)
    with pytest.raises(ValueError, match="gguf w13: expected Q8_0 rows"):
        moe.moe_forward(torch.zeros(3, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), w13, w2,
                        "gguf", 7.0, backend="triton")


# -- compiling for the GPUs ---------------------------------------------------------------
# (kernel, M, activations) per target: the GEMV's 8-warp tiles (12 rows: where Q6_K's spilled on
# sm_121; 16: Q5_0's on sm_90), the GEMM's 64-row bf16 tiles (prefill; K-quants spilled on sm_121
# with 4 warps), fp32 GEMM tiles on sm_90 (the parity tests' dtype on an H200).
_COMPILES = {90: [("gemv", 16, "bf16"), ("gemm", 2048, "bf16"), ("gemm", 2048, "fp32")],
             121: [("gemv", 12, "bf16"), ("gemm", 2048, "bf16")]}


@pytest.mark.parametrize("arch", [90, 121])
def test_kernels_compile_for_gpus(arch):
    # The tiles gemv_config / gemm_config pick, for every type, compiled for
    # H100/H200 (sm_90) and GB10 (sm_121) with no GPU: ptxas must fit them
    # in registers (no spills) and shared memory.
    from parallel.quant.gguf_triton import _CODES, gemm_config, gemv_config
    from triton_compile import assert_fit, spec
    cases, specs = [], []
    for name in SIX + ["Q5_0"]:
        t, code = QTYPES[name], _CODES[name][0]
        for kind, M, x in _COMPILES[arch]:
            if kind == "gemv":
                c = gemv_config(t, M)
                const = dict(QT=code, TS=t.type_size, M=M, M_PAD=1 << (M - 1).bit_length(), BN=c["block_n"],
                             BK=c["block_k"])
                ptrs = dict(x_ptr=x, w_ptr="u8", y_ptr="fp32")
            else:
                c = gemm_config(t, M, x == "fp32")
                const = dict(QT=code, TS=t.type_size, BM=c["block_m"], BN=c["block_n"], BK=c["block_k"],
                             F32=x == "fp32")
                ptrs = dict(x_ptr=x, w_ptr="u8", y_ptr=x)
            cases.append((name, kind, M, x))
            specs.append(spec(f"parallel.quant.gguf_triton:gguf_{kind}_kernel", arch, const, ptrs, c["num_warps"],
                              c.get("num_stages")))
    assert_fit(cases, specs)
