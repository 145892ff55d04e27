"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, MoE with a shared
expert) and Qwen3.5 (dense and MoE: split DeltaNet projections, mrope)
against transformers fp32 on tiny random configs with real structure (value
heads 2x key heads, partial rotary, a dense layer among MoE layers): logits
over 150 tokens (three 64-token delta-rule chunks), from transformers 5's
config.json too, and split over two tensor-parallel ranks; a multimodal
Qwen3.5 checkpoint serves its language model;
the engine's linear-attention state after a chunked prefill equals the state
after one whole prefill; `tqserve plan`'s per-sequence state and KV bytes
equal what the pool allocates. (Engine runs: test_model_families_engine.)"""
import pytest
import torch
import transformers
from spawn_ranks import run_ranks
from test_model_parity import assert_close
from test_spec_decode import partly_right
from tiny_models import save_tiny_qwen3_next, token_prompts

from engine import LLM, SamplingParams
from kvcache.linear_state import LinearStateCache
from model_zoo.models import build_model
from server import plan

CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=256, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
    rope_theta=10000.0, partial_rotary_factor=0.25, tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"] * 2)
# Qwen3.5: split DeltaNet projections, multimodal rotary (mrope) for text; dense, and MoE in every layer.
_35 = {k: v for k, v in CONFIG.items() if k not in ("architectures", "rope_theta", "partial_rotary_factor",
                                                    "mlp_only_layers", "norm_topk_prob")}
_35["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                              mrope_section=[2, 1, 1])
FLAVOURS = {
    "qwen3_next": (CONFIG, "Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ({k: v for k, v in dict(_35, model_type="qwen3_5_text").items()
                 if "expert" not in k}, "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ({k: v for k, v in dict(_35, model_type="qwen3_5_moe_text").items() if k != "intermediate_size"},
                    "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
N = 150


def make_hf(flavour="qwen3_next"):
    config, cfg_cls, model_cls = FLAVOURS[flavour]
    hc = getattr(transformers, cfg_cls)(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    hc._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(hc).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:      # the DeltaNet output norm scales by w, the others by 1 + w
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "linear_attn.norm" in n else 0.0))
            elif n.endswith(("A_log", "dt_bias")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return hf


def prompt():
    return torch.randint(0, CONFIG["vocab_size"], (N,), generator=torch.Generator().manual_seed(1))


def logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), None))


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_logits_match_transformers(flavour):
    hf = make_hf(flavour)
    ids = prompt()
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    for config in (FLAVOURS[flavour][0], hf.config.to_dict()):
        ours = build_model(config)
        ours.load_weights(hf.state_dict().items())
        assert_close(logits(ours, ids), ref, f"{flavour} meta=None")
    kinds = [type(s).__name__ for s in ours.kv_cache_spec()]
    assert kinds == ["LinearAttentionSpec", "LayerSpec", "LinearAttentionSpec", "LinearAttentionSpec"] * 2


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration directory: config.json nests the text
    model's config, the tensors are model.language_model.* beside model.visual.*
    and mtp.*; the engine serves the language model."""
    import json

    from safetensors.torch import save_file
    hf = make_hf("qwen3_5")
    text = dict(FLAVOURS["qwen3_5"][0], bos_token_id=1, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text,
        vision_config=dict(model_type="qwen3_5_vision", depth=1))))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v.contiguous()
               for k, v in hf.state_dict().items()}
    tensors["model.visual.patch_embed.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), dtype="float32", quantization="none", block_size=4, max_num_seqs=2)
    ids = prompt()[:40].tolist()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([ids + out.outputs[0].token_ids])).logits[0], -1)
    for j, t in enumerate(out.outputs[0].token_ids):
        assert t == int(ref[len(ids) - 1 + j].argmax())
        assert abs(out.outputs[0].logprobs[j][t] - ref[len(ids) - 1 + j, t].item()) < 1e-4


def _tp_rank(rank: int, world: int) -> list[str]:
    lines = []
    for flavour in FLAVOURS:
        hf = make_hf(flavour)
        ours = build_model(FLAVOURS[flavour][0])          # this rank's heads and experts
        ours.load_weights(hf.state_dict().items())
        delta = ours.model.layers[0].linear_attn
        assert (delta.num_k_heads, delta.num_v_heads, delta.conv1d.weight.shape[0]) == (1, 2, (2 * 16 + 2 * 24))
        ids = prompt()
        with torch.no_grad():
            ref = hf(input_ids=ids[None]).logits[0].float()
        d = assert_close(logits(ours, ids), ref, f"{flavour} tp={world} rank {rank}")
        lines.append(f"{flavour} {d:.3e}")
    return lines


def test_tensor_parallel_2_ranks_match_transformers():
    for lines in run_ranks(_tp_rank):
        assert [line.split()[0] for line in lines] == list(FLAVOURS)


