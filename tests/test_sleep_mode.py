"""vLLM's sleep mode (engine/sleep_mode.py): an idle engine gives its KV pool
(level 1) and weights (level 2) back to the system, measured in this
process's anonymous memory, refuses requests while asleep, and wakes (in one
call or weights first, then the KV cache) to the same greedy tokens: on the
real SmolLM2 GGUF, on every KV storage kind (dense with a sliding window,
TurboQuant, linear-attention state, DeepSeek-V4's pool), with LoRA slots
emptied and reloaded, and over two tensor-parallel ranks. The HTTP routes
are in test_server_ops.py."""
import shutil

import pytest

from engine import LLM, InvalidRequest, LoRARequest, SamplingParams
from tests.test_lora import ADAPTERS, reference, save_adapter
from tests.tiny_models import (save_tiny_deepseek_v4, save_tiny_gemma3, save_tiny_llama, save_tiny_qwen3_next,
                               token_prompts)

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def anon_mib() -> float:
    """This process's anonymous resident memory (not the mapped GGUF's page cache)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


def tokens(llm, prompts, **kw):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, **kw)]


def test_smollm2_sleeps_both_levels_and_wakes_to_the_same_tokens():
    llm = LLM("smollm2-135m", kv_cache_memory=128 << 20, enable_sleep_mode=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ref = tokens(llm, prompts)
    kv = llm.core.plan.total_bytes / 2**20
    before = anon_mib()
    llm.sleep(1)
    assert llm.is_sleeping() and before - anon_mib() > 0.9 * kv         # the pool went; the weights stay (CPU)
    with pytest.raises(InvalidRequest, match="sleeping"):
        llm.generate(prompts, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping() and tokens(llm, prompts) == ref
    before = anon_mib()
    llm.sleep(2)
    freed = llm.core.asleep.freed_bytes / 2**20
    assert freed > kv + 30          # the weights the engine owns went too (the GGUF's mapped ones are page cache)
    assert before - anon_mib() > 0.9 * freed
    llm.wake_up(["weights"])         # an RL trainer would update them here
    assert llm.is_sleeping()
    with pytest.raises(InvalidRequest, match="sleeping"):
        llm.generate(prompts, GREEDY)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping() and tokens(llm, prompts) == ref


FAMILIES = {"gemma3_tq4": (save_tiny_gemma3, {"kv_cache_dtype": "tq4"}),     # TurboQuant + dense sliding window
            "qwen3_next": (save_tiny_qwen3_next, {}),                         # linear-attention state slots
            "deepseek_v4": (save_tiny_deepseek_v4, {"block_size": 4})}        # its own paged pool


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_kv_kind_wakes_to_the_same_tokens(family, tmp_path):
    save, kw = FAMILIES[family]
    save(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", quantization="none", kv_cache_memory=8 << 20,
              enable_sleep_mode=True, **kw)
    prompts = [[t % 128 for t in p] for p in token_prompts(3, lo=10, hi=40, seed=5)]    # (V4's vocabulary: 128)
    ref = tokens(llm, prompts)
    for level in (1, 2):
        llm.sleep(level)
        assert llm.core.asleep.freed_bytes >= llm.core.plan.total_bytes
        llm.wake_up()
        assert tokens(llm, prompts) == ref, level


def test_lora_slots_reload_after_level_2_and_two_ranks_sleep_together(tmp_path):
    base = save_tiny_llama(tmp_path / "model").eval()
    ref = save_adapter(base, tmp_path / "a", seed=7, **ADAPTERS["all8"])
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    prompts = token_prompts(2, lo=10, hi=30, seed=9)
    want = [reference(m, p, 10)[1] for m, p in zip((ref, base), prompts)]
    for tp in (1, 2):
        llm = LLM(str(tmp_path / "model"), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True,
                  enable_sleep_mode=True, tensor_parallel_size=tp)
        try:
            assert tokens(llm, prompts, lora_request=[lora, None]) == want
            for level in (1, 2):
                llm.sleep(level)
                llm.wake_up()
                assert tokens(llm, prompts, lora_request=[lora, None]) == want, (tp, level)
        finally:
            llm.close()
    shutil.rmtree(tmp_path / "a")


def test_what_sleep_refuses(tmp_path):
    save_tiny_llama(tmp_path)
    off = LLM(str(tmp_path), dtype="float32", kv_cache_memory=4 << 20)
    with pytest.raises(InvalidRequest, match="--enable-sleep-mode"):
        off.sleep()
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, enable_sleep_mode=True)
    with pytest.raises(InvalidRequest, match="level must be 1 or 2"):
        llm.sleep(3)
    llm.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()
    assert not llm.is_sleeping()
    while llm.core.has_work():
        llm.step()
    llm.sleep()
    with pytest.raises(InvalidRequest, match="tags"):
        llm.wake_up(["everything"])
    llm.sleep(2)            # asleep already: nothing more
    assert llm.core.asleep.level == 1
    llm.wake_up()
    assert not llm.is_sleeping()


def test_async_engine_sleeps_and_refuses_with_engine_sleeping(tmp_path):
    """Through the engine-core process: a request that reaches a sleeping
    engine fails with EngineSleeping (the server's 503), not a plain
    InvalidRequest (a 400)."""
    import asyncio

    from engine import AsyncLLM, EngineArgs
    from engine.errors import EngineSleeping
    save_tiny_llama(tmp_path)
    prompt = [5, 6, 7, 8]

    async def main():
        eng = AsyncLLM(EngineArgs(model=str(tmp_path), dtype="float32", kv_cache_memory=4 << 20,
                                  enable_sleep_mode=True))
        await eng.start()
        try:
            async def run(rid):
                out = None
                async for out in eng.generate(prompt, GREEDY, rid):
                    pass
                return out.outputs[0].token_ids
            want = await run("a")
            assert await eng.sleep(2) and await eng.is_sleeping()
            with pytest.raises(EngineSleeping, match="sleeping"):
                await run("b")
            await eng.wake_up()
            assert not await eng.is_sleeping()
            return want, await run("c")
        finally:
            await eng.shutdown()
    want, got = asyncio.run(main())
    assert got == want
