"""Logit parity of model_zoo against transformers, fp32, tiny random configs.

Every model is checked three ways against transformers' logits for the whole
sequence: without a cache (meta=None), through the paged dense KV cache under
several batch schedules (one prefill; chunked prefill then decode; two
sequences of different lengths sharing steps), and split over two
tensor-parallel ranks (gloo).
"""
import random

import pytest
import torch
import transformers
from spawn_ranks import run_ranks

from kvcache.dense_cache import DenseLayerCache
from kvcache.metadata import AttentionMetadata, GroupMetadata
from model_zoo.models import build_model

TOL = 1e-3

# Tiny configs in config.json shape. Each one also switches on the options that
# a wrong convention would get wrong (biases, head_dim != hidden/heads, rope
# scaling, tied embeddings, attention scale != head_dim ** -0.5, softcapping).
CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
        intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
        max_position_embeddings=1024, tie_word_embeddings=False),
    "smollm2": dict(   # SmolLM2-135M's shape, shrunk: 9 heads / 3 KV heads, head_dim 8, tied
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=72,
        intermediate_size=192, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=301, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=288, hidden_size=64,
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3_moe": dict(   # 8 experts, top 3 renormalised; layer 1 dense (mlp_only_layers), 2 sparse
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=288, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False),
    "gemma3": dict(    # gemma-3-270m's shape, shrunk: 1 KV head, 5 sliding + 1 global layer
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=300,
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        rope_theta=1000000.0, rope_local_base_freq=100.0,
        rope_scaling=dict(rope_type="linear", factor=4.0), final_logit_softcapping=30.0),
}

HF = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}

PROMPT_LENS = {"A": 48, "B": 44}
PROMPT_SEEDS = {"A": 1, "B": 2}


# ---------------------------------------------------------------- references

def make_hf_model(config: dict) -> torch.nn.Module:
    """transformers' model with every parameter random, including the ones it
    initialises to constants (norm weights, biases)."""
    cfg_cls, model_cls = HF[config["model_type"]]
    hf_config = cfg_cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(hf_config).eval()
    gemma = config["model_type"].startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma stores the offset from 1: a (1 + w) vs w mix-up shows.
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if gemma else 1.0))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def make_prompt(name: str, vocab: int) -> torch.Tensor:
    # A fixed seed per prompt: tensor-parallel ranks must see the same tokens.
    g = torch.Generator().manual_seed(PROMPT_SEEDS[name])
    return torch.randint(0, vocab, (PROMPT_LENS[name],), generator=g)


class Case:
    """One config: the transformers model, ours with its weights, and the
    reference logits for each prompt."""

    def __init__(self, key: str, config: dict | None = None):
        self.key = key
        self.config = config or CONFIGS[key]
        self.hf = make_hf_model(self.config)
        self.ours = build_model(self.config)
        self.ours.load_weights(self.hf.state_dict().items())
        self.prompts = {n: make_prompt(n, self.config["vocab_size"]) for n in PROMPT_LENS}
        with torch.no_grad():
            self.ref = {n: self.hf(input_ids=p[None]).logits[0].float() for n, p in self.prompts.items()}


_cases: dict[str, Case] = {}


@pytest.fixture(params=list(CONFIGS))
def case(request) -> Case:
    if request.param not in _cases:
        _cases[request.param] = Case(request.param)
    return _cases[request.param]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    assert ours.dtype == torch.float32
    diff = (ours - ref).abs().max().item()
    print(f"{what}: max |logit diff| = {diff:.2e} (logit scale {ref.abs().max().item():.1f})")
    mismatch = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not mismatch, f"{what}: argmax differs at positions {mismatch}"
    assert diff < TOL, f"{what}: max |logit diff| {diff:.2e} >= {TOL}"
    return diff


# ---------------------------------------------------------------- paged runs

