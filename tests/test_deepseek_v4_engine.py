"""DeepSeek-V4 served by the engine: its cache in the paged pool (kvcache/dsv4_paged.py).

The tiny random checkpoint of tests/test_deepseek_v4.py (sliding window 8, CSA
ratio 4 + indexer top-4, HCA ratio 16, hash + routed MoE), saved by
transformers' save_pretrained and loaded from that directory like any model.
Block size 4: a CSA block holds 16 tokens' worth of entries, an HCA block 64.

  - prompt logprobs and generated-token logprobs vs transformers (fp32, full
    teacher-forced forward), greedy tokens = transformers' argmax at every
    step, for several prompts of different lengths, with whole prefills and
    with 16-token chunks (mixed decode + prefill-chunk steps checked to occur;
    decodes run all at once, DSV4Rows, prefills a sequence at a time);
  - preemption under a small pool: same tokens, everything freed;
  - rollback through the engine: decode 6 wrong tokens across window closes
    of both compressors, truncate, decode: bit-identical to never having
    decoded them (fp32 and tq4 entries); entry blocks freed; too deep a
    rollback refused;
  - bytes per token per layer kind and per-sequence state from the plan
    (fp32, bf16, tq4 entries);
  - `tqserve serve` on the directory answers the openai client.
"""
import openai
import pytest
import torch
import transformers
from test_deepseek_v4 import CONFIG, hf_config, randomise
from test_server_process import ServerProcess

from engine import LLM, SamplingParams
from engine.request import EngineRequest
from kvcache.dsv4_paged import dsv4_groups
from kvcache.kv_manager import KVCacheManager
from kvcache.spec import DSV4LayerSpec

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

TOL = 1e-4
V = CONFIG["vocab_size"]


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_v4")
    hf = transformers.DeepseekV4ForCausalLM(hf_config(CONFIG)).eval()
    randomise(list(hf.named_parameters()) + list(hf.named_buffers()), CONFIG["n_routed_experts"],
              CONFIG["num_experts_per_tok"])
    hf.save_pretrained(d)
    return str(d), hf


def prompts(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, V, (m,), generator=g).tolist() for m in lens]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against_hf(hf, out):
    """Every prompt / generated logprob the engine reports vs transformers on
    the whole sequence; greedy tokens are transformers' argmax."""
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    ref = hf_logprobs(hf, prompt + gen)
    worst = 0.0
    for p, lp in enumerate(out.prompt_logprobs or []):
        if lp is not None:
            assert prompt[p] in lp
            worst = max(worst, max(abs(v - ref[p - 1, t].item()) for t, v in lp.items()))
    for j, (tok, lp) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert tok == int(row.argmax()), f"step {j}: {tok} != transformers' argmax {int(row.argmax())}"
        worst = max(worst, max(abs(v - row[t].item()) for t, v in lp.items()))
    assert worst < TOL, worst
    return worst


def record_steps(llm):
    """Wrap the runner to record (decodes, prefill chunks, tokens) of every step."""
    steps, run = [], llm.core.runner.execute

    def execute(sched):
        n = [s.num_new_tokens for s in sched.scheduled]
        steps.append((sum(1 for x in n if x == 1), sum(1 for x in n if x > 1), sum(n)))
        return run(sched)
    llm.core.runner.execute = execute
    return steps


def count_paths(llm):
    """Count the pool's step views: batched (rows: decode-only steps),
    per-sequence (batch) and, of those, mixed ones whose decodes ran batched."""
    pool, n = llm.core.runner.kv_caches, {"rows": 0, "batch": 0, "mixed": 0}
    rows, batch = pool.rows, pool.batch

    def counted_rows(meta, *a, **kw):
        n["rows"] += not a        # (batch() asks for its leading decodes' rows too)
        return rows(meta, *a, **kw)

    def counted_batch(*a):
        m = batch(*a)
        n["batch"] += 1
        n["mixed"] += m.rows is not None
        return m
    pool.rows, pool.batch = counted_rows, counted_batch
    return n


# dsv4-triton: the CUDA backend's kernels (kvcache/dsv4_triton.py), interpreted, in decodes and prefill chunks.
@pytest.mark.parametrize("chunk,backend", [(None, "dsv4-torch"), (16, "dsv4-torch"), (None, "dsv4-triton"),
                                           (16, "dsv4-triton")])
