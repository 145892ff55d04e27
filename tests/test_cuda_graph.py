"""CUDA graphs for decode and verification steps (engine/cuda_graph.py), checked on CPU.

What a capture needs besides CUDA is checked here with the graphs emulated
(DecodeGraphs(emulate=True)): the static buffers, the batch padded to a
captured size (pad rows read and write nothing), the metadata frozen at
capture with bounds in its host values (a backend that read the real
lengths on the host would get max_model_len and fail these tests), and
every torch op of the step free of host syncs (forbid_host_syncs). The
attention runs through dense-triton, the CUDA backend, under Triton's
interpreter, and the model's torch code, not the compiled CPU ops, as on a
GPU. tests/gpu/test_gpu_engine.py checks real captures against eager.
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graph import DecodeGraphs, HostSyncError, capture_sizes, forbid_host_syncs, why_not_capturable
from kvcache.linear_state import LinearStateCache
from model_zoo import cpu_ops
from parallel.quant import fp_methods
from test_spec_decode import partly_right
from tiny_models import (save_tiny_deepseek_v4, save_tiny_gemma3, save_tiny_gemma4, save_tiny_llama, save_tiny_qwen3,
                         save_tiny_qwen3_5, save_tiny_qwen3_moe, save_tiny_qwen3_next, token_prompts)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    # Verification graphs (4 rows per sequence) only up to the step's token budget.
    g = DecodeGraphs(None, [], [4], 64, 32, torch.device("cpu"), query_lens=(1, 4), max_num_tokens=64)
    assert g.sizes_of == {1: [1, 2, 4, 8, 16, 24, 32], 4: [1, 2, 4, 8, 16]} and g.query_lens == (1, 4)
    assert (g.size_for(3, 4), g.size_for(17, 4), g.size_for(17)) == (4, None, 24)


@pytest.mark.parametrize("op", [
    lambda x: x.sum().item(),
    lambda x: int(x[0]),
    lambda x: bool((x > 0).all()),
    lambda x: x[x > 2],
    lambda x: x.nonzero(),
    lambda x: torch.tensor([1, 2]),
    lambda x: torch.repeat_interleave(x, x.clamp(min=0)),
    lambda x: torch.unique(x),
])
def test_forbid_host_syncs_catches(op):
    x = torch.arange(5)
    with pytest.raises(HostSyncError):
        with forbid_host_syncs():
            op(x)


def test_forbid_host_syncs_lets_device_work_through():
    x = torch.arange(6.0)
    with forbid_host_syncs():
        y = torch.where(x > 2, x, 0).index_select(0, torch.arange(3)) @ torch.ones(3)
        z = torch.repeat_interleave(x, 2)
    assert float(y) == 0.0 and z.shape == (12,)


@pytest.fixture
def graph_env(monkeypatch):
    """The CUDA code path on CPU: dense-triton attention (interpreted), the
    model's torch ops instead of the compiled CPU ones."""
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-triton")
    monkeypatch.setattr(cpu_ops, "ENABLED", False)


def _engine(path, **kw):
    kw = dict(dtype="float32", block_size=4, max_num_seqs=6, kv_cache_memory=4 << 20, max_num_batched_tokens=64,
              enable_prefix_caching=True) | kw
    return LLM(str(path), **kw)


def _emulate(llm):
    """Replace eager decode steps by emulated graph replays; count them."""
    core = llm.core
    graphs = core._capture_graphs(emulate=True)
    assert graphs is not None
    core.runner.graphs = graphs
    replays = []
    run = graphs.run

    def counted(b, *a):
        replays.append(b)
        return run(b, *a)
    graphs.run = counted
    return replays


def _toks(outs):
    return [o.outputs[0].token_ids for o in outs]


SAVERS = {"llama": save_tiny_llama, "qwen3": save_tiny_qwen3, "gemma3": save_tiny_gemma3,
          "qwen3_moe": save_tiny_qwen3_moe, "gemma4": lambda p: save_tiny_gemma4(p, hybrid=True, moe=False),
          # Linear-attention state per sequence: pad rows write the pad slot
          # (Qwen3-Next's DeltaNet is the same code: test_pad_rows_of_linear_attention).
          "qwen3_5": save_tiny_qwen3_5}


