"""Speculative decoding with DeepSeek-V4's MTP head (engine/mtp_proposer.py).

The tiny random V4 of tests/test_deepseek_v4.py with the random MTP head of
its mtp_reference, saved as one checkpoint; block size 4 (as
tests/test_deepseek_v4_engine.py). A random head's drafts are almost never
accepted, so verification and rollback of *rejected* drafts is what the plain
runs exercise; an "oracle" wrapper around the proposer (the MTP head still
runs and its drafts are still checked, but the engine verifies the reference
continuation cut at a varying length + one wrong token) exercises accepted
drafts: the MTP cache then follows several kept positions per decode step.

  - lossless: greedy tokens with MTP (k = 1, 3) == the same engine without
    speculation, with requests that opt out, 16-token chunked prefill (mixed
    prefill + verify steps checked to occur), under preemption (pool empty at
    the end), with tq4 compressed entries; == transformers' argmax, logprobs
    too;
  - the drafts are the MTP head's: the first == argmax of the no-cache
    model.mtp_forward over the whole sequence (the target's no-cache
    streams), chained ones == the no-cache head over the sequence extended by
    the previous drafts, its own output streams standing in for the target's;
    checked at every step, with plain and oracle drafts, and after preemption;
  - the spec_decode counters are consistent (and exact with oracle drafts);
  - method "mtp" refused for a model without a head or a checkpoint without
    its weights.

Runs torch with one thread (a tiny model: more threads only contend).
"""
import pytest
import torch
from test_deepseek_v4 import case, save_with_mtp
from test_deepseek_v4_engine import V, check_against_hf, greedy, prompts
from tiny_models import save_tiny_llama

from engine import LLM
from engine.request import EngineRequest, Status

TOL = 1e-4
MAX_TOKENS = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint with MTP weights, the same without them, transformers' model)."""
    c = case(4)
    plain = tmp_path_factory.mktemp("v4_no_mtp")
    c.hf.save_pretrained(plain)
    d = tmp_path_factory.mktemp("v4_mtp")
    save_with_mtp(c, d)
    return str(d), str(plain), c.hf


PROMPTS = prompts(6, 5, 60, seed=11)     # 5..60 tokens + 20 generated: CSA and HCA entries
OPT_OUT = {1, 4}                         # these requests never draft


def params(**kw):
    return [greedy(MAX_TOKENS, speculative=i not in OPT_OUT, **kw) for i in range(len(PROMPTS))]


def mtp(k, **kw):
    return dict(block_size=4, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)


_refs = {}


def reference(path, kv_dtype="auto"):
    """Greedy tokens of the engine without speculation (whole prefills)."""
    if kv_dtype not in _refs:
        llm = LLM(path, block_size=4, kv_cache_dtype=kv_dtype)
        _refs[kv_dtype] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params())]
    return _refs[kv_dtype]


# ------------------------------------------------------------- the references

@torch.inference_mode()
def check_drafts(model, ids: list[int], drafts: list[int]) -> list[float]:
    """drafts (to follow ids) against the MTP head without a cache: the first
    from the head over positions 0..L-2 (the target's streams there, fed the
    next token), each further one from the head over the positions so far plus
    one, where the stand-in stream is the head's own output at the position
    before and the token fed is the previous draft. Each draft must be the
    argmax (within TOL of the top logit when two are that close). Returns the
    top-1 / top-2 logit gap at each draft."""
    L = len(ids)
    t = torch.tensor(ids)
    streams = model.forward_streams(t, torch.arange(L), None)
    nxt, st = t[1:], streams[:-1]
    gaps = []
    for j, d in enumerate(drafts):
        h = model.mtp_streams(nxt, st, torch.arange(L - 1 + j), None)
        logits = model.compute_logits(model.mtp[0].collapse(h[-1:]))[0]
        top2 = logits.topk(2).values
        gaps.append((top2[0] - top2[1]).item())
        if top2[0] - top2[1] > TOL:
            assert d == int(logits.argmax()), f"draft {j} after {L} tokens: {d} != argmax {int(logits.argmax())}"
        else:
            assert logits[d] >= top2[0] - TOL, f"draft {j} after {L} tokens: {d} is not (near) the top"
        nxt, st = torch.cat([nxt, torch.tensor([d])]), torch.cat([st, h[-1:]])
    return gaps


