"""The prefix cache kept across restarts (engine/prefix_store.py,
prefix_cache_file): an engine that closes writes its cached blocks; a new
engine of the same model and KV format reads them and hits the prompt at
once, with the same tokens and logprobs as a cold run; on SmolLM2's GGUF,
on TurboQuant with hot tokens (two groups) and on a sliding-window model.
A file of another KV format is ignored; models whose cache holds
per-sequence state are refused at start."""
import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import save_tiny_gemma3, save_tiny_llama, save_tiny_qwen3_next, token_prompts

SP = SamplingParams(max_tokens=8, temperature=0, logprobs=2)     # (prompt logprobs would skip the cache)


def run(llm, prompts):
    outs = llm.generate(prompts, SP)
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            [o.num_cached_tokens for o in outs])


@pytest.mark.parametrize("model, kw", [
    ("smollm2-135m", {"dtype": "float32"}),
    ("tiny-llama", {"dtype": "float32", "kv_cache_dtype": "tq4", "block_size": 4}),     # + the hot group
    ("tiny-gemma3", {"dtype": "float32", "block_size": 4}),                              # sliding windows
])
def test_a_restarted_engine_hits_the_saved_prefixes(model, kw, tmp_path):
    if model == "tiny-llama":
        save_tiny_llama(tmp_path / "m")
        model = str(tmp_path / "m")
    elif model == "tiny-gemma3":
        save_tiny_gemma3(tmp_path / "m")
        model = str(tmp_path / "m")
    prompts = [p * 3 for p in token_prompts(3, lo=20, hi=40, seed=4)]     # 60-120 tokens
    file = tmp_path / "prefix.pt"
    kw = dict(kw, kv_cache_memory=16 << 20)
    cold = run(LLM(model, **kw), prompts)
    assert not any(cold[2])
    with LLM(model, prefix_cache_file=str(file), **kw) as first:
        assert run(first, prompts)[0] == cold[0]
    assert file.exists()
    second = LLM(model, prefix_cache_file=str(file), **kw)
    tokens, logprobs, cached = run(second, prompts)
    assert all(c >= len(p) // 2 for c, p in zip(cached, prompts)), cached     # hits from the file at once
    assert tokens == cold[0]
    for got, want in zip(logprobs, cold[1]):
        for a, b in zip(got, want):
            assert max(abs(a[t] - b[t]) for t in a if t in b) < 1e-4
    # Another KV format's file is not read (its rows mean something else).
    other = LLM(model, prefix_cache_file=str(file), **dict(kw, kv_cache_dtype="k8v4"))
    assert not any(run(other, prompts)[2])


def test_models_with_per_sequence_state_are_refused(tmp_path):
    save_tiny_qwen3_next(tmp_path)
    with pytest.raises(ValueError, match="per-sequence state"):
        LLM(str(tmp_path), dtype="float32", kv_cache_memory=8 << 20, prefix_cache_file=str(tmp_path / "p.pt"))
