"""Engine behaviour on a tiny random llama (token-id prompts, no tokenizer):
scheduler, paged KV, prefix cache, preemption, sampler, bad input."""

import pytest
import torch

from engine import LLM, InvalidRequest, SamplingError, SamplingParams
from tiny_models import save_tiny_llama, token_prompts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    return str(d), save_tiny_llama(d)


prompts = token_prompts


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_equals_transformers_and_batch_invariant(tiny_dir):
    path, hf = tiny_dir
    llm = LLM(path, block_size=4, kv_cache_memory=4 << 20)
    ps = prompts(16)
    batch = llm.generate(ps, greedy())
    for p, o in zip(ps[:4], batch[:4]):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
    alone = llm.generate([ps[5]], greedy())[0]
    assert alone.outputs[0].token_ids == batch[5].outputs[0].token_ids
    assert all(o.outputs[0].finish_reason == "length" for o in batch)


def test_chunked_prefill_equals_unchunked(tiny_dir):
    path, _ = tiny_dir
    ps = prompts(6, 40, 120, seed=1)
    whole = LLM(path, block_size=4, enable_prefix_caching=False)
    ref = whole.generate(ps, greedy())
    chunked = LLM(path, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16)
    out = chunked.generate(ps, greedy())
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    # Every step is capped at 16 tokens, so the prompts took many chunks.
    assert chunked.core.stats.steps_total >= sum(map(len, ps)) // 16 + 11
    assert whole.core.stats.steps_total == 12


def test_prefix_cache_hit_equals_miss(tiny_dir):
    path, _ = tiny_dir
    llm = LLM(path, block_size=4)
    base = prompts(1, 50, 51, seed=2)[0]
    first = llm.generate([base], greedy())[0]
    st = llm.core.get_stats()
    hits0 = st.prefix_cache_hits_total
    second = llm.generate([base], greedy())[0]
    branch = llm.generate([base[:30] + [7, 8, 9]], greedy())[0]
    st = llm.core.get_stats()
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens == 48 and st.prefix_cache_hits_total >= hits0 + 48 + 28
    nocache = LLM(path, block_size=4, enable_prefix_caching=False)
    assert nocache.generate([base[:30] + [7, 8, 9]], greedy())[0].outputs[0].token_ids == \
        branch.outputs[0].token_ids
    # vLLM's reset_prefix_cache: refused while a request holds blocks, then every block forgotten.
    llm.add_request(base, greedy())
    llm.step()
    assert llm.reset_prefix_cache() is False
    while llm.core.has_work():
        llm.step()
    assert llm.reset_prefix_cache() is True
    again = llm.generate([base], greedy())[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_keeps_tokens(tiny_dir):
    path, _ = tiny_dir
    ps = prompts(8, 30, 60, seed=3)
    ref = LLM(path, block_size=4).generate(ps, greedy(40))
    # 2 layers * 2 (k, v) * 2 heads * 16 dims * 4 B = 512 B/token: 160 tokens of room.
    small = LLM(path, block_size=4, kv_cache_memory=160 * 512, max_model_len=120)
    out = small.generate(ps, greedy(40))
    assert small.core.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert small.core.kv.num_used_blocks == 0


def test_blocks_return_to_pool(tiny_dir):
    path, _ = tiny_dir
    llm = LLM(path, block_size=4, enable_prefix_caching=False)
    llm.generate(prompts(10), greedy())
    assert llm.core.kv.num_used_blocks == 0


def test_sampling_seed_repeatable_and_n(tiny_dir):
    path, _ = tiny_dir
    llm = LLM(path, block_size=4)
    p = prompts(1, seed=4)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=16, ignore_eos=True)
    a = llm.generate(p, sp)[0].outputs[0].token_ids
    b = llm.generate(p + prompts(3, seed=5), sp)[0].outputs[0].token_ids   # in another batch
    assert a == b
    c = llm.generate(p, SamplingParams(temperature=1.0, seed=124, max_tokens=16, ignore_eos=True))
    assert c[0].outputs[0].token_ids != a
    two = llm.generate(p, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))[0]
    assert [o.index for o in two.outputs] == [0, 1]
    assert two.outputs[0].token_ids != two.outputs[1].token_ids
    # top_k=1 is greedy
    g = llm.generate(p, greedy(16))[0].outputs[0].token_ids
    k1 = llm.generate(p, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True, seed=9))
    assert k1[0].outputs[0].token_ids == g


def test_logit_bias_stop_ids_min_tokens_penalties(tiny_dir):
    path, _ = tiny_dir
    llm = LLM(path, block_size=4)
    p = prompts(1, seed=6)
    forced = llm.generate(p, greedy(5, logit_bias={42: 100.0}))[0].outputs[0]
    assert forced.token_ids == [42] * 5
    stop = llm.generate(p, greedy(20, logit_bias={42: 100.0}, stop_token_ids=[42]))[0].outputs[0]
    assert stop.token_ids == [42] and stop.finish_reason == "stop" and stop.stop_reason == 42
    late = llm.generate(p, greedy(20, logit_bias={42: 100.0}, stop_token_ids=[42], min_tokens=3))[0]
    assert late.outputs[0].token_ids[:3] != [42, 42, 42] and late.outputs[0].token_ids[-1] == 42
    assert len(late.outputs[0].token_ids) == 4
    eos = SamplingParams(temperature=0, max_tokens=10, logit_bias={2: 100.0})
    assert llm.generate(p, eos)[0].outputs[0].token_ids == [2]          # eos from config.json
    # A strong repetition penalty never repeats a token under greedy decoding.
    rep = llm.generate(p, greedy(30, repetition_penalty=1e6))[0].outputs[0].token_ids
    assert len(set(rep)) == len(rep) and not set(rep) & set(p[0])
    freq = llm.generate(p, greedy(30, frequency_penalty=2.0, presence_penalty=2.0))[0].outputs[0]
    plain = llm.generate(p, greedy(30))[0].outputs[0]
    assert len(set(freq.token_ids)) >= len(set(plain.token_ids))