class Driver:
    """Runs requests through llm.core.step() and, between steps, checks each
    running request's drafts against check_drafts. With oracle set (the
    reference outputs), the engine verifies the true continuation cut after
    (num_tokens % (n + 1)) tokens plus one wrong token instead (the MTP
    head's drafts are still computed and checked); records what each step
    verified."""

    def __init__(self, llm, oracle: list[list[int]] | None = None, check_every: int | None = 1):
        self.llm, self.core = llm, llm.core
        self.oracle, self.check_every = oracle, check_every
        self.full: dict[str, list[int]] = {}
        self.head: dict[str, list[int]] = {}      # this step's MTP drafts
        self.verified: list[tuple[str, int, list[int]]] = []   # (request, start, drafts verified)
        self.steps: list[list[tuple[bool, bool]]] = []          # per step: (prefill chunk, verifies)
        self.checked, self.checked_resumed, self.gaps = 0, 0, []
        propose, execute = self.core.proposer.propose, self.core.runner.execute

        def proposer(reqs, room):
            out = propose(reqs, room)
            for r, d, n in zip(reqs, out, room):
                assert len(d) == n                # the head always drafts what fits
            self.head = {r.request_id: list(d) for r, d in zip(reqs, out)}
            if oracle is not None:
                out = [self._oracle(r, d) for r, d in zip(reqs, out)]
            return out

        def runner(sched):
            self.steps.append([(s.start < s.req.num_prompt_tokens, bool(s.spec_token_ids))
                               for s in sched.scheduled])
            self.verified += [(s.req.request_id, s.start, list(s.spec_token_ids))
                              for s in sched.scheduled if s.spec_token_ids]
            return execute(sched)
        self.core.proposer.propose, self.core.runner.execute = proposer, runner

    def _oracle(self, r, d):
        n = len(d)
        if not n:
            return d
        true = self.full[r.request_id][r.num_tokens:r.num_tokens + n]
        j = r.num_tokens % (n + 1)
        return true[:j] + ([(true[j] + 1) % V] if j < n else [])

    def run(self, ps, sps) -> list[list[int]]:
        core, rids = self.core, [f"r{i}" for i in range(len(ps))]
        for i, (rid, p, sp) in enumerate(zip(rids, ps, sps)):
            core.add_request(EngineRequest(rid, p, sp))
            if self.oracle is not None:
                self.full[rid] = p + self.oracle[i]
        outs = {rid: [] for rid in rids}
        model = core.model
        while core.has_work():
            for o in core.step():
                outs[o.request_id] += o.new_token_ids
            if self.check_every is None or len(self.steps) % self.check_every:
                continue
            for rid, d in self.head.items():
                req = core.scheduler.requests.get(rid)
                if not d or req is None or req.status != Status.RUNNING:
                    continue
                assert req.params.speculative and req.num_computed_tokens == req.num_tokens - 1
                if self.oracle is None:
                    assert req.spec_token_ids == d
                self.gaps += check_drafts(model, req.token_ids, d)
                self.checked += 1
                self.checked_resumed += req.num_preemptions > 0
        return [outs[rid] for rid in rids]


def check_stats(core, k: int, expect_accepted: list[int] | None = None):
    st = core.get_stats()
    per = st.spec_decode_num_accepted_tokens_per_pos
    assert len(per) == k
    assert st.spec_decode_num_drafts_total > 0
    assert all(a >= b for a, b in zip(per, per[1:])), per
    assert sum(per) == st.spec_decode_num_accepted_tokens_total
    assert st.spec_decode_num_accepted_tokens_total <= st.spec_decode_num_draft_tokens_total
    assert st.spec_decode_num_drafts_total <= st.spec_decode_num_draft_tokens_total \
        <= k * st.spec_decode_num_drafts_total
    if expect_accepted is not None:
        # Every verified draft list counts once; accepted = its longest correct prefix.
        assert st.spec_decode_num_drafts_total == len(expect_accepted)
        assert st.spec_decode_num_accepted_tokens_total == sum(expect_accepted)
        assert per == [sum(a > i for a in expect_accepted) for i in range(k)]
    return st


def accepted_prefixes(driver: Driver, ps, ref) -> list[int]:
    out = []
    for rid, start, drafts in driver.verified:
        i = int(rid[1:])
        true = (ps[i] + ref[i])[start + 1:start + 1 + len(drafts)]
        out.append(next((j for j, (a, b) in enumerate(zip(drafts, true)) if a != b), len(drafts)))
    return out


