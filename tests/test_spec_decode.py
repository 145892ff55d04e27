"""Speculative decoding with n-gram drafts (engine/speculative.py) on a tiny
random llama and on SmolLM2: lossless greedy outputs in every KV preset and
under batching, chunked prefill, prefix hits and preemption; rejection
sampling that keeps the target distribution (and a wrong rule that a test
of the same size catches); rollback that leaves no trace; stop strings,
stop ids, min/max tokens and logprobs applied to accepted tokens exactly as
without speculation. MTP drafts: tests/test_spec_decode_mtp.py."""
import numpy as np
import pytest
import torch

import engine.sampler as sampler
from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.request import EngineRequest, Request
from engine.sampler import DraftRow, sample
from engine.speculative import NgramProposer, Proposer, SpeculativeConfig
from tiny_models import save_tiny_llama, token_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MEM = 1 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_spec")
    save_tiny_llama(d)
    return str(d)


def repetitive(n, seed, lo=20, hi=50):
    """Prompts that repeat their own start: prompt lookup finds drafts."""
    return [p + p[:15] for p in token_prompts(n, lo, hi, seed=seed)]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def toks(outs):
    return [o.outputs[0].token_ids for o in outs]


def spec_stats(llm):
    s = llm.core.get_stats()
    return s.spec_decode_num_drafts_total, s.spec_decode_num_accepted_tokens_total


# ---------------------------------------------------------------- config, proposer

def test_config_parse_and_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)          # vLLM's defaults
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    for bad, words in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    # the engine args carry it and size rollback for it
    a = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).resolved()
    assert a.max_rollback_tokens == 3


def test_cli_flag_gives_one_line_error():
    from server.cli import build_parser
    p = build_parser()
    ns = p.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--speculative-config", "[1, 2]"])


def test_ngram_lookup():
    p = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3))
    # the newest 3 tokens (7 8 9) occurred before, followed by 1 2 3
    assert p.lookup([7, 8, 9, 1, 2, 3, 4, 5, 7, 8, 9], 3) == [1, 2, 3]
    # the latest earlier occurrence wins
    assert p.lookup([5, 6, 1, 5, 6, 2, 0, 5, 6], 2) == [2, 0]
    # only 2 tokens match (min 2): falls back from 3 to 2
    assert p.lookup([1, 2, 9, 9, 3, 1, 2], 3) == [9, 9, 3]
    # no match, or too short
    assert p.lookup([1, 2, 3, 4, 5], 3) == []
    assert p.lookup([1, 1], 3) == []
    # fewer tokens than k follow the match
    assert p.lookup([4, 5, 6, 4, 5], 3) == [6, 4, 5]


# ---------------------------------------------------------------- lossless greedy

@pytest.mark.parametrize("preset", ["auto", "f16", "k8v4", "tq4", "tq3", "tq4:kv"])
def test_ngram_greedy_lossless(tiny_dir, preset):
    """Token-identical to no speculation in each KV preset: batched with
    requests that opt out, with chunked prefill, prefix hits, preemption."""
    fmt, _, hot = preset.partition(":")
    kw = dict(block_size=4, kv_cache_memory=MEM, kv_cache_dtype=fmt, **({"kv_hot": hot} if hot else {}))
    ps = repetitive(6, seed=1)
    params = [greedy(speculative=i % 3 != 2) for i in range(len(ps))]
    ref = toks(LLM(tiny_dir, **kw).generate(ps, params))
    llm = LLM(tiny_dir, speculative_config=NGRAM, max_num_batched_tokens=24, **kw)
    assert toks(llm.generate(ps, params)) == ref
    drafts, accepted = spec_stats(llm)
    assert drafts > 0 and accepted > 0
    # prefix hits: the same prompts again reuse cached blocks, same tokens
    hits = llm.core.get_stats().prefix_cache_hits_total
    assert toks(llm.generate(ps, params)) == ref
    assert llm.core.get_stats().prefix_cache_hits_total > hits
    assert llm.core.kv.num_used_blocks == 0 or llm.core.kv.enable_caching
    # preemption: a pool far too small for 6 sequences at once
    plan = llm.core.plan
    # hot tokens: 2 blocks per sequence + min(sequences, 8) (pool_plan)
    hot_b = sum(b * (6 * 2 + 6) for g, b in zip(plan.groups, plan.block_bytes) if g.hot)
    small = LLM(tiny_dir, speculative_config=NGRAM, max_model_len=120, max_num_batched_tokens=64, max_num_seqs=6,
                **{**kw, "kv_cache_memory": 160 * plan.bytes_per_token + hot_b})
    assert toks(small.generate(ps, params)) == ref
    assert small.core.get_stats().num_preemptions_total > 0
    assert spec_stats(small)[1] > 0
    small.core.kv.reset_prefix_cache()
    assert small.core.kv.num_used_blocks == 0


