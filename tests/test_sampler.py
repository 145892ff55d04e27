"""engine/sampler.py against a per-request reference (the sampler's earlier,
one-request-at-a-time logic, kept here), on CPU and, when there is one, CUDA."""
import warnings

import numpy as np
import pytest
import torch

from engine.request import EngineRequest, Request
from engine.sampler import _Upload, batch_token_logprobs, sample, token_logprobs
from engine.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))]
V = 1000
EOS = 7


# ---------------------------------------------------------------- reference
# The earlier sampler, run one request at a time (so a batch quirk of its
# batched top-p, which touched top_p = 1 rows, does not enter), on the
# logits' device, drawing from a generator seeded like the request.

def _ref_penalties(logits, reqs):
    dev = logits.device
    for i, r in enumerate(reqs):
        p = r.params
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long, device=dev)
            sel = logits[i, ids]
            logits[i, ids] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and r.num_output_tokens:
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
            counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long, device=dev)
            ids = ids.clamp(0, logits.shape[1] - 1)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=dev)
        if r.num_output_tokens < p.min_tokens:
            banned = list((r.eos_token_ids | r.stop_token_ids) & set(range(logits.shape[1])))
            if banned:
                logits[i, banned] = float("-inf")


def _ref_filter(logits, reqs):
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype, device=dev)
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in reqs]
    if any(top_k):
        ks = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k], device=dev)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(
            1, (ks - 1).clamp(max=logits.shape[1] - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([r.params.top_p for r in reqs], dtype=probs.dtype, device=dev)
    if (top_p < 1).any():
        sp, si = torch.sort(probs, dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p[:, None]
        sp = sp.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter_(1, si, sp)
    min_p = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype, device=dev)
    if (min_p > 0).any():
        thr = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < thr, 0)
    return probs / probs.sum(-1, keepdim=True)


def _ref_token_logprobs(logp, token, k):
    d = {token: float(logp[token])}
    if k:
        vals, ids = torch.topk(logp, k)
        for v, t in zip(vals.tolist(), ids.tolist()):
            d.setdefault(t, v)
    return d


def ref_sample_one(row: torch.Tensor, r: Request, gen: torch.Generator | None):
    raw = row[None].float()
    logits = raw.clone()
    _ref_penalties(logits, [r])
    if r.params.greedy:
        tok = int(logits.argmax(dim=-1))
    else:
        probs = _ref_filter(logits, [r])
        q = torch.empty_like(probs)
        q[0].exponential_(generator=gen)
        tok = int((probs / q).argmax(dim=-1))
    lp = None
    if r.params.logprobs is not None:
        lp = _ref_token_logprobs(torch.log_softmax(raw, dim=-1)[0], tok, r.params.logprobs)
    return tok, lp


# ---------------------------------------------------------------- helpers

def make_req(i, n_out=0, prompt_len=12, **kw) -> Request:
    g = torch.Generator().manual_seed(1000 + i)
    prompt = torch.randint(0, V, (prompt_len,), generator=g)
    prompt[1::2] = torch.randint(0, 40, (len(prompt[1::2]),), generator=g)   # some ids whose penalty changes winners
    prompt = prompt.tolist()
    r = Request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=None, **kw), [EOS]), 4096)
    out = torch.randint(0, 40, (n_out,), generator=g).tolist()   # small range: repeats
    r.token_ids.extend(out)
    return r


MIXED = [
    dict(temperature=0),
    dict(temperature=0.7, seed=11),
    dict(temperature=2.0, top_k=3, seed=12),
    dict(temperature=0.9, top_p=0.8, seed=13, logprobs=3),
    dict(temperature=1.3, min_p=0.3, seed=14),
    dict(temperature=0, repetition_penalty=1.3, logprobs=0),
    dict(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4, seed=15),
    dict(temperature=0, logit_bias={3: 5.0, 999: -100.0, 5: 2.5}, logprobs=5),
    dict(temperature=0, logit_bias={EOS: 100.0, 9: 99.0}, min_tokens=40, stop_token_ids=[9]),
    dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=0.8,
         frequency_penalty=-0.5, seed=16, logprobs=2),
    dict(temperature=0.6, top_k=3000, seed=17),                  # top_k > V
    dict(temperature=0, frequency_penalty=2.0, presence_penalty=-1.0),
]