# ------------------------------------------------------------------ lossless

@pytest.mark.parametrize("k", [1, 3])
def test_lossless_batched_chunked_opt_out(ckpt, k):
    """Opted-out and drafting requests in one batch, 16-token steps: the same
    tokens as without speculation and as transformers' argmax, logprobs
    within TOL of transformers'; mixed prefill-chunk + verify steps occur;
    opted-out requests never verify drafts."""
    path, _, hf = ckpt
    ref = reference(path)
    llm = LLM(path, **mtp(k, max_num_batched_tokens=16))
    assert llm.core.model.mtp_loaded
    d = Driver(llm, check_every=4)
    got = d.run(PROMPTS, params())
    assert got == ref
    assert any(any(p for p, _ in s) and any(v for _, v in s) for s in d.steps), "no prefill + verify step"
    assert not any(rid in (f"r{i}" for i in OPT_OUT) for rid, _, _ in d.verified)
    assert {rid for rid, _, _ in d.verified} == {f"r{i}" for i in range(len(PROMPTS)) if i not in OPT_OUT}
    check_stats(llm.core, k)
    assert llm.core.kv.num_used_blocks == 0
    if k == 3:
        # logprobs through the verification rows, against transformers
        llm = LLM(path, **mtp(k, max_num_batched_tokens=16))
        outs = llm.generate(PROMPTS[:3], params(logprobs=5, prompt_logprobs=5)[:3])
        for o, r in zip(outs, ref):
            assert o.outputs[0].token_ids == r
            check_against_hf(hf, o)
        assert llm.core.get_stats().spec_decode_num_drafts_total > 0


@pytest.mark.parametrize("oracle", [False, True])
def test_lossless_under_preemption(ckpt, oracle):
    """A pool too small for the batch: requests are preempted (their MTP
    cache goes with their state slot and is rebuilt on recompute); tokens
    unchanged, drafts still the head's, everything freed."""
    path, _, _ = ckpt
    ref, k = reference(path), 3
    plan = LLM(path, **mtp(k, max_num_seqs=4, max_model_len=90, kv_cache_memory=2**20)).core.plan
    budget = 4 * plan.state_bytes_per_seq + 4 * sum(plan.block_bytes[:-1]) + 90 * plan.bytes_per_token + plan.pad_bytes
    llm = LLM(path, **mtp(k, max_num_seqs=4, kv_cache_memory=int(budget), max_model_len=90,
                          max_num_batched_tokens=32))
    assert llm.core.plan.capacity_tokens == 90
    d = Driver(llm, oracle=ref if oracle else None, check_every=3)
    got = d.run(PROMPTS, params())
    st = llm.core.get_stats()
    assert st.num_preemptions_total > 0
    assert got == ref
    assert d.checked_resumed > 0         # drafts checked after a request's recompute
    check_stats(llm.core, k, accepted_prefixes(d, PROMPTS, ref) if oracle else None)
    assert llm.core.kv.num_used_blocks == 0 and llm.core.kv.usage == 0


def test_lossless_tq4(ckpt):
    """Compressed (tq4) entries: the same tokens as the tq4 engine without
    speculation, with plain and with oracle drafts (verify chunks of up to 4
    tokens, rollback of coded entries after partial acceptance). Whole
    prefills: with tq4 (and bf16) storage the tokens depend on where prefill
    chunks end even without speculation (window ring and compressor carry are
    read back rounded to 16 bits across a chunk boundary, used in fp32 within
    one; max_num_batched_tokens=13 alone changes a request's tokens here), and
    drafts shift those boundaries."""
    path, _, _ = ckpt
    ref, k = reference(path, "tq4"), 3
    for oracle in (None, ref):
        llm = LLM(path, **mtp(k, kv_cache_dtype="tq4"))
        d = Driver(llm, oracle=oracle, check_every=None)   # the no-cache reference is not tq4
        assert d.run(PROMPTS, params()) == ref
        check_stats(llm.core, k, accepted_prefixes(d, PROMPTS, ref) if oracle else None)
        assert llm.core.kv.num_used_blocks == 0


