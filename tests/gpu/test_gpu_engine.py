"""The engine on CUDA: parity with transformers on the same GPU, CUDA graphs,
batch invariance, seeded sampling, the device pool, every KV preset.

Skipped, with the reason printed (pytest -ra), where torch sees no CUDA
device. Needs only torch, transformers and pytest (with safetensors, which
transformers brings): no gguf, fastapi, uvicorn, pydantic or openai, so it
runs on a bare GPU machine (tests/gpu/run.sh).
"""
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: torch.cuda.is_available() is False")

from engine import LLM, SamplingParams  # noqa: E402
from test_model_parity import CONFIGS, make_hf_model  # noqa: E402

V4 = "deepseek_v4"
FAMILIES = ["llama", "qwen3", "gemma3", V4]
# bf16 logits drift with the order of reductions: compare logprobs of the
# chosen tokens loosely there, exactly-ish in fp32.
TOL = {"float32": 2e-3, "bfloat16": 0.25}


def save_family(folder, family):
    if family == V4:
        from test_deepseek_v4 import CONFIG
        from tiny_models import save_tiny_deepseek_v4
        return save_tiny_deepseek_v4(folder), CONFIG["vocab_size"]
    hf = make_hf_model(CONFIGS[family])
    hf.save_pretrained(folder)
    return hf, CONFIGS[family]["vocab_size"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf, vocab = save_family(d, request.param)
    return request.param, str(d), hf, vocab


def prompts(n, vocab, lo=20, hi=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def engine_kw(family):
    return dict(block_size=4) if family == V4 else {}


def toks(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- parity
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_match_transformers_on_gpu(family, dtype):
    name, path, hf, vocab = family
    ref_model = hf.to("cuda", getattr(torch, dtype))
    llm = LLM(path, device="cuda", dtype=dtype, enforce_eager=True, **engine_kw(name))
    ps = prompts(3, vocab, seed=1)
    outs = llm.generate(ps, greedy(6, prompt_logprobs=0, logprobs=0))
    worst = 0.0
    for o in outs:
        ids = o.prompt_token_ids + o.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(ref_model(input_ids=torch.tensor([ids], device="cuda")).logits[0].float(), -1)
        for p, lp in enumerate(o.prompt_logprobs[1:], 1):
            worst = max(worst, abs(lp[ids[p]] - ref[p - 1, ids[p]].item()))
        for j, (t, lp) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)):
            worst = max(worst, abs(lp[t] - ref[len(o.prompt_token_ids) - 1 + j, t].item()))
    hf.to("cpu", torch.float32)
    print(f"{name} {dtype}: max |logprob diff| vs transformers on cuda {worst:.2e}")
    assert worst < TOL[dtype], worst
    assert llm.core.kv.num_used_blocks == 0


# ---------------------------------------------------------------- engine behaviour
def test_cuda_graphs_equal_eager_and_batch_invariant(family):
    name, path, _, vocab = family
    ps = prompts(6, vocab, seed=2)
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True, **engine_kw(name))
    ref = toks(eager.generate(ps, greedy(16)))
    del eager
    graphs = LLM(path, device="cuda", dtype="float32", enforce_eager=False, **engine_kw(name))
    assert toks(graphs.generate(ps, greedy(16))) == ref
    assert graphs.core.graphs is not None and graphs.core.graphs.replays > 0
    # one at a time == in a batch
    assert [toks(graphs.generate([p], greedy(16)))[0] for p in ps[:3]] == ref[:3]


def test_hybrid_cuda_graphs_equal_eager(tmp_path):
    """Qwen3-Next (linear-attention state per sequence): decode graphs with
    pad rows (5 -> 8, pads writing the state's pad slot) give the eager tokens."""
    from tiny_models import save_tiny_qwen3_next, token_prompts
    save_tiny_qwen3_next(tmp_path)
    ps = token_prompts(5, lo=20, hi=60, seed=2)
    eager = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=True)
    ref = toks(eager.generate(ps, greedy(16)))
    del eager
    graphs = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=False)
    assert toks(graphs.generate(ps, greedy(16))) == ref
    assert graphs.core.graphs is not None and graphs.core.graphs.replays > 0
    assert [toks(graphs.generate([p], greedy(16)))[0] for p in ps[:2]] == ref[:2]