def test_logprobs_match_transformers(tiny_dir):
    path, hf = tiny_dir
    llm = LLM(path, block_size=4)
    p = prompts(1, 20, 21, seed=7)[0]
    out = llm.generate([p], greedy(4, logprobs=3, prompt_logprobs=2))[0]
    toks = out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p + toks])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        lp = out.prompt_logprobs[i]
        assert abs(lp[p[i]] - ref[i - 1, p[i]].item()) < 1e-3
        assert len(lp) in (2, 3)
    for j, t in enumerate(toks):
        lp = out.outputs[0].logprobs[j]
        assert next(iter(lp)) == t
        assert abs(lp[t] - ref[len(p) - 1 + j, t].item()) < 1e-3
        assert max(lp.values()) == lp[t]          # greedy: chosen is the top
    scored = llm.generate([p], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert scored.outputs[0].token_ids == [] and len(scored.prompt_logprobs) == len(p)


def test_bad_input_is_clear_and_harmless(tiny_dir):
    path, _ = tiny_dir
    llm = LLM(path, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequest, match="64"):
        llm.generate([[5] * 70], greedy())
    with pytest.raises(InvalidRequest, match="max_tokens"):
        llm.generate([[5] * 10], greedy(60))
    with pytest.raises(InvalidRequest):
        llm.generate([[5, 999]], greedy())
    with pytest.raises(InvalidRequest, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], greedy())
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=-1), dict(top_k=-5),
                dict(min_tokens=5, max_tokens=2), dict(logprobs=-1), dict(allowed_token_ids=[])):
        with pytest.raises(SamplingError):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequest, match="--max-logprobs"):     # (vLLM's default cap, 20)
        llm.generate([[5] * 10], greedy(logprobs=50))
    # A batch with one bad prompt queues nothing; the engine is still fine.
    with pytest.raises(InvalidRequest):
        llm.generate([[5] * 10, [5] * 100], greedy())
    assert not llm.core.has_work()
    assert llm.generate([[5] * 10], greedy())[0].outputs[0].finish_reason == "length"


def test_sliding_window_blocks_stay_bounded(tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                           max_position_embeddings=1024, query_pre_attn_scalar=32)
    hf = Gemma3ForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * 0.2) if "norm" in n else p.mul_(3.0)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), block_size=4, kv_cache_memory=1 << 20)
    assert [g.sliding_window for g in llm.core.kv.groups] == [None, 8]
    p = prompts(1, 30, 31, seed=8)[0]
    llm.add_request(p, greedy(150))
    sliding_used, full_used = [], []
    while llm.core.has_work():
        llm.step()
        pools = llm.core.kv.pools
        sliding_used.append(pools[1].num_blocks - pools[1].num_free)
        full_used.append(pools[0].num_blocks - pools[0].num_free)
    # The 30-token prefill needs all its blocks in its step; after that the
    # window (8 tokens) never holds more than 3 blocks of 4 plus the next one.
    assert max(sliding_used[1:]) <= 8 // 4 + 2 and sliding_used[0] == 8
    assert max(full_used) >= (30 + 149) // 4
    ref = hf_greedy(hf, p, 40)
    assert llm.generate([p], greedy(40))[0].outputs[0].token_ids == ref


def test_cache_salt_isolates_prefix_blocks(tiny_dir):
    """vLLM's cache_salt: only requests with the same salt share prefix-cache
    blocks, also after a preemption re-admits one."""
    path, _ = tiny_dir
    llm = LLM(path, block_size=4)
    base = prompts(1, 50, 51, seed=7)[0]

    def run(salt):
        before = llm.core.get_stats().prefix_cache_hits_total
        rid = llm.add_request(base, greedy(), cache_salt=salt)
        out = llm._run([rid], False)[rid]
        return llm.core.get_stats().prefix_cache_hits_total - before, out.outputs[0].token_ids

    hits, want = run("tenant-a")
    assert hits == 0
    assert run("tenant-a") == (48, want)          # the same salt: its blocks
    assert run("tenant-b") == (0, want)           # another salt, or none: not found
    assert run(None) == (0, want)
    assert run(None) == (48, want)
    assert run("tenant-b") == (48, want)
    # Salted requests through preemptions: the same tokens.
    small = LLM(path, block_size=4, kv_cache_memory=160 * 512, max_model_len=120)
    ps = prompts(8, 30, 60, seed=3)
    ref = LLM(path, block_size=4).generate(ps, greedy(40))
    rids = [small.add_request(p, greedy(40), cache_salt=f"t{i % 2}") for i, p in enumerate(ps)]
    done = small._run(rids, False)
    assert small.core.get_stats().num_preemptions_total > 0
    assert [done[r].outputs[0].token_ids for r in rids] == [o.outputs[0].token_ids for o in ref]
    found = []
    for salt in ("t0", "t0", "t1"):
        hits = small.core.get_stats().prefix_cache_hits_total
        rid = small.add_request(ps[0], greedy(1), cache_salt=salt)
        small._run([rid], False)
        found.append(small.core.get_stats().prefix_cache_hits_total - hits)
    assert found[1] > 0 and found[2] == 0, found
