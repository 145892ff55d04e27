"""The engine with compressed KV formats: every preset on a tiny random llama
(batch invariance, chunked prefill, prefix cache, preemption), and SmolLM2:
real K/V round-trip MSE against Lloyd-Max, k8v4 greedy == f16."""
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_calibration import calibration_ids, key_means
from kvcache.attention import Attention
from kvcache.kv_formats import layer_seed
from kvcache.linear_state import LinearStateCache
from kvcache.tq_cache import TQLayerCache
from kvcache.turboquant import codebook_mse, rotate, rotation_signs, unit_mse
from tiny_models import save_tiny_llama, token_prompts

# preset[:kv_hot] (hot tokens default to "k")
PRESETS = ["f16", "tq4", "tq3", "tq2", "k8v4", "k4v3", "k4v2", "k3v3", "k3v3g32", "tq4:off", "tq3:kv"]
MEM = 1 << 20   # small pools: allocation dominates a tiny model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama_tq")
    save_tiny_llama(d)
    return str(d)


prompts = token_prompts


def greedy(max_tokens=10):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def toks(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", PRESETS)
def test_preset_engine_invariants(tiny_dir, spec):
    preset_invariants(tiny_dir, spec)


def preset_invariants(tiny_dir: str, spec: str) -> None:
    """Compact versions of test_engine_tiny's batch-invariance, chunked-prefill,
    prefix-cache and preemption checks, with this KV format, on the token-id
    model saved at tiny_dir (vocabulary 256)."""
    preset, _, hot = spec.partition(":")
    kw = {"kv_hot": hot} if hot else {}
    llm = LLM(tiny_dir, block_size=4, kv_cache_memory=MEM, kv_cache_dtype=preset, **kw)
    # attention layers (a hybrid model's linear-attention states are never compressed)
    caches = [c for c in llm.core.runner.kv_caches if not isinstance(c, LinearStateCache)]
    assert caches
    assert all(isinstance(c, TQLayerCache) for c in caches) == (preset != "f16")
    # hot tokens wherever K (or V with "kv") is TurboQuant, unless off
    want = "" if hot == "off" or preset in ("f16", "k8v4") else hot or "k"
    assert {getattr(c, "hot", "") for c in caches} == {want}
    assert any(g.hot for g in llm.core.plan.groups) == bool(want) == (llm.core.info.hot_bytes_per_seq > 0)
    # compressed layers store keys centred on the calibration forward's mean key
    assert all(c.k_mean is not None and c.k_mean.abs().sum() > 0
               for c in caches if isinstance(c, TQLayerCache))
    # batch invariance
    ps = prompts(8, seed=10)
    batch = toks(llm.generate(ps, greedy()))
    assert toks(llm.generate([ps[3]], greedy())) == [batch[3]]
    # prefix cache: a hit reuses compressed blocks as they are
    base = prompts(1, 40, 41, seed=11)[0]
    first = toks(llm.generate([base], greedy()))
    hits0 = llm.core.get_stats().prefix_cache_hits_total
    assert toks(llm.generate([base], greedy())) == first
    # (a hybrid model runs without prefix caching: the same tokens, no hits)
    assert (llm.core.get_stats().prefix_cache_hits_total > hits0) == llm.core.plan.prefix_caching
    # chunked prefill (8 tokens a step) equals whole-prompt prefill
    ps = prompts(3, 30, 70, seed=12)
    whole = toks(LLM(tiny_dir, block_size=4, enable_prefix_caching=False, kv_cache_memory=MEM,
                     kv_cache_dtype=preset, **kw).generate(ps, greedy()))
    chunked = LLM(tiny_dir, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=8,
                  kv_cache_memory=MEM, kv_cache_dtype=preset, **kw)
    assert toks(chunked.generate(ps, greedy())) == whole
    assert chunked.core.stats.steps_total > sum(map(len, ps)) // 8
    # preemption: room for ~100 tokens, 5 sequences of up to ~75
    ps = prompts(5, 30, 50, seed=13)
    ref = toks(LLM(tiny_dir, block_size=4, kv_cache_memory=MEM,
                   kv_cache_dtype=preset, **kw).generate(ps, greedy(25)))
    plan = llm.core.plan
    # hot tokens (tq presets): 2 blocks per sequence + min(sequences, 8), beside the 100 tokens
    hot = sum(b * (5 * 2 + 5) for g, b in zip(plan.groups, plan.block_bytes) if g.hot)
    small = LLM(tiny_dir, block_size=4, kv_cache_memory=100 * plan.bytes_per_token + hot + 5 * plan.state_bytes_per_seq,
                max_model_len=80,
                max_num_seqs=5, max_num_batched_tokens=64, kv_cache_dtype=preset, **kw)
    assert small.core.plan.capacity_tokens == 100
    assert toks(small.generate(ps, greedy(25))) == ref
    assert small.core.get_stats().num_preemptions_total > 0
    assert small.core.kv.num_used_blocks == 0


def test_protected_layers_and_overrides_in_engine(tiny_dir):
    llm = LLM(tiny_dir, block_size=4, kv_cache_memory=1 << 20, kv_cache_dtype="tq3",
              kv_protect_layers=1)
    assert not any(isinstance(c, TQLayerCache) for c in llm.core.runner.kv_caches)   # 2 layers, both protected
    llm = LLM(tiny_dir, block_size=4, kv_cache_memory=1 << 20, kv_cache_dtype="tq3",
              kv_cache_dtype_k="q8")
    c = llm.core.runner.kv_caches[0]
    assert (c.k_fmt.name, c.v_fmt.name) == ("q8", "tq3")
    with pytest.raises(ValueError):
        LLM(tiny_dir, kv_cache_dtype="tq9")


# -- SmolLM2 ------------------------------------------------------------------
def shakespeare(n_chars, offset=0):
    from fixtures_models import shakespeare_text
    return shakespeare_text()[offset:offset + n_chars]


@pytest.fixture(scope="module")
def smol_f16():
    return LLM("smollm2-135m", kv_cache_memory=64 << 20, max_model_len=1024, kv_cache_dtype="f16")


@pytest.mark.parametrize("preset,uniform", [("tq4", "k4v4"), ("tq3", "k3v3")])
def test_budget_preset_split_within_uniform_bytes(tiny_dir, preset, uniform):
    """tq4 / tq3 choose one (K, V) split by calibration, in no more bytes than
    uniform k4v4 / k3v3, with no worse a calibration error."""
    from engine.kv_calibration import calibration_ids, capture_qkv, split_errors
    from kvcache.kv_formats import layer_seed
    budget = LLM(tiny_dir, block_size=4, kv_cache_memory=MEM, kv_cache_dtype=preset)
    flat = LLM(tiny_dir, block_size=4, kv_cache_memory=MEM, kv_cache_dtype=uniform)
    assert budget.core.plan.bytes_per_token <= flat.core.plan.bytes_per_token
    got = capture_qkv(budget.core.model, calibration_ids(None, budget.core.info.vocab_size), grads=True)
    b = int(uniform[1])
    caches = budget.core.runner.kv_caches
    split = {(c.k_fmt.bits, c.v_fmt.bits) for c in caches}
    assert len(split) == 1
    err = {"chosen": 0.0, "flat": 0.0}
    for i, c in enumerate(caches):
        mod, q, k, v, g = got[i]
        assert g.abs().sum() > 0
        opts = split_errors(mod, q, k, v, g, k.mean(0), layer_seed(0, i))
        err["chosen"] += opts[next(iter(split))][1]
        err["flat"] += opts[(b, b)][1]
    assert err["chosen"] <= err["flat"], err
    assert toks(budget.generate(prompts(2), greedy()))   # and it serves


def test_calibration_without_gradients_scores_relative_error(tiny_dir, monkeypatch):
    """Models whose kernels have no backward (torch's int4 matmul) still get a
    calibrated split, scored by relative attention error."""
    import engine.kv_calibration as kc
    real = kc.capture_qkv

    def no_backward(model, ids, grads=False):
        if grads:
            raise RuntimeError("derivative for _weight_int4pack_mm_for_cpu is not implemented")
        return real(model, ids)
    monkeypatch.setattr(kc, "capture_qkv", no_backward)
    llm = LLM(tiny_dir, block_size=4, kv_cache_memory=MEM, kv_cache_dtype="tq4")
    assert all(c.k_mean is not None for c in llm.core.runner.kv_caches)
    assert toks(llm.generate(prompts(2), greedy()))


def capture_kv(llm, prompt):
    """K/V (after RoPE) of every layer for one prompt, via forward hooks."""
    got = {}

    def hook(mod, args, out):
        k, v = args[1], args[2]
        got.setdefault(mod.layer_idx, []).append(
            (k.detach().view(-1, mod.num_kv_heads, mod.head_dim).clone(),
             v.detach().view(-1, mod.num_kv_heads, mod.head_dim).clone()))

    hs = [m.register_forward_hook(hook) for m in llm.core.model.modules() if isinstance(m, Attention)]
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    finally:
        for h in hs:
            h.remove()
    return {i: (torch.cat([a for a, _ in x]), torch.cat([b for _, b in x])) for i, x in got.items()}


def real_kv_mse(kv: dict, bits: int, group=None) -> tuple[float, float]:
    """Mean per-coordinate MSE of rotated unit K and V vectors over all layers."""
    ks, vs = [], []
    for i, (k, v) in kv.items():
        s = rotation_signs(k.shape[-1], layer_seed(0, i))
        ks.append(unit_mse(rotate(k.float(), s).flatten(0, 1), bits, group))
        vs.append(unit_mse(rotate(v.float(), s).flatten(0, 1), bits, group))
    return sum(ks) / len(ks), sum(vs) / len(vs)


# Measured (1,200 chars of tinyshakespeare, all layers, per-vector norms,
# keys centred as the engine stores them), relative to the codebook's MSE on
# uniform unit vectors (codebook_mse), at 2/3/4 bits:
#   SmolLM2 (head_dim 64)  K -0.9/-1.1/-1.2%, V -1.2/-1.3/-1.2%
#   Gemma3  (head_dim 256) K -2.8/-3.2/-3.3%, V -1.3/-1.4/-1.5%
# Uncentred SmolLM2 keys sit 5.6-6.4% below it: their shared offset makes the
# rotated unit vectors far from uniform on the sphere.
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_kv_roundtrip_mse_near_lloyd_max(model, smol_f16):
    llm = smol_f16 if model == "smollm2-135m" else LLM(model, kv_cache_memory=32 << 20,
                                                        max_model_len=512, kv_cache_dtype="f16")
    kv = capture_kv(llm, shakespeare(1200))
    shape = {"smollm2-135m": (30, 3, 64), "gemma3-270m": (18, 1, 256)}[model]
    assert (len(kv),) + tuple(kv[0][0].shape[1:]) == shape and kv[0][0].shape[0] > 200
    mean = key_means(llm.core.model, calibration_ids(llm.tokenizer, 0))
    kv = {i: (k - mean[i], v) for i, (k, v) in kv.items()}
    for bits in (2, 3, 4):
        ref = codebook_mse(bits, shape[2])
        for name, m in zip("KV", real_kv_mse(kv, bits)):
            assert abs(m / ref - 1) < 0.05, (name, bits, m, ref)


def test_smollm2_k8v4_greedy_equals_f16_and_ppl(smol_f16):
    """k8v4 (int8 K, 4-bit V: 6.25 bits/value) against f16 KV.

    k8v4 moves a token's logprob by 0.0-0.55 nats (measured over 8 plain
    text continuations; the 4-bit V is the noisy part), so greedy equality is
    a property of confident continuations only: on plain text, paths through
    top-2 margins under ~0.15 nats flip (3 of 8; and the chat prompts of
    test_real_models, margins 0.08-0.13), and which ones flip changes with
    float reduction order (thread count). So the greedy check runs on
    continuations whose f16 margins are all >= 1 nat (checked here: a
    counting prompt and passages seen twice), and quality in general is
    checked teacher-forced: perplexity within +3% of f16."""
    tok = smol_f16.tokenizer
    text = shakespeare(40_000)
    ps = [tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,")]
    for o in (5000, 10000, 30000):
        line = text[o:o + 300]
        ps.append(tok.encode(line + "\n\n" + line + "\n\n" + line[:60]))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = smol_f16.generate(ps, sp)
    for o in ref:
        c = o.outputs[0]
        assert all(lp[t] - max(v for u, v in lp.items() if u != t) >= 1.0 for t, lp in zip(c.token_ids, c.logprobs))
    k8v4 = LLM("smollm2-135m", kv_cache_memory=64 << 20, max_model_len=1024, kv_cache_dtype="k8v4")
    assert k8v4.core.plan.bytes_per_token * 16 / 6.25 == smol_f16.core.plan.bytes_per_token
    assert k8v4.core.info.compression_ratio == 16 / 6.25 and smol_f16.core.info.compression_ratio == 1.0
    assert toks(k8v4.generate(ps, sp)) == toks(ref)
    seqs = [tok.encode(text[o:o + 2000])[:256] for o in (0, 10000)]

    def ppl(llm):
        outs = llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=0))
        lps = [lp[t] for ids, o in zip(seqs, outs) for t, lp in zip(ids[1:], o.prompt_logprobs[1:])]
        return math.exp(-sum(lps) / len(lps))
    assert ppl(k8v4) < 1.03 * ppl(smol_f16)
