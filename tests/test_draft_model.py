"""Speculative decoding with a draft model (engine/draft_model.py, vLLM's
speculative_config {"model": ..., "num_speculative_tokens": k}): the target's
greedy tokens come out unchanged, whatever the draft proposes; a draft equal
to the target has every draft accepted (k + 1 tokens a step); preemption,
sleep mode (level 2 reads both models again) and the real SmolLM2 GGUF
drafting for itself; what cannot draft is refused at start."""
import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import save_tiny_llama, save_tiny_qwen3, token_prompts

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def tokens(llm, prompts, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    save_tiny_llama(d / "target")
    save_tiny_qwen3(d / "other")          # another architecture, the same 256 ids: a poor draft
    prompts = token_prompts(5, lo=10, hi=40, seed=3)
    want = tokens(LLM(str(d / "target"), dtype="float32", kv_cache_memory=8 << 20), prompts)
    return d, prompts, want


def draft_llm(d, draft, k=3, **kw):
    return LLM(str(d / "target"), dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", 8 << 20),
               speculative_config={"model": str(d / draft), "num_speculative_tokens": k}, **kw)


def test_the_target_as_its_own_draft_accepts_every_draft(models, monkeypatch):
    import engine.draft_model
    monkeypatch.setattr(engine.draft_model, "CATCH_UP_CHUNK", 7)      # prompts of 10-40 tokens: in chunks
    d, prompts, want = models
    llm = draft_llm(d, "target", k=4)
    assert tokens(llm, prompts) == want
    st = llm.core.stats
    assert st.spec_decode_num_draft_tokens_total > 0
    assert st.spec_decode_num_accepted_tokens_total == st.spec_decode_num_draft_tokens_total
    assert st.steps_total <= 1 + -(-20 // 5) + 1      # a prefill, then 5 tokens a step


def test_a_poor_draft_changes_nothing_also_under_preemption_and_sleep(models):
    d, prompts, want = models
    llm = draft_llm(d, "other", k=3)
    assert tokens(llm, prompts) == want
    st = llm.core.stats
    assert 0 <= st.spec_decode_num_accepted_tokens_total < st.spec_decode_num_draft_tokens_total
    tight = draft_llm(d, "other", k=3, kv_cache_memory=200_000, max_num_seqs=5)
    assert tokens(tight, prompts) == want and tight.core.scheduler.stats.num_preemptions > 0
    assert len(tight.core.proposer.seqs) == 0           # every request's draft blocks went back
    napping = draft_llm(d, "target", k=2, enable_sleep_mode=True)
    assert tokens(napping, prompts[:2]) == want[:2]
    napping.sleep(2)
    napping.wake_up()
    assert tokens(napping, prompts[:2]) == want[:2]
    st = napping.core.stats
    assert st.spec_decode_num_accepted_tokens_total == st.spec_decode_num_draft_tokens_total   # both reloaded


def test_smollm2_gguf_drafts_for_itself():
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(max_tokens=16, temperature=0)
    want = tokens(LLM("smollm2-135m", dtype="float32", kv_cache_memory=64 << 20), prompts, sp)
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory=64 << 20,
              speculative_config={"model": "smollm2-135m", "num_speculative_tokens": 4})
    assert tokens(llm, prompts, sp) == want
    st = llm.core.stats
    assert st.spec_decode_num_accepted_tokens_total >= 0.9 * st.spec_decode_num_draft_tokens_total > 0


@pytest.mark.parametrize("config, kw, words", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, {}, "takes the drafting model as 'model'"),
    ({"method": "ngram", "model": "smollm2-135m", "num_speculative_tokens": 2}, {}, "other methods take none"),
    ({"model": "gemma3-270m", "num_speculative_tokens": 2}, {}, "tokenizer is not the target's"),
    ({"model": "smollm2-135m", "num_speculative_tokens": 2}, {"tensor_parallel_size": 2}, "tensor parallelism"),
])
def test_what_cannot_draft_is_refused(config, kw, words):
    with pytest.raises(ValueError, match=words):
        LLM("smollm2-135m", kv_cache_memory=16 << 20, speculative_config=config, **kw)
