"""DeepSeek-V4's FP8 (128x128 block scales) and FP4 (e2m1 + E8M0 per 32)
weights kept resident (parallel.quant.fp8_block / mxfp4 / moe): dequantization
bit for bit against the loader's (model_zoo.dsv4_checkpoint), the torch
matmuls against F.linear, the Triton kernels run on CPU by Triton's
interpreter against the torch reference (max abs error within 1e-5 of the
reference's largest value for fp32 activations, 1e-2 for bf16), the grouped
MoE against Experts.forward's per-expert loop, and the kernels compiled for
sm_90 (H200) and sm_121 (GB10) with no GPU."""
import math
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model_zoo.dsv4_checkpoint import dequant_fp4, dequant_fp8, pack_fp4
from parallel.quant import fp8_block, gguf, moe, mxfp4
from tq_paged import assert_close
from triton_compile import assert_fit, spec

E8M0 = torch.float8_e8m0fnu


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def fp8_weight(N, K, g, scale="f32", lead=()):
    w8 = (torch.randn(*lead, N, K, generator=g) * 3).to(torch.float8_e4m3fn)
    shape = (*lead, -(-N // 128), -(-K // 128))
    if scale == "f32":
        s = torch.rand(shape, generator=g) * 0.02 + 0.001
    else:
        s = torch.randint(118, 125, shape, generator=g, dtype=torch.uint8)
        s = s if scale == "u8" else s.view(E8M0)
    return w8, s


def fp4_weight(N, K, g, scale="u8", lead=()):
    codes = torch.randint(0, 16, (*lead, N, K), generator=g)
    s = torch.randint(120, 128, (*lead, N, K // 32), generator=g, dtype=torch.uint8)
    s = s if scale == "u8" else s.view(E8M0) if scale == "e8m0" else torch.exp2(s.float() - 127).bfloat16()
    return mxfp4.pack(codes), s


# -- dequantization -------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["f32", "u8", "e8m0"])
@pytest.mark.parametrize("N,K", [(256, 384), (200, 330), (7, 130)])
def test_fp8_dequantize_is_the_loaders(N, K, scale):
    w8, s = fp8_weight(N, K, _gen(), scale)
    ref = dequant_fp8(w8, s)
    assert torch.equal(fp8_block.dequantize(w8, s), ref)
    assert torch.equal(fp8_block.dequantize(w8, s, torch.bfloat16), ref.bfloat16())
    buf = torch.full((N * K + 100,), float("nan"))                   # a reused, larger buffer
    out = fp8_block.dequantize(w8, s, out=buf)
    assert out.shape == (N, K) and out.data_ptr() == buf.data_ptr() and torch.equal(out, ref)


def test_fp8_dequantize_leading_dims():
    w8, s = fp8_weight(200, 136, _gen(1), lead=(3,))
    out = fp8_block.dequantize(w8, s)
    assert torch.equal(out, torch.stack([dequant_fp8(w8[e], s[e]) for e in range(3)]))
    with pytest.raises(ValueError):
        fp8_block.dequantize(w8[0], s[0, :1])


@pytest.mark.parametrize("scale", ["u8", "e8m0", "bf16"])
def test_fp4_dequantize_is_the_loaders(scale, monkeypatch):
    monkeypatch.setattr(mxfp4, "_CHUNK", 1000)          # several table lookups (7 rows each)
    g = _gen(2)
    packed, s = fp4_weight(72, 320, g, scale)
    codes = torch.randint(0, 16, (72, 320), generator=g)
    assert torch.equal(mxfp4.pack(codes), pack_fp4(codes))
    ref = dequant_fp4(packed, s)
    assert torch.equal(mxfp4.dequantize(packed, s), ref)
    assert torch.equal(mxfp4.dequantize(packed.view(torch.int8), s), ref)     # official int8 bytes
    assert torch.equal(mxfp4.dequantize(packed, s, torch.bfloat16), ref.bfloat16())
    buf = torch.empty(72 * 320 + 7)
    assert torch.equal(mxfp4.dequantize(packed, s, out=buf), ref)
    pl, sl = fp4_weight(8, 64, g, scale, lead=(3,))                    # [E, N, K/2] at once
    assert torch.equal(mxfp4.dequantize(pl, sl), torch.stack([dequant_fp4(pl[e], sl[e]) for e in range(3)]))
    every = mxfp4.pack(torch.arange(16).repeat(1, 2))                 # each code once, scale 1
    assert torch.equal(mxfp4.dequantize(every, torch.full((1, 1), 127, dtype=torch.uint8))[0, :16],
                       torch.tensor(mxfp4.E2M1))


def test_bytes_per_parameter():
    w8, s = fp8_weight(1024, 2048, _gen(3))
    assert (w8.nbytes + s.nbytes) / w8.numel() == 1 + 4 / 128 ** 2         # ~1.0002
    packed, sc = fp4_weight(256, 2048, _gen(3))
    assert (packed.nbytes + sc.nbytes) / (256 * 2048) == 0.5 + 1 / 32 == 0.53125


# -- matmul: torch path ------------------------------------------------------------------
def test_torch_matmul_is_f_linear_of_the_dequantized():
    g = _gen(4)
    x = torch.randn(3, 5, 330, generator=g)
    w8, s = fp8_weight(200, 330, g)
    scratch = torch.empty(200 * 330 + 50)
    assert torch.equal(fp8_block.matmul(x, w8, s, scratch=scratch), F.linear(x, dequant_fp8(w8, s)))
    x = torch.randn(4, 320, generator=g)
    packed, sc = fp4_weight(72, 320, g)
    assert torch.equal(mxfp4.matmul(x, packed, sc, scratch=scratch), F.linear(x, dequant_fp4(packed, sc)))
    xb = x.bfloat16()
    assert torch.equal(mxfp4.matmul(xb, packed, sc), F.linear(xb, dequant_fp4(packed, sc).bfloat16()))


# -- matmul: Triton (interpreter) ----------------------------------------------------------
# M=1 and M=5: the GEMV kernel (M=5 padded to 8 rows); M=32: the tl.dot GEMM kernel.
@pytest.mark.parametrize("M", [1, 5, 32])
def test_fp8_triton_matmul(M):
    g = _gen(5)
    for N, K, scale in [(200, 330, "f32"), (136, 256, "u8")]:
        w8, s = fp8_weight(N, K, g, scale)
        x = torch.randn(M, K, generator=g)
        ref = F.linear(x, dequant_fp8(w8, s))
        assert_close(fp8_block.matmul(x, w8, s, backend="triton"), ref, 1e-5)
    if M == 1:          # split-K: partial sums over K tiles, summed by torch
        assert_close(fp8_block._triton_matmul(x, w8, s, splits=2), ref, 1e-5)
    if M == 32:         # bf16 activations: weights dequantized to bf16 in registers, fp32 accumulation
        out = fp8_block.matmul(x.bfloat16(), w8, s, backend="triton")
        assert out.dtype == torch.bfloat16
        assert_close(out.float(), F.linear(x.bfloat16().float(), dequant_fp8(w8, s)), 1e-2)


@pytest.mark.parametrize("M", [1, 5, 32])
def test_fp4_triton_matmul(M):
    g = _gen(6)
    for N, K, scale in [(72, 320, "u8"), (40, 96, "bf16")]:
        packed, s = fp4_weight(N, K, g, scale)
        x = torch.randn(M, 2 * K, generator=g)[:, :K]                 # rows at stride 2K
        ref = F.linear(x, dequant_fp4(packed, s))
        assert_close(mxfp4.matmul(x, packed, s, backend="triton"), ref, 1e-5)
    if M == 1:
        assert_close(mxfp4._triton_matmul(x, packed, s, splits=3, block_k=32), ref, 1e-5)
    if M == 32:
        out = mxfp4.matmul(x.bfloat16(), packed, s, backend="triton")
        assert_close(out.float(), F.linear(x.bfloat16().float(), dequant_fp4(packed, s)), 1e-2)


def test_triton_kernel_reads_every_fp8_code():
    # every finite e4m3 code (not the NaNs 0x7f / 0xff), E8M0 scale 2^0 and 2^3
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)         # 254 codes
    w8 = codes.view(2, 127)
    s = torch.tensor([[130]], dtype=torch.uint8)
    eye = torch.eye(127)
    out = fp8_block.matmul(eye, w8, s, backend="triton").t()
    assert torch.equal(out, dequant_fp8(w8, s))


# -- grouped MoE ----------------------------------------------------------------------
def ref_experts(x, idx, w, W13, W2, limit, act="silu"):
    """model_zoo.deepseek_v4.Experts.forward's math, local ids (-1: another rank's);
    act gelu_tanh: Gemma 4's experts (transformers' loop, weights applied in their dtype)."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        if not 0 <= e < W13.shape[0]:
            continue
        tok, slot = torch.where(idx == e)
        g, u = F.linear(x[tok], W13[e]).chunk(2, dim=-1)
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        h = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
        out.index_add_(0, tok, (F.linear(h, W2[e]) * w[tok, slot, None]).to(x.dtype))
    return out


def _routes(T, k, E, g):
    """Random routes with some -1, an expert used twice by one token, an
    expert with no tokens (E - 1) and expert 0 holding most pairs."""
    idx = torch.randint(0, E - 1, (T, k), generator=g)
    idx[torch.rand(T, k, generator=g) < 0.4] = 0
    idx[torch.rand(T, k, generator=g) < 0.2] = -1
    idx[1, :2] = 1                  # repeated expert in one token
    idx[2] = -1                     # a token with no local expert
    w = torch.rand(T, k, generator=g) + 0.1
    return idx, w


def _moe_case(fmt, g, E=4, H=64, I=48):
    if fmt == "bf16":
        w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
        return w13, w2, w13, w2
    if fmt == "fp8":
        a, b = fp8_weight(2 * I, H, g, lead=(E,)), fp8_weight(H, I, g, "e8m0", lead=(E,))
        deq = dequant_fp8
    else:
        a, b = fp4_weight(2 * I, H, g, lead=(E,)), fp4_weight(H, I, g, "e8m0", lead=(E,))
        deq = dequant_fp4
    W13 = torch.stack([deq(a[0][e], a[1][e]) for e in range(E)])
    W2 = torch.stack([deq(b[0][e], b[1][e]) for e in range(E)])
    return a, b, W13, W2


SHAPES = {"bf16": dict(H=64, I=48), "fp8": dict(H=160, I=80), "mxfp4": dict(H=96, I=64)}


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_moe_torch_path_is_experts_forward(fmt):
    g = _gen(7)
    w13, w2, W13, W2 = _moe_case(fmt, g, **SHAPES[fmt])
    x = torch.randn(9, SHAPES[fmt]["H"], generator=g)
    idx, w = _routes(9, 3, 4, g)
    ref = ref_experts(x, idx, w, W13, W2, 1.5)
    assert torch.equal(moe.moe_forward(x, idx, w, w13, w2, fmt, 1.5), ref)
    assert torch.equal(moe.moe_forward(x, torch.full_like(idx, -1), w, w13, w2, fmt, 1.5), torch.zeros_like(x))


def test_moe_bf16_is_the_model_module():
    from model_zoo.deepseek_v4 import Experts
    ex = Experts(dict(n_routed_experts=4, hidden_size=32, moe_intermediate_size=16, swiglu_limit=0.8))
    g = _gen(8)
    with torch.no_grad():
        ex.gate_up_proj.normal_(generator=g)
        ex.down_proj.normal_(generator=g)
        x = torch.randn(6, 32, generator=g)
        idx, w = _routes(6, 2, 4, g)
        assert torch.equal(moe.moe_forward(x, idx, w, ex.gate_up_proj, ex.down_proj, "bf16", ex.limit),
                           ex(x, idx, w))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_moe_triton_grouped(fmt):
    g = _gen(9)
    w13, w2, W13, W2 = _moe_case(fmt, g, **SHAPES[fmt])
    # 24 tokens x 2: mean 12 rows per active expert -> 16-row tiles; expert 0
    # gets most pairs, so several tiles; some row tiles of the grid stay idle.
    x = torch.randn(24, SHAPES[fmt]["H"], generator=g)
    idx, w = _routes(24, 2, 4, g)
    ref = ref_experts(x, idx, w, W13, W2, 1.5)
    assert (idx == 0).sum() > 16
    assert_close(moe.moe_forward(x, idx, w, w13, w2, fmt, 1.5, backend="triton"), ref, 1e-5)
    if fmt == "fp8":    # bf16 activations
        out = moe.moe_forward(x.bfloat16(), idx, w, w13, w2, fmt, 1.5, backend="triton")
        assert out.dtype == torch.bfloat16
        assert_close(out.float(), ref_experts(x.bfloat16().float(), idx, w, W13, W2, 1.5), 2e-2)


def test_moe_gelu_tanh_and_fp32_weights():
    """Gemma 4's experts: gelu_tanh gate, no clamp, fp32 routing weights with bf16
    activations (its router's), on the torch path and the Triton kernels."""
    g = _gen(11)
    w13, w2, _, _ = _moe_case("bf16", g)
    x = torch.randn(24, 64, generator=g)
    idx, w = _routes(24, 2, 4, g)
    ref = ref_experts(x, idx, w, w13, w2, math.inf, "gelu_tanh")
    assert torch.equal(moe.moe_forward(x, idx, w, w13, w2, "bf16", math.inf, act="gelu_tanh"), ref)
    assert not torch.allclose(ref, ref_experts(x, idx, w, w13, w2, math.inf))      # not SwiGLU
    assert_close(moe.moe_forward(x, idx, w, w13, w2, "bf16", math.inf, act="gelu_tanh", backend="triton"), ref, 1e-5)
    xb = x.bfloat16()
    out = moe.moe_forward(xb, idx, w, w13.bfloat16(), w2.bfloat16(), "bf16", math.inf, act="gelu_tanh")
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref, 3e-2)
    with pytest.raises(ValueError, match="activation 'relu'"):
        moe.moe_forward(x, idx, w, w13, w2, "bf16", math.inf, act="relu")


def test_moe_tile_map():
    counts = torch.tensor([20, 0, 3, 16])
    ends = counts.cumsum(0)
    te, r0, r1 = moe._tile_map(counts, ends - counts, ends, 40, 4, 16)
    assert te.numel() == 3 + 4
    assert te.tolist() == [0, 0, 2, 3, -1, -1, -1]
    assert r0[:4].tolist() == [0, 16, 20, 23] and r1[:4].tolist() == [20, 20, 23, 39]


# -- without triton, on a GPU build ------------------------------------------------------
def test_import_and_torch_paths_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from parallel.quant import fp8_block, mxfp4, moe\n"
            "w = torch.ones(4, 32, dtype=torch.float8_e4m3fn); s = torch.ones(1, 1)\n"
            "assert fp8_block.matmul(torch.ones(2, 32), w, s).sum() == 256\n"
            "p = mxfp4.pack(torch.full((4, 32), 2)); sc = torch.full((4, 1), 127, dtype=torch.uint8)\n"
            "assert mxfp4.matmul(torch.ones(1, 32), p, sc).sum() == 128\n"
            "assert fp8_block.pick_backend(None, torch.ones(1)) == 'torch'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**env, "OMP_NUM_THREADS": "1"},
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]


# -- compiling for the GPUs ---------------------------------------------------------------
_W = {"fp8": ("fp8e4nv", "fp32"), "fp8e8": ("fp8e4nv", "u8"), "fp4": ("u8", "u8"), "dense": ("bf16", "bf16")}
_MOD = {"fp8": "fp8_block", "fp8e8": "fp8_block", "fp4": "mxfp4"}
# GGUF experts: type -> (kernel code, bytes per block, tile unit)
_GG = {name: (code, gguf.QTYPES[name].type_size, unit) for name, (code, unit) in moe.GGUF_CODES.items()}


def _kernel_spec(arch, case):
    kind, x, fmt, bm, *act = case.split(",")
    act = act[0] if act else "0"
    w, s = ("u8", "u8") if fmt in _GG else _W[fmt]
    e8 = s == "u8" and fmt not in _GG
    if kind in ("gemv", "gemm"):
        ptrs = dict(x_ptr=x, w_ptr=w, p_ptr=w, s_ptr=s, y_ptr="fp32" if kind == "gemv" else x)
        name = f"parallel.quant.{_MOD[fmt]}:_{kind}_kernel"
        if kind == "gemv":
            M = int(bm)
            return spec(name, arch, dict(M=M, M_PAD=1 << (M - 1).bit_length(), BN=32, BK=128, SCALE_E8M0=e8),
                        ptrs, 4, 3)
        t = fp8_block.gemm_tiles(int(bm), x == "fp32")
        return spec(name, arch, dict(BM=t["block_m"], BN=t["block_n"], BK=64, F32=x == "fp32", SCALE_E8M0=e8),
                    ptrs, t["num_warps"], t["num_stages"])
    ptrs = dict(x_ptr=x, w_ptr=w, s_ptr=s, u_ptr=w, h_ptr=x, y_ptr=x, tile_e_ptr="i32", tile_r0_ptr="i32",
                tile_r1_ptr="i32", tok_ptr="i32", pair_ptr="i32", rw_ptr="fp32")
    code = 3 if fmt in _GG else {"dense": 0, "fp8": 1, "fp8e8": 1, "fp4": 2}[fmt]
    qt, ts, unit = _GG.get(fmt, (0, 0, 64))
    q = dict(QT=qt, TS=ts) | (dict(QTU=qt, TSU=ts, ACT=int(act)) if kind == "up" else {})
    t = moe.moe_tiles(kind, max(64, unit), x == "fp32")
    # down: the rows it gets beside a 64-wide up kernel (Q4_K_M's Q4_K gate / up, Q6_K down), the most
    rows = moe.moe_block_m(int(bm), max(64, unit) if kind == "up" else 64, x == "fp32")
    return spec(f"parallel.quant.moe:_moe_{kind}_kernel", arch,
                dict(FMT=code, BM=rows, BN=t["block_n"], BK=max(64, unit), SCALE_E8M0=e8, F32=x == "fp32", **q),
                ptrs, t["num_warps"], t["num_stages"], floats=("limit",))


# kernel, activations, weight format (scales: fp8 fp32, fp8e8 / fp4 E8M0; a GGUF type name: the
# grouped experts over GGUF blocks), rows (GEMV / GEMM: M; MoE: mean rows per expert), as MoE
# activation: the tiles fp8_block.launch and moe._moe_triton pick.
_SPECS = {90: ["gemv,bf16,fp8,3", "gemm,bf16,fp8,64", "gemm,fp32,fp8e8,32", "gemv,bf16,fp4,1", "gemm,bf16,fp4,64",
               "up,bf16,dense,16", "up,bf16,dense,16,1", "down,bf16,fp8e8,64", "up,bf16,fp4,16", "down,bf16,fp4,64",
               "up,bf16,Q4_K,16", "down,bf16,Q6_K,64", "up,bf16,Q8_0,64,1", "down,bf16,Q5_0,16", "up,bf16,Q6_K,64",
               "up,fp32,fp8e8,64", "down,fp32,Q6_K,16", "gemv,bf16,fp8,16"],
          121: ["gemv,bf16,fp8e8,2", "gemm,bf16,fp8,64", "gemm,bf16,fp4,32", "up,bf16,fp8,64", "up,bf16,fp4,16,1",
                "down,bf16,fp4,16", "up,bf16,Q4_K,64", "down,bf16,Q6_K,16", "up,bf16,Q5_K,16", "up,bf16,Q8_0,64",
                "up,bf16,Q6_K,64", "down,bf16,Q8_0,64", "up,fp32,fp4,64", "gemm,fp32,fp8,32"]}


@pytest.mark.parametrize("arch", [90, 121])
def test_kernels_compile_for_gpus(arch):
    # The interpreter skips Triton's type checks and lowering; compiling for
    # H100/H200 (sm_90) and GB10 (sm_121) targets, no GPU needed, catches
    # what only the GPU build sees, register spills and shared memory over
    # the GB10's 99 KiB. A few bytes of spill are ptxas's own trade (8-warp
    # tiles held at 128 registers for two blocks per SM) or the fp32 FMA
    # dot's squeeze; 64-wide 4-warp tiles spilled up to 2.9 KB.
    assert_fit(_SPECS[arch], [_kernel_spec(arch, c) for c in _SPECS[arch]], max_spill=32)
