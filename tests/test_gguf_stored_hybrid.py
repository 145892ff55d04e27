"""`--quantization gguf` on Qwen3-Next, Qwen3.5 (dense, with an MTP block, and
MoE) and Gemma 4 (dense with per-layer inputs and KV sharing, and MoE) GGUF
files: the quantized blocks stay resident (parallel/quant/base.py GGUFBlocks,
GGUFExperts), written by test_gguf_hybrid.py's llama.cpp-layout writers in
Q8_0, Q4_0 and Q4_K (rows not a whole number of 256-blocks in Q4_0: a
32-block type, as llama-quantize falls back to, here with Q4_K's 0.5625 bytes
per weight):

  - every linear / embedding layer holds the file's blocks (counted), bar
    the ones that stay dense by design (Qwen's one-row shared_expert_gate;
    Gemma 4's router, F32 in llama.cpp's files), with the format's bytes per
    weight (Q8_0 1.0625, Q4_0 and Q4_K 0.5625) and no dense copy; the model's
    resident bytes (model_zoo.models.resident_bytes) are the dense load's
    less exactly those layers' savings;
  - logits equal the same file loaded dequantized (fp32): prefill of 70
    tokens (each layer dequantized, then F.linear) within 1e-5 of the largest
    |logit| (measured: 0 for qwen3next and Gemma 4, <= 5e-6 where Qwen3.5's
    out_proj reads its input reordered, or the experts run per expert); 9
    tokens (the fused CPU GEMV, whose sums differ from F.linear's in order
    only: tests/test_gguf_cpu.py) within 1e-4 for Qwen (measured <= 1.4e-5) and
    5e-4 for Gemma 4 (measured <= 1.1e-4): these tiny random Gemma 4 models
    amplify rounding, their dense fp32 logits are 4e-5 .. 9e-4 of the largest
    from an fp64 run's;
  - through the engine (quantization gguf vs none) greedy tokens are equal
    for 16 tokens, and quantization auto picks gguf;
  - the MTP head appended to a Qwen3.5 file keeps its blocks, and drafts;
  - the converter's reorders inside rows are undone or matched on blocks with
    mixed types (qwen3next's attn_qkv / attn_gate of two types, a dense
    out_proj beside block in_proj_qkv, an expert stack with an F16 part)."""
import gguf
import pytest
import torch
from test_gguf_hybrid import GEMMA4, gemma4_hf, logits, mtp_head, prompt, qwen_hf, write_gemma4, write_qwen

from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from model_zoo.fused_moe import RoutedExperts
from model_zoo.gguf_file import GGUFFile
from model_zoo.gguf_loader import open_gguf
from model_zoo.models import create_model, resident_bytes
from parallel.linear import LinearBase, VocabParallelEmbedding
from parallel.quant.base import GGUFBlocks, GGUFExperts
from parallel.quant.gguf import QTYPES, row_bytes

# Hidden size 256 so that Q4_K (256-blocks) holds the projections that read the
# hidden state; every other row length here is a multiple of 32 (Qwen's shared
# expert 64 wide for that), so no tensor falls back to F16.
HIDDEN = 256
QWEN_EXTRA = {"qwen3next": dict(hidden_size=HIDDEN, shared_expert_intermediate_size=64),
              "qwen35": dict(hidden_size=HIDDEN),
              "qwen35moe": dict(hidden_size=HIDDEN, shared_expert_intermediate_size=64)}
GEMMA4_CONFIG = {"gemma4": dict(GEMMA4["dense"], hidden_size=HIDDEN, hidden_size_per_layer_input=32),
                 "gemma4-moe": dict(GEMMA4["moe"], hidden_size=HIDDEN)}