# Padded batches run the matmuls on more rows, which moves last bits; the tiny random Gemma 4
# amplifies them (eager alone, batch 3 and batch 4 differ by up to 3e-4 in a logprob).
TOL = {"gemma4": 1e-3}


@pytest.mark.parametrize("family", list(SAVERS))
def test_replayed_decode_equals_eager(graph_env, tmp_path, family, monkeypatch):
    """Greedy tokens and their logprobs with graphs = eager for a batch that
    pads (3 -> 4), every family. Llama also: seeded sampling, 5 -> 6, the
    same prompts alone (batch invariance through the padding) and a request
    arriving mid-run (its prefill steps eager, the decodes around it
    replayed); the other families share that code path (CI time)."""
    SAVERS[family](tmp_path)
    full = family == "llama"
    # The routed experts' CUDA path: the grouped Triton kernels (interpreted).
    monkeypatch.setattr(fp_methods, "BACKEND", "triton")
    prompts = token_prompts(5, lo=3, hi=20, seed=1)
    greedy = SamplingParams(max_tokens=12 if full else 6, temperature=0.0, logprobs=2, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7 + i, ignore_eos=True)
              for i in range(3)]
    eager = _engine(tmp_path)
    ref_g = eager.generate(prompts[:3], greedy)
    if full:
        ref_s = _toks(eager.generate(prompts[:3], seeded))
        ref_5 = _toks(eager.generate(prompts, greedy))
    del eager

    llm = _engine(tmp_path)
    replays = _emulate(llm)
    out_g = llm.generate(prompts[:3], greedy)
    assert _toks(out_g) == _toks(ref_g)
    for a, b in zip(out_g, ref_g):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t] - lb[t]) for t in la) < TOL.get(family, 1e-4)
    assert 4 in replays and max(replays) == 4
    if not full:
        return
    assert _toks(llm.generate(prompts[:3], seeded)) == ref_s
    assert _toks(llm.generate(prompts, greedy)) == ref_5
    assert 6 in replays
    # Alone: size 1, the same tokens as in the padded batches.
    assert [_toks(llm.generate([p], greedy))[0] for p in prompts[:2]] == _toks(ref_g)[:2]
    # A request added while others decode.
    llm.add_request(prompts[0], greedy, request_id="a")
    for _ in range(3):
        llm.step()
    llm.add_request(prompts[1], greedy, request_id="b")
    done = {}
    for _ in range(100):
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        if len(done) == 2:
            break
    assert [done["a"], done["b"]] == _toks(ref_g)[:2]


