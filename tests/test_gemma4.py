"""Gemma 4 (text) logit parity against transformers, fp32, tiny random configs
with the real head dims (256 sliding, 512 full).

Three configs, each with >= 2 layers of both types and prompts longer than
4 sliding windows:
  dense  31B-like: K = V full layers with their own KV-head count (1 vs 2),
         final soft-capping, use_bidirectional_attention "vision";
  ple    E2B-like: per-layer inputs, the last 4 of 8 layers KV-shared (both
         types, producers 2 and 3), double-wide MLP there, attention biases;
  moe    26B-A4B-like: routed experts (8, top 2) beside the dense MLP, K = V,
         proportional RoPE with a factor.
Each is checked without a cache, from transformers' own config.to_dict()
(per_layer_config), through the paged dense KV cache under
test_model_parity's schedules, and split over two tensor-parallel ranks.
The engine runs tiny_models.save_tiny_gemma4(hybrid=True) (sliding + full,
KV sharing, per-layer inputs, experts) against transformers and with
TurboQuant presets; test_model_families_engine runs its default variant.
"""
from pathlib import Path

import pytest
import torch
import transformers
from spawn_ranks import run_ranks
from test_model_families_engine import logprob_gap
from test_model_parity import SCHEDULES, assert_close, make_prompt, run_paged
from tiny_models import save_tiny_gemma4, token_prompts

from engine import LLM, SamplingParams
from model_zoo.gemma4 import Gemma4ForCausalLM, kv_producers, layer_shapes
from model_zoo.models import build_model

S, F = "sliding_attention", "full_attention"
BASE = dict(architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=300, hidden_size=64,
            intermediate_size=128, num_attention_heads=2, head_dim=256, global_head_dim=512,
            sliding_window=8, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512)
CONFIGS = {
    "dense": dict(BASE, num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_key_value_heads=2,
                  attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                  final_logit_softcapping=30.0, use_bidirectional_attention="vision",
                  rope_parameters={S: dict(rope_type="default", rope_theta=100.0),
                                   F: dict(rope_type="proportional", partial_rotary_factor=0.25,
                                           rope_theta=10000.0)}),
    "ple": dict(BASE, num_hidden_layers=8, layer_types=[S, S, F, S, F, S, S, F], num_key_value_heads=1,
                attention_k_eq_v=False, hidden_size_per_layer_input=16, vocab_size_per_layer_input=300,
                num_kv_shared_layers=4, use_double_wide_mlp=True, attention_bias=True,
                rope_parameters={S: dict(rope_type="default", rope_theta=100.0),
                                 F: dict(rope_type="proportional", partial_rotary_factor=0.25,
                                         rope_theta=10000.0)}),
    "moe": dict(BASE, num_hidden_layers=6, layer_types=[S, F, S, S, F, F], num_key_value_heads=2,
                attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                final_logit_softcapping=30.0,
                rope_parameters={S: dict(rope_type="default", rope_theta=100.0),
                                 F: dict(rope_type="proportional", partial_rotary_factor=0.25,
                                         rope_theta=10000.0, factor=2.0)}),
}
PROMPTS = ("A", "B")


def make_hf(config: dict) -> torch.nn.Module:
    """transformers' model with every parameter random, the constants too:
    norm weights, router scales and the layer_scalar buffers around 1."""
    hf_config = transformers.Gemma4TextConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "eager"
    # The experts loop of modeling_gemma4.py, not the grouped_mm default (other summation order).
    hf_config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return model


class Case:
    def __init__(self, key: str):
        self.key, self.config = key, CONFIGS[key]
        self.hf = make_hf(self.config)
        self.ours = build_model(self.config)
        self.ours.load_weights(self.hf.state_dict().items())
        self.prompts = {n: make_prompt(n, self.config["vocab_size"]) for n in PROMPTS}
        with torch.no_grad():
            self.ref = {n: self.hf(input_ids=p[None]).logits[0].float() for n, p in self.prompts.items()}


_cases: dict[str, Case] = {}


@pytest.fixture(params=list(CONFIGS))
def case(request) -> Case:
    if request.param not in _cases:
        _cases[request.param] = Case(request.param)
    return _cases[request.param]


def no_cache_logits(model, prompt):
    with torch.no_grad():
        return model.compute_logits(model(prompt, torch.arange(len(prompt)), None))


