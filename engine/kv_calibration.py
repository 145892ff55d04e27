"""Startup calibration for compressed KV formats: per-layer key offsets and,
for the bit-budget presets (tq4 / tq3 / tq2), each layer's (K, V) bit split.

Keys of a head share a large constant offset in many models: with it, 4-bit
keys cost SmolLM2 +5.1% perplexity, +3.8% with keys centred
(tests/bench/results/kv_levers_smollm2-135m.md). Subtracting a
constant from every key leaves attention unchanged (kvcache/tq_cache.py), so
the engine measures each layer's mean key on a fixed built-in text once,
after loading, and the compressed caches store keys minus that mean. The text
is fixed so a given model always gets the same offsets (prefix-cached blocks
stay valid across restarts of the same build), and it is not the evaluation
text of the fidelity benchmark.

The same forward gives each layer's queries, so for a budget preset every
(K, V) split of KV_MENU is tried on the captured K/V (round-trip through the
codec), scored by the layer's attention-output error weighted by the squared
loss gradient (one backward pass), and the best split that fits the budget is
taken for all layers (kv_formats.choose_split): Gemma3-270M gets 5-bit K /
3-bit V for tq4, SmolLM2 4/4.
"""
from dataclasses import replace
import logging
import time

import torch
import torch.nn.functional as F

from kvcache.attention import Attention
from kvcache.dense_cache import expand_kv
from kvcache.kv_formats import KV_MENU, KVPolicy, choose_split, layer_seed
from kvcache.turboquant import Codec, tq
from parallel.linear import ParallelLMHead, VocabParallelEmbedding

log = logging.getLogger("tqserve.engine")

CALIBRATION_TEXT = """\
The library opens at nine in the morning and closes at six, except on Sundays, when it stays \
closed. Visitors who want to borrow a book need a card, which they can get at the front desk by \
showing proof of address. Most people come for the reading room on the second floor: it is quiet, \
the chairs are comfortable, and the windows look out over the old harbour.

"Did you remember to bring the tickets?" she asked, checking her bag for the third time.
"They're in my coat pocket," he said. "Both of them. And the hotel confirmation, too."
"Good. The train leaves at 7:42, so we should be at the station by half past."

To make bread you need flour, water, salt and yeast. Mix them, knead the dough for ten minutes \
until it is smooth, and let it rise in a warm place for about an hour. Shape the loaf, let it rise \
again, then bake it at 220 degrees Celsius for thirty-five minutes.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

print([fibonacci(i) for i in range(10)])

The committee met on Tuesday to review the budget for the coming year. Revenue grew by 4.2 percent, \
mostly from membership fees, while costs rose faster than expected because of repairs to the roof \
and the heating system. Several members proposed raising fees; others argued that a fundraising \
campaign in the spring would cover the gap without discouraging new members. A vote was postponed \
until the next meeting, when the treasurer will present three options with their risks.

Question: What is the capital of France?
Answer: The capital of France is Paris, which is also its largest city.

Rivers carry water from high ground to the sea, shaping valleys, depositing sediment and supporting \
the plants and animals that live along their banks. Over thousands of years a river can change its \
course many times, leaving behind lakes, marshes and fertile plains where people have farmed since \
long before the first cities were built.
"""


def capture_qkv(model, token_ids: list[int], grads: bool = False) -> dict[int, tuple]:
    """(attention module, q [T, Hq, D], k [T, H, D], v [T, H, D], g) per layer,
    post-RoPE as written to the cache, from one no-cache forward. With grads,
    g [T, Hq, D] is the gradient of the calibration text's next-token loss
    with respect to the layer's attention output (one backward pass), else None."""
    got, outs, hooks = {}, {}, []

    def pre(mod: Attention, args):
        T = args[0].shape[0]
        got[mod.layer_idx] = [mod] + [x.detach().float().view(T, -1, mod.head_dim) for x in args[:3]]

    def post(mod: Attention, args, out):
        out.retain_grad()
        outs[mod.layer_idx] = out

    def leaf(mod, args, out):      # gradients start at the embeddings: weights need none
        return out.detach().requires_grad_()

    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if not attns:
        return got
    for m in attns:
        hooks.append(m.register_forward_pre_hook(pre))
        if grads:
            hooks.append(m.register_forward_hook(post))
    if grads:
        emb = next(m for m in model.modules()
                   if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead))
        hooks.append(emb.register_forward_hook(leaf))
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, device=device)
    try:
        with torch.set_grad_enabled(grads):
            hidden = model(ids, torch.arange(len(token_ids), device=device), None)
            if grads:
                logits = model.compute_logits(hidden[:-1]).float()
                F.cross_entropy(logits, ids[1:], reduction="sum").backward()
    finally:
        for h in hooks:
            h.remove()
    return {i: (*x, outs[i].grad.float().view_as(x[1]) if grads else None) for i, x in got.items()}