@pytest.mark.parametrize("kv,backend", [("auto", "dsv4-torch"), ("tq4", "dsv4-torch"), ("tq4", "dsv4-triton")])
def test_deepseek_v4_decode_replayed_equals_eager(graph_env, monkeypatch, tmp_path, kv, backend):
    """DeepSeek-V4's stateful pool (window and carry rings per state slot,
    paged compressed entries; tq4: coded) captured: decodes of 3 sequences
    padded to 4 (the pad sequence writes the pad slot, rows that close no
    window the discard row) across CSA and HCA window closes, every one
    replayed, give eager's tokens and logprobs; eager decodes run batched
    too (DSV4Rows), checked against transformers in test_deepseek_v4_engine.
    dsv4-triton: the entries read by the CUDA backend's kernels, at the
    graph's table bound, each sequence's count read on the device."""
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", f"dense-triton,{backend}")
    save_tiny_deepseek_v4(tmp_path)
    prompts = [[t % 128 for t in p] for p in token_prompts(3, lo=20, hi=60, seed=1)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    ref = _engine(tmp_path, kv_cache_dtype=kv).generate(prompts, greedy)
    llm = _engine(tmp_path, kv_cache_dtype=kv)
    replays = _emulate(llm)
    assert llm.core.runner.graphs.tables[-1].shape[1] == 1       # the state group: one slot per sequence
    out = llm.generate(prompts, greedy)
    assert replays.count(4) >= 9, replays       # (chunked prefills: one sequence starts and ends later)
    assert _toks(out) == _toks(ref)
    # Replayed steps run the batch padded to 4, so fp32 sums differ from eager's by ~1e-6; a coded
    # (tq4) entry near a code boundary can then round the other way, a 4-bit step: up to 1.4e-4 in
    # these logprobs on an AVX-512 CPU (below 1e-4 on AVX2), against 1.7e-6 for dense entries.
    tol = 1e-4 if kv == "auto" else 1e-3
    for a, b in zip(out, ref):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and max(abs(la[t] - lb[t]) for t in la) < tol
    assert llm.core.kv.num_used_blocks == 0


def test_deepseek_v4_graphs_bounded_by_context(tmp_path, monkeypatch, caplog):
    """A captured V4 step through dsv4-torch reads every sequence's whole
    entry table at its bound: past MAX_GRAPH_ENTRIES per sequence the engine
    says so and its batched steps stay eager."""
    from kvcache import dsv4_paged
    save_tiny_deepseek_v4(tmp_path)
    llm = _engine(tmp_path)
    assert llm.core.plan.capacity_tokens == 128 and why_not_capturable(llm.core.caches) is None
    monkeypatch.setattr(dsv4_paged, "MAX_GRAPH_ENTRIES", 16)
    with caplog.at_level("INFO", logger="tqserve.engine"):
        assert llm.core._capture_graphs(emulate=True) is None
    assert "would read 32 compressed entries per sequence" in caplog.text     # 128 tokens / CSA's 4
    # The CUDA backend reads only the entries a sequence uses: no bound.
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dsv4-triton")
    assert why_not_capturable(_engine(tmp_path).core.caches) is None


def _one_sequence_padded_to_2(path, state):
    """One 6-token prompt, 4 greedy tokens, eager then with every decode
    replayed at size 2: [(tokens, state(llm)) eager, (...) replayed]."""
    p = token_prompts(1, lo=6, hi=7, seed=3)[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = []
    for emulate in (False, True):
        llm = _engine(path, max_num_seqs=2, enable_prefix_caching=False)
        if emulate:
            replays = _emulate(llm)
            llm.core.runner.graphs.sizes_of[1] = [2]     # every decode pads to 2
        runs.append((_toks(llm.generate([p], sp)), state(llm)))
    assert replays == [2, 2, 2] and runs[0][0] == runs[1][0]
    return runs


def test_pad_rows_write_nothing(graph_env, tmp_path):
    """Decodes of one sequence padded to 2 rows: the pad's KV write is
    skipped. The pool holds exactly the sequence's rows (6 prompt + 3 decoded
    tokens written), equal to the eager run's (up to the last bits a
    2-row matmul may change), and the tokens are the eager ones."""
    save_tiny_llama(tmp_path)
    runs = _one_sequence_padded_to_2(tmp_path, lambda llm: [(c.k.clone(), c.v.clone()) for c in llm.core.caches])
    for (k0, v0), (k1, v1) in zip(runs[0][1], runs[1][1]):
        for a, b in ((k0, k1), (v0, v1)):
            assert int(a.flatten(1).ne(0).any(1).sum()) == int(b.flatten(1).ne(0).any(1).sum()) == 9
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pad_rows_of_linear_attention_write_the_pad_slot(graph_env, tmp_path):
    """Qwen3-Next, one sequence padded to 2 rows: every sequence slot of every
    DeltaNet layer's state ends as in the eager run, and only the pad slot
    (the last, kvcache/linear_state.PAD_SLOT) took the pad row's writes."""
    save_tiny_qwen3_next(tmp_path)
    runs = _one_sequence_padded_to_2(tmp_path, lambda llm: [
        (c.conv.clone(), c.recurrent.clone()) for c in llm.core.caches if isinstance(c, LinearStateCache)])
    assert runs[0][1]
    for eager, graphed in zip(runs[0][1], runs[1][1]):
        for a, b in zip(eager, graphed):
            torch.testing.assert_close(a[:-1], b[:-1], rtol=1e-5, atol=1e-5)
            assert a[:-1].flatten(1).ne(0).any(1).sum() == 1      # the sequence's slot only
            assert not a[-1].any() and b[-1].any()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_verification_steps_replayed_equal_eager(graph_env, tmp_path):
    """n-gram drafts, k = 3: steps with drafts replay the graphs of 4 rows
    per sequence (a sequence with fewer drafts padded after its own rows, pad
    sequences after the batch). Greedy tokens equal the eager run's without
    speculation, seeded sampling the eager run's with it, and drafts were
    accepted in replayed steps."""
    save_tiny_llama(tmp_path)
    prompts = [([5, 6, 7, 8] * 4)[:n] for n in (9, 13, 16)] + token_prompts(2, lo=4, hi=12, seed=4)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, seed=3 + i, ignore_eos=True) for i in range(5)]
    eager = _engine(tmp_path)
    ref = _toks(eager.generate(prompts, greedy))
    del eager
    eager = _engine(tmp_path, speculative_config=NGRAM)
    ref_s = _toks(eager.generate(prompts, seeded))
    del eager
    llm = _engine(tmp_path, speculative_config=NGRAM)
    graphs = llm.core._capture_graphs(emulate=True)
    assert graphs.query_lens == (1, 4) and (8, 4) not in graphs.graphs and (6, 4) in graphs.graphs
    llm.core.runner.graphs = graphs
    shapes, run = [], graphs.run

    def counted(b, q, *a):
        shapes.append((b, q))
        return run(b, q, *a)
    graphs.run = counted
    assert _toks(llm.generate(prompts[:3], greedy)) == ref[:3]
    assert (4, 4) in shapes                     # 3 sequences padded to 4, each to 4 rows
    assert llm.core.get_stats().spec_decode_num_accepted_tokens_total > 0
    assert _toks(llm.generate(prompts, greedy)) == ref
    assert (6, 4) in shapes
    assert _toks(llm.generate(prompts, seeded)) == ref_s
    # Alone: batch 1, 4 rows.
    shapes.clear()
    assert _toks(llm.generate([prompts[2]], greedy)) == ref[2:3] and (1, 4) in shapes


