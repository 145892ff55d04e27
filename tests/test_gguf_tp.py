"""GGUF blocks under tensor parallelism (`--quantization gguf` with
--tensor-parallel-size 2): each rank keeps its part of every quantized
tensor as stored, cut the way the parallel layers cut a dense one
(QuantizedTensor.narrow): a column-parallel rank its rows, a row-parallel
one its input columns on the type's block boundaries, the vocabulary its
range (the last rank's padding rows zero blocks).

  - narrow / zero_padded against the whole tensor dequantized, every type;
  - every rank's layers hold exactly the dense model's shard (rank 0 and 1
    built in this process), tiny Qwen3-MoE (odd vocabulary, routed experts
    by id) and llama (q/k rows permuted by llama.cpp) files;
  - two gloo ranks: logits equal one rank's, prefill (the dequantizing
    path) and a few rows (the fused GEMV);
  - a row-parallel split inside a block is one startup error naming the
    numbers, before any rank waits.
"""
import gguf
import numpy as np
import pytest
import torch
from fixtures_models import write_tiny_gguf
from spawn_ranks import run_ranks
from test_gguf_moe import CONFIG as MOE_CONFIG, write_gguf
from test_gguf_stored_hybrid import write as write_hybrid
from test_model_parity import make_hf_model

from model_zoo.gguf_loader import open_gguf
from model_zoo.models import build_model, create_model
from parallel.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding
from parallel.quant import gguf as qgguf
from parallel.quant.base import GGUFBlocks, GGUFExperts, QuantizedTensor
from parallel.state import assume_tp

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")      # gguf-py quantizes these; the k-quants get random bytes
VOCAB = 259                                          # odd: rank 1 holds a zero padding row


def blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in QUANTIZABLE:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)
    else:
        data = rng.integers(0, 256, size=(rows, qgguf.row_bytes(qtype, cols)), dtype=np.uint8)
        data[:, :2] = 0x3c      # finite fp16 scales where the type leads with them
    return torch.from_numpy(np.ascontiguousarray(data))


def dequant(q: QuantizedTensor) -> torch.Tensor:
    return qgguf.dequantize(q.data.contiguous(), q.fmt, q.shape[1])


@pytest.mark.parametrize("qtype", list(qgguf.QTYPES))
def test_narrow_is_the_dequantized_slice(qtype):
    block = qgguf.QTYPES[qtype].block
    q = QuantizedTensor(qtype, blocks(qtype, 6, 4 * block), (6, 4 * block))
    full = dequant(q)
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dequant(q.narrow(0, 2, 3)), full[2:5], **same)
    torch.testing.assert_close(dequant(q.narrow(1, block, 2 * block)), full[:, block:3 * block], **same)
    assert q.narrow(1, 0, 4 * block) is q
    padded = q.narrow(0, 4, 2).zero_padded(5)
    assert padded.shape == (5, 4 * block)
    torch.testing.assert_close(dequant(padded)[:2], full[4:], **same)
    assert torch.equal(dequant(padded)[2:], torch.zeros(3, 4 * block))      # zero blocks are zeros
    with pytest.raises(ValueError, match=rf"columns 16\.\.{16 + block} do not fall on its {block}-element blocks"):
        q.narrow(1, 16, block)


def test_fp8_narrow_keeps_the_scale_blocks():
    g = torch.Generator().manual_seed(1)
    w8 = torch.randn(300, 64, generator=g).to(torch.float8_e4m3fn)
    q = QuantizedTensor("fp8", w8, (300, 64), torch.rand(3, 1, generator=g))
    part = q.narrow(0, 256, 44)                       # the ragged last block
    assert torch.equal(part.scale, q.scale[2:]) and part.shape == (44, 64)
    assert torch.equal(q.narrow(1, 32, 32).scale, q.scale)     # 64 columns: one block whole
    with pytest.raises(ValueError, match=r"rows 100\.\.200 do not fall on the 128-wide scale blocks"):
        q.narrow(0, 100, 100)


