"""Asynchronous scheduling (--async-scheduling): each step is scheduled and
launched while the one before is in flight, its last tokens read on the
device. Its tokens, logprobs and finish reasons equal the synchronous
engine's; the KV pool ends empty; requests that sample from their own
previous tokens on the host (penalties, grammars) have the next step's
forward launched ahead and its sampling after the tokens arrive."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from test_server_process import free_port
from tiny_models import save_tiny_llama, save_tiny_qwen3, token_prompts


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_async")
    save_tiny_llama(d)
    return str(d)


def count_ahead(llm) -> list[tuple[int, bool]]:
    """Per launched step: how many input ids came from the step in flight, and
    whether its sampling waited for that step's tokens."""
    seen, launch = [], llm.core.runner.launch

    def counted(out, prev=None, sample=True):
        h = launch(out, prev, sample)
        seen.append((h.plan.patches, not sample))
        return h
    llm.core.runner.launch = counted
    return seen


def run(path, prompts, params, **kw):
    llm = LLM(path, block_size=4, kv_cache_memory=4 << 20, **kw)
    ahead = count_ahead(llm)
    outs = llm.generate(prompts, params)
    res = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]
    assert llm.core.kv.num_used_blocks == 0 and llm.core.inflight is None
    stats = llm.core.get_stats()
    llm.close()
    return res, ahead, stats


def same(got, want):
    """Tokens and finish reasons equal; logprobs over the same tokens, equal to
    float rounding (a step's batch differs: a request ended while its next
    step was in flight still has a row in that step)."""
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        assert (g[2] is None) == (w[2] is None)
        for a, b in zip(g[2] or [], w[2] or []):
            assert list(a) == list(b) and all(a[k] == pytest.approx(b[k], abs=1e-5) for k in a)


def mixed_params(n, stops=None):
    """Greedy, seeded and logprob rows; max_tokens 3..; stop tokens where given."""
    return [SamplingParams(temperature=0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else 100 + i,
                           max_tokens=3 + 2 * i, ignore_eos=i % 3 == 0, logprobs=2 if i % 4 == 0 else None,
                           stop_token_ids=[stops[i]] if stops and stops[i] is not None else None)
            for i in range(n)]


def test_async_equals_sync(tiny_path):
    """Chunked prefills next to decodes, a queue (max_num_seqs), max_tokens,
    stop tokens that end requests while their next step is in flight."""
    ps = token_prompts(10, 5, 40, seed=7)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=24)
    ref, _, _ = run(tiny_path, ps, mixed_params(10), **kw)
    # Stop each odd request at its 3rd generated token (if it gets that far).
    stops = [toks[2] if i % 2 and len(toks) > 3 else None for i, (toks, _, _) in enumerate(ref)]
    want, ahead_sync, _ = run(tiny_path, ps, mixed_params(10, stops), **kw)
    got, ahead, _ = run(tiny_path, ps, mixed_params(10, stops), async_scheduling=True, **kw)
    assert sum(r[1] == "stop" for r in want) >= 3                  # some end on a stop token
    same(got, want)
    assert not any(p for p, _ in ahead_sync) and sum(p > 0 for p, _ in ahead) > 10   # steps did run ahead
    assert not any(d for _, d in ahead)         # sampled as launched: nothing reads its tokens on the host