def _random_logits(B, device, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        x = torch.randn(B, V, generator=g) * 3
        x[:, :40] += 5          # the ids outputs are drawn from: penalties change winners
        return x.to(device)
    # bf16: distinct values in each row (top-k alternatives without ties), the
    # 40 largest at the ids outputs are drawn from.
    vals = torch.unique((torch.randn(20 * V, generator=g) * 3).to(dtype))
    assert len(vals) >= V
    rows = []
    for _ in range(B):
        v = vals[torch.randperm(len(vals), generator=g)[:V]].sort(descending=True).values
        rows.append(torch.cat([v[:40][torch.randperm(40, generator=g)], v[40:][torch.randperm(V - 40, generator=g)]]))
    return torch.stack(rows).to(device)


def _same_lp(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert list(a) == list(b)
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=1e-5)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_reference(device, dtype):
    """Several steps of a mixed batch: tokens and logprobs equal to the
    per-request reference drawing from generators seeded like the requests."""
    reqs = [make_req(i, n_out=(3 * i) % 25, **kw) for i, kw in enumerate(MIXED)]
    gens = {r.request_id: torch.Generator(device=device).manual_seed(r.seed) for r in reqs if r.seed is not None}
    for step in range(6):
        logits = _random_logits(len(reqs), device, seed=step, dtype=dtype)
        toks, lps = sample(logits, reqs)
        assert len(toks) == len(lps) == len(reqs)
        for i, r in enumerate(reqs):
            want_tok, want_lp = ref_sample_one(logits[i], r, gens.get(r.request_id))
            assert toks[i] == want_tok, (step, i, MIXED[i])
            _same_lp(lps[i], want_lp)
        for r, t in zip(reqs, toks):
            r.token_ids.append(t)


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_bias_and_bans_take_effect(device):
    logits = torch.zeros(4, V, device=device)
    logits[:, 50], logits[:, 60] = 1.0, 0.5
    reqs = [make_req(0, temperature=0, logit_bias={50: -10.0, 60: 3.0}),
            make_req(1, temperature=0, min_tokens=5, logit_bias={EOS: 50.0}),
            make_req(2, temperature=0, repetition_penalty=1e6),
            make_req(3, temperature=0)]
    reqs[2].token_ids[:] = reqs[2].token_ids[:reqs[2].num_prompt_tokens] + [50]
    toks, lps = sample(logits, reqs)
    assert toks[0] == 60 and toks[1] == 50 and toks[2] != 50 and toks[3] == 50
    assert lps == [None] * 4
    reqs[1].token_ids.extend([1] * 5)                              # min_tokens reached
    assert sample(logits, reqs)[0][1] == EOS


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_and_bad_words(device):
    """allowed_token_ids keeps only its tokens (after the other rules: a
    biased-away one stays away); bad words ban a one-token word always and
    a longer one's last token right after the rest of it."""
    logits = torch.zeros(4, V, device=device)
    logits[:, 50], logits[:, 60], logits[:, 70] = 3.0, 2.0, 1.0
    reqs = [make_req(0, temperature=0, allowed_token_ids=[60, 70]),
            make_req(1, temperature=0, allowed_token_ids=[50, 60], logit_bias={60: -100.0}),
            make_req(2, temperature=0),
            make_req(3, temperature=0)]
    for r in reqs[2:]:
        r.bad_words_ids = [[50], [9, 60]]
    reqs[2].token_ids.append(9)             # "9 60" would be completed: 60 banned too
    assert sample(logits, reqs)[0] == [60, 50, 70, 60]
    sampled = make_req(4, temperature=1.0, seed=3, allowed_token_ids=[5, 6, 800])
    seen = set()
    for step in range(20):
        tok = sample(_random_logits(1, device, seed=step), [sampled])[0][0]
        seen.add(tok)
        sampled.token_ids.append(tok)
    assert seen <= {5, 6, 800} and len(seen) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_alone_equals_in_batch(device):
    """A seeded request gives the same tokens alone and among 8 mixed others
    (including unseeded ones and top_p = 1 next to top_p < 1)."""
    kw = dict(temperature=0.9, top_k=50, seed=123, logprobs=2)
    others = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.5, top_p=0.5),
              dict(temperature=1.2, seed=5, min_p=0.1), dict(temperature=0, repetition_penalty=1.2),
              dict(temperature=0.7, frequency_penalty=1.0), dict(temperature=1.0, top_k=2),
              dict(temperature=1.0, seed=9, top_p=0.3, logprobs=0)]
    alone = [make_req(0, **kw)]
    batch = [make_req(i + 1, **o) for i, o in enumerate(others[:4])] + [make_req(0, **kw)] \
        + [make_req(i + 5, **o) for i, o in enumerate(others[4:])]
    me = 4
    for step in range(8):
        row = _random_logits(1, device, seed=100 + step)
        big = _random_logits(len(batch), device, seed=200 + step)
        big[me] = row[0]
        ta, la = sample(row, alone)
        tb, lb = sample(big, batch)
        assert ta[0] == tb[me]
        _same_lp(la[0], lb[me])
        alone[0].token_ids.append(ta[0])
        for r, t in zip(batch, tb):
            r.token_ids.append(t)
    c = make_req(0, **dict(kw, seed=124))
    assert [sample(_random_logits(1, device, seed=100 + s), [c])[0][0] for s in range(8)] \
        != alone[0].output_token_ids


