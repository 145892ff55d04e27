"""Each newer model family through the whole engine on a tiny random config
(token-id prompts, fp32): prompt logprobs equal transformers' within 1e-4 and
greedy tokens equal its generate(); chunked prefill mixed with decodes equals
whole prefill; preemption and recompute keep the tokens; and the KV presets
f16, k8v4, tq4 and tq3 keep test_tq_engine's invariants."""
import pytest
import torch
from test_tq_engine import preset_invariants
from tiny_models import save_tiny_gemma4, save_tiny_qwen3_5, save_tiny_qwen3_moe, save_tiny_qwen3_next, token_prompts

from engine import LLM, SamplingParams

FAMILIES = {"qwen3_moe": save_tiny_qwen3_moe, "gemma4": save_tiny_gemma4,
            "gemma4_dense": lambda d: save_tiny_gemma4(d, moe=False), "qwen3_next": save_tiny_qwen3_next,
            "qwen3_5": save_tiny_qwen3_5, "qwen3_5_moe": lambda d: save_tiny_qwen3_5(d, moe=True)}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return str(d), FAMILIES[request.param](d)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def llm(path, **kw):
    return LLM(path, dtype="float32", quantization="none", block_size=4, **kw)


def logprob_gap(engine, hf, ps, max_tokens=8) -> float:
    """Greedy tokens of `engine` == transformers' generate() for each prompt (asserted);
    returns the largest |prompt or sampled logprob - transformers'|."""
    outs = engine.generate(ps, greedy(max_tokens, logprobs=1, prompt_logprobs=1))
    worst = 0.0
    for p, o in zip(ps, outs):
        got = o.outputs[0].token_ids
        ids = torch.tensor([p])
        ref_tokens = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref_tokens
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p + got])).logits[0].float(), -1)
        for i in range(1, len(p)):
            worst = max(worst, abs(o.prompt_logprobs[i][p[i]] - ref[i - 1, p[i]].item()))
        for j, t in enumerate(got):
            worst = max(worst, abs(o.outputs[0].logprobs[j][t] - ref[len(p) - 1 + j, t].item()))
    print(f"max |logprob - transformers| = {worst:.2e}")
    return worst


def test_logprobs_and_greedy_equal_transformers(family):
    path, hf = family
    assert logprob_gap(llm(path), hf, token_prompts(6, 20, 50, seed=21)) < LOGPROB_TOL


def test_chunked_prefill_with_decodes_equals_whole(family):
    path, _ = family
    ps = token_prompts(6, 40, 120, seed=22)
    whole = toks(llm(path, enable_prefix_caching=False).generate(ps, greedy()))
    # 16-token steps: later prompts prefill in chunks while earlier ones decode.
    chunked = llm(path, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert toks(chunked.generate(ps, greedy())) == whole
    assert chunked.core.stats.steps_total >= sum(map(len, ps)) // 16 + 11


def test_preemption_keeps_tokens(family):
    path, _ = family
    ps = token_prompts(8, 30, 60, seed=23)
    ref = toks(llm(path).generate(ps, greedy(40)))
    plan = llm(path, max_num_seqs=8).core.plan
    # 400 tokens of context for 8 sequences of up to 100, and each one's fixed state
    # (linear-attention layers, plus their pad slot; the rest still holds one 120-token
    # sequence: a slot for each)
    # (Without prefix caching for a model with such state: its snapshots would take a share of this budget.)
    small = llm(path, kv_cache_memory=400 * plan.bytes_per_token + 9 * plan.state_bytes_per_seq,
                max_model_len=120, max_num_seqs=8, enable_prefix_caching=not plan.state_bytes_per_seq)
    assert small.core.plan.capacity_tokens == 400
    assert toks(small.generate(ps, greedy(40))) == ref
    assert small.core.get_stats().num_preemptions_total > 0
    assert small.core.kv.num_used_blocks == 0


@pytest.mark.parametrize("spec", ["f16", "k8v4", "tq4", "tq3"])
def test_kv_presets(family, spec):
    preset_invariants(family[0], spec)