def _states(llm):
    """Slot 0's state (the only sequence's) of every linear-attention layer."""
    return [(c.conv[0].clone(), c.recurrent[0].clone()) for c in llm.core.runner.kv_caches
            if isinstance(c, LinearStateCache)]


def test_chunked_prefill_state_equals_whole(tmp_path):
    save_tiny_qwen3_next(tmp_path)
    p = token_prompts(1, 100, 101, seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=1)      # the state after the prompt only
    args = dict(dtype="float32", quantization="none", block_size=4, max_num_seqs=1)
    whole = LLM(str(tmp_path), **args)
    chunked = LLM(str(tmp_path), max_num_batched_tokens=16, **args)   # 7 chunks, one across a 64-token chunk edge
    a, b = whole.generate([p], sp), chunked.generate([p], sp)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert chunked.core.stats.steps_total >= 7 and whole.core.stats.steps_total == 1
    sa, sb = _states(whole), _states(chunked)
    assert len(sa) == 4 and any(r.abs().sum() > 0 for _, r in sa)
    assert torch.equal(sa[0][0], sb[0][0])          # layer 0's last 3 conv inputs: the embeddings' projections
    for (ca, ra), (cb, rb) in zip(sa, sb):          # later layers: the delta rule chunked otherwise upstream
        assert (ca - cb).abs().max() <= 1e-5 * ca.abs().max()
        assert (ra - rb).abs().max() <= 1e-5 * ra.abs().max()


def test_plan_state_and_kv_bytes_match_the_pool(tmp_path):
    save_tiny_qwen3_next(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", quantization="none", kv_cache_dtype="f16", block_size=4,
              max_num_seqs=4)
    p = plan.make_plan(str(tmp_path), tp=1, kv_cache_dtype="f16")
    assert p.per_sequence == llm.core.plan.state_bytes_per_seq > 0
    assert p.kv_per_token == llm.core.plan.bytes_per_token
    assert llm.core.plan.num_blocks[1] == 4                    # a state slot for each of max_num_seqs
    # and prefix caching's snapshots of it: 4 per sequence, more slots of the same tensors
    assert llm.core.plan.prefix_caching and llm.core.plan.num_snapshots == 16
    assert all(c.recurrent.shape[0] == 4 + 16 + 1 for c in llm.core.runner.slot_caches)


def test_speculative_rollback_resumes_from_the_state_checkpoints(tmp_path):
    """Drafts with 0..3 correct tokens then a wrong one (k = 3): each step
    rolls the linear-attention state back to a different one of the step's
    positions. Tokens and every reported logprob equal a run without drafts;
    the slot keeps k + 1 checkpoints, which the plan counts."""
    save_tiny_qwen3_next(tmp_path)
    args = dict(dtype="float32", quantization="none", block_size=4, max_num_seqs=3)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    ps = token_prompts(3, 9, 40, seed=3)
    plain = LLM(str(tmp_path), **args)
    ref = plain.generate(ps, sp)
    spec = LLM(str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **args)
    spec.core.proposer = partly_right(ps, [o.outputs[0].token_ids for o in ref])
    out = spec.generate(ps, sp)
    for a, b in zip(ref, out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        worst = max(abs(la[t] - lb[t]) for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for t in la)
        assert worst < 1e-4, worst
    st = spec.core.get_stats()
    assert 0 < st.spec_decode_num_accepted_tokens_total < st.spec_decode_num_draft_tokens_total
    assert st.spec_decode_num_accepted_tokens_per_pos[2] > 0       # some steps kept 3 drafts of 3
    assert spec.core.plan.state_bytes_per_seq == 4 * plain.core.plan.state_bytes_per_seq
    assert spec.core.plan.max_rollback == 3
    # the real n-gram proposer on looping greedy text
    ngram = LLM(str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **args)
    assert [o.outputs[0].token_ids for o in ngram.generate(ps, sp)] == [o.outputs[0].token_ids for o in ref]


def test_reused_slots_start_from_zero(tmp_path):
    """A slot keeps its last sequence's state: the next sequence in it starts from
    zeros, a one-token prompt (a decode in its first step) as well as a prefill."""
    save_tiny_qwen3_next(tmp_path)
    args = dict(dtype="float32", quantization="none", block_size=4, max_num_seqs=2)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    new = [[5], [9, 4, 3, 200, 17]]
    ref = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **args).generate(new, sp)]
    used = LLM(str(tmp_path), **args)
    used.generate(token_prompts(4, 30, 60, seed=8), sp)            # both slots hold a finished sequence
    assert any(c.recurrent.abs().sum() > 0 for c in used.core.runner.kv_caches if isinstance(c, LinearStateCache))
    assert [o.outputs[0].token_ids for o in used.generate(new, sp)] == ref