def test_verification_steps_over_linear_attention_replayed(graph_env, tmp_path):
    """Qwen3-Next, k = 3 drafts with 0..3 correct tokens then a wrong one
    (the state checkpoints, 4 per slot, resumed from each of a step's rows),
    every verification step replayed at 4 rows per sequence (3 sequences
    padded to 4: the DeltaNet layers a token at a time from device lengths,
    the pad sequence writing the pad slot). Tokens and logprobs equal a run
    without drafts."""
    save_tiny_qwen3_next(tmp_path)
    prompts = token_prompts(3, lo=5, hi=14, seed=3)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)
    ref = _engine(tmp_path).generate(prompts, greedy)
    llm = _engine(tmp_path, speculative_config=NGRAM)
    llm.core.proposer = partly_right(prompts, _toks(ref))
    assert why_not_capturable(llm.core.caches, 4) is None
    assert "5 rows > 4 checkpoints" in why_not_capturable(llm.core.caches, 5)
    graphs = llm.core._capture_graphs(emulate=True)
    assert graphs.query_lens == (1, 4)
    llm.core.runner.graphs = graphs
    shapes, run = [], graphs.run
    graphs.run = lambda b, q, *a: (shapes.append((b, q)), run(b, q, *a))[1]
    out = llm.generate(prompts, greedy)
    assert _toks(out) == _toks(ref)
    for a, b in zip(out, ref):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert max(abs(la[t] - lb[t]) for t in la) < 1e-4
    st = llm.core.get_stats()
    assert shapes.count((4, 4)) >= 3 and st.spec_decode_num_accepted_tokens_per_pos[2] > 0


def test_steps_that_stay_eager(graph_env, tmp_path):
    """A decode batch larger than the largest captured size stays eager."""
    save_tiny_llama(tmp_path)
    llm = _engine(tmp_path)
    replays = _emulate(llm)
    llm.core.runner.graphs.sizes_of[1] = [1, 2]
    prompts = token_prompts(3, lo=4, hi=9, seed=5)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp)
    assert replays == []            # 3 decodes > 2: eager
    llm.generate(prompts[:2], sp)
    assert replays == [2, 2]


def test_backends_that_cannot_be_captured_say_so(tmp_path, caplog):
    save_tiny_llama(tmp_path)
    llm = _engine(tmp_path, kv_cache_dtype="tq4")
    with caplog.at_level("INFO", logger="tqserve.engine"):
        assert llm.core._capture_graphs(emulate=True) is None
    assert "CUDA graphs off: attention backend" in caplog.text