# ---------------------------------------------------------------- whole models, one rank at a time

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_tp")
    moe = d / "tiny-qwen3moe-q8.gguf"
    write_gguf(moe, make_hf_model(dict(MOE_CONFIG, vocab_size=VOCAB)), "Q8_0")
    llama = d / "tiny-llama-q4_0.gguf"
    write_tiny_gguf(llama, qtype="Q4_0")
    gemma4 = write_hybrid("gemma4", "Q8_0", d / "tiny-gemma4-q8.gguf")
    return {"qwen3moe": moe, "llama": llama, "gemma4": gemma4}


def load(path, quantization: str, tp: int = 1, rank: int = 0):
    src = open_gguf(path)
    with assume_tp(tp, rank):
        if quantization == "gguf":
            return create_model(src.config, torch.float32, "cpu", src.weights(stored=True), stored=src.stored)
        return create_model(src.config, torch.float32, "cpu", src.weights())


def held(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant", None), (GGUFBlocks, GGUFExperts))}


def dense_weight(m) -> torch.Tensor:
    """A GGUFBlocks layer's weight dequantized, shard by shard in row order."""
    q = m.quant
    return torch.cat([qgguf.dequantize(s.data, s.fmt, q.k) if s.fmt else s.data for s in q.shards.values()])


@pytest.mark.parametrize("name", ["qwen3moe", "llama", "gemma4"])
def test_each_rank_holds_the_dense_models_shard(files, name):
    one = sum(m.quant.nbytes(m) for m in held(load(files[name], "gguf")).values())
    per_rank = []
    for rank in range(2):
        dense, ours = load(files[name], "none", 2, rank), load(files[name], "gguf", 2, rank)
        layers = held(ours)
        for kind in (QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding):
            assert any(isinstance(m, kind) for m in layers.values()), kind
        for n, m in layers.items():
            d = dense.get_submodule(n)
            if isinstance(m.quant, GGUFExperts):
                assert m.first == rank * m.num_local
                for part, qt in m.quant.parts.items():
                    got = qgguf.dequantize(qt.flatten(0, 1), m.quant.qtypes[part],
                                           m.hidden if part != "down" else m.inter)
                    want = d.gate_up_proj.chunk(2, dim=1)[("gate", "up").index(part)] if part != "down" \
                        else d.down_proj
                    assert torch.equal(got, want.flatten(0, 1)), (n, part)
            else:
                assert m.weight.numel() == 0
                assert torch.equal(dense_weight(m), d.weight), n
            for t in m.quant.parts.values() if isinstance(m.quant, GGUFExperts) else \
                    (s.data for s in m.quant.shards.values()):     # no view keeps the whole tensor alive
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), n
        per_rank.append(sum(m.quant.nbytes(m) for m in layers.values()))
    # Every quantized byte lives on exactly one rank, but the vocabulary padding
    # row (qwen3moe: odd vocabulary, untied head: two tables), what every rank
    # holds whole (Gemma 4's per-layer input projections) and the KV heads that
    # fewer KV heads than ranks replicate (Gemma 4: one; each file one type).
    hidden = open_gguf(files[name]).config["hidden_size"]
    pad = 2 * qgguf.row_bytes("Q8_0", hidden) if name == "qwen3moe" else 0
    replicated = 0
    for m in held(load(files[name], "gguf", 2, 0)).values():
        if isinstance(m, ReplicatedLinear):
            replicated += m.quant.nbytes(m)
        elif isinstance(m, QKVParallelLinear) and m.kv_replicas > 1:
            fmt = next(iter(m.quant.shards.values())).fmt
            replicated += (m.quant.n - m.q_size) * qgguf.row_bytes(fmt, m.quant.k)
    print(f"{name}: resident GGUF bytes TP=1 {one}, per rank {per_rank}, replicated KV {replicated}")
    assert sum(per_rank) == one + pad + replicated


