"""DeepSeek-V4 in the model zoo against transformers' DeepseekV4ForCausalLM (fp32).

Tiny random configs with all three layer types (sliding window 8, CSA ratio 4
with the lightning indexer, HCA at ratio 16 so that a 80-token prompt emits
entries), hash- and score-routed MoE, 4 hyper-connection streams, YaRN on the
compressed branches. Parameters transformers initialises to constants (sinks,
tid2eid, router bias, hc base/scale, position biases, norms) are randomised.

  - full forward (no cache) vs transformers, with index_topk below the number
    of entries (top-k selection, scores checked tie-free at the cut) and above;
  - chunked prefill + token-by-token decode through DSV4SequenceState, and two
    sequences sharing one flat forward;
  - rollback: decode k other tokens, roll back k, decode: identical logits to
    never having decoded them (k crosses window closes of both compressors);
  - MTP head vs an independent reference built from transformers' modules;
  - FP8 / FP4 official-name checkpoint == its dequantised fp32 twin.
"""
import tempfile

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from spawn_ranks import run_ranks
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as HFM

from kvcache.dsv4_state import DSV4Batch
from model_zoo import dsv4_checkpoint as ckpt
from model_zoo.deepseek_v4 import DeepseekV4ForCausalLM
from model_zoo.models import build_model

TOL = 1e-4
N = 80

CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
    vocab_size=128, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
    n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    hc_mult=4, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16,
    index_topk=4, partial_rotary_factor=0.25, max_position_embeddings=128, rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    num_nextn_predict_layers=1)