# Layers holding blocks (GGUFBlocks, GGUFExperts), from the configs (4 Qwen layers, linear
# attention in 0 and 2; 8 Gemma 4 layers, 6 for the MoE one):
#   qwen3next   DeltaNet in_proj_qkv, in_proj_z, in_proj_ba, out_proj (x2); attention qkv, o (x2);
#               shared expert gate_up, down (x4); embedding, head: 22; experts x4
#   qwen35      in_proj_qkv, _z, _b, _a, out_proj (x2); qkv, o (x2); MLP gate_up, down (x4);
#               embedding, head: 24; the MTP head's fc, qkv, o, gate_up, down: 5
#   qwen35moe   as qwen35 with shared experts for the MLP: 24; experts x4
#   gemma4      qkv, o, MLP gate_up, down, per-layer input gate and projection (x8); embedding,
#               tied head (the same blocks), per-layer embedding and model projection: 52
#   gemma4-moe  qkv, o, gate_up, down (x6); embedding, tied head: 26; experts x6
HELD = {"qwen3next": 22 + 4, "qwen35": 24 + 5, "qwen35moe": 24 + 4, "qwen35moe-fused": 24 + 4,
        "gemma4": 52, "gemma4-moe": 26 + 6}
DENSE_BY_DESIGN = ("shared_expert_gate", "router.proj")
BPP = {"Q8_0": 1.0625, "Q4_0": 0.5625, "Q4_K": 0.5625}
PREFILL_TOL = 1e-5
DECODE_TOL = {"qwen": 1e-4, "gemma4": 5e-4}


def write(case: str, qtype: str, path, mix=None):
    """case's file in qtype (mix: test_gguf_hybrid.finish's); returns its path."""
    if case.startswith("gemma4"):
        config = GEMMA4_CONFIG[case]
        write_gemma4(path, gemma4_hf(f"stored-{case}", config), config, qtype, mix=mix)
    else:
        arch = case.removesuffix("-fused")
        hf = qwen_hf(arch, **QWEN_EXTRA[arch])
        write_qwen(path, hf, arch, qtype, fused=case.endswith("-fused"),
                   mtp=mtp_head(hf) if arch == "qwen35" else False, mix=mix)
    return path


def load_both(path):
    """(source, the file dequantized, the file's blocks kept)."""
    src = open_gguf(path)
    dense = create_model(src.config, torch.float32, "cpu", src.weights())
    stored = create_model(src.config, torch.float32, "cpu", src.weights(stored=True), stored=src.stored)
    return src, dense, stored


