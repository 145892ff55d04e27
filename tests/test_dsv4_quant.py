"""DeepSeek-V4's FP8 and FP4 weights kept resident (`--quantization fp8`).

The tiny FP8 + FP4 checkpoint of tests/test_deepseek_v4.py (quantise_checkpoint:
official names, experts e2m1 + E8M0 per 32, other projections e4m3 with
128x128 block scales), written to a directory and opened like any model:

  - the HF loader tells the stored formats from the safetensors headers and
    streams each stored weight paired with its scale;
  - through the engine, LLM(dir, quantization="fp8") vs LLM(dir) (the
    dequantized dense model): prompt logprobs equal (fp32 on the CPU: the
    kernels dequantize bit for bit, then the same F.linear; bound 1e-6),
    greedy tokens equal; resident bytes measured from the allocated tensors:
    experts 0.53125 B/parameter, FP8 1 + 4 / 128^2 per full block;
  - tensor parallel (2 ranks, assumed: no process group): each rank's FP8
    rows / columns and scale blocks, and its experts, are exactly the dense
    model's shards; a split off the 128-wide blocks raises, naming the sizes;
  - the Triton kernels (interpreter) on the whole model against the torch path;
  - Experts.forward (now moe_forward) bit for bit the per-expert loop it replaced.
"""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from test_deepseek_v4 import CONFIG, quantise_checkpoint, randomise

import model_zoo.dsv4_checkpoint as ckpt

from engine import LLM, SamplingParams
from model_zoo.deepseek_v4 import DeepseekV4ForCausalLM, Experts
from model_zoo.hf_loader import open_hf_dir
from model_zoo.models import build_model, create_model, resident_bytes
from parallel.linear import ColumnParallelLinear, LinearBase, ReplicatedLinear, RowParallelLinear
from parallel.quant import fp8_block, fp_methods, mxfp4
from parallel.quant.base import QuantizedTensor
from parallel.quant.fp_methods import ExpertWeights, Fp8Block
from parallel.state import assume_tp
from server import plan

V = CONFIG["vocab_size"]