def test_hybrid_verification_graphs_equal_eager(tmp_path):
    """Qwen3-Next, k = 3 drafts with 0..3 correct tokens then a wrong one:
    verification steps replayed at 4 rows per sequence (the delta rule a
    token at a time from device lengths, resuming from each state
    checkpoint) give the tokens of eager decoding without drafts."""
    from test_spec_decode import partly_right
    from tiny_models import save_tiny_qwen3_next, token_prompts
    save_tiny_qwen3_next(tmp_path)
    ps = token_prompts(3, lo=20, hi=40, seed=3)
    kw = dict(device="cuda", dtype="float32")
    ref = toks(LLM(str(tmp_path), enforce_eager=True, **kw).generate(ps, greedy(16)))
    llm = LLM(str(tmp_path), enforce_eager=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **kw)
    llm.core.proposer = partly_right(ps, ref)
    graphs = llm.core.graphs
    assert graphs is not None and graphs.query_lens == (1, 4)
    shapes, run = [], graphs.run
    graphs.run = lambda b, q, *a: (shapes.append((b, q)), run(b, q, *a))[1]
    assert toks(llm.generate(ps, greedy(16))) == ref
    assert shapes.count((4, 4)) >= 3 and llm.core.get_stats().spec_decode_num_accepted_tokens_per_pos[2] > 0


def mtp_runs(path, ps, max_tokens, **kw):
    """MTP drafting eagerly, then with CUDA graphs: [(tokens, drafts per
    step, the engine's graphs, its MTP head's graphs)] for the two."""
    runs = []
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", enforce_eager=eager, **kw)
        drafts, propose = [], llm.core.proposer.propose
        llm.core.proposer.propose = lambda reqs, k: (d := propose(reqs, k), drafts.append(d))[0]
        runs.append((toks(llm.generate(ps, greedy(max_tokens))), drafts, llm.core.graphs,
                     llm.core.runner.head_graphs))
        del llm
    return runs


def test_mtp_graphs_equal_eager(tmp_path):
    """Qwen3-Next with an MTP head (k = 3) on CUDA: the target's steps
    replayed as graphs that keep the streams the head drafts from, and the
    head's chained passes as graphs of their own, give the eager run's
    drafts and tokens."""
    from test_hybrid_mtp import MTP, add_mtp_head
    from test_qwen3_next import make_hf
    from tiny_models import token_prompts
    hf = make_hf("qwen3_next").float()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    add_mtp_head(tmp_path, hf)
    ps = token_prompts(3, lo=9, hi=20, seed=4)
    (ref, ref_drafts, _, _), (out, drafts, graphs, head) = mtp_runs(tmp_path, ps, 12, speculative_config=MTP)
    assert graphs is not None and graphs.query_lens == (1, 4) and graphs.replays > 0
    assert head is not None and head.replays > 0
    assert out == ref and drafts == ref_drafts


@pytest.mark.parametrize("kv", ["auto", "tq4"])
def test_deepseek_v4_mtp_graphs_equal_eager(tmp_path, kv):
    """DeepSeek-V4 with its MTP head (k = 3) on CUDA: decodes and
    verification steps run every sequence at once (DSV4Rows) and replay as
    graphs (the pool's pad slot and discard rows taking the pad rows' writes),
    and so do the head's chained passes; drafts and tokens equal the eager
    run's, and the tokens equal decoding without drafts."""
    from test_deepseek_v4 import CONFIG, case, save_with_mtp
    save_with_mtp(case(4), tmp_path)
    ps = prompts(3, CONFIG["vocab_size"], seed=6)
    kw = dict(block_size=4, kv_cache_dtype=kv)
    ref = toks(LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=True, **kw).generate(ps, greedy(16)))
    (eager_out, eager_drafts, _, _), (out, drafts, graphs, head) = mtp_runs(
        tmp_path, ps, 16, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **kw)
    assert graphs is not None and graphs.query_lens == (1, 4) and graphs.replays > 0
    assert head is not None and head.replays > 0
    assert out == eager_out == ref and drafts == eager_drafts


