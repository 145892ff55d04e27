"""The compiled CPU row ops (model_zoo/cpu_ops.py) against the torch code
they replace (the layers' forward_native): RMSNorm (Llama and Gemma forms,
whole rows and per head on a strided projection view), rotary embedding,
SiLU / GELU-tanh gated activations; fp32 and bf16; a row's result does not
depend on the batch; TQSERVE_CPU_OPS=torch (cpu_ops.ENABLED) runs the torch
code."""
import pytest
import torch

from model_zoo import cpu_ops
from model_zoo.layers import GeluAndMul, GemmaRMSNorm, RMSNorm, RotaryEmbedding, SiluAndMul

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _kernel_built():
    assert cpu_ops._lib() is not None, "the CPU row-ops kernel did not build (see the log)"


def _norm(cls, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = cls(d, 1e-5)
    n.weight.data = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)
    return n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", (RMSNorm, GemmaRMSNorm))
@pytest.mark.parametrize("rows,d", ((1, 576), (37, 576), (3, 100), (600, 640)))
def test_rms_norm(cls, dtype, rows, d):
    n = _norm(cls, d, dtype)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    got, want = n.forward_cpu(x), n.forward_native(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        # Same roundings as torch; only the sum of squares' order differs, which can
        # move a value across a bf16 rounding boundary: one ulp, rarely.
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_strided_view(dtype):
    # q of a fused qkv output: rows at the qkv width's stride, heads within.
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = qkv[:, :9 * 64].view(5, 9, 64)
    assert not q.is_contiguous()
    n = _norm(RMSNorm, 64, dtype)
    got, want = n.forward_cpu(q), n.forward_native(q)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-6 if dtype == torch.float32 else 2 ** -7,
                               atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_rope_equals_torch(dtype, head_dim):
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    T, H = 7, 4
    qkv = torch.randn(T, 3 * H * head_dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = qkv[:, :H * head_dim]                      # a view at qkv's row stride
    cos, sin = rope._cos_sin(torch.tensor([0, 1, 5, 100, 1000, 4095, 70000]), dtype)
    got = cpu_ops.rope(q, head_dim, cos, sin)
    cpu_ops.ENABLED = False
    try:
        want = rope._rotate(q, cos, sin)
    finally:
        cpu_ops.ENABLED = True
    # The same products and sums, rounded where torch rounds: bitwise equal.
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", (SiluAndMul(), GeluAndMul()))
def test_gated_activations(act, dtype):
    x = torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(4)).to(dtype) * 4
    got, want = cpu_ops.act_and_mul(x, cpu_ops.SILU if isinstance(act, SiluAndMul) else cpu_ops.GELU_TANH), \
        act.forward_native(x)
    assert got.shape == want.shape == (9, 1536)
    scale = want.float().abs().max()
    if dtype == torch.float32:
        # exp from a polynomial (~1 ulp) rather than torch's; products as torch.
        assert (got - want).abs().max() <= 1e-6 * scale
    else:
        # Whole-ulp steps of bf16 where the fp32 activation sits near a rounding boundary.
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_batch(dtype):
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(5)).to(dtype)
    n = _norm(RMSNorm, 576, dtype)
    act = SiluAndMul()
    xa = torch.randn(16, 2 * 288, generator=torch.Generator().manual_seed(6)).to(dtype)
    for i in (0, 7, 15):
        assert torch.equal(n.forward_cpu(x)[i], n.forward_cpu(x[i:i + 1])[0])
        assert torch.equal(act.forward_cpu(xa)[i], act.forward_cpu(xa[i:i + 1])[0])


def test_dispatch():
    n = _norm(RMSNorm, 64, torch.float32)
    x = torch.randn(2, 64)
    assert cpu_ops.runs(x)
    assert not cpu_ops.runs(x.half()) and not cpu_ops.runs(x.t())
    # Autograd through a layer (engine/kv_calibration.py) takes the torch code.
    xg = x.clone().requires_grad_()
    assert not cpu_ops.runs(xg)
    n(xg).sum().backward()
    assert xg.grad is not None
    cpu_ops.ENABLED = False
    try:
        assert not cpu_ops.runs(x)
        assert torch.equal(n(x), n.forward_native(x))
    finally:
        cpu_ops.ENABLED = True
    assert n(torch.empty(0, 64)).shape == (0, 64)
    # fp32 weight, bf16 activations: torch's product is fp32, and so is the layer's.
    assert n(x.bfloat16()).dtype == torch.float32