class Fixed(Proposer):
    """Drafts given by a function of the request (for tests)."""

    def __init__(self, fn):
        self.fn = fn

    def propose(self, reqs, max_drafts):
        return [self.fn(r)[:k] for r, k in zip(reqs, max_drafts)]


def partly_right(prompts, outputs, k: int = 3, vocab: int = 256) -> Fixed:
    """Drafts of each prompt's reference continuation (outputs: token ids)
    with 0..k correct tokens, a different count step to step, then wrong
    ones: each verification keeps a different number of its rows."""
    cont = {tuple(p): list(o) + [0] * (k + 1) for p, o in zip(prompts, outputs)}

    def drafts(r):
        c, j = cont[tuple(r.prompt_token_ids)], r.num_output_tokens
        good = (j + len(r.prompt_token_ids)) % (k + 1)
        return c[j:j + good] + [(c[j + good] + 1) % vocab] * k
    return Fixed(drafts)


def test_stops_limits_and_logprobs_as_without(tiny_dir):
    """Drafts that would run past a stop id, max_tokens or min_tokens' ban:
    the accepted tokens stop exactly where decoding one at a time stops, and
    their logprobs match."""
    ps = repetitive(4, seed=3)
    base = LLM(tiny_dir, block_size=4)
    ref = base.generate(ps, greedy(30, logprobs=3))
    # an oracle proposer: drafts the reference continuation (all accepted)
    cont = {tuple(p): o.outputs[0].token_ids for p, o in zip(ps, ref)}

    def oracle(r):
        return cont[tuple(r.prompt_token_ids)][r.num_output_tokens:] + [0, 0]

    llm = LLM(tiny_dir, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    llm.core.proposer = Fixed(oracle)
    got = llm.generate(ps, greedy(30, logprobs=3))
    assert toks(got) == toks(ref)
    for a, b in zip(got, ref):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t] - lb[t]) for t in la) < 1e-4
    drafts, accepted = spec_stats(llm)
    assert accepted >= 4 * drafts          # the oracle's drafts are accepted (up to the limits)
    steps = llm.core.get_stats().steps_total
    assert steps < base.core.get_stats().steps_total / 2
    # stop ids, min_tokens and max_tokens inside an accepted run
    r0 = toks(ref)[0]
    stop_id = r0[9]
    kw = dict(stop_token_ids=[stop_id])
    for params in (greedy(30, **kw), greedy(30, min_tokens=12, **kw), greedy(7)):
        want = toks(base.generate([ps[0]], params))
        assert toks(llm.generate([ps[0]], params)) == want
    assert len(toks(llm.generate([ps[0]], greedy(30, **kw)))[0]) == r0.index(stop_id) + 1


def test_penalties_see_the_drafts(tiny_dir):
    """A verification row's penalties count the drafts before it: with an
    oracle drafting the penalized continuation, every draft is accepted and
    the tokens are decoding one at a time's (penalties that missed the
    drafts would pick other tokens there)."""
    ps = repetitive(3, seed=5)
    base = LLM(tiny_dir, block_size=4)
    params = greedy(30, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3)
    ref = toks(base.generate(ps, params))
    assert ref != toks(base.generate(ps, greedy(30)))
    cont = {tuple(p): o for p, o in zip(ps, ref)}
    llm = LLM(tiny_dir, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    llm.core.proposer = Fixed(lambda r: cont[tuple(r.prompt_token_ids)][r.num_output_tokens:] + [0, 0])
    assert toks(llm.generate(ps, params)) == ref
    drafts, accepted = spec_stats(llm)
    assert accepted >= 4 * drafts


def test_disable_by_batch_size(tiny_dir):
    """No drafts while more requests run than disable_by_batch_size; drafts
    again at or below it."""
    ps = repetitive(4, seed=7)
    llm = LLM(tiny_dir, block_size=4, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    ref = toks(llm.generate(ps, greedy(speculative=False)))
    assert toks(llm.generate(ps, greedy())) == ref             # 4 running > 3: nobody drafts
    assert spec_stats(llm) == (0, 0)
    assert toks(llm.generate(ps[:3], greedy())) == ref[:3]
    assert spec_stats(llm)[0] > 0


# ---------------------------------------------------------------- rollback

def test_token_array_follows_appends_and_rollbacks():
    """The numpy mirror that penalties and prompt lookup read: extended by
    appends (past its first buffer), cut by a rollback and extended again."""
    r = Request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=100)), 200)
    for t in range(70):
        r.append(t)
        if t % 9 == 0:
            assert r.token_array.tolist() == r.token_ids
    assert r.token_array.tolist() == r.token_ids
    r.truncate(10)
    r.append(99)
    r.append(98)
    assert r.token_array.tolist() == r.token_ids == [1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 99, 98]