@pytest.mark.parametrize("kv", ["auto", "k8v4", "tq4"])
def test_verification_graphs_equal_eager(tmp_path, kv):
    """n-gram drafts (k = 3) on CUDA: verification steps replayed as graphs of
    4 rows per sequence give the tokens of eager decoding without drafts
    (tq4: hot tokens, their HOT pass in one launch from the hot pool)."""
    from tiny_models import save_tiny_llama, token_prompts
    save_tiny_llama(tmp_path)
    ps = [([5, 6, 7, 8] * 6)[:n] for n in (9, 13, 21)] + token_prompts(2, lo=20, hi=40, seed=4)
    kw = dict(device="cuda", dtype="float32", kv_cache_dtype=kv)
    eager = LLM(str(tmp_path), enforce_eager=True, **kw)
    ref = toks(eager.generate(ps, greedy(24)))
    del eager
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(str(tmp_path), enforce_eager=False, speculative_config=spec, **kw)
    graphs = llm.core.graphs
    assert graphs is not None and graphs.query_lens == (1, 4)
    shapes, run = [], graphs.run
    graphs.run = lambda b, q, *a: (shapes.append((b, q)), run(b, q, *a))[1]
    assert toks(llm.generate(ps, greedy(24))) == ref
    assert any(q == 4 for _, q in shapes) and llm.core.get_stats().spec_decode_num_accepted_tokens_total > 0


def test_async_scheduling_equals_sync(family):
    """--async-scheduling on the device: the next step's last ids copied from
    the step in flight's tokens there (through the graphs; a stop token ending
    requests while their next step runs, seeded rows, penalties: steps sampled
    after the tokens in flight arrive); tokens as without."""
    name, path, _, vocab = family
    ps = prompts(6, vocab, seed=6)
    sps = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=None if i % 2 else 10 + i, max_tokens=6 + 3 * i,
                          ignore_eos=True, frequency_penalty=0.5 if i == 2 else 0.0,
                          repetition_penalty=1.2 if i == 4 else 1.0) for i in range(6)]
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=64, **engine_kw(name))
    sync = LLM(path, **kw)
    ref = toks(sync.generate(ps, sps))
    del sync
    stops = [dataclasses.replace(sp, stop_token_ids=[t[3]]) if i % 2 else sp for i, (sp, t) in enumerate(zip(sps, ref))]
    want = LLM(path, **kw).generate(ps, stops)
    assert [o.outputs[0].finish_reason for o in want[1::2]] == ["stop"] * 3
    llm = LLM(path, async_scheduling=True, **kw)
    got = llm.generate(ps, stops)
    assert toks(got) == toks(want) and [o.outputs[0].finish_reason for o in got] == \
        [o.outputs[0].finish_reason for o in want]
    assert llm.core.kv.num_used_blocks == 0 and not llm.core.has_work()


def test_seeded_sampling_repeats_alone_and_in_batch(family):
    name, path, _, vocab = family
    llm = LLM(path, device="cuda", dtype="float32", **engine_kw(name))
    ps = prompts(5, vocab, seed=3)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = toks(llm.generate([ps[0]], sp))[0]
    mixed = [sp] + [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)] * 4
    assert toks(llm.generate(ps, mixed))[0] == alone
    assert toks(llm.generate([ps[0]], sp))[0] == alone


def test_preemption_and_prefix_hits_on_device_pool(family):
    name, path, _, vocab = family
    ps = prompts(6, vocab, lo=40, hi=60, seed=4)
    ref = toks(LLM(path, device="cuda", dtype="float32", **engine_kw(name)).generate(ps, greedy(20)))
    # (V4 without prefix caching here: its state snapshots would take a share of this tight budget.)
    small = LLM(path, device="cuda", dtype="float32", max_model_len=128, kv_cache_memory=_tight_budget(path, name),
                max_num_seqs=6, enable_prefix_caching=name != V4, **engine_kw(name))
    assert toks(small.generate(ps, greedy(20))) == ref
    assert small.core.scheduler.stats.num_preemptions > 0
    assert small.core.kv.num_used_blocks == 0
    # V4 resumes from snapshots of its per-sequence state on a grid (32 tokens: its blocks' span at block size 2)
    kw = dict(block_size=2, mamba_block_size=32) if name == V4 else engine_kw(name)
    shared = ps[0][:40]
    llm = LLM(path, device="cuda", dtype="float32", **kw)
    a = toks(llm.generate([shared + [5, 6]], greedy(8)))
    b = toks(llm.generate([shared + [5, 6]], greedy(8)))
    assert a == b and llm.core.scheduler.stats.prefix_cache_hits >= 32


