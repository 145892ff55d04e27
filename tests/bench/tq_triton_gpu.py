"""Decode attention on a GPU: the Triton kernel over TurboQuant-compressed
paged blocks (kvcache.tq_triton.tq_paged_decode) vs torch
scaled_dot_product_attention over dense bf16 KV of the same shapes
(contiguous, not paged: the baseline gets its best case).

Shapes: 32 query heads, 8 KV heads, head_dim 128 (Llama-8B-like), block size
16, bf16 queries; context 1K/4K/8K, batch 1 and 16; formats tq4, tq3, k8v4;
hot tokens off and "k" (int8 copies of each sequence's first and newest
block: a CODED and a HOT launch merged by log-sum-exp, as TQLayerCache
dispatches it; only for TurboQuant K, as KVPolicy.layer_hot). Per config:
the kernel alone (queries already rotated), the whole decode step
(TQLayerCache._decode: rotate q, kernel(s), de-rotate), SDPA, the KV bytes
read (the coded stores) and the kernel's effective bandwidth, and the
kernel's error against the torch reference path (TQLayerCache._attend_torch)
on the same storage (column `correct`), so that a wrong kernel's timings
stand out.

    .venv/bin/python tests/bench/tq_triton_gpu.py [--contexts 1024,4096,8192] \
        [--batches 1,16] [--presets tq4,tq3,k8v4] [--hot off,k] [--iters 50]

Writes tests/bench/results/tq_triton_gpu.{json,md}. Needs CUDA.
"""
import argparse
import json
import sys

import torch

from bench_paths import OUT, log  # puts the repo on sys.path

HQ, H, D, BS = 32, 8, 128, 16