def test_no_cache_matches_transformers(case):
    assert type(case.ours) is Gemma4ForCausalLM
    for name, prompt in case.prompts.items():
        assert_close(no_cache_logits(case.ours, prompt), case.ref[name], f"gemma4 {case.key} meta=None prompt {name}")


def test_config_as_transformers_writes_it(case):
    """transformers 5.23's config.json (per_layer_config for the full layers'
    head_dim / KV heads, no global_head_dim, no architectures) gives the same model."""
    config = case.hf.config.to_dict()
    assert "per_layer_config" in config and "global_head_dim" not in config and not config.get("architectures")
    assert layer_shapes(config) == layer_shapes(case.config)
    model = build_model(config)
    assert type(model) is Gemma4ForCausalLM
    model.load_weights(case.hf.state_dict().items())
    assert_close(no_cache_logits(model, case.prompts["A"]), case.ref["A"], f"gemma4 {case.key} from to_dict()")


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_paged_matches_transformers(case, schedule, block_size):
    steps = SCHEDULES[schedule]
    names = {name for step in steps for name, _ in step}
    got = run_paged(case.ours, {n: case.prompts[n] for n in names}, steps, block_size)
    for name in sorted(names):
        assert_close(got[name], case.ref[name], f"gemma4 {case.key} paged {schedule} bs={block_size} seq {name}")


def test_layer_shapes_and_kv_cache_spec():
    """Each config really has what it claims: head dims 256 / 512, the full
    layers' own KV heads, K = V without v_proj, KV-shared layers without a cache."""
    spec = [(s.layer_idx, s.num_kv_heads, s.head_dim, s.sliding_window)
            for s in build_model(CONFIGS["dense"]).kv_cache_spec()]
    assert spec == [(0, 2, 256, 8), (1, 2, 256, 8), (2, 1, 512, None), (3, 2, 256, 8), (4, 2, 256, 8),
                    (5, 1, 512, None)]
    ple = build_model(CONFIGS["ple"])
    assert kv_producers(CONFIGS["ple"]) == [None] * 4 + [2, 3, 3, 2]
    assert [(s.layer_idx, s.num_kv_heads, s.head_dim, s.sliding_window) for s in ple.kv_cache_spec()] == \
        [(0, 1, 256, 8), (1, 1, 256, 8), (2, 1, 512, None), (3, 1, 256, 8)]
    # q rows only in shared layers; q + k (no v) in K = V layers; double-wide MLP in shared layers
    assert ple.model.layers[7].self_attn.qkv_proj.weight.shape == (2 * 512, 64)
    assert ple.model.layers[4].mlp.gate_up_proj.weight.shape == (2 * 2 * 128, 64)
    assert ple.model.layers[3].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    dense = build_model(CONFIGS["dense"])
    assert dense.model.layers[2].self_attn.qkv_proj.weight.shape == ((2 + 1) * 512, 64)
    assert dense.model.layers[0].self_attn.qkv_proj.weight.shape == ((2 + 2 + 2) * 256, 64)
    assert min(len(make_prompt(n, 300)) for n in PROMPTS) > 4 * BASE["sliding_window"]
    # hub configs without per_layer_config: the global KV-head count needs attention_k_eq_v
    assert layer_shapes(dict(CONFIGS["dense"], attention_k_eq_v=False))[2] == (512, 2)


def test_moe_routes_and_loads_per_expert_tensors():
    """The MoE case's experts matter (zeroing them changes the logits), and a
    hub-style checkpoint (one tensor per expert) loads the same weights."""
    from test_model_parity import per_expert
    case = _cases.get("moe") or Case("moe")
    sd = per_expert(case.hf.state_dict())
    assert "model.layers.0.experts.7.down_proj.weight" in sd and "model.layers.0.router.proj.weight" in sd
    model = build_model(case.config)
    model.load_weights(sd.items())
    for name, p in case.ours.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name
    with torch.no_grad():
        for layer in model.model.layers:
            layer.experts.down_proj.zero_()
    diff = (no_cache_logits(model, case.prompts["A"]) - case.ref["A"]).abs().max().item()
    assert diff > 0.1, diff