def test_state_prefix_hits_with_graphs_equal_no_caching(tmp_path):
    """Qwen3-Next on the device: hits restore state snapshots (copies in the
    step's packed inputs, around the graph replays), shared system prompt and
    a follow-up turn, asynchronous scheduling: tokens equal no caching."""
    from tiny_models import conversation, save_tiny_qwen3_next
    save_tiny_qwen3_next(tmp_path)
    system, ps = conversation(256, seed=3)
    kw = dict(device="cuda", dtype="float32", block_size=4, mamba_block_size=8, max_num_seqs=4)
    ref = toks(LLM(str(tmp_path), enable_prefix_caching=False, **kw).generate(ps, greedy(16)))
    llm = LLM(str(tmp_path), async_scheduling=True, **kw)
    outs = [llm.generate([p], greedy(16))[0] for p in ps]
    assert toks(outs) == ref and [o.num_cached_tokens for o in outs] == [0, 0, 40]
    assert llm.core.graphs is not None and llm.core.graphs.replays > 0
    follow = ps[2] + ref[2] + [5, 6, 7]
    f = llm.generate([follow], greedy(16))[0]
    assert f.num_cached_tokens > 40
    assert toks([f]) == toks(LLM(str(tmp_path), enable_prefix_caching=False, **kw).generate([follow], greedy(16)))


def test_state_prefix_hits_with_mtp_drafts_and_graphs(tmp_path):
    """DeepSeek-V4 with its MTP head drafting on the device (the target's
    decode / verification steps and the head's chained passes replayed as
    CUDA graphs): the step's snapshots wait for the head's first pass, so
    hits resume its ring as well. Tokens equal the engine without drafts or
    caching; the drafts equal those of the same engine without caching
    (near-ties aside: the CPU test checks them exactly,
    tests/test_state_prefix_cache.py)."""
    from test_deepseek_v4 import case, save_with_mtp
    from tiny_models import conversation
    save_with_mtp(case(4), str(tmp_path))
    system, ps = conversation(128, seed=5, users=(24, 31))
    kw = dict(device="cuda", dtype="float32", block_size=2, mamba_block_size=32, max_num_seqs=2)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    ref = toks(LLM(str(tmp_path), enable_prefix_caching=False, **kw).generate(ps, greedy(16)))
    runs = {}
    for caching in (False, True):
        llm = LLM(str(tmp_path), speculative_config=mtp, enable_prefix_caching=caching, **kw)
        seen, propose = {}, llm.core.proposer.propose

        def rec(reqs, room, propose=propose, seen=seen):
            out = propose(reqs, room)
            seen.update((tuple(r.token_ids), d) for r, d in zip(reqs, out) if d)
            return out
        llm.core.proposer.propose = rec
        outs = [llm.generate([p], greedy(16))[0] for p in ps]
        assert toks(outs) == ref
        runs[caching] = ([o.num_cached_tokens for o in outs], seen, llm)
    hits, drafts, llm = runs[True]
    assert hits == [0, 0, 32] and runs[False][0] == [0, 0, 0]
    assert llm.core.graphs is not None and llm.core.graphs.replays > 0
    assert llm.core.head_graphs is not None and llm.core.head_graphs.replays > 0
    # Drafts after the same tokens (a near-tie's other draft may change what is accepted after it).
    both = drafts.keys() & runs[False][1].keys()
    same = sum(drafts[k] == runs[False][1][k] for k in both)
    assert len(both) >= 0.8 * len(drafts) and same >= 0.95 * len(both), (same, len(both), len(drafts))


def _tight_budget(path, name):
    """The smallest KV budget whose plan holds a 128-token sequence (max_model_len),
    for the test's 6 sequences of up to 80 tokens: they preempt each other."""
    from kvcache.pool_plan import plan_kv_pool
    probe = LLM(path, device="cuda", dtype="float32", max_num_seqs=6, **engine_kw(name))
    specs, a = probe.core.model.kv_cache_spec(), probe.core.args

    def fits(budget):
        try:
            return plan_kv_pool(specs, budget, a.block_size, torch.float32, 6, a.max_num_batched_tokens,
                                max_model_len=128, max_rollback=a.max_rollback_tokens).capacity_tokens >= 128
        except ValueError:      # not even one block
            return False
    lo, hi = 1, 1 << 30
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