def test_a_step_with_a_host_sync_is_refused_at_capture(graph_env, tmp_path, monkeypatch, caplog):
    """A backend that reads a length on the host fails its warm-up under
    forbid_host_syncs: the engine logs why and stays eager."""
    save_tiny_llama(tmp_path)
    llm = _engine(tmp_path)
    from kvcache.dense_triton import DenseTritonBackend
    orig = DenseTritonBackend.forward

    def syncing(self, cache, q, meta, scale):
        int(meta.seq_lens_t.max())
        return orig(self, cache, q, meta, scale)
    monkeypatch.setattr(DenseTritonBackend, "forward", syncing)
    with caplog.at_level("INFO", logger="tqserve.engine"):
        assert llm.core._capture_graphs(emulate=True) is None
    assert "capturing a decode step failed: HostSyncError" in caplog.text


def test_no_graphs_on_cpu(tmp_path, caplog):
    save_tiny_llama(tmp_path)
    with caplog.at_level("INFO", logger="tqserve.engine"):
        assert _engine(tmp_path).core.graphs is None
    assert "attention (layers): dense-cpu x 2" in caplog.text      # the startup line names the backends


@pytest.mark.parametrize("kv", ["tq4", "k8v4"])
def test_turboquant_decode_replayed_equals_eager(tmp_path, monkeypatch, kv):
    """TurboQuant layers through tq-triton (decode, hot pass and the one-launch
    store, interpreted): eager gives the CPU kernel's greedy tokens, captured
    steps (padded 3 -> 4: the pad rows' slot -1 writes nothing) eager's
    tokens and logprobs; verification steps too (tq4's hot tokens: the HOT
    prefill launch over the hot pool, and for spans longer than block_size +
    1 over the new rows the store keeps)."""
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    save_tiny_llama(tmp_path)
    # Repeating prompts: the n-gram drafts below find matches in them.
    prompts = [p[:4] * 3 for p in token_prompts(3, lo=3, hi=20, seed=2)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-torch")
    cpu = _engine(tmp_path, kv_cache_dtype=kv).generate(prompts, greedy)     # tq-cpu: the CPU kernel
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", "dense-triton,tq-triton")
    eager = _engine(tmp_path, kv_cache_dtype=kv)
    assert any(c is not None and c.backend.name == "tq-triton" and c.hot for c in eager.core.caches) == (kv == "tq4")
    ref = eager.generate(prompts, greedy)
    assert _toks(ref) == _toks(cpu)
    del eager
    llm = _engine(tmp_path, kv_cache_dtype=kv)
    replays = _emulate(llm)
    out = llm.generate(prompts, greedy)
    assert 4 in replays
    assert _toks(out) == _toks(ref)
    for a, b in zip(out, ref):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert max(abs(la[t] - lb[t]) for t in la) < 1e-4
    # Verification steps (n-gram drafts): captured over coded blocks (tq-triton's
    # one-launch prefill kernel) and, with hot tokens, the one-launch HOT pass,
    # which for spans longer than block_size + 1 reads the store's new rows.
    bs = llm.core.args.block_size
    assert why_not_capturable(llm.core.caches, bs + 1) is None
    assert why_not_capturable(llm.core.caches, 2 * bs + 3) is None
    del llm
    # k = 3: spans of 4 rows (block_size 4) over the hot pool; k = 6 (tq4): 7
    # rows, longer than block_size + 1, whose HOT pass reads the store's new rows.
    for k in (3, 6) if kv == "tq4" else (3,):
        llm = _engine(tmp_path, kv_cache_dtype=kv, speculative_config=NGRAM | {"num_speculative_tokens": k})
        graphs = llm.core._capture_graphs(emulate=True)
        assert graphs.query_lens == (1, 1 + k)
        llm.core.runner.graphs = graphs
        shapes, run = [], graphs.run
        graphs.run = lambda b, q, *a: (shapes.append((b, q)), run(b, q, *a))[1]
        assert _toks(llm.generate(prompts, greedy)) == _toks(ref)     # eager, without drafts
        assert llm.core.get_stats().spec_decode_num_accepted_tokens_total > 0 and (4, 1 + k) in shapes
        del llm