@pytest.fixture(scope="module")
def tiny_fp(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_v4_fp")
    torch.manual_seed(0)
    m = build_model(CONFIG)
    randomise(list(m.named_parameters()) + list(m.named_buffers()), CONFIG["n_routed_experts"],
              CONFIG["num_experts_per_tok"])
    q, _ = quantise_checkpoint(m.state_dict())
    save_file({k: v.contiguous() for k, v in q.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CONFIG))
    return str(d), q


def load(path, stored: bool, tp: int = 1, rank: int = 0):
    src = open_hf_dir(path)
    with assume_tp(tp, rank):
        if stored:
            return create_model(src.config, torch.float32, "cpu", src.weights(stored=True), stored=src.stored)
        return create_model(src.config, torch.float32, "cpu", src.weights())


def stored_layers(model):
    return {n: m for n, m in model.named_modules() if getattr(m, "quant", None) is not None
            and m.quant.name != "dense"}


# ---------------------------------------------------------------- loader

def test_stored_formats_from_headers(tiny_fp):
    path, q = tiny_fp
    src = open_hf_dir(path)
    fp8 = {k for k, v in q.items() if v.dtype == torch.float8_e4m3fn}
    fp4 = {k for k, v in q.items() if k.endswith(".weight") and v.dtype == torch.uint8}
    assert src.stored == {**{k: "fp8" for k in fp8}, **{k: "mxfp4" for k in fp4}}
    E, L = CONFIG["n_routed_experts"], CONFIG["num_hidden_layers"] + 1
    assert len(fp4) == 3 * E * L and any(k.startswith("mtp.0.attn.") for k in fp8)
    got = dict(src.weights(stored=True))
    assert not any(k.endswith(".scale") and k[:-len(".scale")] + ".weight" in src.stored for k in got)
    for k, fmt in src.stored.items():
        t = got[k]
        assert isinstance(t, QuantizedTensor) and t.fmt == fmt
        assert torch.equal(t.scale.view(torch.uint8) if fmt == "mxfp4" else t.scale,
                           q[k[:-len(".weight")] + ".scale"].view(torch.uint8) if fmt == "mxfp4"
                           else q[k[:-len(".weight")] + ".scale"])
        w = q[k]
        assert t.shape == ((w.shape[0], 2 * w.shape[1]) if fmt == "mxfp4" else tuple(w.shape))
    plain = dict(src.weights())
    assert len(plain) == len(q) and all(not isinstance(v, QuantizedTensor) for v in plain.values())


# ---------------------------------------------------------------- through the engine

def test_engine_fp8_equals_dequantized_model(tiny_fp):
    path, _ = tiny_fp
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, V, (n,), generator=g).tolist() for n in (23, 61, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=5, logprobs=5)
    dense = LLM(path, block_size=4)
    quant = LLM(path, block_size=4, quantization="fp8")
    ref, out = dense.generate(ps, params), quant.generate(ps, params)
    worst = 0.0
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            worst = max(worst, max(abs(la[t] - lb[t]) for t in la))
    print(f"fp8/fp4 resident vs dequantized: max |logprob diff| {worst:.1e}")
    assert worst <= 1e-6

    # resident bytes, from the allocated tensors
    md, mq = dense.core.model, quant.core.model
    layers = stored_layers(mq)
    assert {type(m.quant).__name__ for m in layers.values()} == {"Fp8Block", "ExpertWeights"}
    saved = 0
    for name, m in layers.items():
        q, d = m.quant, md.get_submodule(name)
        if isinstance(q, ExpertWeights):
            params = d.gate_up_proj.numel() + d.down_proj.numel()
            assert q.nbytes(m) == params * 0.53125, name
            saved += params * 4 - q.nbytes(m)
        else:
            n, k = d.weight.shape
            assert q.nbytes(m) == n * k + 4 * -(-n // 128) * -(-k // 128), name     # e4m3 + fp32 scales
            saved += n * k * 4 - q.nbytes(m)
    assert quant.core.resident_bytes == resident_bytes(mq) == dense.core.resident_bytes - saved
    ex = sum(m.quant.nbytes(m) for m in layers.values() if isinstance(m.quant, ExpertWeights))
    fp8 = [m for m in layers.values() if isinstance(m.quant, Fp8Block)]
    fp8_params = sum(m.quant.n * m.quant.k for m in fp8)
    print(f"resident: {dense.core.resident_bytes} B dequantized (fp32) -> {quant.core.resident_bytes} B; "
          f"experts {ex} B = 0.53125 B/param; fp8 layers {sum(m.quant.nbytes(m) for m in fp8) / fp8_params:.4f} "
          f"B/param (tiny matrices: one fp32 scale per <= 128x128)")


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_measures_what_a_load_allocates(tiny_fp, tp):
    """`tqserve plan`'s weight bytes (server.plan.measure_weights: a meta-device
    build fed empty meta tensors) equal what loading the real checkpoint
    allocates, per rank; and the fp8 default is the official checkpoints'
    layout (compressor kv / gate projections stay dense)."""
    path, _ = tiny_fp
    src = open_hf_dir(path)
    for rank in range(tp):
        loaded = resident_bytes(load(path, stored=True, tp=tp, rank=rank))
        measured = plan.measure_weights(src.config, tp, "float32", "fp8", fmts=src.stored, rank=rank)
        assert measured == loaded, (tp, rank)
    with torch.device("meta"):
        official = ckpt.official_formats(build_model(CONFIG))
    stored = {ckpt.model_name(k): f for k, f in src.stored.items()}
    assert official.items() < stored.items()
    assert set(stored) - set(official) == {
        k for k in stored if ".compressor." in k and not k.endswith("indexer.q_b_proj.weight")}
    assert plan.measure_weights(CONFIG, 1, "float32", "fp8") < 0.5 * plan.measure_weights(CONFIG, 1, "float32")


def test_bf16_model_equals_dequantized(tiny_fp):
    """In bf16 too: the kernels round each dequantized weight once, as the
    loader's fp32 dequantization cast to bf16 does."""
    path, _ = tiny_fp
    src = open_hf_dir(path)
    dense = create_model(src.config, torch.bfloat16, "cpu", src.weights())
    quant = create_model(src.config, torch.bfloat16, "cpu", src.weights(stored=True), stored=src.stored)
    ids = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        a = dense.compute_logits(dense(ids, torch.arange(30), None))
        b = quant.compute_logits(quant(ids, torch.arange(30), None))
    assert torch.equal(a, b)


def test_fp8_bytes_per_parameter_at_scale():
    """A full-size FP8 matrix: 1 + 4/128^2 bytes per parameter, measured."""
    layer = ReplicatedLinear(2048, 1024, bias=False)
    layer.use_quant(Fp8Block.for_layer(layer))
    w8 = torch.zeros(1024, 2048, dtype=torch.float8_e4m3fn)
    layer.weight_loader(layer.weight, QuantizedTensor("fp8", w8, (1024, 2048), torch.ones(8, 16)))
    assert layer.quant.nbytes(layer) / (1024 * 2048) == 1 + 4 / 128 ** 2      # 1.000244


# ---------------------------------------------------------------- tensor parallel

def test_tensor_parallel_shards_are_the_dense_ones(tiny_fp):
    path, _ = tiny_fp
    for rank in range(2):
        dense, quant = load(path, False, 2, rank), load(path, True, 2, rank)
        layers = stored_layers(quant)
        assert any(isinstance(m, ColumnParallelLinear) for m in layers.values())
        assert any(isinstance(m, RowParallelLinear) for m in layers.values())
        for name, m in layers.items():
            d = dense.get_submodule(name)
            if isinstance(m.quant, ExpertWeights):
                assert m.first == rank * m.num_local
                w13, w2 = m.quant.w13, m.quant.w2
                assert torch.equal(mxfp4.dequantize(*w13), d.gate_up_proj)
                assert torch.equal(mxfp4.dequantize(*w2), d.down_proj)
            else:
                assert torch.equal(fp8_block.dequantize(m.quant.w8, m.quant.scale), d.weight), name


@pytest.mark.parametrize("cls,shape", [(ColumnParallelLinear, (200, 512)), (RowParallelLinear, (512, 200))])
def test_fp8_block_aligned_split_and_ragged_blocks(cls, shape):
    """Two ranks of a [512, 200] / [200, 512] layer: 256 rows / columns each
    (two scale blocks), the 200-wide side ragged (a partial last block)."""
    i, o = shape
    g = torch.Generator().manual_seed(3)
    w8 = (torch.randn(o, i, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-o // 128), -(-i // 128), generator=g) * 0.02 + 0.001
    full = fp8_block.dequantize(w8, scale)
    x = torch.randn(5, i, generator=g)
    parts = []
    for rank in range(2):
        with assume_tp(2, rank):
            layer = cls(i, o)
        layer.use_quant(Fp8Block.for_layer(layer))
        layer.weight_loader(layer.weight, QuantizedTensor("fp8", w8, (o, i), scale))
        dense = full[rank * o // 2:(rank + 1) * o // 2] if cls is ColumnParallelLinear else \
            full[:, rank * i // 2:(rank + 1) * i // 2]
        assert torch.equal(fp8_block.dequantize(layer.quant.w8, layer.quant.scale), dense)
        xr = x if cls is ColumnParallelLinear else x[:, rank * i // 2:(rank + 1) * i // 2]
        y = layer.quant.matmul(layer, xr)
        assert torch.equal(y, F.linear(xr, dense))
        parts.append(y)
    y = torch.cat(parts, -1) if cls is ColumnParallelLinear else parts[0] + parts[1]
    torch.testing.assert_close(y, F.linear(x, full), rtol=1e-5, atol=1e-5)


def test_grouped_matmul_triton_per_group():
    """o_a_proj with 128-aligned groups: one Triton matmul per group (interpreter) vs the dequantized einsum."""
    g = torch.Generator().manual_seed(9)
    w8 = (torch.randn(256, 96, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 1, generator=g) * 0.02 + 0.001
    layer = ReplicatedLinear(96, 256, bias=False)
    layer.use_quant(Fp8Block.for_layer(layer))
    layer.weight_loader(layer.weight, QuantizedTensor("fp8", w8, (256, 96), scale))
    x = torch.randn(3, 2, 96, generator=g)
    ref = torch.einsum("tgi,goi->tgo", x, fp8_block.dequantize(w8, scale).view(2, 128, 96))
    assert torch.equal(layer.quant.grouped_matmul(x, 2), ref)
    fp_methods.BACKEND = "triton"
    try:
        out = layer.quant.grouped_matmul(x, 2)
    finally:
        fp_methods.BACKEND = None
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_split_off_the_blocks_raises():
    with assume_tp(2, 0), torch.device("meta"):
        col, row = ColumnParallelLinear(64, 384), RowParallelLinear(384, 64)
    with pytest.raises(ValueError, match=r"384 output rows split over 2 tensor-parallel ranks are 192 per rank"):
        col.use_quant(Fp8Block.for_layer(col, "q_b_proj"))
    with pytest.raises(ValueError, match=r"384 input columns split over 2 .* 192 per rank"):
        row.use_quant(Fp8Block.for_layer(row, "o_b_proj"))
    cfg = dict(CONFIG, head_dim=96, partial_rotary_factor=1 / 3)     # q_b_proj: 4 heads x 96 = 384 rows
    with assume_tp(2, 0), torch.device("meta"):
        m = DeepseekV4ForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_b_proj: 384 output rows .* 192 per rank"):
        m.use_stored({"layers.0.attn.wq_b.weight": "fp8"})


# ---------------------------------------------------------------- kernels, MoE path

def test_triton_kernels_on_the_model(tiny_fp, monkeypatch):
    """The whole model (FP8 linears, grouped o_a_proj, FP4 experts) with the
    Triton kernels (interpreter) against the torch path: 6 tokens (GEMV) and
    17 tokens (GEMM tiles)."""
    path, _ = tiny_fp
    m = load(path, True)
    g = torch.Generator().manual_seed(4)
    for n in (6, 17):
        ids = torch.randint(0, V, (n,), generator=g)
        with torch.no_grad():
            ref = m.compute_logits(m(ids, torch.arange(n), None))
            monkeypatch.setattr(fp_methods, "BACKEND", "triton")
            out = m.compute_logits(m(ids, torch.arange(n), None))
            monkeypatch.setattr(fp_methods, "BACKEND", None)
        diff = (out - ref).abs().max().item()
        print(f"triton vs torch, {n} tokens: max |logit diff| {diff:.1e} (scale {ref.abs().max().item():.1f})")
        assert diff < 1e-4 * max(1.0, ref.abs().max().item())


def loop_experts(ex: Experts, x, idx, w):
    """Experts.forward before moe_forward: a Python loop over the experts."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        if not ex.first <= e < ex.first + ex.num_local:
            continue
        tok, slot = torch.where(idx == e)
        gg, u = F.linear(x[tok], ex.gate_up_proj[e - ex.first]).chunk(2, dim=-1)
        h = F.silu(gg.clamp(max=ex.limit)) * u.clamp(min=-ex.limit, max=ex.limit)
        out.index_add_(0, tok, F.linear(h, ex.down_proj[e - ex.first]) * w[tok, slot, None])
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_dense_experts_are_the_old_loop(rank):
    """fp32: bit for bit. bf16: CPU index_add_ sums a token's experts in fp32
    and rounds once, where the loop rounded after each expert: within bf16's
    rounding of the fp32 result."""
    c = dict(n_routed_experts=8, hidden_size=32, moe_intermediate_size=16, swiglu_limit=0.8)
    with assume_tp(2, rank):
        ex = Experts(c)
    g = torch.Generator().manual_seed(6 + rank)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g))
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g))
        x = torch.randn(11, 32, generator=g)
        idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(11)])
        w = torch.rand(11, 3, generator=g)
        ref = loop_experts(ex, x, idx, w)
        assert torch.equal(ex(x, idx, w), ref)
        ex.to(torch.bfloat16)
        xb, wb = x.bfloat16(), w.bfloat16()
        out, loop = ex(xb, idx, wb).float(), loop_experts(ex, xb, idx, wb).float()
        diff = (out - loop).abs()
        print(f"bf16 experts: moe_forward vs the old loop: {int((diff > 0).sum())} of {diff.numel()} values "
              f"differ, by at most {diff.max().item():.1e} (scale {loop.abs().max().item():.1f})")
        assert (diff <= 2 ** -7 * loop.abs()).all()     # one bf16 rounding step apart at most


def test_no_quantization_changes_nothing(tiny_fp):
    path, _ = tiny_fp
    m = load(path, False)
    assert not stored_layers(m)
    assert all(m.quant.name == "dense" for m in m.modules() if isinstance(m, LinearBase))