@pytest.mark.parametrize("preset", ["f16", "k8v4", "tq4", "tq3"])
def test_kv_presets_on_cuda(family, preset):
    name, path, _, vocab = family
    ps = prompts(4, vocab, seed=5)
    llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_dtype=preset, **engine_kw(name))
    assert all(t.device.type == "cuda" for t in _kv_tensors(llm))
    outs = llm.generate(ps, greedy(10, logprobs=0))
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert all(lp is not None and all(v == v for v in lp.values()) for o in outs for lp in o.outputs[0].logprobs)
    assert llm.core.kv.num_used_blocks == 0


def _kv_tensors(llm):
    caches = llm.core.runner.kv_caches
    layers = caches if isinstance(caches, list) else [caches]
    out = []
    for c in layers:
        if c is None:
            continue
        out += [v for v in vars(c).values() if isinstance(v, torch.Tensor)]
    return out


# ---------------------------------------------------------------- images
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_images_match_transformers_on_gpu(tmp_path, dtype):
    """Gemma 3 with its vision tower on CUDA (needs Pillow: run.sh installs
    it from .gpu-wheels): the encoder's rows, the bidirectional image spans in
    dense-triton's prefill and the decode graphs after them give
    transformers' tokens on the same GPU; eager equals graphs."""
    from test_gemma3_images import PROMPTS, greedy as g, hf_reference, image, save_tiny_gemma3_vision
    hf = save_tiny_gemma3_vision(tmp_path).to("cuda", getattr(torch, dtype))
    graphs = LLM(str(tmp_path), device="cuda", dtype=dtype, block_size=4)
    eager = LLM(str(tmp_path), device="cuda", dtype=dtype, block_size=4, enforce_eager=True)
    assert graphs.core.graphs is not None
    for ids, seeds in PROMPTS:
        images = [image(s) for s in seeds]
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
        out = graphs.generate(prompt, g(8, logprobs=0))[0]
        ref_tokens, ref = hf_reference(hf, ids, images, 8)
        worst = max(abs(lp[t] - ref[len(ids) - 1 + j, t].item())
                    for j, (t, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)))
        print(f"{dtype}: max |logprob - transformers| {worst:.2e}")
        if dtype == "float32":
            assert out.outputs[0].token_ids == ref_tokens
        assert worst < TOL[dtype]
        assert eager.generate(prompt, g(8))[0].outputs[0].token_ids == out.outputs[0].token_ids


# ---------------------------------------------------------------- sleep mode
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_back_device_memory_and_wakes_with_graphs(family, level):
    """Sleep mode on the device: the KV pool and (both levels: level 1 to
    pinned host memory) the weights leave the GPU's allocations; waking
    recaptures the CUDA graphs and gives the same greedy tokens as before."""
    name, path, _, vocab = family
    llm = LLM(path, device="cuda", dtype="bfloat16", enable_sleep_mode=True, kv_cache_memory=64 << 20,
              **engine_kw(name))
    ps = prompts(4, vocab, seed=7)
    want = toks(llm.generate(ps, greedy(12)))
    assert llm.core.graphs is not None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    llm.sleep(level)
    freed = llm.core.asleep.freed_bytes
    assert freed >= llm.core.plan.total_bytes + llm.core.resident_bytes * 0.9
    assert before - torch.cuda.memory_allocated() >= 0.9 * freed
    llm.wake_up()
    assert llm.core.graphs is not None and llm.core.runner.graphs is llm.core.graphs
    assert toks(llm.generate(ps, greedy(12))) == want


# ---------------------------------------------------------------- draft model
def test_draft_model_on_device(family):
    """A draft model (engine/draft_model.py) on the device: the target as its
    own draft has every draft accepted and changes no greedy token (CUDA
    graphs on for the target's verification steps)."""
    name, path, _, vocab = family
    if name == V4:
        pytest.skip("DeepSeek-V4 cannot draft (its own pool); it drafts with its MTP head")
    ps = prompts(4, vocab, seed=11)
    # fp32: in bf16 the draft's and the verification's batch shapes round differently, and a draft may
    # lose to the target's own token by a rounding.
    want = toks(LLM(path, device="cuda", dtype="float32", **engine_kw(name)).generate(ps, greedy(16)))
    llm = LLM(path, device="cuda", dtype="float32", speculative_config={"model": path, "num_speculative_tokens": 3},
              **engine_kw(name))
    assert toks(llm.generate(ps, greedy(16))) == want
    st = llm.core.stats
    assert st.spec_decode_num_accepted_tokens_total == st.spec_decode_num_draft_tokens_total > 0