def test_engine_matches_transformers(tiny_v4, monkeypatch, caplog, chunk, backend):
    monkeypatch.setenv("TQSERVE_ATTN_BACKEND", backend)
    path, hf = tiny_v4
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    with caplog.at_level("INFO", logger="tqserve.engine"):
        llm = LLM(path, block_size=4, **kw)
    assert f"attention (layers): sliding-window-torch x 1, {backend} x 3" in caplog.text
    # prefix caching resumes from state snapshots every 512 tokens (tests/test_state_prefix_cache.py): none here
    assert llm.core.kv.enable_caching and llm.core.kv.snapshot_interval == 512
    steps = record_steps(llm)
    paths = count_paths(llm)
    ps = prompts(4, 20, 90, seed=2)   # 20..90 tokens: CSA and HCA entries, several blocks
    outs = llm.generate(ps, greedy(12, prompt_logprobs=20, logprobs=20))
    worst = max(check_against_hf(hf, o) for o in outs)
    assert llm.core.runner.kv_caches.layers[1].backend.name == backend
    print(f"{backend}, chunk {chunk}: max |logprob diff| vs transformers {worst:.2e} over {len(steps)} steps "
          f"({paths['rows']} batched, {paths['batch']} per sequence, {paths['mixed']} of them with batched decodes)")
    # Decode steps ran batched (DSV4Rows, 4 sequences at once), prefills per
    # sequence, and in mixed steps the decodes batched beside the prefill chunk.
    assert paths["rows"] >= 11 and paths["batch"] >= 1
    assert (paths["mixed"] >= 5) if chunk else paths["mixed"] == 0
    if chunk is not None:
        assert max(n for _, _, n in steps) == chunk
        assert any(d >= 1 and p >= 1 for d, p, _ in steps), "no mixed decode + prefill step"
    assert llm.core.kv.num_used_blocks == 0 and llm.core.kv.usage == 0


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async-scheduling"])
def test_preemption_frees_everything(tiny_v4, ahead):
    path, _ = tiny_v4
    ps = prompts(6, 30, 70, seed=3)
    ref_llm = LLM(path, block_size=4, max_num_seqs=4)
    ref = ref_llm.generate(ps, greedy(30))
    plan = ref_llm.core.plan
    # Room for 4 sequences' state + block slack + 110 tokens of entries (+ the pad
    # slot and discard rows), where 6 requests of up to 100 tokens wait to run 4 at a time.
    budget = 4 * plan.state_bytes_per_seq + 4 * sum(plan.block_bytes[:-1]) + 110 * plan.bytes_per_token + \
        plan.pad_bytes
    small = LLM(path, block_size=4, max_num_seqs=4, kv_cache_memory=int(budget), max_model_len=110,
                max_num_batched_tokens=32, async_scheduling=ahead)
    assert small.core.plan.capacity_tokens == 110
    out = small.generate(ps, greedy(30))
    assert small.core.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert small.core.kv.num_used_blocks == 0 and small.core.kv.usage == 0


def run_core(core, rid):
    """Step until request rid finishes; its new tokens and logprobs."""
    toks, lps = [], []
    while core.has_work():
        for o in core.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                lps += o.new_logprobs
    return toks, lps


