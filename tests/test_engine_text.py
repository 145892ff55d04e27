"""Text-level engine behaviour on SmolLM2: incremental detokenization, stop
strings, the async client in its own process (concurrency, abort)."""
import asyncio

import pytest

from engine import LLM, AsyncLLM, EngineArgs, InvalidRequest, SamplingParams
from engine.detokenizer import IncrementalDetokenizer

ARGS = dict(kv_cache_memory=64 << 20, max_model_len=1024, max_num_seqs=16)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", **ARGS)


def test_incremental_detokenization_utf8(llm):
    tok = llm.tokenizer
    text = "Ünïcödé ✓ naïve café — 日本語のテキスト 🚀🎉 done.\n  spaces  and\ttabs"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say:", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0          # multi-token characters were held back


def test_stop_strings_cut_text(llm):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = llm.generate(["Once upon a time"], sp)[0].outputs[0]
    words = base.text.split()
    stop = words[len(words) // 2]
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                          stop=[stop, "zzzz-never"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    assert stop not in cut.text
    keep = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                           stop=[stop], include_stop_str_in_output=True))
    assert keep[0].outputs[0].text == base.text[:base.text.index(stop) + len(stop)]
    assert not llm.core.has_work() and llm.core.kv.num_used_blocks == 0


def test_chat_stops_on_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=200))
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] in llm.core.info.eos_token_ids
    assert "<|im_end|>" not in o.text and o.text.strip()
    # The eos / stop token that ended it is not text even with special tokens kept (a
    # DSML tool parser keeps them), unless asked for; the same with stop strings set.
    ask = [{"role": "user", "content": "Say hello."}]
    for extra in ({}, {"stop": ["zzzz-never"]}):
        kept = llm.chat(ask, SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False, **extra))
        assert kept.outputs[0].token_ids == o.token_ids and kept.outputs[0].text == o.text
        shown = llm.chat(ask, SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False,
                                             include_stop_str_in_output=True, **extra)).outputs[0]
        assert shown.text == o.text + "<|im_end|>"
    stop_id = o.token_ids[2]
    by_id = llm.chat(ask, SamplingParams(temperature=0, max_tokens=200, stop_token_ids=[stop_id])).outputs[0]
    assert by_id.stop_reason == stop_id and by_id.token_ids == o.token_ids[:3]
    assert by_id.text == llm.tokenizer.decode(o.token_ids[:2])


def test_async_client_concurrency_and_abort():
    async def main():
        eng = AsyncLLM(EngineArgs(model="smollm2-135m", **ARGS))
        await eng.start()
        try:
            tok = eng.tokenizer
            sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

            async def run(i):
                last = None
                async for out in eng.generate(f"Story number {i}:", sp, f"r{i}"):
                    last = out
                return last

            outs = await asyncio.gather(*[run(i) for i in range(8)])
            assert all(o.finished and len(o.outputs[0].token_ids) == 16 for o in outs)
            assert outs[3].outputs[0].text == tok.decode(outs[3].outputs[0].token_ids)
            # Streams grow monotonically; closing one early aborts it in the core.
            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            seen = 0
            gen = eng.generate("Tell me everything.", long, "quitter")
            async for out in gen:
                assert len(out.outputs[0].token_ids) > seen
                seen = len(out.outputs[0].token_ids)
                if seen >= 5:
                    break
            await gen.aclose()
            for _ in range(100):
                await asyncio.sleep(0.05)
                if eng.stats()["num_running"] == 0 and eng.stats()["kv_cache_usage"] == 0:
                    break
            assert eng.stats()["num_running"] == 0 and eng.stats()["kv_cache_usage"] == 0
            with pytest.raises(InvalidRequest, match="1024"):
                async for _ in eng.generate([5] * 2000, sp):
                    pass
            st = eng.stats()
            assert st["generation_tokens_total"] >= 8 * 16 + 5
            assert eng.kv_info["capacity_tokens"] > 1024
        finally:
            await eng.shutdown()
    asyncio.run(main())


def test_abort_stops_the_request_in_the_core():
    """AsyncLLM.abort (a drain's end, a cancelled background response): the
    stream ends "abort" and the core stops the request (it used to run on to
    max_tokens, its outputs dropped)."""
    async def main():
        eng = AsyncLLM(EngineArgs(model="smollm2-135m", **ARGS))
        await eng.start()
        try:
            gen = eng.generate("Tell me everything.", SamplingParams(temperature=0, max_tokens=900, ignore_eos=True),
                               "long")
            first = await gen.__anext__()
            assert not first.finished and eng.stats()["num_running"] == 1
            await eng.abort("long")
            last = [o async for o in gen][-1]
            assert last.finished and last.outputs[0].finish_reason == "abort"
            for _ in range(100):                 # bounded: 10 s
                if eng.stats()["num_running"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert eng.stats()["num_running"] == 0
        finally:
            await eng.shutdown()
    asyncio.run(main())