def test_load_weights_rejects_bad_checkpoints():
    case = _cases.get("ple") or Case("ple")
    sd = dict(case.hf.state_dict())
    with pytest.raises(ValueError, match="model.layers.1.layer_scalar"):
        build_model(case.config).load_weights((k, v) for k, v in sd.items() if k != "model.layers.1.layer_scalar")
    with pytest.raises(ValueError, match="model.embed_tokens_per_layer.weight"):
        build_model(case.config).load_weights(
            (k, v) for k, v in sd.items() if k != "model.embed_tokens_per_layer.weight")
    with pytest.raises(ValueError, match="model.layers.2.self_attn.k_proj.weight"):
        build_model(case.config).load_weights(
            (k, v) for k, v in sd.items() if k != "model.layers.2.self_attn.k_proj.weight")
    # KV-shared layers: k/v projections and norms a checkpoint still holds are ignored, as transformers does
    extra = dict(sd, **{"model.layers.6.self_attn.k_proj.weight": torch.zeros(256, 64),
                        "model.layers.6.self_attn.k_norm.weight": torch.zeros(256)})
    model = build_model(case.config)
    model.load_weights(extra.items())
    assert_close(no_cache_logits(model, case.prompts["A"]), case.ref["A"], "gemma4 ple with stray shared-layer K")
    dense = _cases.get("dense") or Case("dense")
    bad = dict(dense.hf.state_dict(), **{"model.layers.2.self_attn.v_proj.weight": torch.zeros(512, 64)})
    with pytest.raises(ValueError, match="model.layers.2.self_attn.v_proj.weight"):
        build_model(dense.config).load_weights(bad.items())


def test_rejects_unsupported_configs():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        build_model(dict(CONFIGS["dense"], use_bidirectional_attention="all"))
    with pytest.raises(ValueError, match="hidden_activation"):
        build_model(dict(CONFIGS["dense"], hidden_activation="silu"))
    with pytest.raises(ValueError, match="per_layer_config"):
        build_model(dict(CONFIGS["dense"], per_layer_config={"2": {"head_dim": 512, "sliding_window": 4}}))


# ---------------------------------------------------------------- tensor parallel

def _tp_rank(rank: int, world: int) -> list[str]:
    lines = []
    for key in CONFIGS:
        case = Case(key)        # built under tp=2: this rank's shards only
        layer = case.ours.model.layers[-1]
        assert layer.self_attn.qkv_proj.num_heads == 1, "q heads are not split"
        if layer.moe:
            assert layer.experts.num_local == 4, "experts are not split"
        d0 = assert_close(no_cache_logits(case.ours, case.prompts["A"]), case.ref["A"],
                          f"gemma4 {key} tp={world} rank {rank} meta=None")
        got = run_paged(case.ours, case.prompts, SCHEDULES["mixed"], 4)
        d1 = max(assert_close(got[n], case.ref[n], f"gemma4 {key} tp={world} rank {rank} paged seq {n}")
                 for n in PROMPTS)
        lines.append(f"{key} {d0:.2e} {d1:.2e}")
    return lines


def test_tensor_parallel_2_ranks_match_transformers():
    """Two gloo ranks: q heads and sliding KV heads split, the full layers'
    single KV head replicated, the per-layer embedding's vocabulary and the
    experts split (4 / 4); both ranks give transformers' logits."""
    for lines in run_ranks(_tp_rank):
        assert [line.split()[0] for line in lines] == list(CONFIGS)