def make_metadata(seqs, kv_caches, block_size: int) -> AttentionMetadata:
    """Flat-batch metadata for seqs = [(block_tables, context_len_before, new_tokens)],
    decodes (new_tokens == 1) first. block_tables holds one block list per
    cache group."""
    num_groups = len(seqs[0][0])
    query_start_loc, seq_lens = [0], []
    for _, ctx, n in seqs:
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(ctx + n)
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][2] == 1:
        num_decodes += 1
    assert all(n > 1 for _, _, n in seqs[num_decodes:]), "decodes must come first"
    groups = []
    for g in range(num_groups):
        slots = []
        for tables, ctx, n in seqs:
            slots += [tables[g][p // block_size] * block_size + p % block_size for p in range(ctx, ctx + n)]
        width = max(len(tables[g]) for tables, _, _ in seqs)
        bt = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (tables, _, _) in enumerate(seqs):
            bt[i, :len(tables[g])] = torch.tensor(tables[g], dtype=torch.long)
        groups.append(GroupMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=bt))
    return AttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, num_decodes=num_decodes,
                             groups=groups, kv_caches=kv_caches)


def run_paged(model, prompts: dict[str, torch.Tensor], steps, block_size: int, num_blocks: int = 64):
    """Run `steps` (each a list of (sequence name, tokens this step)) through
    the paged cache; return each sequence's logits, in position order.

    Full-attention layers share group 0, sliding ones group 1, each with its
    own shuffled block allocation (block 0 is never handed out: it stands for
    "freed"). Blocks that fall entirely out of a sliding window are freed and
    reused, as a scheduler would.
    """
    specs = model.kv_cache_spec()
    windows = sorted({s.sliding_window for s in specs if s.sliding_window is not None})
    assert len(windows) <= 1
    window = windows[0] if windows else None
    group_of = [0 if s.sliding_window is None else 1 for s in specs]
    num_groups = max(group_of) + 1
    kv_caches = [DenseLayerCache(num_blocks, block_size, s.num_kv_heads, s.head_dim, torch.float32,
                                 group_of[i], s.sliding_window) for i, s in enumerate(specs)]
    rng = random.Random(1)
    free = [rng.sample(range(1, num_blocks), num_blocks - 1) for _ in range(num_groups)]
    tables = {name: [[] for _ in range(num_groups)] for name in prompts}
    ctx = {name: 0 for name in prompts}
    out = {name: [] for name in prompts}
    for step in steps:
        batch = []
        for name, n in step:
            for g in range(num_groups):
                while len(tables[name][g]) * block_size < ctx[name] + n:
                    tables[name][g].append(free[g].pop())
            batch.append((tables[name], ctx[name], n))
        meta = make_metadata(batch, kv_caches, block_size)
        ids = torch.cat([prompts[name][ctx[name]:ctx[name] + n] for name, n in step])
        pos = torch.cat([torch.arange(ctx[name], ctx[name] + n) for name, n in step])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, pos, meta))
        for (name, n), chunk in zip(step, logits.split([n for _, n in step])):
            out[name].append(chunk)
            ctx[name] += n
            if window is not None:
                # The next query (position ctx) sees keys > ctx - window.
                table = tables[name][1]
                for b in range(len(table)):
                    if table[b] and (b + 1) * block_size <= ctx[name] - window + 1:
                        free[1].append(table[b])
                        table[b] = 0
    return {name: torch.cat(chunks) for name, chunks in out.items() if chunks}


SCHEDULES = {
    "prefill": [[("A", 48)]],
    "chunked+decode": [[("A", 20)], [("A", 17)]] + [[("A", 1)]] * 11,
    # A decodes while B prefills in two chunks, then both decode, then A alone.
    "mixed": ([[("A", 30)], [("A", 1), ("B", 25)], [("A", 1), ("B", 15)]]
              + [[("A", 1), ("B", 1)]] * 4 + [[("A", 1)]] * 12),
}


# ---------------------------------------------------------------- tests

def test_no_cache_matches_transformers(case):
    for name, prompt in case.prompts.items():
        with torch.no_grad():
            logits = case.ours.compute_logits(case.ours(prompt, torch.arange(len(prompt)), None))
        assert_close(logits, case.ref[name], f"{case.key} meta=None prompt {name}")


def test_config_as_transformers_writes_it(case):
    """The same weights under config.to_dict() (transformers 5's config.json:
    rope_parameters, layer_types, no architectures) give the same model."""
    config = case.hf.config.to_dict()
    assert "rope_parameters" in config
    model = build_model(config)
    assert type(model) is type(case.ours)
    model.load_weights(case.hf.state_dict().items())
    prompt = case.prompts["A"]
    with torch.no_grad():
        logits = model.compute_logits(model(prompt, torch.arange(len(prompt)), None))
    assert_close(logits, case.ref["A"], f"{case.key} from to_dict()")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_paged_matches_transformers(case, schedule, block_size):
    steps = SCHEDULES[schedule]
    names = {name for step in steps for name, _ in step}
    for name in names:   # every schedule covers each of its prompts exactly
        assert sum(n for step in steps for s, n in step if s == name) == PROMPT_LENS[name]
    got = run_paged(case.ours, {n: case.prompts[n] for n in names}, steps, block_size)
    for name in sorted(names):
        assert_close(got[name], case.ref[name], f"{case.key} paged {schedule} bs={block_size} seq {name}")