def held(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant", None), (GGUFBlocks, GGUFExperts))}


def logits_diff(dense, stored, vocab: int) -> dict[int, float]:
    """Largest |logit difference| / largest |logit|, per prompt length."""
    out = {}
    for n in (70, 9):
        ids = prompt(vocab, n)
        a, b = logits(dense, ids), logits(stored, ids)
        out[n] = float((a - b).abs().max() / a.abs().max())
    return out


def check_logits(dense, stored, vocab: int, what: str) -> dict[int, float]:
    d = logits_diff(dense, stored, vocab)
    print(f"{what}: max |logit diff| / max |logit|: prefill 70 {d[70]:.1e}, 9 tokens (GEMV) {d[9]:.1e}")
    family = "gemma4" if what.startswith("gemma4") else "qwen"
    assert d[70] <= PREFILL_TOL and d[9] <= DECODE_TOL[family], (what, d)
    return d


CASES = ["qwen3next", "qwen35", "qwen35moe", "gemma4", "gemma4-moe"]


# fused gate + up experts (ffn_gate_up_exps): one type is enough
@pytest.mark.parametrize("case,qtype", [(c, q) for c in CASES for q in BPP] + [("qwen35moe-fused", "Q4_K")])
def test_layers_hold_the_files_blocks(case, qtype, tmp_path):
    src, dense, stored = load_both(write(case, qtype, tmp_path / f"{case}-{qtype}.gguf"))
    assert src.stored and set(src.stored.values()) == ({"Q4_K", "Q4_0"} if qtype == "Q4_K" else {qtype})
    layers = held(stored)
    linear = {n for n, m in stored.named_modules()
              if isinstance(m, (LinearBase, VocabParallelEmbedding, RoutedExperts))}
    assert set(layers) == {n for n in linear if not n.endswith(DENSE_BY_DESIGN)}, sorted(linear ^ set(layers))
    assert len(layers) == HELD[case]
    saved = 0
    for n, m in layers.items():
        q = m.quant
        if isinstance(q, GGUFExperts):
            assert m.gate_up_proj.numel() == 0 and m.down_proj.numel() == 0      # no dense copy
            for part, t in q.parts.items():
                k = q.H if part != "down" else q.I
                fmt = q.qtypes[part]
                assert fmt == ("Q4_K" if qtype == "Q4_K" and k % 256 == 0 else "Q4_0" if qtype == "Q4_K" else qtype)
                assert t.dtype == torch.uint8 and t.shape[2] == row_bytes(fmt, k)
                assert t.numel() / (t.shape[0] * t.shape[1] * k) == BPP[qtype]
                saved += t.shape[0] * t.shape[1] * k * 4 - t.numel()
            continue
        assert m.weight.numel() == 0, n                                         # no dense copy
        if id(q) in {id(layers[o].quant) for o in layers if o < n}:
            continue                                                            # the tied head: counted once
        for s in q.shards.values():
            want = "Q4_K" if qtype == "Q4_K" and q.k % 256 == 0 else "Q4_0" if qtype == "Q4_K" else qtype
            assert s.fmt == want, (n, s.fmt)
            assert s.data.dtype == torch.uint8 and s.data.shape == (s.rows, row_bytes(s.fmt, q.k)), n
            assert s.data.numel() / (s.rows * q.k) == BPP[qtype] == QTYPES[s.fmt].bytes_per_param
            saved += s.rows * q.k * 4 - s.data.numel()
    assert resident_bytes(stored) == resident_bytes(dense) - saved
    print(f"{case} {qtype}: {len(layers)} layers hold blocks; resident {resident_bytes(stored)} B vs "
          f"{resident_bytes(dense)} B dense ({resident_bytes(stored) / resident_bytes(dense):.3f})")
    if case.startswith("qwen35"):       # Qwen3.5's value heads outnumber the key heads: out_proj's columns tiled
        assert all(layer.linear_attn.out_tiled for layer in stored.model.layers if layer.linear)
    if case == "qwen3next":             # the file's split qkvz
        assert all(layer.linear_attn.split_qkvz for layer in stored.model.layers if layer.linear)
        assert not any("in_proj_qkvz" in name for name in src.stored)
    check_logits(dense, stored, src.config["vocab_size"], f"{case} {qtype}")
    if case == "qwen35":                # the MTP head's drafts from the same hidden states
        ids, pos = prompt(src.config["vocab_size"]), torch.arange(70)
        with torch.no_grad():
            h = dense(ids, pos, None)
            a, b = (m.compute_logits(m.mtp_streams(ids, h, pos, None)) for m in (dense, stored))
        assert (a - b).abs().max() <= PREFILL_TOL * a.abs().max()


@pytest.mark.parametrize("case", CASES)
def test_engine_greedy_tokens_equal_the_dequantized_engine(case, tmp_path):
    path = write(case, "Q4_K", tmp_path / f"{case}-Q4_K.gguf")
    src = open_gguf(path)
    # quantization auto on the CPU keeps the blocks
    assert EngineArgs(model=str(path), device="cpu").resolved(src.stored).quantization == "gguf"
    args = dict(dtype="float32", block_size=4, kv_cache_memory=16 << 20, max_model_len=256, max_num_seqs=4)
    dense = LLM(str(path), quantization="none", **args)
    blocks = LLM(str(path), quantization="gguf", **args)
    assert len(held(blocks.core.model)) == HELD[case]
    assert blocks.core.resident_bytes < 0.2 * dense.core.resident_bytes
    vocab = src.config["vocab_size"]
    prompts = [[int(t) for t in torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 23, 41)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    a, b = dense.generate(prompts, sp), blocks.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_mtp_head_keeps_blocks_and_drafts(tmp_path):
    path = write("qwen35", "Q8_0", tmp_path / "qwen35-mtp.gguf")
    args = dict(dtype="float32", quantization="gguf", block_size=4, kv_cache_memory=4 << 20, max_model_len=128,
                max_num_seqs=2)
    spec = LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **args)
    model = spec.core.model
    assert model.mtp_loaded
    mtp = {n for n in held(model) if n.startswith("mtp.")}
    assert mtp == {"mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.self_attn.o_proj",
                   "mtp.layers.0.mlp.gate_up_proj", "mtp.layers.0.mlp.down_proj"}
    vocab = model.config["vocab_size"]
    prompts = [[int(t) for t in torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (7, 13)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(str(path), **args).generate(prompts, sp)
    out = spec.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert spec.core.get_stats().spec_decode_num_draft_tokens_total > 0


# Files mixing types as llama-quantize's K_M mixes do, with the parts that meet in one layer
# (or one transform) in different types.
MIXED = {
    # attn_qkv bumped to Q8_0 beside a Q4_K attn_gate (the two halves of in_proj_qkvz), ssm_ba F16
    "qwen3next": {"attn_qkv.weight": "Q8_0", "ssm_ba.weight": "F16"},
    # out_proj F16: dequantized with its columns untiled (out_tiled off) beside block in_proj_qkv
    "qwen35": {"ssm_out.weight": "F16", "attn_qkv.weight": "Q8_0"},
    # an expert stack with an F16 part: the whole stack dense
    "qwen35moe": {"ffn_down_exps.weight": "F16"},
}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_types(case, tmp_path):
    mix = MIXED[case]
    src, dense, stored = load_both(write(case, "Q4_K", tmp_path / f"{case}-mixed.gguf", mix))
    layers = held(stored)
    delta = [layer.linear_attn for layer in stored.model.layers if layer.linear]
    if case == "qwen3next":
        for d in delta:
            assert [s.fmt for s in d.in_proj_qkv.quant.shards.values()] == ["Q8_0"]
            assert [s.fmt for s in d.in_proj_z.quant.shards.values()] == ["Q4_K"]
            assert d.in_proj_ba.weight.numel() > 0 and not isinstance(d.in_proj_ba.quant, GGUFBlocks)
    elif case == "qwen35":
        for d in delta:
            assert not d.out_tiled and d.out_proj.weight.numel() > 0
            assert isinstance(d.in_proj_qkv.quant, GGUFBlocks) and isinstance(d.in_proj_z.quant, GGUFBlocks)
    else:
        assert not any(isinstance(m.quant, GGUFExperts) for m in layers.values())
        assert not any("experts" in name for name in src.stored)
    assert layers
    check_logits(dense, stored, src.config["vocab_size"], f"{case} mixed {mix}")


def test_split_qkvz_model_takes_a_merged_checkpoint(tmp_path):
    """A qwen3next model with the GGUF layout (in_proj_qkv + in_proj_z) also loads a
    checkpoint's in_proj_qkvz (the dense stream): the same logits."""
    src = open_gguf(write("qwen3next", "Q8_0", tmp_path / "qwen3next.gguf"))
    dense = create_model(src.config, torch.float32, "cpu", src.weights())
    names = {n: f for n, f in src.stored.items() if ".linear_attn." in n}
    split = create_model(src.config, torch.float32, "cpu", src.weights(), stored=names)
    assert all(layer.linear_attn.split_qkvz for layer in split.model.layers if layer.linear)
    assert logits_diff(dense, split, src.config["vocab_size"])[70] <= PREFILL_TOL


def test_what_stays_dense_is_not_offered(tmp_path):
    """ModelSource.stored (what --quantization gguf may keep) names the layers' tensors only:
    no norm, router, conv kernel, A_log, dt_bias, shared-expert gate or Gemma 4 scale."""
    for case in ("qwen35moe", "gemma4"):
        src = open_gguf(write(case, "Q8_0", tmp_path / f"{case}.gguf"))
        quantized = {t.name for t in GGUFFile(src.path).tensors
                     if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)}
        assert len(src.stored) <= len(quantized)
        assert not [n for n in src.stored if n.endswith(("norm.weight", "mlp.gate.weight", "conv1d.weight", "A_log",
                                                        "dt_bias", "shared_expert_gate.weight", "scale",
                                                        "layer_scalar"))]