def key_means(model, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """Mean key per layer ([num_kv_heads, head_dim]) over token_ids."""
    return {i: k.mean(0) for i, (_, _, k, _, _) in capture_qkv(model, token_ids).items()}


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode(CALIBRATION_TEXT)
    # Token-id-only models (tests' tiny configs): a fixed pseudo-random sequence.
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (256,), generator=g).tolist()


def _attention(mod: Attention, q, k, v) -> torch.Tensor:
    """Causal attention of one sequence (the flash path when there is no window)."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if mod.sliding_window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mod.scale).transpose(0, 1)
    pos = torch.arange(q.shape[1], device=q.device)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - mod.sliding_window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=mod.scale).transpose(0, 1)


@torch.no_grad()
def split_errors(mod: Attention, q, k, v, g, k_mean, seed: int) -> dict:
    """{(K bits, V bits): (bits per token, error)} over KV_MENU for one layer:
    the attention output with K and V round-tripped through the codec (keys
    centred as stored) against the exact one, each output coordinate's error
    weighted by its squared loss gradient g (a diagonal-Fisher estimate of the
    loss increase: layers and coordinates the rest of the model amplifies
    count more); g None = relative error."""
    H, D = k.shape[1:]
    ref = _attention(mod, q, k, v)
    rt = {}
    for b in sorted({b for kv in KV_MENU for b in kv}):
        c = Codec(tq(b), H, D, seed)
        rt[b] = (c.dequantize(c.encode(k - k_mean)) + k_mean, c.dequantize(c.encode(v)),
                 c.bits_per_value() * H * D)
    out = {}
    for kb, vb in KV_MENU:
        d2 = (_attention(mod, q, rt[kb][0], rt[vb][1]) - ref).pow(2)
        err = (d2 * g.pow(2)).sum() if g is not None else d2.sum() / ref.pow(2).sum()
        out[(kb, vb)] = (rt[kb][2] + rt[vb][2], float(err))
    return out


def calibrate(model, tokenizer, vocab_size: int, specs: list, policy):
    """Measure key means and, for a bit-budget preset, choose its (K, V)
    split. Returns (policy, {layer: key mean}); models whose attention is not
    kvcache.attention.Attention (DeepSeek-V4) get (policy unchanged, {})."""
    if not isinstance(policy, KVPolicy):
        return policy, {}
    t0 = time.monotonic()
    ids = calibration_ids(tokenizer, vocab_size)
    try:
        got = capture_qkv(model, ids, grads=policy.budget is not None)
    except (RuntimeError, NotImplementedError) as e:   # e.g. torch's int4 matmul has no backward
        log.info("KV calibration: no loss gradients (%s); scoring splits by relative error",
                 str(e).splitlines()[0][:120])
        got = capture_qkv(model, ids)
    if not got:
        return policy, {}
    means = {i: k.mean(0) for i, (_, _, k, _, _) in got.items()}
    n = max(s.layer_idx for s in specs) + 1
    layers = [s for s in specs if policy.compressed(s, n) and s.layer_idx in got]
    if policy.budget is not None and layers:
        options = {s.layer_idx: split_errors(*got[s.layer_idx], means[s.layer_idx],
                                             layer_seed(policy.seed, s.layer_idx)) for s in layers}
        b = policy.budget
        kb, vb = choose_split(options, b)
        policy = replace(policy, k=tq(kb), v=tq(vb))
        scores = ", ".join(f"k{k}v{v} {sum(o[(k, v)][1] for o in options.values()):.4g}"
                           for k, v in KV_MENU if (k, v) in ((b, b), (kb, vb)))
        log.info("KV calibration: tq%d -> k%dv%d (weighted error %s)", b, kb, vb, scores)
    log.info("KV calibration: key means for %d layers in %.1fs", len(means), time.monotonic() - t0)
    return policy, means


def set_key_means(caches, means: dict[int, torch.Tensor]) -> int:
    """Give every cache that stores centred keys (set_key_mean) its layer's
    mean key; returns how many got one."""
    if not isinstance(caches, list):   # DeepSeek-V4's own paged cache: no per-layer key store
        return 0
    n = 0
    for i, c in enumerate(caches):
        if hasattr(c, "set_key_mean") and i in means:
            c.set_key_mean(means[i])
            n += 1
    return n