def cuda_time_us(fn, iters):
    for _ in range(3):                      # compile / autotune / allocator warm-up
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def run_config(preset, ctx, batch, iters, hot="", device="cuda"):
    from kvcache.kv_formats import parse_preset
    from kvcache.tq_cache import CODED, HOT, TQLayerCache, merge
    from kvcache.tq_triton import tq_paged_decode

    dev = torch.device(device)
    kf, vf = parse_preset(preset)
    nblk = ctx // BS
    cache = TQLayerCache(batch * nblk + 1, BS, H, D, kf, vf, 0, seed=0, device=dev,
                         hot=hot, hot_blocks=2 * batch + 1, hot_group_id=1)
    g = torch.Generator(device=dev).manual_seed(0)
    # Shuffled blocks, as a pool hands them out after some churn.
    bt = (torch.randperm(batch * nblk, generator=g, device=dev) + 1).view(batch, nblk)
    slots = (bt.unsqueeze(-1) * BS + torch.arange(BS, device=dev)).flatten()
    for i in range(0, slots.numel(), 65536):          # encode in pieces: bounded temporaries
        s = slots[i:i + 65536]
        cache.write(s, torch.randn(s.numel(), H, D, device=dev, generator=g) * 2 + 0.5,
                    torch.randn(s.numel(), H, D, device=dev, generator=g))
    ht = v_hot = None
    if hot:
        # Hot table: valid at column 0 and the newest block's; the other
        # entries point at hot block 0 (never read). Rewrite those blocks'
        # tokens with their int8 copies.
        assert nblk > 1, "hot tokens: a context of at least two blocks"
        ht = torch.zeros_like(bt)
        ht[:, 0] = torch.arange(batch, device=dev) * 2 + 1
        ht[:, -1] = torch.arange(batch, device=dev) * 2 + 2
        offs = torch.arange(BS, device=dev)
        s, hs = ((t[:, [0, -1]].unsqueeze(-1) * BS + offs).flatten() for t in (bt, ht))
        cache.write(s, torch.randn(s.numel(), H, D, device=dev, generator=g) * 2 + 0.5,
                    torch.randn(s.numel(), H, D, device=dev, generator=g), hs)
        v_hot = ht if hot == "kv" else bt
    seq_lens = torch.full((batch,), ctx, dtype=torch.long, device=dev)
    q = torch.randn(batch, HQ, D, device=dev, generator=g, dtype=torch.bfloat16)
    scale = D ** -0.5

    def kernel(qr):
        if not hot:
            return tq_paged_decode(cache, qr, bt, seq_lens)[0]
        return merge(*tq_paged_decode(cache, qr, bt, seq_lens, part=CODED),
                     *tq_paged_decode(cache, qr, ht, seq_lens, part=HOT, v_tables=v_hot))

    # Correctness first, in fp32 against the torch reference on this storage
    # (as TQLayerCache._decode's CPU path: hot pass over block 0 and the own block).
    qr32 = cache._rotate_q(q.float().unsqueeze(1), scale)
    cols, qpos = cache.decode_columns(bt, seq_lens), (seq_lens - 1)[:, None]
    if not hot:
        ref = cache._attend_torch(qr32, cols, bt, qpos, seq_lens)[0]
    else:
        hot_cols = torch.tensor([[0, nblk - 1]], device=dev).expand(batch, 2)
        ref = merge(*cache._attend_torch(qr32, cols[:, 1:], bt, qpos, seq_lens, CODED),
                    *cache._attend_torch(qr32, hot_cols, ht, qpos, seq_lens, HOT, v_hot))
    err32 = float((kernel(qr32) - ref).abs().max() / ref.abs().max())
    qr = cache._rotate_q(q.unsqueeze(1), scale)
    err16 = float((kernel(qr).float() - ref).abs().max() / ref.abs().max())

    t_kernel = cuda_time_us(lambda: kernel(qr), iters)
    t_step = cuda_time_us(lambda: cache._decode(q, bt, seq_lens, scale, ht), iters)

    kd = torch.randn(batch, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    vd = torch.randn(batch, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    qd = q.unsqueeze(2)                                                 # [B, HQ, 1, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_sdpa = cuda_time_us(lambda: sdpa(qd, kd, vd, scale=scale, enable_gqa=True), iters)

    per_token = sum(t.stride(0) * t.element_size() for d in (cache.k, cache.v) for t in d.values())
    kv_bytes = per_token * batch * ctx
    dense_bytes = 2 * batch * ctx * H * D * 2
    return {
        "preset": preset, "hot": hot or "off", "context": ctx, "batch": batch,
        "kernel_us": round(t_kernel, 1), "decode_step_us": round(t_step, 1), "sdpa_bf16_us": round(t_sdpa, 1),
        "speedup_vs_sdpa": round(t_sdpa / t_kernel, 3),
        "kv_bytes": kv_bytes, "dense_bf16_bytes": dense_bytes,
        "kernel_GBps": round(kv_bytes / t_kernel / 1e3, 1), "sdpa_GBps": round(dense_bytes / t_sdpa / 1e3, 1),
        "max_rel_err_fp32": err32, "max_rel_err_bf16": err16,
        # fp32 must match the reference; bf16 differs by its rounding only.
        "correct": err32 < 1e-4 and err16 < 3e-2,
    }


def write(results, device_name):
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"device": device_name, "torch": torch.__version__, "shape": f"Hq={HQ} Hkv={H} D={D} block={BS}"}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    (OUT / "tq_triton_gpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["# Decode attention: Triton over TurboQuant blocks vs SDPA on dense bf16 KV",
             "", f"{device_name}, torch {meta['torch']}, triton {meta.get('triton')}, {meta['shape']}, "
             "bf16 queries. Times per layer-step (CUDA events); GB/s = KV bytes read / time.", "",
             "| preset | hot | context | batch | kernel us | decode step us | SDPA bf16 us | speedup | "
             "kernel GB/s | SDPA GB/s | KV MB | dense MB | rel err fp32 | rel err bf16 | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = [r["preset"], r.get("hot", "off"), r["context"], r["batch"], r["kernel_us"], r["decode_step_us"],
                 r["sdpa_bf16_us"], f"{r['speedup_vs_sdpa']}x", r["kernel_GBps"], r["sdpa_GBps"],
                 f"{r['kv_bytes'] / 2**20:.1f}", f"{r['dense_bf16_bytes'] / 2**20:.1f}",
                 f"{r['max_rel_err_fp32']:.1e}", f"{r['max_rel_err_bf16']:.1e}",
                 "yes" if r["correct"] else "**NO**"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    (OUT / "tq_triton_gpu.md").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--presets", default="tq4,tq3,k8v4")
    ap.add_argument("--hot", default="off,k", help="hot-token modes to time: off, k, kv")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("tq_triton_gpu: CUDA is not available; this benchmark needs a GPU (nothing written).")
        sys.exit(1)
    name = torch.cuda.get_device_name()
    results = []
    from kvcache.kv_formats import parse_preset
    for preset in a.presets.split(","):
        for hot in ("" if h == "off" else h for h in a.hot.split(",")):
            kf, vf = parse_preset(preset)
            if hot and not (kf.kind == "tq" or (hot == "kv" and vf.kind == "tq")):
                continue                       # no hot copies of int8 / f16 components
            for ctx in map(int, a.contexts.split(",")):
                for batch in map(int, a.batches.split(",")):
                    r = run_config(preset, ctx, batch, a.iters, hot)
                    log(json.dumps(r))
                    results.append(r)
                    torch.cuda.empty_cache()
    write(results, name)
    log(f"wrote {OUT / 'tq_triton_gpu.md'}")


if __name__ == "__main__":
    main()
