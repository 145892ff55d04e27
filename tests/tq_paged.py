"""A TurboQuant layer cache filled with random K/V in shuffled blocks, and
the tolerance check the kernel tests (CPU and Triton) compare with."""
import torch

from kvcache.tq_cache import TQLayerCache

BS = 16


def paged_cache(kf, vf, H, D, lens, window=None, seed=0):
    """A cache holding len tokens of each sequence in shuffled blocks; returns
    (cache, block_tables [B, W])."""
    g = torch.Generator().manual_seed(seed)
    W = max(-(-L // BS) for L in lens) + 1          # one spare column: unused entries exist
    nblocks = W * len(lens) + 3
    c = TQLayerCache(nblocks, BS, H, D, kf, vf, 0, window, seed=seed + 1, chunk_tokens=2 * BS)
    bt = torch.randperm(nblocks, generator=g)[:W * len(lens)].view(len(lens), W)
    slots = torch.cat([bt[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS
                       for i, L in enumerate(lens)])
    # Keys with a mean offset and larger norm than values, as in real models.
    k = torch.randn(len(slots), H, D, generator=g) * 2 + 0.5
    v = torch.randn(len(slots), H, D, generator=g)
    c.write(slots, k, v)
    return c, bt


def assert_close(out, ref, rel):
    """Max abs error within rel of the reference's largest value."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = float((out.float() - ref.float()).abs().max())
    assert err <= rel * float(ref.float().abs().max()), err