@pytest.mark.parametrize("preset", ["auto", "tq4", "tq3:kv"])
def test_rollback_leaves_no_trace(tiny_dir, preset):
    """Drafts that are always rejected (across block boundaries: 3 drafts,
    blocks of 4): after every step the pool usage and the block tables'
    shapes equal a run that never drafted, and every logit the run reports
    equals it."""
    fmt, _, hot = preset.partition(":")
    kw = dict(block_size=4, kv_cache_memory=MEM, kv_cache_dtype=fmt, enable_prefix_caching=False,
              **({"kv_hot": hot} if hot else {}))
    a = LLM(tiny_dir, **kw)
    b = LLM(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    ps = token_prompts(3, 9, 23, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    # drafts the target never picks (one off its greedy choice): rejected at the first position
    cont = {tuple(p): t + [0] for p, t in zip(ps, toks(a.generate(ps, params)))}
    b.core.proposer = Fixed(lambda r: [(cont[tuple(r.prompt_token_ids)][r.num_output_tokens] + 1) % 256] * 3)
    for llm in (a, b):
        for i, p in enumerate(ps):
            llm.add_request(p, params, request_id=f"r{i}")
    outs = {id(a): {}, id(b): {}}
    n = 0
    while a.core.has_work() or b.core.has_work():
        for llm in (a, b):
            for o in llm.step():
                outs[id(llm)][o.request_id] = o
        n += 1
        assert n < 200
        assert a.core.kv.num_used_blocks == b.core.kv.num_used_blocks
        for rid, req in a.core.scheduler.requests.items():
            rb = b.core.scheduler.requests[rid]
            assert rb.num_computed_tokens == req.num_computed_tokens
            for g in range(len(a.core.kv.groups)):
                ta, tb = a.core.kv.block_table(rid, g), b.core.kv.block_table(rid, g)
                assert [x < 0 for x in ta] == [x < 0 for x in tb]
    assert spec_stats(b)[0] > 0 and spec_stats(b)[1] == 0
    for rid, oa in outs[id(a)].items():
        ob = outs[id(b)][rid]
        assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
        worst = max(abs(la[t] - lb[t]) for la, lb in zip(oa.outputs[0].logprobs, ob.outputs[0].logprobs)
                    for t in la)
        assert worst < 1e-4, worst


# ---------------------------------------------------------------- the distribution

def _requests(n, V, temperature=1.0, seed=None):
    params = SamplingParams(temperature=temperature, max_tokens=8, seed=seed)
    return [Request(EngineRequest(str(i), [1, 2, 3], params), 64) for i in range(n)]


def _verify_batch(p0, p1, d, n):
    """n requests, each verifying draft d under p0 then a bonus row under p1:
    returns the first token of each and how many were accepted."""
    V = len(p0)
    reqs = _requests(n, V)
    rows, drafts = [], []
    for r in reqs:
        rows += [r, DraftRow(r, [d])]
        drafts += [d, -1]
    logits = torch.log(torch.stack([torch.tensor(p0), torch.tensor(p1)] * n)).float()
    tokens, _ = sample(logits, rows, drafts)
    first = np.array(tokens[0::2])
    return first, int((first == d).sum())


def _tv(samples, p):
    emp = np.bincount(samples, minlength=len(p)) / len(samples)
    return 0.5 * np.abs(emp - np.asarray(p)).sum()


def test_rejection_sampling_keeps_the_target_distribution(monkeypatch):
    """The first token's distribution with a draft equals the target's, for a
    likely and an unlikely draft (TV over 20,000 samples); accepted with
    probability p(d). A wrong rule (on rejection, resample from p instead of
    the residual) fails the same test."""
    p0 = [0.05, 0.3, 0.1, 0.4, 0.15]
    p1 = [0.2, 0.2, 0.2, 0.2, 0.2]
    n = 20000
    torch.manual_seed(0)
    for d in (3, 0):
        first, acc = _verify_batch(p0, p1, d, n)
        assert _tv(first, p0) < 0.02, (d, _tv(first, p0))
        assert abs(acc / n - p0[d]) < 0.02
    monkeypatch.setattr(sampler, "residual", lambda probs, d, has: probs)
    first, _ = _verify_batch(p0, p1, 3, n)
    assert _tv(first, p0) > 0.1


def test_engine_sampling_distribution_with_speculation(tiny_dir, monkeypatch):
    """Seeded sampling through the engine (temperature 0.3): the second token
    is verified against a draft, the target's most likely token given the
    first. How often the second token is that draft must agree with a run
    without speculation (1,000 samples each, within 4 standard errors); the
    wrong rule (resample from p on rejection) inflates it far beyond."""
    prompt = token_prompts(1, 12, 13, seed=9)[0]
    n = 1000
    kw = dict(block_size=4, max_num_seqs=256, kv_cache_memory=8 << 20, enable_prefix_caching=False)
    base = LLM(tiny_dir, **kw)
    # the draft for t2 given t1: the target's argmax there
    best = toks(base.generate([prompt + [t] for t in range(256)], greedy(1)))
    draft = {t: b[0] for t, b in enumerate(best)}

    def run(llm, seed0):
        params = [SamplingParams(temperature=0.3, max_tokens=3, ignore_eos=True, seed=seed0 + i) for i in range(n)]
        outs = np.array(toks(llm.generate([prompt] * n, params)))
        return np.mean([draft[a] == b for a, b in outs[:, :2]])

    spec = LLM(tiny_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 1}, **kw)
    spec.core.proposer = Fixed(lambda r: [draft[r.token_ids[-1]]])
    ref = run(base, 0)
    got = run(spec, 10**6)
    drafts, accepted = spec_stats(spec)
    assert drafts >= n and 0 < accepted < drafts
    se = np.sqrt(2 * ref * (1 - ref) / n)
    assert abs(got - ref) < 4 * se, (ref, got, se)
    monkeypatch.setattr(sampler, "residual", lambda probs, d, has: probs)
    bad = run(spec, 2 * 10**6)
    assert bad - ref > 8 * se, (ref, bad, se)


# ---------------------------------------------------------------- real models

@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_lossless_with_stop_strings(name):
    """SmolLM2 and Gemma3 (sliding-window groups) asked to repeat a passage:
    drafts are accepted, and greedy tokens and text equal the same engine's
    requests that opt out; a stop string inside an accepted run ends the text
    and the tokens where decoding one at a time ends them."""
    from fixtures_models import shakespeare_text
    llm = LLM(name, kv_cache_memory=64 << 20, max_model_len=1024, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})
    text = shakespeare_text()
    passages = [text[i:i + 300] for i in (2000, 9000)]
    prompts = [llm.tokenizer.encode(llm.chat_template and _chat(llm, f"Repeat this text exactly:\n\n{p}")
                                    or p, add_special_tokens=False) for p in passages]
    off = [o.outputs[0] for o in llm.generate(prompts, greedy(40, speculative=False))]
    on = [o.outputs[0] for o in llm.generate(prompts, greedy(40))]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    drafts, accepted = spec_stats(llm)
    assert accepted > drafts // 2, (drafts, accepted)
    # a stop string from the middle of the first output
    words = off[0].text.split()
    stop = " ".join(words[len(words) // 2:len(words) // 2 + 2])
    a = llm.generate([prompts[0]], greedy(40, stop=[stop], speculative=False))[0].outputs[0]
    b = llm.generate([prompts[0]], greedy(40, stop=[stop]))[0].outputs[0]
    assert a.finish_reason == b.finish_reason == "stop" and a.stop_reason == stop
    assert (a.text, a.token_ids) == (b.text, b.token_ids)
    assert len(b.token_ids) < len(off[0].token_ids)
    # a JSON schema: drafts the grammar takes are verified under its masks
    import json
    from engine.structured_output import StructuredOutputsParams
    record = {"name": "Romeo Montague", "city": "Verona", "friends": ["Mercutio", "Benvolio"]}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "friends": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "city", "friends"], "additionalProperties": False}
    ids = llm.tokenizer.encode(_chat(llm, f"Copy this JSON exactly:\n{json.dumps(record)}"), add_special_tokens=False)
    so = StructuredOutputsParams(json=schema)
    d0, a0 = spec_stats(llm)
    a = llm.generate([ids], greedy(60, speculative=False, structured_outputs=so))[0].outputs[0]
    b = llm.generate([ids], greedy(60, structured_outputs=so))[0].outputs[0]
    assert (a.text, a.token_ids) == (b.text, b.token_ids)
    assert isinstance(json.loads(b.text), dict)
    assert spec_stats(llm)[1] > a0          # drafts accepted under the grammar


