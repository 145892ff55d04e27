"""Beam search (vLLM's LLM.beam_search and use_beam_search) against
transformers' `generate(num_beams=...)` on a tiny fp32 llama: every beam's
tokens and score, with and without EOS endings, length penalties 0, 1, 2.
The HTTP side is in test_server_openai.py::test_beam_search."""
import collections

import pytest
import torch

from engine import LLM, BeamSearchParams, InvalidRequest
from engine.beam_search import BeamSearch
from tests.tiny_models import save_tiny_llama, token_prompts

PROMPTS = token_prompts(10, lo=5, hi=20, seed=5)
EOS = 2


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """The tiny llama with EOS made a close second to its most generated
    token, so that beams end at different lengths."""
    d = tmp_path_factory.mktemp("beams")
    m = save_tiny_llama(d).eval()
    with torch.no_grad():
        gen = [m.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        common = collections.Counter(t for g in gen for t in g).most_common(1)[0][0]
        m.lm_head.weight[EOS] = m.lm_head.weight[common] * 0.97
    m.save_pretrained(d)
    return m, LLM(str(d), dtype="float32", kv_cache_memory=8 << 20)


def hf_beams(model, prompt, k, n, length_penalty, eos=True):
    g = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, max_new_tokens=n,
                       do_sample=False, length_penalty=length_penalty, early_stopping=False,
                       eos_token_id=EOS if eos else None, pad_token_id=0, output_scores=True,
                       return_dict_in_generate=True)
    seqs = [s[len(prompt):].tolist() for s in g.sequences]
    return [s[:s.index(EOS) + 1] if eos and EOS in s else s for s in seqs], g.sequences_scores.tolist()


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beams_equal_transformers(eos_model, length_penalty):
    model, llm = eos_model
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=length_penalty))
    ended = 0
    for p, out in zip(PROMPTS, outs):
        want, scores = hf_beams(model, p, 3, 8, length_penalty)
        beams = out.sequences
        assert [b.tokens[len(p):] for b in beams] == want
        for b, score in zip(beams, scores):
            n = len(b.tokens) - len(p)
            assert b.cum_logprob / n ** length_penalty == pytest.approx(score, abs=1e-4)
            assert len(b.logprobs) == n and all(b.tokens[len(p) + i] in d for i, d in enumerate(b.logprobs))
            assert b.finish_reason == ("stop" if b.tokens[-1] == EOS else "length")
            ended += b.finish_reason == "stop"
    assert ended >= 1          # beams ending in EOS, ranked among longer ones


def test_ignore_eos_and_prompt_forms(eos_model):
    model, llm = eos_model
    params = BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search([PROMPTS[0], {"prompt_token_ids": PROMPTS[1]}], params)
    for p, out in zip(PROMPTS[:2], outs):
        want, _ = hf_beams(model, p, 4, 6, 1.0, eos=False)
        assert [b.tokens[len(p):] for b in out.sequences] == want
        assert all(b.finish_reason == "length" for b in out.sequences)
    with pytest.raises(InvalidRequest, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidRequest, match="maximum context length"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=10**6))
    with pytest.raises(InvalidRequest, match="beam width 11 needs the top 22 logprobs"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=11, max_tokens=2))
    assert not llm.core.has_work()


def test_search_stops_when_no_live_beam_can_win():
    """transformers' early_stopping=False rule: with beam_width complete
    beams scoring above every live one at its length, the search ends."""
    s = BeamSearch([7, 7], BeamSearchParams(beam_width=1, max_tokens=50), stop_ids={2})
    s.advance([{2: -0.1, 5: -1.0, 6: -3.0}])
    assert s.complete[0].tokens == [7, 7, 2] and s.done and s.steps == 1
    out = s.output(None).sequences
    assert [b.tokens for b in out] == [[7, 7, 2]] and out[0].finish_reason == "stop"


def test_async_beam_search_and_abort(eos_model):
    """AsyncLLM.beam_search (the server's) gives LLM.beam_search's beams;
    abort(request_id) (a client gone, a drain's end) ends it with the beams
    so far, finish_reason "abort", and leaves nothing running."""
    import asyncio

    from engine import AsyncLLM, EngineArgs
    _, llm = eos_model
    path = llm.core.args.model
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=1.0)
    want = [b.tokens for b in llm.beam_search(PROMPTS[2], params)[0].sequences]

    async def main():
        eng = AsyncLLM(EngineArgs(model=path, kv_cache_memory=8 << 20, dtype="float32"))
        await eng.start()
        try:
            got = [b.tokens for b in (await eng.beam_search(PROMPTS[2], params, "bs")).sequences]
            long = asyncio.create_task(eng.beam_search(PROMPTS[3], BeamSearchParams(3, 400, ignore_eos=True), "bs2"))
            while eng._beam_searches.get("bs2") is None or eng._beam_searches["bs2"].steps < 3:
                await asyncio.sleep(0.01)
            await eng.abort("bs2")
            cut = await asyncio.wait_for(long, 30)
            for _ in range(100):
                if not eng.stats().get("num_running") and not eng._streams:
                    break
                await asyncio.sleep(0.05)
            return got, cut, eng.stats(), dict(eng._streams)
        finally:
            await eng.shutdown()
    got, cut, stats, streams = asyncio.run(main())
    assert got == want
    assert all(b.finish_reason == "abort" for b in cut.sequences) and len(cut.sequences) == 3
    assert 3 <= len(cut.sequences[0].tokens) - len(PROMPTS[3]) < 400
    assert stats["num_running"] == 0 and not streams
