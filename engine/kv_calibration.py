"""Per-layer key offsets for compressed KV formats, measured at startup.

Keys of a head share a large constant offset in many models (SmolLM2's keys
lose 2-3 points of perplexity to 4-bit codes because of it). Subtracting a
constant from every key leaves attention unchanged (kvcache/tq_cache.py), so
the engine measures each layer's mean key on a fixed built-in text once,
after loading, and the compressed caches store keys minus that mean. The text
is fixed so a given model always gets the same offsets (prefix-cached blocks
stay valid across restarts of the same build), and it is not the evaluation
text of the fidelity benchmark.
"""
import logging
import time

import torch

from kvcache.attention import Attention

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


@torch.no_grad()
def key_means(model, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """Mean key per layer ([num_kv_heads, head_dim], post-RoPE, as written to
    the cache) over one no-cache forward of token_ids."""
    sums, hooks = {}, []

    def hook(mod: Attention, args):
        k = args[1].float().view(-1, mod.num_kv_heads, mod.head_dim)
        sums[mod.layer_idx] = (k.sum(0), k.shape[0])

    for mod in model.modules():
        if isinstance(mod, Attention):
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        ids = torch.tensor(token_ids)
        model(ids, torch.arange(len(token_ids)), None)
    finally:
        for h in hooks:
            h.remove()
    return {i: s / n for i, (s, n) in sums.items()}


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode(CALIBRATION_TEXT)
    # Token-id-only models (tests' tiny configs): a fixed pseudo-random sequence.
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (256,), generator=g).tolist()


def center_keys(model, tokenizer, vocab_size: int, caches: list) -> int:
    """Give every cache that stores centred keys (set_key_mean) its layer's
    mean key; returns how many got one."""
    if not isinstance(caches, list):   # DeepSeek-V4's own paged cache: no per-layer key store
        return 0
    targets = {i: c for i, c in enumerate(caches) if hasattr(c, "set_key_mean")}
    if not targets:
        return 0
    t0 = time.monotonic()
    means = key_means(model, calibration_ids(tokenizer, vocab_size))
    for i, c in targets.items():
        if i in means:
            c.set_key_mean(means[i])
    n = sum(i in means for i in targets)
    log.info("KV calibration: key means for %d compressed layers in %.1fs", n, time.monotonic() - t0)
    return n