def _chat(llm, content):
    from model_zoo.chat_template import render_chat
    return render_chat(llm.chat_template, [{"role": "user", "content": content}], add_generation_prompt=True,
                       bos_token=llm.tokenizer.bos_token, eos_token=llm.tokenizer.eos_token)


def test_server_with_speculative_config(tmp_path):
    """`tqserve serve --speculative-config ...`: the openai client gets the same
    greedy text streamed with drafts as without (a request that opts out via
    extra_body), /metrics counts the drafts; a bad config is one clear line
    and exit status 2."""
    import json
    import subprocess
    import sys

    import httpx
    import openai
    from test_server_process import REPO, ServerProcess

    from fixtures_models import shakespeare_text
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    srv = ServerProcess(tmp_path / "server.log", "--speculative-config", json.dumps(cfg), "--max-model-len", "1024",
                        "--kv-cache-memory", "64MiB", "--max-num-seqs", "4")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Repeat this text exactly:\n\n" + shakespeare_text()[5000:5300]}]
        kw = dict(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0)
        off = client.chat.completions.create(**kw, extra_body={"speculative": False}).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert streamed == off and len(off) > 40
        # OpenAI's predicted outputs: the same text, most of it accepted from the prediction.
        pred = client.chat.completions.create(**kw, prediction={"type": "content", "content": off})
        assert pred.choices[0].message.content == off
        details = pred.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= pred.usage.completion_tokens // 2
        assert details.rejected_prediction_tokens <= 8
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                     prediction={"type": "content", "content": off}))
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == \
            details.accepted_prediction_tokens
        assert client.chat.completions.create(**kw).usage.completion_tokens_details is None
        metrics = httpx.get(srv.url + "/metrics").text
        acc = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("tqserve:spec_decode_num_accepted_tokens_total")]
        assert acc and acc[0] > 0, metrics
        assert 'tqserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2-135m",position="3"}' \
            in metrics
    finally:
        srv.stop()
    bad = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--speculative-config",
                          '{"method": "eagle", "num_speculative_tokens": 2}'], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2
    assert "speculative method must be one of ngram, mtp" in bad.stderr + bad.stdout