def test_async_preemption(tiny_path):
    ps = token_prompts(8, 30, 60, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _, _ = run(tiny_path, ps, sp, max_model_len=120)
    small = dict(kv_cache_memory=160 * 512, max_model_len=120)     # 160 tokens of room (512 B/token)
    llm = LLM(tiny_path, block_size=4, async_scheduling=True, **small)
    ahead = count_ahead(llm)
    out = llm.generate(ps, sp)
    assert llm.core.get_stats().num_preemptions_total > 0 and any(p for p, _ in ahead)
    same([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in out], ref)
    assert llm.core.kv.num_used_blocks == 0


def test_requests_that_read_their_tokens_sample_late(tiny_path):
    """Penalties read a request's previous tokens on the host: with one of
    them running, each step's forward still runs ahead, its sampling waits
    for the tokens in flight, and the tokens equal the synchronous engine's
    (a min_tokens row among them)."""
    ps = token_prompts(4, 5, 20, seed=2)
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5),
           SamplingParams(temperature=0, max_tokens=12, min_tokens=6),
           SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, presence_penalty=0.5)]
    want, _, _ = run(tiny_path, ps, sps)
    got, ahead, _ = run(tiny_path, ps, sps, async_scheduling=True)
    same(got, want)
    assert len(ahead) == 12 and all(p == 4 and d for p, d in ahead[1:])
    # min_tokens alone needs only the count of tokens, in flight or not: no
    # step waits, and the stop-token ban lifts at the right token: the 5th
    # greedy token, made a stop token, ends the request with min_tokens 4.
    ref, _, _ = run(tiny_path, ps[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop = ref[0][0][4]
    assert stop not in ref[0][0][:4]
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=4, stop_token_ids=[stop], ignore_eos=True)
    want, _, _ = run(tiny_path, ps[:1], sp)
    got, ahead, _ = run(tiny_path, ps[:1], sp, async_scheduling=True)
    assert want[0][:2] == (ref[0][0][:5], "stop")
    same(got, want)
    assert all(p == 1 and not d for p, d in ahead[1:])


def test_abort_while_a_step_is_in_flight(tiny_path):
    ps = token_prompts(3, 10, 20, seed=5)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want, _, _ = run(tiny_path, ps[1:], sp)
    llm = LLM(tiny_path, block_size=4, kv_cache_memory=4 << 20, async_scheduling=True)
    ids = [llm.add_request(p, sp) for p in ps]
    got: dict[str, list[int]] = {}
    for i in range(40):
        if i == 6:
            assert llm.core.inflight is not None
            llm.core.abort([ids[0]])
        for o in llm.step():
            got[o.request_id] = o.outputs[0].token_ids
        if not llm.core.has_work():
            break
    assert not llm.core.has_work() and llm.core.kv.num_used_blocks == 0
    assert [got[r] for r in ids[1:]] == [w[0] for w in want]
    assert len(got.get(ids[0], [])) < 30


def test_async_under_tensor_parallelism(tmp_path):
    """Two ranks (tiny Qwen3, KV heads split): the leader shares each step's
    sampled tokens with the follower, whose next step reads them on its
    device. Tokens and finish reasons equal the synchronous two ranks', with
    greedy, seeded, penalty (sampled late), stop-token and min_tokens rows
    and a queue; steps ran ahead."""
    save_tiny_qwen3(tmp_path)

    def run_ranks(*flags):
        out = subprocess.run([sys.executable, str(Path(__file__).parent / "tp_engine_run.py"), str(tmp_path),
                              str(free_port()), *flags], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    stop = str(run_ranks()["outputs"][0][0][4])       # the first prompt's 5th greedy token
    want, got = run_ranks("--stop", stop), run_ranks("--async-scheduling", "--stop", stop)
    assert not want["async"] and got["async"] and got["used_blocks"] == 0
    assert got["outputs"] == want["outputs"] and want["outputs"][3][1] == "stop"
    assert sum(p > 0 for p, _ in got["steps"]) > 8 and any(d for _, d in got["steps"])


def test_off_with_speculative_decoding(tiny_path, caplog):
    with caplog.at_level("INFO", logger="tqserve.engine"):
        llm = LLM(tiny_path, block_size=4, async_scheduling=True,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not llm.core.async_scheduling
    assert "asynchronous scheduling off: speculative decoding" in caplog.text


def test_no_step_past_max_tokens(tiny_path):
    """A request whose token in flight is its last is not scheduled again: as
    many steps launched as the synchronous engine runs."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, ahead_sync, _ = run(tiny_path, token_prompts(1, seed=9), sp)
    got, ahead, _ = run(tiny_path, token_prompts(1, seed=9), sp, async_scheduling=True)
    same(got, want)
    assert len(ahead) == len(ahead_sync) == 10 and [p for p, _ in ahead[1:]] == [1] * 9