def test_cpu_generator_stream_unchanged():
    """On CPU a request's generator is torch.Generator().manual_seed(seed), as
    before: seeded CPU outputs keep their values."""
    r = make_req(0, temperature=1.0, seed=77)
    g = r.generator_for(torch.device("cpu"))
    assert r.generator_for(torch.device("cpu")) is g
    a = torch.empty(64).exponential_(generator=g)
    b = torch.empty(64).exponential_(generator=torch.Generator().manual_seed(77))
    assert torch.equal(a, b)
    assert make_req(1, temperature=1.0).generator_for(torch.device("cpu")) is None


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_follow_the_distribution(device):
    """Unseeded rows (one draw for all) sample from softmax(logits / T),
    restricted by top-k; greedy rows in the same batch take the argmax."""
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = torch.full((n, V), -1e4)
    logits[:, :4] = p.log()
    reqs = [make_req(i % 7, temperature=1.0) for i in range(n - 2)]
    reqs += [make_req(1, temperature=0), make_req(2, temperature=1.0, top_k=1)]
    toks, _ = sample(logits.to(device), reqs)
    freq = torch.bincount(torch.tensor(toks[:-2]), minlength=4)[:4].float() / (n - 2)
    assert torch.allclose(freq, p, atol=0.03), freq
    assert toks[-2:] == [3, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_token_logprobs_and_batch(device):
    logp = torch.log_softmax(_random_logits(5, device, seed=3), dim=-1)
    toks = [1, 500, 999, 0, 42]
    for k in (0, 1, 5, 20):
        got = batch_token_logprobs(logp, toks, k)
        for j, t in enumerate(toks):
            want = _ref_token_logprobs(logp[j], t, k)
            _same_lp(got[j], want)
            _same_lp(token_logprobs(logp[j], t, k), want)
    got = batch_token_logprobs(logp, toks, [0, 1, 2, 3, 20])
    for j, (t, k) in enumerate(zip(toks, [0, 1, 2, 3, 20])):
        _same_lp(got[j], _ref_token_logprobs(logp[j], t, k))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_one_host_sync_per_step_on_cuda():
    reqs = [make_req(i, n_out=i, **kw) for i, kw in enumerate(MIXED)]
    logits = _random_logits(len(reqs), "cuda", seed=1)
    sample(logits, reqs)                       # warm up (lazy generators, allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            sample(logits, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [x for x in w if "synchroniz" in str(x.message)]
    assert len(syncs) == 1, [str(x.message) for x in syncs]


@pytest.mark.parametrize("device", DEVICES)
def test_upload_packs_one_buffer(device):
    """The host arrays travel in one buffer (the path CUDA takes; forced here
    on CPU too) and come back as the same values and dtypes."""
    up = _Upload(torch.device(device))
    up.pack = True
    parts = [[1.5, -2.0, 3.25], [7, -1, 2 ** 40], [], [0.1], [3], list(range(5))]
    kinds = [np.float32, np.int64, np.int64, np.float32, np.int64, np.float32]
    for a, k in zip(parts, kinds):
        up.add(a, k)
    got = up.send()
    for g, a, k in zip(got, parts, kinds):
        assert g.device.type == device
        assert g.dtype == (torch.int64 if k == np.int64 else torch.float32)
        assert g.cpu().tolist() == np.asarray(a, k).tolist()


def test_empty_batch():
    assert sample(torch.zeros(0, V), []) == ([], [])


class _FixedGrammar:
    """A grammar stand-in whose mask allows a fixed token set (what
    structured_output.fill_bitmask reads from a request's grammar)."""

    def __init__(self, allowed):
        import numpy as np
        from engine.structured_output import mask_words
        self.active, self.words = True, mask_words(V)
        self.bits = np.zeros(self.words, np.int32)
        for t in allowed:
            self.bits[t // 32] |= np.uint32(1 << (t % 32)).view(np.int32)

    def fill_mask(self, row):
        row[:self.words] = self.bits


@pytest.mark.parametrize("device", DEVICES)
def test_grammar_rows_take_allowed_tokens_only(device):
    """Constrained rows (greedy, seeded, with logprobs) sample inside their
    mask; the other rows and every row's raw logprobs are as without masks."""
    logits = _random_logits(len(MIXED), device, seed=5)
    allowed = {1: [7, 300, 999], 3: [2, 5], 5: [640]}
    plain = [make_req(i, n_out=4, **kw) for i, kw in enumerate(MIXED)]
    masked = [make_req(i, n_out=4, **kw) for i, kw in enumerate(MIXED)]
    for i, toks in allowed.items():
        masked[i].grammar = _FixedGrammar(toks)
    t0, lp0 = sample(logits, plain)
    t1, lp1 = sample(logits, masked)
    for i in range(len(MIXED)):
        if i in allowed:
            assert t1[i] in allowed[i]
        else:
            assert t1[i] == t0[i]
    assert lp1[5] is not None and lp1[5][t1[5]] == pytest.approx(
        torch.log_softmax(logits[5].float(), -1)[t1[5]].item(), abs=1e-5)   # raw, not masked
    assert lp1[7] == lp0[7]