def test_sliding_window_is_exercised():
    """The gemma3 case really has both layer kinds, and prompts longer than its window."""
    config = CONFIGS["gemma3"]
    specs = build_model(config).kv_cache_spec()
    kinds = [s.sliding_window for s in specs]
    assert kinds == [8, 8, 8, 8, 8, None]
    assert min(PROMPT_LENS.values()) > 4 * config["sliding_window"]


def test_kv_cache_spec():
    specs = build_model(CONFIGS["gemma3"]).kv_cache_spec()
    assert [(s.layer_idx, s.num_kv_heads, s.head_dim) for s in specs] == [(i, 1, 32) for i in range(6)]
    config = dict(CONFIGS["gemma3"], layer_types=["full_attention", "sliding_attention"] * 3)
    assert [s.sliding_window for s in build_model(config).kv_cache_spec()] == [None, 8] * 3

    specs = build_model(CONFIGS["smollm2"]).kv_cache_spec()
    assert [(s.layer_idx, s.num_kv_heads, s.head_dim, s.sliding_window) for s in specs] == \
        [(0, 3, 8, None), (1, 3, 8, None)]
    assert build_model(CONFIGS["qwen3"]).kv_cache_spec()[0].head_dim == 32
    # Qwen2 sliding layers: only with use_sliding_window, from max_window_layers on.
    config = dict(CONFIGS["qwen2"], use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert [s.sliding_window for s in build_model(config).kv_cache_spec()] == [None, 16, 16]
    assert [s.sliding_window for s in build_model(CONFIGS["qwen2"]).kv_cache_spec()] == [None] * 3


def test_qwen2_sliding_window_matches_transformers():
    config = dict(CONFIGS["qwen2"], use_sliding_window=True, sliding_window=8, max_window_layers=1)
    case = Case("qwen2-sliding", config)
    assert [s.sliding_window for s in case.ours.kv_cache_spec()] == [None, 8, 8]
    prompt = case.prompts["A"]
    with torch.no_grad():
        logits = case.ours.compute_logits(case.ours(prompt, torch.arange(len(prompt)), None))
    assert_close(logits, case.ref["A"], "qwen2-sliding meta=None")
    got = run_paged(case.ours, case.prompts, SCHEDULES["mixed"], 4)
    for name in ("A", "B"):
        assert_close(got[name], case.ref[name], f"qwen2-sliding paged mixed seq {name}")


def test_load_weights_rejects_bad_checkpoints():
    case = _cases.get("qwen3") or Case("qwen3")
    sd = dict(case.hf.state_dict())
    model = build_model(case.config)

    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_norm.weight"):
        model.load_weights((k, v) for k, v in sd.items() if k != "model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        model.load_weights((k, v) for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="lm_head.weight"):
        model.load_weights((k, v) for k, v in sd.items() if k != "lm_head.weight")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.extra.weight"):
        model.load_weights(list(sd.items()) + [("model.layers.0.self_attn.extra.weight", torch.zeros(1))])
    bad = dict(sd, **{"model.layers.2.self_attn.v_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match="model.layers.2.self_attn.v_proj.weight"):
        model.load_weights(bad.items())

    # Tied: no lm_head.weight needed, and one given is the embedding itself.
    tied = build_model(CONFIGS["gemma3"])
    gemma_sd = make_hf_model(CONFIGS["gemma3"]).state_dict()
    tied.load_weights((k, v) for k, v in gemma_sd.items() if k != "lm_head.weight")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert torch.equal(tied.lm_head.weight, gemma_sd["model.embed_tokens.weight"])


def per_expert(sd: dict) -> dict:
    """transformers' fused expert tensors as a Hugging Face checkpoint stores them:
    experts.{e}.gate_proj / up_proj / down_proj.weight."""
    out = {}
    for k, v in sd.items():
        prefix, _, leaf = k.rpartition(".")
        if leaf == "gate_up_proj":
            for e, t in enumerate(v):
                g, u = t.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = g, u
        elif leaf == "down_proj" and prefix.endswith(".experts"):
            out.update({f"{prefix}.{e}.down_proj.weight": t for e, t in enumerate(v)})
        else:
            out[k] = v
    return out


def test_moe_loads_per_expert_tensors():
    """Qwen3-MoE from per-expert tensors (a hub checkpoint) = from transformers' fused
    ones; a missing or out-of-range expert raises, naming it."""
    case = _cases.get("qwen3_moe") or Case("qwen3_moe")
    sd = per_expert(case.hf.state_dict())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in sd and "model.layers.1.mlp.gate_proj.weight" in sd
    model = build_model(case.config)
    model.load_weights(sd.items())
    for name, p in case.ours.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name

    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts.gate_up_proj"):
        build_model(case.config).load_weights(
            (k, v) for k, v in sd.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight")
    bad = dict(sd, **{"model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(48, 64)})
    with pytest.raises(ValueError, match=r"experts.8.gate_proj.weight: expert 8 out of range"):
        build_model(case.config).load_weights(bad.items())
    bad = dict(sd, **{"model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(48, 64)})
    with pytest.raises(ValueError, match=r"experts.3.down_proj.weight: shape mismatch"):
        build_model(case.config).load_weights(bad.items())


def test_build_model_rejects_unknown_architectures():
    with pytest.raises(ValueError, match="MambaForCausalLM.*LlamaForCausalLM.*Gemma3ForCausalLM"):
        build_model({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    with pytest.raises(ValueError, match="'mamba'.*Qwen2ForCausalLM"):
        build_model({"model_type": "mamba"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        build_model(dict(CONFIGS["llama"], rope_scaling={"rope_type": "yarn", "factor": 4.0}))


# ---------------------------------------------------------------- tensor parallel

# KV heads split (2/2), odd vocab, KV head replicated (1 < 2), experts split (4/4)
TP_KEYS = ["llama", "qwen2", "gemma3", "qwen3_moe"]


def _tp_rank(rank: int, world: int) -> list[str]:
    lines = []
    for key in TP_KEYS:
        case = Case(key)        # built under tp=2: this rank's shards only
        qkv = case.ours.model.layers[0].self_attn.qkv_proj
        full_q = CONFIGS[key]["num_attention_heads"] * qkv.head_dim
        assert qkv.q_size * world == full_q, "q heads are not split"
        prompt = case.prompts["A"]
        with torch.no_grad():
            logits = case.ours.compute_logits(case.ours(prompt, torch.arange(len(prompt)), None))
        d0 = assert_close(logits, case.ref["A"], f"{key} tp={world} rank {rank} meta=None")
        got = run_paged(case.ours, case.prompts, SCHEDULES["mixed"], 4)
        d1 = max(assert_close(got[n], case.ref[n], f"{key} tp={world} rank {rank} paged seq {n}")
                 for n in ("A", "B"))
        lines.append(f"{key} {d0:.2e} {d1:.2e}")
    return lines


def test_tensor_parallel_2_ranks_match_transformers():
    """Two gloo ranks, each holding half the heads / features / vocabulary,
    produce transformers' logits on both ranks."""
    for lines in run_ranks(_tp_rank):
        assert [line.split()[0] for line in lines] == TP_KEYS


def test_rotary_cos_sin_are_shared_within_one_forward_only():
    """A model's begin(positions) lets its layers share one cos / sin; the next
    forward's begin drops them, even for the same tensor with new values."""
    from model_zoo.layers import RotaryEmbedding
    rope_args = (8, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(4, 16), torch.randn(4, 8)
    rope, pos = RotaryEmbedding(*rope_args), torch.arange(4)
    rope.begin(pos)
    first = rope(pos, q, k)
    assert rope._memo is not None and rope._memo[0] is pos
    assert all(torch.equal(a, b) for a, b in zip(rope(pos, q, k), first))
    pos.add_(7)
    rope.begin(pos)
    again = rope(pos, q, k)
    fresh = RotaryEmbedding(*rope_args)(pos.clone(), q, k)       # no begin: nothing kept
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))
    assert not all(torch.equal(a, b) for a, b in zip(again, first))