def test_verification_steps_batched_and_replayed(ckpt, monkeypatch):
    """Verification steps run every sequence at once (DSV4Rows, a row at a
    time from device tensors): eagerly when every sequence verifies k drafts
    (plain drafts, all drafting; the MTP head's chained passes, one row per
    sequence, batched too and its drafts checked against the no-cache
    head), and as CUDA graphs (emulated on CPU) of 1 + k rows per sequence
    whatever its drafts (oracle drafts, 0..3 accepted: pad rows after a
    sequence's tokens), the head's chained passes from graphs of their own
    (its drafts checked against the no-cache head). Both: the tokens of
    decoding without drafts; the graph run's drafts are counted exactly."""
    from model_zoo import cpu_ops
    monkeypatch.setattr(cpu_ops, "ENABLED", False)    # the model's torch ops, as on a GPU
    path, _, _ = ckpt
    ref, k = reference(path), 3
    sps = [greedy(MAX_TOKENS) for _ in PROMPTS]
    llm = LLM(path, **mtp(k, max_num_seqs=8))
    pool, spans, head = llm.core.runner.kv_caches, [], []
    rows, mtp_batch = pool.rows, pool.mtp_batch
    pool.rows = lambda meta, *a, **kw: (a or spans.append(meta.max_query_len), rows(meta, *a, **kw))[1]
    pool.mtp_batch = lambda *a: (m := mtp_batch(*a), head.append(m.batched))[0]
    d = Driver(llm, check_every=5)          # drafts checked against the no-cache head too
    assert d.run(PROMPTS, sps) == ref and d.checked > 10
    assert spans.count(1 + k) >= 10, spans
    assert head.count(True) >= 20 and False in head      # the head's chained passes batched too

    llm = LLM(path, **mtp(k, max_num_seqs=8))
    graphs = llm.core._capture_graphs(emulate=True)
    assert graphs is not None and graphs.query_lens == (1, 1 + k)
    llm.core.runner.graphs, run, shapes = graphs, graphs.run, []
    graphs.run = lambda b, q, *a: (shapes.append((b, q)), run(b, q, *a))[1]
    head = llm.core.runner.head_graphs = llm.core._capture_head_graphs(emulate=True)
    d = Driver(llm, oracle=ref, check_every=3)      # the head's drafts against the no-cache head
    assert d.run(PROMPTS, sps) == ref and d.checked > 5
    assert sum(q == 1 + k for _, q in shapes) >= 5, shapes
    assert head.replays >= 20                       # its chained passes (k - 1 per step) replayed
    check_stats(llm.core, k, accepted_prefixes(d, PROMPTS, ref))


# ------------------------------------------------------------ the drafts

@pytest.mark.parametrize("oracle", [False, True])
def test_drafts_are_the_heads(ckpt, oracle):
    """k = 3, prefills in 16-token chunks then decodes: after every step each
    running request's drafts (req.spec_token_ids, or with oracle drafts what
    the head proposed) are the no-cache MTP head's greedy chain. With oracle
    drafts the engine accepts 0..3 drafts per step, so the head's cache
    follows 1..4 kept positions per decode; the counters are exact."""
    path, _, _ = ckpt
    ref, k = reference(path), 3
    ps, sps = PROMPTS[:4], params()[:4]     # r1 opts out: its MTP cache still follows, unchecked
    llm = LLM(path, **mtp(k, max_num_batched_tokens=16))
    d = Driver(llm, oracle=ref if oracle else None)
    assert d.run(ps, sps) == ref[:4]
    near = sum(g <= TOL for g in d.gaps)
    print(f"oracle {oracle}: {d.checked} draft chains ({len(d.gaps)} drafts) checked, {near} near-ties "
          f"(top-2 logit gap <= {TOL}), smallest gap {min(d.gaps):.1e}")
    assert d.checked >= (40 if not oracle else 15)
    assert near <= len(d.gaps) // 50          # nearly every draft was a decisive argmax
    acc = accepted_prefixes(d, ps, ref) if oracle else None
    st = check_stats(llm.core, k, acc)
    if oracle:
        assert st.spec_decode_num_accepted_tokens_per_pos[k - 1] > 0   # whole drafts accepted too
        assert st.spec_decode_num_accepted_tokens_total > st.spec_decode_num_drafts_total


# ------------------------------------------------------------------ errors

def test_mtp_needs_a_head(tmp_path):
    save_tiny_llama(tmp_path)
    with pytest.raises(ValueError, match="MTP head"):
        LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_mtp_needs_the_weights(ckpt):
    _, plain, _ = ckpt
    with pytest.raises(ValueError, match="no MTP weights"):
        LLM(plain, **mtp(2))
    LLM(plain, block_size=4)                  # fine without speculation
