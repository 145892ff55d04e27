"""vLLM's allowed_token_ids, bad_words and --max-logprobs in the engine:
allowed tokens against transformers' argmax over them (a tiny llama, fp32,
beside an unconstrained request in the same batch); bad words on the real
SmolLM2 and its tokenizer, where the banned token is replaced by the model's
best other choice at exactly the position it would have been generated
(synchronous and asynchronous scheduling). The HTTP side is in
test_server_openai.py::test_allowed_token_ids_and_bad_words."""
import random

import numpy as np
import pytest
import torch

from engine import LLM, InvalidRequest, SamplingParams
from engine.bad_words import banned_now, token_sequences
from engine.sampling_params import SamplingError
from tests.tiny_models import save_tiny_llama, token_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("constraints")
    return d, save_tiny_llama(d).eval()


def hf_greedy(model, prompt: list[int], n: int, allowed: list[int] | None = None) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            if allowed is not None:
                logits = torch.full_like(logits, -torch.inf).index_copy(0, torch.tensor(allowed),
                                                                         logits[allowed])
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_allowed_token_ids_equal_the_argmax_over_them(tiny):
    path, model = tiny
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    allowed = random.Random(0).sample(range(3, 256), 12)
    prompts = token_prompts(3, lo=5, hi=20, seed=2)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed[:3],
                             logprobs=1)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    want = hf_greedy(model, prompts[0], 8, allowed)
    assert outs[0].token_ids == want and want != hf_greedy(model, prompts[0], 8)
    assert outs[1].token_ids == hf_greedy(model, prompts[1], 8)         # its batch neighbours' masks miss it
    assert set(outs[2].token_ids) <= set(allowed[:3])
    assert len(set(outs[2].token_ids)) > 1                             # sampled, not one forced token
    # An allowed token banned by another rule (min_tokens bans EOS) stays banned.
    eos_only = llm.generate(prompts[0], SamplingParams(max_tokens=3, min_tokens=2, temperature=0,
                                                       allowed_token_ids=[2, allowed[0]]))[0].outputs[0]
    assert eos_only.token_ids[:2] == [allowed[0]] * 2
    with pytest.raises(SamplingError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidRequest, match=r"allowed_token_ids must be in \[0, 256\)"):
        llm.generate(prompts[0], SamplingParams(allowed_token_ids=[256]))


def test_max_logprobs(tiny):
    path, _ = tiny
    prompt = token_prompts(1, seed=4)[0]
    capped = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, max_logprobs=3)
    assert len(capped.generate(prompt, SamplingParams(max_tokens=1, logprobs=3))[0].outputs[0].logprobs[0]) >= 3
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest, match=f"{name} of 4, which is greater than max allowed: 3"):
            capped.generate(prompt, SamplingParams(max_tokens=1, **{name: 4}))
    free = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, max_logprobs=-1)
    out = free.generate(prompt, SamplingParams(max_tokens=1, logprobs=256, temperature=0))[0].outputs[0]
    lps = out.logprobs[0]
    assert len(lps) == 256 and abs(np.logaddexp.reduce(list(lps.values()))) < 1e-4    # the whole distribution


def test_banned_now():
    seqs = [[5], [7, 8], [1, 2, 3]]
    assert banned_now(seqs, np.array([], np.int64)) == [5]
    assert banned_now(seqs, np.array([4, 7], np.int64)) == [5, 8]
    assert banned_now(seqs, np.array([1, 2], np.int64)) == [5, 3]
    assert banned_now(seqs, np.array([2, 1], np.int64)) == [5]


def _ranked(lps: dict[int, float]) -> list[int]:
    return [t for t, _ in sorted(lps.items(), key=lambda kv: -kv[1])]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bad_words_replace_exactly_the_banned_token(async_scheduling):
    llm = LLM("smollm2-135m", kv_cache_memory=64 << 20, max_model_len=512, async_scheduling=async_scheduling)
    tok = llm.tokenizer
    prompt = "Here is a short story about a dragon who loved to read books:"
    sp = dict(max_tokens=24, temperature=0, ignore_eos=True)
    orig = llm.generate(prompt, SamplingParams(logprobs=5, **sp))[0].outputs[0]
    ids = orig.token_ids
    # A two-token phrase from the output that starts a word: its second token
    # is banned only right after its first.
    j = next(i for i in range(1, len(ids) - 1)
             if tok.decode([ids[i]]).startswith(" ") and tok.decode(ids[i:i + 2]).strip().isalpha())
    phrase = tok.decode(ids[j:j + 2])
    assert ids[j:j + 2] in token_sequences(tok, [phrase])
    new = llm.generate(prompt, SamplingParams(bad_words=[phrase], **sp))[0].outputs[0].token_ids
    assert new[:j + 1] == ids[:j + 1]
    assert new[j + 1] == next(t for t in _ranked(orig.logprobs[j + 1]) if t != ids[j + 1])
    assert not any(new[i:i + 2] == ids[j:j + 2] for i in range(len(new) - 1))
    # A one-token word is never generated, in either spelling.
    k = next(i for i, t in enumerate(ids) if tok.decode([t]).strip().isalpha())
    word = tok.decode([ids[k]]).strip()
    banned = {s[0] for s in token_sequences(tok, [word]) if len(s) == 1}
    assert ids[k] in banned
    new = llm.generate(prompt, SamplingParams(bad_words=[word], **sp))[0].outputs[0].token_ids
    assert new[:k] == ids[:k]
    assert new[k] == next(t for t in _ranked(orig.logprobs[k]) if t not in banned)
    assert not banned & set(new)