def randomise(named, n_experts: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in named:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(p.shape[0])]))
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("base", "sinks", "bias", "position_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hf_config(config: dict):
    c = transformers.DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    c._attn_implementation = "eager"
    return c


class Case:
    def __init__(self, **overrides):
        self.config = {**CONFIG, **overrides}
        self.hf = transformers.DeepseekV4ForCausalLM(hf_config(self.config)).eval()
        randomise(list(self.hf.named_parameters()) + list(self.hf.named_buffers()),
                  self.config["n_routed_experts"], self.config["num_experts_per_tok"])
        self.ours = build_model(self.config)
        self.ours.load_weights(self.hf.state_dict().items())
        self.ids = torch.randint(0, self.config["vocab_size"], (N,), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            self.ref = self.hf(input_ids=self.ids[None]).logits[0]

    def step(self, state, ids, start):
        with torch.no_grad():
            n = ids.shape[0]
            return self.ours.compute_logits(self.ours(ids, torch.arange(start, start + n), DSV4Batch([state], [0, n])))


_cases = {}


def case(topk: int) -> Case:
    if topk not in _cases:
        _cases[topk] = Case(index_topk=topk)
    return _cases[topk]


def close(ours, ref, what):
    diff = (ours - ref).abs().max().item()
    print(f"{what}: max |logit diff| = {diff:.2e} (logit scale {ref.abs().max().item():.1f})")
    assert diff < TOL, f"{what}: {diff:.2e}"
    return diff


def test_config_has_everything():
    c = case(4)
    assert c.ours.kv_cache_spec()[3].ratio == 4 and c.ours.kv_cache_spec()[2].ratio == 16
    assert N // 16 >= 4 and N // 4 > 4   # HCA emits entries; CSA has more entries than index_topk
    assert not c.ours.mtp_loaded         # transformers' checkpoint has no MTP


@pytest.mark.parametrize("topk", [4, 64])
def test_full_forward_parity(topk):
    c = case(topk)
    with torch.no_grad():
        out = c.ours.compute_logits(c.ours(c.ids, torch.arange(N), None))
    close(out, c.ref, f"full forward, index_topk={topk}")


def test_topk_selection_has_no_ties():
    """With index_topk=4 < entries, the kept set depends on the scores: check that
    the cut between the k-th and (k+1)-th valid score is never a tie, so the
    parity above is a real test of the selection."""
    c = case(4)
    attn = c.ours.model.layers[1].self_attn
    seen = []
    orig = attn.compressor.indexer.scores

    def record(*a, **k):
        s = orig(*a, **k)
        seen.append(s)
        return s
    attn.compressor.indexer.scores = record
    try:
        with torch.no_grad():
            c.ours(c.ids, torch.arange(N), None)
    finally:
        del attn.compressor.indexer.scores
    scores = seen[0]
    valid = (torch.arange(N) + 1) // 4
    cuts = 0
    for t in range(N):
        v = scores[t, :valid[t]]
        if v.numel() > 4:
            top = v.sort(descending=True).values
            assert (top[3] - top[4]).abs() > 1e-4, f"tie at query {t}"
            cuts += 1
    assert cuts > 40


@pytest.mark.parametrize("topk", [4, 64])
def test_chunked_prefill_and_decode(topk):
    c = case(topk)
    st = c.ours.new_state()
    outs, p = [], 0
    for n in [2, 19, 16, 3] + [1] * (N - 40):   # a first chunk shorter than CSA's ratio, then unaligned
        outs.append(c.step(st, c.ids[p:p + n], p))
        p += n
    close(torch.cat(outs), c.ref, f"chunked prefill + decode, index_topk={topk}")


def test_two_sequences_in_one_forward():
    c = case(4)
    other = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref_b = c.hf(input_ids=other[None]).logits[0]
    sa, sb = c.ours.new_state(), c.ours.new_state()
    c.step(sa, c.ids[:45], 0)
    c.step(sb, other[:30], 0)
    outs_a, outs_b = [], []
    pa, pb = 45, 30
    while pa < N:   # a decodes one token while b prefills chunks of 5
        nb = min(5, 50 - pb)
        ids = torch.cat([c.ids[pa:pa + 1], other[pb:pb + nb]])
        pos = torch.cat([torch.tensor([pa]), torch.arange(pb, pb + nb)])
        with torch.no_grad():
            lg = c.ours.compute_logits(c.ours(ids, pos, DSV4Batch([sa, sb], [0, 1, 1 + nb])))
        outs_a.append(lg[:1])
        outs_b.append(lg[1:])
        pa, pb = pa + 1, pb + nb
    close(torch.cat(outs_a), c.ref[45:], "batched: sequence a (decode)")
    close(torch.cat(outs_b), ref_b[30:], "batched: sequence b (chunked prefill)")


@pytest.mark.parametrize("k,verify_chunk", [(1, False), (6, False), (6, True)])
def test_rollback(k, verify_chunk):
    """Decode k wrong tokens from position 63 (where both CSA, ratio 4, and HCA,
    ratio 16, close a window; k=6 also crosses CSA's close at 67), one by one
    or as one speculative verify chunk, roll back k, decode the right ones:
    bit-identical to never decoding them."""
    c = case(4)
    P = 63
    straight = c.ours.new_state(max_rollback=6)
    c.step(straight, c.ids[:P], 0)
    want = torch.cat([c.step(straight, c.ids[t:t + 1], t) for t in range(P, P + 10)])

    st = c.ours.new_state(max_rollback=6)
    c.step(st, c.ids[:P], 0)
    wrong = torch.randint(0, 128, (k,), generator=torch.Generator().manual_seed(3))
    if verify_chunk:
        c.step(st, wrong, P)
    else:
        for i in range(k):
            c.step(st, wrong[i:i + 1], P + i)
    entries = st.layers[2].compressor.entries.n
    assert entries == (P + k) // 16 == 4   # the wrong tokens closed an HCA window
    st.rollback(k)
    assert st.length == P and st.layers[2].compressor.entries.n == 3
    got = torch.cat([c.step(st, c.ids[t:t + 1], t) for t in range(P, P + 10)])
    assert torch.equal(got, want), (got - want).abs().max()
    close(got, c.ref[P:P + 10], f"rollback {k}")
    with pytest.raises(ValueError):
        st.rollback(7)
    with pytest.raises(ValueError, match="cached length"):
        c.step(st, c.ids[:1], 0)


def test_bytes_per_layer_kind():
    c = case(4)
    st = c.ours.new_state()
    c.step(st, c.ids, 0)
    b = st.nbytes_by_kind()
    D, Di = 32, 16
    # fp32 entries: CSA 2 layers x 20 entries x D (+ indexer keys at Di), HCA 1 x 5 x D
    assert b["compressed_sparse_attention"]["compressor_entries"] == 2 * (N // 4) * D * 4
    assert b["compressed_sparse_attention"]["indexer_entries"] == 2 * (N // 4) * Di * 4
    assert b["heavily_compressed_attention"]["compressor_entries"] == (N // 16) * D * 4
    assert b["sliding_attention"]["window"] == (8 - 1) * D * 4
    print(b)


# ---------------------------------------------------------------- MTP

def mtp_reference(c: Case, streams, ids):
    """transformers' own decoder layer / norms / hyper head wired as the official
    MTPBlock: e = enorm(embed(t+1)); x = e_proj(e) + h_proj(hnorm(h_t)); block;
    logits = head(norm(hc_head(x)))."""
    cfg = hf_config({**c.config, "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                     "mlp_layer_types": ["moe"]})
    torch.manual_seed(5)
    H = cfg.hidden_size
    mods = torch.nn.ModuleDict(dict(
        layer=HFM.DeepseekV4DecoderLayer(cfg, 0), enorm=HFM.DeepseekV4RMSNorm(H), hnorm=HFM.DeepseekV4RMSNorm(H),
        norm=HFM.DeepseekV4RMSNorm(H), e_proj=torch.nn.Linear(H, H, bias=False),
        h_proj=torch.nn.Linear(H, H, bias=False), hc_head=HFM.DeepseekV4HyperHead(cfg)))
    randomise(list(mods.named_parameters()) + list(mods.named_buffers()), cfg.n_routed_experts, 2)
    rotary = HFM.DeepseekV4RotaryEmbedding(cfg)
    T = ids.shape[0] - 1
    pos = torch.arange(T)[None]
    with torch.no_grad():
        e = mods["enorm"](c.hf.model.embed_tokens(ids[1:][None]))
        x = mods["e_proj"](e).unsqueeze(2) + mods["h_proj"](mods["hnorm"](streams[None, :T]))
        pe = {k: rotary(e, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=e, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)
        assert isinstance(mask, torch.Tensor)
        x = mods["layer"](x, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                          input_ids=ids[1:][None], past_key_values=None)
        logits = c.hf.lm_head(mods["norm"](mods["hc_head"](x)))[0]
    names = {f"mtp.0.{k[len('layer.'):]}" if k.startswith("layer.") else f"mtp.0.{k}": v
             for k, v in mods.state_dict().items()}
    return logits, names


def save_with_mtp(c: Case, path) -> None:
    """c's transformers model saved to path with mtp_reference's random MTP
    head added to its checkpoint (the engine's method "mtp" drafts with it)."""
    c.hf.save_pretrained(path)
    _, weights = mtp_reference(c, torch.zeros(N, 4, 32), c.ids)
    st = load_file(f"{path}/model.safetensors")
    assert not any(k.startswith("mtp.") for k in st)
    st.update({k: v.contiguous() for k, v in weights.items()})
    save_file(st, f"{path}/model.safetensors", metadata={"format": "pt"})


def test_mtp_head_matches_reference():
    c = case(4)
    captured = []
    hook = c.hf.model.hc_head.register_forward_pre_hook(lambda m, a: captured.append(a[0][0]))
    with torch.no_grad():
        c.hf(input_ids=c.ids[None])
    hook.remove()
    ref, weights = mtp_reference(c, captured[0], c.ids)
    ours = build_model(c.config)
    ours.load_weights(list(c.hf.state_dict().items()) + list(weights.items()))
    assert ours.mtp_loaded
    with torch.no_grad():
        streams = ours.forward_streams(c.ids, torch.arange(N), None)
        close(streams, captured[0], "pre-collapse hyper-connection state")
        draft = ours.compute_logits(ours.mtp_forward(c.ids[1:], streams[:-1], torch.arange(N - 1), None))
    close(draft, ref, "MTP draft logits (full)")
    # and step by step with its own window cache
    st, mst = ours.new_state(), ours.new_state(mtp=True)
    outs = []
    with torch.no_grad():
        s = ours.forward_streams(c.ids[:30], torch.arange(30), DSV4Batch([st], [0, 30]))
        outs.append(ours.compute_logits(ours.mtp_forward(c.ids[1:30], s[:-1], torch.arange(29),
                                                         DSV4Batch([mst], [0, 29]))))
        last = s[-1:]
        for t in range(30, N):
            outs.append(ours.compute_logits(ours.mtp_forward(c.ids[t:t + 1], last, torch.tensor([t - 1]),
                                                             DSV4Batch([mst], [0, 1]))))
            last = ours.forward_streams(c.ids[t:t + 1], torch.tensor([t]), DSV4Batch([st], [0, 1]))
    close(torch.cat(outs), ref, "MTP draft logits (cached, step by step)")


# ---------------------------------------------------------------- checkpoints

def official_name(hf: str) -> str:
    """transformers' name -> the official checkpoint name (the inverse of
    dsv4_checkpoint.hf_name for this model), written out by hand."""
    top = {v: k for k, v in ckpt.TOP_LEVEL.items()}
    if hf in top:
        return top[hf]
    s = hf[len("model."):] if hf.startswith("model.") else hf
    for a, b in [(".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
                 (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
                 (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
                 (".self_attn.", ".attn."), (".mlp.", ".ffn."),
                 (".compressor.kv_norm.", ".compressor.norm."), (".position_bias", ".ape"),
                 (".q_a_proj.", ".wq_a."), (".q_b_proj.", ".wq_b."), (".kv_proj.", ".wkv."),
                 (".gate_proj.", ".wgate."), (".o_a_proj.", ".wo_a."), (".o_b_proj.", ".wo_b."),
                 (".q_a_norm.", ".q_norm."), (".sinks", ".attn_sink"), (".input_layernorm.", ".attn_norm."),
                 (".post_attention_layernorm.", ".ffn_norm."), (".attn_hc.", ".hc_attn_"),
                 (".ffn_hc.", ".hc_ffn_"), (".gate.e_score_correction_bias", ".gate.bias"),
                 (".hc_head.hc_", ".hc_head_")]:
        s = s.replace(a, b)
    s = s.replace(".shared_experts.wgate.", ".shared_experts.w1.").replace(
        ".shared_experts.up_proj.", ".shared_experts.w3.").replace(".shared_experts.down_proj.", ".shared_experts.w2.")
    return s


def quantise_checkpoint(state: dict[str, torch.Tensor]):
    """Official-name checkpoint: experts FP4 (e2m1 codes + e8m0 scales per 32),
    other 2-D projections FP8 e4m3 with 128x128 block scales; and its fp32
    dequantised twin under transformers' names."""
    g = torch.Generator().manual_seed(11)
    q, twin = {}, {}
    for name, t in state.items():
        if name.endswith("inv_freq"):
            continue
        off = official_name(name)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E = t.shape[0]
            for e in range(E):
                w = t[e]
                pieces = ([("w1", w[:w.shape[0] // 2]), ("w3", w[w.shape[0] // 2:])] if "gate_up" in name
                          else [("w2", w)])
                for kind, part in pieces:
                    codes = torch.randint(0, 16, part.shape, generator=g)
                    exps = torch.randint(-6, -2, (part.shape[0], part.shape[1] // 32), generator=g)
                    # odd experts: raw E8M0 bytes (uint8, bias 127); even: torch.float8_e8m0fnu
                    scale = (exps + 127).to(torch.uint8) if e % 2 else (2.0 ** exps).to(torch.float8_e8m0fnu)
                    base = off.replace("experts.gate_up_proj", f"experts.{e}.{kind}").replace(
                        "experts.down_proj", f"experts.{e}.{kind}")
                    q[base + ".weight"] = ckpt.pack_fp4(codes)
                    q[base + ".scale"] = scale
                    twin[name] = twin.get(name, t.clone())
                    deq = ckpt.dequant_fp4(ckpt.pack_fp4(codes), scale)
                    if "gate_up" in name:
                        half = w.shape[0] // 2
                        sl = slice(0, half) if kind == "w1" else slice(half, None)
                        twin[name][e, sl] = deq
                    else:
                        twin[name][e] = deq
            continue
        if t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name \
                and "lm_head" not in name and ".gate.weight" not in name and "hc_" not in name:
            blocks = [-(-d // 128) for d in t.shape]
            amax = t.abs().amax().clamp(min=1e-8)
            scale = torch.full(blocks, (amax / 448.0).item())
            w8 = (t / scale[0, 0]).to(torch.float8_e4m3fn)
            q[off] = w8
            q[off[:-len(".weight")] + ".scale"] = scale
            twin[name] = ckpt.dequant_fp8(w8, scale)
        else:
            q[off] = t
            twin[name] = t
    return q, twin


def test_official_names_round_trip():
    c = case(4)
    for name in c.hf.state_dict():
        assert ckpt.hf_name(official_name(name)) == name, name
    for k in ["mtp.0.attn.wq_a.weight", "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.experts.3.w2.weight",
              "mtp.0.hc_attn_scale", "mtp.0.attn_norm.weight"]:
        print(k, "->", ckpt.hf_name(k))
    assert ckpt.hf_name("mtp.0.attn.wq_a.weight") == "mtp.0.self_attn.q_a_proj.weight"
    assert ckpt.hf_name("mtp.0.norm.weight") == "mtp.0.norm.weight"
    assert ckpt.hf_name("mtp.0.hc_head_fn") == "mtp.0.hc_head.hc_fn"


def test_fp8_fp4_checkpoint_equals_dequantised_twin():
    c = case(4)
    _, mtp_weights = mtp_reference(c, torch.zeros(N, 4, 32), c.ids)
    state = {**c.hf.state_dict(), **mtp_weights}
    q, twin = quantise_checkpoint(state)
    assert any(v.dtype == torch.float8_e4m3fn for v in q.values())
    assert any(v.dtype == torch.uint8 for v in q.values())
    assert any(k.startswith("mtp.0.attn.") for k in q)
    with tempfile.TemporaryDirectory() as d:
        save_file({k: v.contiguous() for k, v in q.items()}, f"{d}/model.safetensors")
        loaded = load_file(f"{d}/model.safetensors")
    a, b = build_model(c.config), build_model(c.config)
    a.load_weights(loaded.items())
    b.load_weights(twin.items())
    assert a.mtp_loaded and b.mtp_loaded
    sa, sb = a.state_dict(), b.state_dict()
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k
    with torch.no_grad():
        la = a.compute_logits(a(c.ids, torch.arange(N), None))
        lb = b.compute_logits(b(c.ids, torch.arange(N), None))
    assert torch.equal(la, lb)


def test_missing_and_unknown_tensors_raise():
    c = case(4)
    sd = dict(c.hf.state_dict())
    m = DeepseekV4ForCausalLM(c.config)
    with pytest.raises(ValueError, match="unknown"):
        m.load_weights(list(sd.items()) + [("model.layers.0.bogus.weight", torch.zeros(1))])
    sd.pop("model.layers.1.self_attn.compressor.indexer.q_b_proj.weight")
    with pytest.raises(ValueError, match="missing"):
        m.load_weights(sd.items())


def test_dequant_formats_by_hand():
    # e2m1: low nibble first; 0x21 -> (code 1, code 2) = (0.5, 1.0); 0xF7 -> (6.0, -6.0)
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)
    assert ckpt.unpack_fp4(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    # one MXFP4 scale per 32 values; raw E8M0 byte 128 = 2.0
    codes = torch.full((1, 64), 3)
    w = ckpt.dequant_fp4(ckpt.pack_fp4(codes), torch.tensor([[128, 125]], dtype=torch.uint8))
    assert w[0, :32].eq(1.5 * 2.0).all() and w[0, 32:].eq(1.5 * 0.25).all()
    # FP8: 128x128 blocks, a ragged edge block
    w8 = torch.ones(130, 200).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    d = ckpt.dequant_fp8(w8, s)
    assert d[0, 0] == 1 and d[0, 199] == 2 and d[129, 0] == 3 and d[129, 199] == 4


# ---------------------------------------------------------------- tensor parallel

def _tp_rank(rank: int, world: int) -> list[str]:
    c = Case(index_topk=4)   # ours built under tp=2: half the heads, experts, vocabulary
    attn = c.ours.model.layers[1].self_attn
    assert attn.num_heads * world == CONFIG["num_attention_heads"]
    assert c.ours.model.layers[0].mlp.experts.num_local * world == CONFIG["n_routed_experts"]
    # the planner's split matches this rank's shards (every dtype counted as 1 byte)
    from server.plan import plan_deepseek_v4
    ones = dict(fp4=1, fp8=1, bf16=1, fp32=1, index=1)
    held = sum(t.numel() for t in c.ours.parameters()) + sum(t.numel() for t in c.ours.buffers())
    assert plan_deepseek_v4("tiny", CONFIG, world, "f16", 0, dtype_bytes=ones).weight_bytes == held
    with torch.no_grad():
        d0 = close(c.ours.compute_logits(c.ours(c.ids, torch.arange(N), None)), c.ref, f"tp rank {rank} full")
    st, outs, p = c.ours.new_state(), [], 0
    for n in [37, 5] + [1] * (N - 42):
        outs.append(c.step(st, c.ids[p:p + n], p))
        p += n
    d1 = close(torch.cat(outs), c.ref, f"tp rank {rank} chunked + decode")
    # official-name FP8/FP4 checkpoint, per-expert tensors routed to their rank
    _, mtp_weights = mtp_reference(c, torch.zeros(N, 4, 32), c.ids)
    q, twin = quantise_checkpoint({**c.hf.state_dict(), **mtp_weights})
    a, b = build_model(c.config), build_model(c.config)
    a.load_weights(q.items())
    b.load_weights(twin.items())
    with torch.no_grad():
        assert torch.equal(a.compute_logits(a(c.ids, torch.arange(N), None)),
                           b.compute_logits(b(c.ids, torch.arange(N), None)))
    return [f"{d0:.2e} {d1:.2e}"]


def test_tensor_parallel_2_ranks():
    run_ranks(_tp_rank)       # each rank: full / chunked + decode max |logit diff|


@pytest.mark.parametrize("fmt,bits,mse", [("tq4", 4, 0.00950), ("tq3", 3, 0.03455)])
def test_quantised_compressed_entries(fmt, bits, mse):
    """Compressed KV entries stored as TurboQuant codes + one fp16 norm per entry:
    bytes per entry exact, the entries' relative error near the Lloyd-Max MSE
    (layer 1, the first CSA layer, sees no quantised entry upstream), rollback
    still exact. (Logits of this random tiny model are too chaotic to bound.)"""
    c = case(64)
    ref, st = c.ours.new_state(), c.ours.new_state(max_rollback=4, entry_format=fmt)
    c.step(ref, c.ids, 0)
    c.step(st, c.ids, 0)
    x, y = ref.layers[1].compressor.entries.get(), st.layers[1].compressor.entries.get()
    rel = ((y - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    print(f"{fmt} entries: relative squared error {rel:.4f} (Lloyd-Max Gaussian {mse})")
    assert rel < 1.5 * mse
    b = st.nbytes_by_kind()
    per_entry = 32 * bits // 8 + 2
    assert b["compressed_sparse_attention"]["compressor_entries"] == 2 * (N // 4) * per_entry
    assert b["heavily_compressed_attention"]["compressor_entries"] == (N // 16) * per_entry
    # rollback with coded entries: identical to the straight path
    s1, s2 = (c.ours.new_state(max_rollback=4, entry_format=fmt) for _ in range(2))
    c.step(s1, c.ids[:63], 0)
    c.step(s2, c.ids[:63], 0)
    want = torch.cat([c.step(s1, c.ids[t:t + 1], t) for t in range(63, 68)])
    c.step(s2, torch.tensor([5, 6, 7, 8]), 63)
    s2.rollback(4)
    assert torch.equal(torch.cat([c.step(s2, c.ids[t:t + 1], t) for t in range(63, 68)]), want)
