"""A TurboQuant layer cache filled with random K/V in shuffled blocks, and
the tolerance check the kernel tests (CPU and Triton) compare with."""
import torch

from kvcache.tq_cache import TQLayerCache

BS = 16


def paged_cache(kf, vf, H, D, lens, window=None, seed=0, hot=""):
    """A cache holding len tokens of each sequence in shuffled blocks; returns
    (cache, block_tables [B, W]), and with hot ("k" / "kv") also the hot
    group's tables [B, W] (int8 copies of every token, in blocks of their own)."""
    g = torch.Generator().manual_seed(seed)
    W = max(-(-L // BS) for L in lens) + 1          # one spare column: unused entries exist
    nblocks = W * len(lens) + 3
    c = TQLayerCache(nblocks, BS, H, D, kf, vf, 0, window, seed=seed + 1, chunk_tokens=2 * BS,
                     hot=hot, hot_blocks=nblocks, hot_group_id=1)
    tables = [torch.randperm(nblocks, generator=g)[:W * len(lens)].view(len(lens), W)
              for _ in range(2 if hot else 1)]
    slots = [torch.cat([t[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS for i, L in enumerate(lens)])
             for t in tables]
    # Keys with a mean offset and larger norm than values, as in real models.
    k = torch.randn(len(slots[0]), H, D, generator=g) * 2 + 0.5
    v = torch.randn(len(slots[0]), H, D, generator=g)
    c.write(slots[0], k, v, slots[1] if hot else None)
    return (c, *tables)


def assert_close(out, ref, rel):
    """Max abs error within rel of the reference's largest value."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = float((out.float() - ref.float()).abs().max())
    assert err <= rel * float(ref.float().abs().max()), err