def test_predicted_output(tiny_dir):
    """OpenAI's predicted outputs: with n-gram speculation a request's
    prediction supplies its drafts. The tokens are the ones without it; a
    right prediction is accepted nearly whole (few steps), an edited one up
    to the edit and again after it."""
    prompts = token_prompts(3, 20, 40, seed=31)
    want = toks(LLM(tiny_dir, kv_cache_memory=MEM, dtype="float32").generate(prompts, greedy(32)))
    llm = LLM(tiny_dir, kv_cache_memory=MEM, dtype="float32", speculative_config=NGRAM)
    edited = want[1][:10] + [5, 6, 7] + want[1][16:]
    outs = llm.generate(prompts, [greedy(32, prediction_token_ids=want[0]),
                                  greedy(32, prediction_token_ids=edited), greedy(32)])
    assert toks(outs) == want
    right, edit, none = (o.metrics for o in outs)
    # (4 drafts a step, each step's fifth token its own: 24 of the 31 after the first)
    assert right["accepted_prediction_tokens"] >= 22 and right["rejected_prediction_tokens"] <= 4
    assert edit["accepted_prediction_tokens"] >= 12 and edit["rejected_prediction_tokens"] >= 1
    assert "accepted_prediction_tokens" not in none
    steps0 = llm.core.stats.steps_total
    alone = llm.generate(prompts[0], greedy(32, prediction_token_ids=want[0]))[0]
    assert alone.outputs[0].token_ids == want[0]
    assert llm.core.stats.steps_total - steps0 <= 10       # 32 tokens in ~8 steps


def test_follow_the_prediction():
    p = NgramProposer(SpeculativeConfig(**NGRAM))
    pred = np.array([10, 11, 12, 13, 14, 15, 11, 12, 16], np.int64)
    assert p.follow(pred, np.array([], np.int64), 3) == [10, 11, 12]
    assert p.follow(pred, np.array([10, 11], np.int64), 3) == [12, 13, 14]
    # "11 12" twice: the occurrence ending nearest the output's length
    assert p.follow(pred, np.array([1, 2, 3, 4, 5, 6, 11, 12], np.int64), 2) == [16]
    assert p.follow(pred, np.array([99], np.int64), 3) == []