# ---------------------------------------------------------------- engine, hybrid layers
# (test_model_families_engine runs tests/tiny_models.save_tiny_gemma4's
# full-attention-only model; its pool-size checks assume no sliding group.)

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma4_hybrid")
    return str(d), save_tiny_gemma4(d, hybrid=True)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_engine_hybrid_matches_transformers(hybrid):
    """Sliding (256, window 16) and K = V full (512) layers, KV-shared layers
    reading layers 2-3: the engine's prompt and sampled logprobs equal
    transformers' within 1e-4 and its greedy tokens equal generate()'s;
    chunked prefill mixed with decodes equals whole prefill; preemption
    keeps the tokens."""
    path, hf = hybrid
    engine = LLM(path, dtype="float32", quantization="none", block_size=4)
    shapes = [(c.num_kv_heads, c.head_dim, c.sliding_window) for c in engine.core.runner.kv_caches]
    assert shapes == [(1, 256, 16), (2, 512, None), (1, 256, 16), (2, 512, None)]
    assert logprob_gap(engine, hf, token_prompts(4, 20, 50, seed=21)) < 1e-4

    ps = token_prompts(6, 40, 120, seed=22)
    whole = toks(LLM(path, dtype="float32", quantization="none", block_size=4,
                     enable_prefix_caching=False).generate(ps, greedy()))
    chunked = LLM(path, dtype="float32", quantization="none", block_size=4, enable_prefix_caching=False,
                  max_num_batched_tokens=16)
    assert toks(chunked.generate(ps, greedy())) == whole
    assert chunked.core.stats.steps_total >= sum(map(len, ps)) // 16 + 11

    ps = token_prompts(8, 30, 60, seed=23)
    ref = toks(engine.generate(ps, greedy(40)))
    per_token = engine.core.plan.bytes_per_token
    small = LLM(path, dtype="float32", quantization="none", block_size=4, kv_cache_memory=160 * per_token,
                max_model_len=100)
    assert small.core.plan.capacity_tokens < 160    # the sliding group took its share
    assert toks(small.generate(ps, greedy(40))) == ref
    assert small.core.get_stats().num_preemptions_total > 0
    assert small.core.kv.num_used_blocks == 0


@pytest.mark.parametrize("preset", ["k8v4", "tq4", "tq3"])
def test_engine_hybrid_turboquant(hybrid, preset):
    """TurboQuant caches at head_dim 512 (full layers; sliding layers stay f16,
    kv_formats' policy) beside 256-dim sliding ones, keys centred, hot tokens
    for the tq presets, and KV-shared layers reading both kinds: batch-
    invariant, and chunked prefill runs (a shared layer re-arms the hot
    pass's per-step state: it used to find it consumed).

    Chunked tokens are not compared with whole-prefill ones here: with
    attention scale 1 over unit-RMS q and k, this random model's softmax is
    near-argmax, and the last-bit differences between chunked and whole
    prefill that f16/f32 storage absorbs flip quantized keys into other
    tokens (which sequence differs changes with the preset)."""
    path, _ = hybrid
    kw = dict(block_size=4, kv_cache_memory=8 << 20, kv_cache_dtype=preset, enable_prefix_caching=False)
    llm = LLM(path, **kw)
    caches = llm.core.runner.kv_caches
    assert [(type(c).__name__, c.head_dim) for c in caches] == [("DenseLayerCache", 256), ("TQLayerCache", 512)] * 2
    assert all(c.k_mean is not None and c.k_mean.abs().sum() > 0 for c in caches[1::2])
    assert {c.hot for c in caches[1::2]} == ({""} if preset == "k8v4" else {"k"})
    ps = token_prompts(6, 30, 70, seed=10)
    batch = toks(llm.generate(ps, greedy()))
    assert toks(llm.generate([ps[3]], greedy())) == [batch[3]]
    chunked = LLM(path, max_num_batched_tokens=8, **kw)
    assert [len(t) for t in toks(chunked.generate(ps, greedy()))] == [12] * len(ps)
    assert chunked.core.stats.steps_total > sum(map(len, ps)) // 8


def test_multimodal_checkpoint_serves_its_language_model(hybrid, tmp_path):
    """A Gemma4ForConditionalGeneration directory (text_config nested, stop ids at the
    top, model.language_model.* beside vision / audio towers): the engine serves the
    language model, token for token as the text-only directory."""
    import json

    from safetensors.torch import load_file, save_file
    path, _ = hybrid
    text = json.loads((Path(path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", eos_token_id=2, bos_token_id=1,
        text_config={k: v for k, v in text.items() if k not in ("architectures", "eos_token_id", "bos_token_id")})))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in
               load_file(str(Path(path) / "model.safetensors")).items()}
    tensors.update({"model.vision_tower.patch.weight": torch.zeros(2, 2), "model.embed_vision.proj.weight":
                    torch.zeros(2, 2), "model.audio_tower.conv.weight": torch.zeros(2, 2)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ps = token_prompts(3, 20, 40, seed=31)
    args = dict(dtype="float32", quantization="none", block_size=4)
    multi = LLM(str(tmp_path), **args)
    assert multi.core.info.eos_token_ids == [2]
    assert toks(multi.generate(ps, greedy())) == toks(LLM(path, **args).generate(ps, greedy()))