@pytest.mark.parametrize("kv_dtype", ["auto", "tq4"])
def test_rollback_through_the_pool(tiny_v4, kv_dtype):
    """Prompt 60 + 4 generated: the next decode is position 63, where CSA (4)
    and HCA (16) both close a window; 6 wrong tokens (positions 63..68, CSA
    closes at 64 and 68 too) are decoded, then rolled back."""
    path, _ = tiny_v4
    P, k = prompts(1, 60, 61, seed=4)[0], 6
    sp = greedy(12, logprobs=20)
    # No prefix caching: the wrong tokens are not drafts, so their blocks would be registered.
    llm = LLM(path, block_size=4, max_rollback_tokens=k, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    core = llm.core
    core.add_request(EngineRequest("straight", P, sp))
    want, want_lp = run_core(core, "straight")

    core.add_request(EngineRequest("r", P, sp))
    req = core.scheduler.requests["r"]
    while req.num_output_tokens < 4:
        core.step()
    assert req.num_computed_tokens == 63 and req.token_ids[-4:] == want[:4]
    wrong = torch.randint(0, V, (k,), generator=torch.Generator().manual_seed(5)).tolist()
    for t in wrong:
        req.token_ids[-1] = t        # as if drafted: decoded, then rejected
        core.step()
    assert req.num_computed_tokens == 69
    csa, hca, state = (core.kv.block_table("r", g) for g in range(3))
    assert len(csa) == 5 and len(hca) == 1 and len(state) == 1   # 17 CSA entries, 4 HCA entries
    used = core.kv.num_used_blocks
    with pytest.raises(ValueError, match="roll back"):
        core.rollback("r", 69 - k - 1)                            # deeper than max_rollback
    core.rollback("r", 63)
    assert req.num_computed_tokens == 63 and len(core.kv.block_table("r", 0)) == 4   # 15 entries
    assert core.kv.num_used_blocks == used - 1
    req.token_ids.append(want[3])    # the accepted token, computed next
    got, got_lp = run_core(core, "r")
    assert got == want[4:]
    assert got_lp == want_lp[4:]     # bit-identical logprobs
    assert core.kv.num_used_blocks == 0


def test_kv_manager_entry_groups_and_state_slots():
    """The pool's view of V4 (no model): an entry group's block covers
    block_size * ratio tokens, a state slot is one per sequence, truncate frees
    entry blocks and keeps the slot, free returns everything."""
    specs = [DSV4LayerSpec(0, "sliding_attention", 8, 4), DSV4LayerSpec(1, CSA, 8, 4, 4, 4),
             DSV4LayerSpec(2, HCA, 8, 4, 16)]
    groups = dsv4_groups(specs)
    assert [(g.ratio, g.per_seq, g.layer_ids) for g in groups] == [(4, False, [1]), (16, False, [2]),
                                                                   (1, True, [0, 1, 2])]
    kv = KVCacheManager(groups, [9, 4, 2], 4, enable_caching=False, max_rollback=3)
    assert kv.allocate("a", [], 0, 15)          # 3 CSA entries, 0 HCA entries
    assert [len(kv.block_table("a", g)) for g in range(3)] == [1, 0, 1]
    assert kv.allocate("a", [], 15, 50)         # 65 tokens: 16 CSA entries, 4 HCA entries
    assert [len(kv.block_table("a", g)) for g in range(3)] == [4, 1, 1]
    assert kv.allocate("b", [], 0, 68) and not kv.allocate("c", [], 0, 1)   # two slots only
    assert [len(kv.block_table("b", g)) for g in range(3)] == [5, 1, 1] and kv.pools[0].num_free == 0
    with pytest.raises(ValueError, match="roll back"):
        kv.truncate("a", 61)                    # 4 behind the highest position
    kv.truncate("a", 62)
    assert [len(kv.block_table("a", g)) for g in range(3)] == [4, 1, 1]
    kv.truncate("b", 65)                        # 16 CSA entries: the 5th block goes
    assert [len(kv.block_table("b", g)) for g in range(3)] == [4, 1, 1] and kv.pools[0].num_free == 1
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.usage == 0


def test_bytes_per_token_by_layer_kind(tiny_v4):
    path, _ = tiny_v4
    llm = LLM(path, block_size=4, max_num_seqs=8, max_rollback_tokens=2)
    plan = llm.core.plan
    D, Di, W, f32 = 32, 16, 8, 4
    # entries grow with context: CSA (2 layers) K=V entry + indexer key per 4 tokens, HCA (1 layer) per 16
    assert plan.bytes_per_token_by_kind() == {"compressed_sparse_attention": 2 * (D + Di) * f32 // 4,
                                             "heavily_compressed_attention": D * f32 // 16}
    assert plan.bytes_per_token == 96 + 8
    # fixed per sequence: window rings (all 4 layers) + compressor carry rings (CSA overlap: 2 windows)
    def state(R, size):   # R: max_rollback_tokens
        window = 4 * (W - 1 + R) * D * size
        carry = 2 * 2 * (2 * 4 + R) * (2 * D + 2 * Di) * size + 2 * (16 + R) * D * size
        return window + carry
    assert plan.state_bytes_per_seq == state(2, f32)
    assert plan.num_blocks[-1] == 8                    # one state slot per max_num_seqs
    assert llm.core.runner.kv_caches.nbytes == plan.total_bytes
    print("bytes/token by kind", plan.bytes_per_token_by_kind(), "state bytes/sequence", plan.state_bytes_per_seq,
          plan.state_bytes_by_part)
    # 16-bit storage halves everything; tq4 stores the compressed K=V entries as
    # 4-bit codes + one fp16 norm (18 B per 32-dim entry), indexer keys in fp16
    ps = prompts(3, 30, 90, seed=7)
    for name, csa, hca in [("bf16", 2 * (D + Di) * 2 // 4, D * 2 // 16),
                           ("tq4", 2 * (D // 2 + 2 + Di * 2) / 4, (D // 2 + 2) / 16)]:
        llm = LLM(path, block_size=4, kv_cache_dtype=name, max_num_batched_tokens=16)
        assert llm.core.plan.bytes_per_token_by_kind() == {CSA: csa, HCA: hca}
        assert llm.core.plan.compression_ratio == pytest.approx((2 * (D + Di) * 2 / 4 + D * 2 / 16) / (csa + hca))
        assert llm.core.plan.state_bytes_per_seq == state(0, 2)
        out = llm.generate(ps, greedy(8))
        assert all(len(o.outputs[0].token_ids) == 8 for o in out) and llm.core.kv.num_used_blocks == 0


def test_tqserve_serves_tiny_v4(tiny_v4, tmp_path):
    path, hf = tiny_v4
    P = prompts(1, 40, 41, seed=6)[0]
    srv = ServerProcess(tmp_path / "server.log", "--model", path, "--max-model-len", "128",
                        "--kv-cache-memory", "8MiB", "--max-num-seqs", "4")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=P, max_tokens=8, temperature=0, logprobs=0)
        toks = [int(s.split(":")[1]) for s in r.choices[0].logprobs.tokens]
        assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
        ref = hf_logprobs(hf, P + toks)
        for j, (t, lp) in enumerate(zip(toks, r.choices[0].logprobs.token_logprobs)):
            assert t == int(ref[len(P) - 1 + j].argmax())
            assert abs(lp - ref[len(P) - 1 + j, t].item()) < TOL
    finally:
        assert srv.terminate() == 0, srv.log()[-3000:]
