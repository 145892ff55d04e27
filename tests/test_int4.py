"""int4 weights: exact repack of 4-bit checkpoints, and the same model output."""
import pytest
import torch

from engine import LLM, SamplingParams
from parallel.int4 import int4_linear, pack_int4


def q4_1_like(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15                      # llama.cpp puts min and max on the grid ends
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.05
    return (q * d + m).view(n, k)


def test_pack_is_exact_for_4bit_groups_and_refuses_others():
    w = q4_1_like(64, 128)
    p = pack_int4(w, torch.float32)
    assert p is not None and p.nbytes < w.numel() * 4 / 4
    x = torch.randn(5, 128)
    torch.testing.assert_close(int4_linear(x, p), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert pack_int4(torch.randn(64, 128), torch.float32) is None
    assert pack_int4(torch.randn(64, 100), torch.float32) is None       # K not a multiple of 32
    xb = x.bfloat16()
    pb = pack_int4(w, torch.bfloat16)
    ref = (xb.float() @ w.t())
    assert (int4_linear(xb, pb).float() - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.fixture(scope="module")
def smol_pair():
    args = dict(kv_cache_memory=64 << 20, max_model_len=512, dtype="bfloat16")
    return LLM("smollm2-135m", **args), LLM("smollm2-135m", quantization="int4", **args)


def test_smollm2_int4_runs_packed_and_agrees(smol_pair):
    dense, packed = smol_pair
    linears = [m for m in packed.core.model.modules() if hasattr(m, "pack_int4")]
    assert linears and all(m.quant.name == "int4" for m in linears)      # every Q4_1 layer
    tok = dense.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False)[:64]
    with torch.no_grad():
        a = dense.core.model.compute_logits(dense.core.model(torch.tensor(ids), torch.arange(len(ids)), None))
        b = packed.core.model.compute_logits(packed.core.model(torch.tensor(ids), torch.arange(len(ids)), None))
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"int4 vs dense bf16: top-1 agreement {agree:.3f}, max |diff| {(a - b).abs().max():.3f}")
    assert agree >= 0.9
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = packed.generate(["The capital of France is"], sp)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text.strip()


def test_int4_needs_bf16():
    with pytest.raises(ValueError, match="bfloat16"):
        LLM("smollm2-135m", quantization="int4")