def test_row_split_inside_a_block_is_one_error(tmp_path):
    """Q4_K's 256-element blocks: o_proj's 256 input columns over 2 ranks are
    128 each. The meta build (what every rank runs before the rendezvous)
    names the layer and the numbers."""
    path = tmp_path / "tiny-llama-q4_k.gguf"
    write_tiny_gguf(path, qtype="Q4_K")
    src = open_gguf(path)
    with assume_tp(2, 0), torch.device("meta"):
        model = build_model(src.config)
    with assume_tp(2, 0), pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj: GGUF Q4_K: 256 input columns split "
                                         r"over 2 tensor-parallel ranks are 128 per rank, not a multiple of its "
                                         r"256-element blocks"):
        model.use_stored(src.stored)


# ---------------------------------------------------------------- two gloo ranks

def _tp_rank(rank: int, world: int) -> list[str]:
    import os
    lines = []
    for name in ("qwen3moe", "llama", "gemma4"):
        path = os.environ[f"TQ_TEST_GGUF_{name.upper()}"]
        vocab = open_gguf(path).config["vocab_size"]
        ids = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            with assume_tp(1):              # this process's TP=1 model, run with no collectives
                one = load(path, "gguf")
                ref_prefill = one.compute_logits(one(ids, torch.arange(40), None))
                ref_rows = one.compute_logits(one(ids[:5], torch.arange(5), None))
            ours = load(path, "gguf", world, rank)
            assert held(ours)
            prefill = ours.compute_logits(ours(ids, torch.arange(40), None))
            rows = ours.compute_logits(ours(ids[:5], torch.arange(5), None))       # <= 16 rows: fused GEMV
            dense = load(path, "none", world, rank)
            dense_prefill = dense.compute_logits(dense(ids, torch.arange(40), None))
        # Prefill dequantizes each layer then runs F.linear: the dense TP=2 model's numbers.
        d2 = (prefill - dense_prefill).abs().max().item() / dense_prefill.abs().max().item()
        assert d2 < 1e-6, (name, d2)
        d0 = (prefill - ref_prefill).abs().max().item() / ref_prefill.abs().max().item()
        d1 = (rows - ref_rows).abs().max().item() / ref_rows.abs().max().item()
        # Sums split over ranks round differently; Gemma 4's tiny random model amplifies
        # rounding (tests/test_gguf_stored_hybrid.py: 5e-4 for its GEMV rows).
        tol = 5e-4 if name == "gemma4" else 1e-5
        assert prefill.shape == ref_prefill.shape and d0 < tol and d1 < tol, (name, d0, d1)
        lines.append(f"{name} vs one rank: prefill {d0:.1e}, rows {d1:.1e}; vs dense two ranks {d2:.1e}")
    return lines


def test_two_ranks_logits_equal_one_rank(files, monkeypatch):
    for name, path in files.items():
        monkeypatch.setenv(f"TQ_TEST_GGUF_{name.upper()}", str(path))
    for lines in run_ranks(_tp_rank):
        assert [line.split()[0] for line in lines] == ["qwen3moe", "llama", "gemma4"]


def test_qwen3_next_files_stay_whole(tmp_path):
    """llama.cpp's DeltaNet layout (qkvz split in two, Qwen3.5's tiled value
    heads) is not cut across ranks: auto dequantizes under TP, an explicit
    --quantization gguf is one error at the meta build."""
    src = open_gguf(write_hybrid("qwen3next", "Q8_0", tmp_path / "tiny-qwen3next-q8.gguf"))
    assert src.stored and not src.stored_splits
    from engine.engine_args import EngineArgs
    args = EngineArgs(model="x", device="cpu", tensor_parallel_size=2)
    r = args.resolved(src.stored, src.stored_splits)
    assert r.quantization is None and "not split across tensor-parallel ranks" in r.auto_reasons["quantization"]
    assert EngineArgs(model="x", device="cpu").resolved(src.stored, src.stored_splits).quantization == "gguf"
    with assume_tp(2, 0), torch.device("meta"):        # as the worker checks, before the rendezvous
        model = build_model(src.config)
        with pytest.raises(ValueError, match="DeltaNet layout are not split across tensor-parallel ranks yet"):
            model.use_stored(src.stored)
