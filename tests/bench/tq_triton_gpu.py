"""TurboQuant attention on a GPU: the Triton kernels over compressed paged
blocks (kvcache.tq_triton) vs torch scaled_dot_product_attention over dense
bf16 KV of the same shapes (contiguous, not paged: the baseline's best case).

Shapes: 32 query heads, 8 KV heads, head_dim 128 (Llama-8B-like), block
size 16, bf16 queries, blocks shuffled as a pool hands them out.
- decode: context 1K/4K/8K, batch 1 and 16, tq4 / tq3 / k8v4, hot tokens off
  and "k". `decode_us` is the whole decode of one layer (query rotation,
  coded splits + HOT program, split merge, de-rotation: one or two
  launches) timed eagerly with CUDA events; `graph_us` the same call
  replayed from a CUDA graph (no launch overhead: what a captured engine
  step pays); `GB/s` = the compressed bytes read / graph_us, next to the
  card's copy bandwidth measured in the same run.
- prefill: a 2,048-token chunk over an 8K compressed context vs masked
  SDPA over the dense context, and 2,048 tokens from 0 vs SDPA's causal
  (flash) kernel, hot tokens off and "k": the coded launch alone (kernel
  us) and the layer's whole step as the engine runs it (step us: the store,
  with hot tokens keeping the new tokens' int8 rows, then rotation, the
  coded and HOT launches, merge, de-rotation).
- verify: a speculative verification step (batch 16, 1 + 3 rows per
  sequence at 8K context) through the tq-triton backend's forward (query
  rotation, the CODED launch, with hot tokens the HOT launch over the hot
  pool, merge, de-rotation), eager and replayed from a CUDA graph, hot
  tokens off and "k", next to masked SDPA over dense bf16 KV.
- --sweep: the 8K batch-16 tq4 decode with other (keys per tile, warps,
  pipeline stages) than tq_triton.decode_tiles picks, to tune it.
Every config first checks its output against the torch reference path on
the same storage (column `correct`), so a wrong kernel's timing stands out.

    .venv/bin/python tests/bench/tq_triton_gpu.py [--contexts 1024,4096,8192] \
        [--batches 1,16] [--presets tq4,tq3,k8v4] [--hot off,k] [--iters 50] [--sweep]

Writes tests/bench/results/tq_triton_gpu.{json,md}. Needs CUDA (torch,
triton; no other package). --cpu-check runs every step of the script on the
CPU under Triton's interpreter, tiny shapes, timings meaningless and nothing
written: that the script runs as is before a GPU session spends its minutes.
"""
import os
import time
import argparse
import json
import sys

import torch

from bench_paths import OUT, log  # puts the repo on sys.path

HQ, H, D, BS = 32, 8, 128, 16
DEV = "cuda"
QDT = torch.bfloat16     # --cpu-check: float16 (the interpreter's tl.dot cannot do bf16)


def cuda_time_us(fn, iters):
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    for _ in range(3):                      # compile / allocator warm-up
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def graph_time_us(fn, iters):
    """fn captured in a CUDA graph, replayed iters times."""
    if DEV == "cpu":
        return cuda_time_us(fn, iters)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_time_us(g.replay, iters)


def copy_bandwidth_gbps():
    """The card's copy bandwidth (bytes read + written / time) on 1 GiB."""
    x = torch.empty(1 << (29 if DEV == "cuda" else 20), dtype=torch.float16, device=DEV)
    y = torch.empty_like(x)
    t = cuda_time_us(lambda: y.copy_(x), 20)
    return 2 * x.numel() * 2 / t / 1e3


def filled_cache(preset, ctx, batch, hot, dev, seed=0):
    from kvcache.kv_formats import parse_preset
    from kvcache.tq_cache import TQLayerCache
    kf, vf = parse_preset(preset)
    nblk = ctx // BS
    cache = TQLayerCache(batch * nblk + 1, BS, H, D, kf, vf, 0, seed=seed, device=dev,
                         hot=hot, hot_blocks=2 * batch + 1, hot_group_id=1)
    g = torch.Generator(device=dev).manual_seed(seed)
    bt = (torch.randperm(batch * nblk, generator=g, device=dev) + 1).view(batch, nblk)
    slots = (bt.unsqueeze(-1) * BS + torch.arange(BS, device=dev)).flatten()
    for i in range(0, slots.numel(), 65536):          # encode in pieces: bounded temporaries
        s = slots[i:i + 65536]
        cache.write(s, torch.randn(s.numel(), H, D, device=dev, generator=g) * 2 + 0.5,
                    torch.randn(s.numel(), H, D, device=dev, generator=g))
    ht = None
    if hot:
        # Hot table: valid at column 0 and the newest block's, as the engine's
        # hot group keeps them; the other entries point at hot block 0.
        assert nblk > 1, "hot tokens: a context of at least two blocks"
        ht = torch.zeros_like(bt)
        ht[:, 0] = torch.arange(batch, device=dev) * 2 + 1
        ht[:, -1] = torch.arange(batch, device=dev) * 2 + 2
        offs = torch.arange(BS, device=dev)
        s, hs = ((t[:, [0, -1]].unsqueeze(-1) * BS + offs).flatten() for t in (bt, ht))
        cache.write(s, torch.randn(s.numel(), H, D, device=dev, generator=g) * 2 + 0.5,
                    torch.randn(s.numel(), H, D, device=dev, generator=g), hs)
    return cache, bt, ht, g


def kv_bytes(cache, tokens):
    per_token = sum(t.stride(0) * t.element_size() for d in (cache.k, cache.v) for t in d.values())
    return per_token * tokens


def rel_err(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def run_decode(preset, ctx, batch, iters, hot, copy_bw, tiles=None):
    from kvcache import tq_triton
    from kvcache.tq_triton import tq_paged_decode
    dev = torch.device(DEV)
    cache, bt, ht, g = filled_cache(preset, ctx, batch, hot, dev)
    cache.backend = "tq-torch"
    seq_lens = torch.full((batch,), ctx, dtype=torch.long, device=dev)
    q = torch.randn(batch, HQ, D, device=dev, generator=g, dtype=QDT)
    scale = D ** -0.5
    orig = tq_triton.decode_tiles
    if tiles:
        tq_triton.decode_tiles = lambda d: tiles
    try:
        ref = cache._decode(q.float(), bt, seq_lens, scale, *([ht] if hot else []))
        out = torch.empty_like(q)
        out32 = torch.empty(batch, HQ, D, device=dev)
        err32 = rel_err(tq_paged_decode(cache, q.float(), bt, seq_lens, scale, ht, out=out32), ref)
        err16 = rel_err(tq_paged_decode(cache, q, bt, seq_lens, scale, ht, out=out), ref)
        step = lambda: tq_paged_decode(cache, q, bt, seq_lens, scale, ht, out=out)   # noqa: E731
        t_eager = cuda_time_us(step, iters)
        t_graph = graph_time_us(step, iters)
    finally:
        tq_triton.decode_tiles = orig

    kd = torch.randn(batch, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    vd = torch.randn(batch, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_sdpa = cuda_time_us(lambda: sdpa(q.unsqueeze(2).to(kd.dtype), kd, vd, scale=scale, enable_gqa=True), iters)
    nbytes, dense = kv_bytes(cache, batch * ctx), 2 * batch * ctx * H * D * 2
    gbps = nbytes / t_graph / 1e3
    return {
        "case": "decode", "preset": preset, "hot": hot or "off", "context": ctx, "batch": batch,
        "tiles": list(tiles or orig(D)),
        "decode_us": round(t_eager, 1), "graph_us": round(t_graph, 1), "sdpa_bf16_us": round(t_sdpa, 1),
        "graph_vs_sdpa": round(t_graph / t_sdpa, 3), "eager_vs_sdpa": round(t_eager / t_sdpa, 3),
        "kv_bytes": nbytes, "dense_bf16_bytes": dense, "GBps": round(gbps, 1),
        "sdpa_GBps": round(dense / t_sdpa / 1e3, 1), "of_copy_bw": round(gbps / copy_bw, 3),
        "max_rel_err_fp32": err32, "max_rel_err_bf16": err16,
        # fp32 must match the reference; bf16 differs by its rounding only.
        "correct": err32 < 1e-4 and err16 < 3e-2,
    }


def run_prefill(preset, ctx, chunk, iters, hot=""):
    """A chunk of `chunk` new tokens ending at `ctx` (one sequence), as an
    engine step runs it per layer: the store (tq_store: K/V, hot copies and,
    with hot tokens and a chunk longer than block_size + 1, the new tokens'
    int8 rows) and the attention (rotation, the coded launch, the HOT
    launch, merge, de-rotation): step us. kernel us: the coded (ALL or
    CODED) launch alone."""
    from kvcache.metadata import AttentionMetadata, GroupMetadata
    from kvcache.tq_cache import ALL, CODED, merge
    from kvcache.tq_triton import tq_prefill
    dev = torch.device(DEV)
    cache, bt, ht, g = filled_cache(preset, ctx, 1, hot, dev)
    q = torch.randn(chunk, HQ, D, device=dev, generator=g, dtype=QDT)
    k = (torch.randn(chunk, H, D, device=dev, generator=g) * 2 + 0.5).to(QDT)
    v = torch.randn(chunk, H, D, device=dev, generator=g).to(QDT)
    scale = D ** -0.5
    pos = torch.arange(ctx - chunk, ctx, device=dev)
    col, off = pos // BS, pos % BS
    groups = [GroupMetadata(bt[0, col] * BS + off, bt)]
    if hot:
        # The hot group's blocks: 0 and the newest (filled_cache's table); the
        # chunk's other blocks have none (slot -1), as the manager hands them out.
        last = (ctx - 1) // BS
        hs = torch.where(col == 0, ht[0, 0] * BS + off, torch.where(col == last, ht[0, -1] * BS + off, -1))
        groups.append(GroupMetadata(hs, ht))
    meta = AttentionMetadata([0, chunk], [ctx], 0, groups, seq_lens_t=torch.tensor([ctx], device=dev),
                             query_start_loc_t=torch.tensor([0, chunk], device=dev))
    cache.backend = "tq-triton"
    cache.store(meta, k, v)
    out32, out16 = cache.attention(q.float(), meta, scale), cache.attention(q, meta, scale)
    # The torch reference over the same storage (what the store wrote).
    qr = cache._rotate_q(q.float()[None], scale)
    qpos, lens_t, cols = pos[None], meta.seq_lens_t, torch.arange(ctx // BS, device=dev)[None]
    if hot:
        # The chunk's rows as the torch path reads them: hot K; hot V ("kv") or coded V.
        nk, nv = cache.new_rows
        hot_rows = (nk, nv if hot == "kv" else cache._rows(cache.v, groups[0].slot_mapping))
        acc = merge(*cache._attend_torch(qr, cols, bt, qpos, lens_t, CODED),
                    *cache._hot_prefill(qr, bt[0], ht[0], ctx, hot_rows))
    else:
        acc, _ = cache._attend_torch(qr, cols, bt, qpos, lens_t)
    ref = cache._finish(acc, torch.float32)[0]
    err32, err16 = rel_err(out32, ref), rel_err(out16, ref)
    qr16 = qr[0].permute(2, 0, 1, 3).reshape(chunk, HQ, D).to(QDT)
    qsl = meta.query_start_loc_t
    t_kernel = cuda_time_us(lambda: tq_prefill(cache, qr16, bt, lens_t, qsl, chunk, part=CODED if hot else ALL),
                            iters)
    t_step = cuda_time_us(lambda: (cache.store(meta, k, v), cache.attention(q, meta, scale)), iters)
    kd = torch.randn(1, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    vd = torch.randn(1, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    qd = q.transpose(0, 1).unsqueeze(0).to(kd.dtype)                                 # [1, HQ, chunk, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if chunk == ctx:
        t_sdpa = cuda_time_us(lambda: sdpa(qd, kd, vd, scale=scale, is_causal=True, enable_gqa=True), iters)
        base = "causal (flash)"
    else:
        mask = torch.arange(ctx, device=dev)[None, :] <= pos[:, None]
        t_sdpa = cuda_time_us(lambda: sdpa(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True), iters)
        base = "masked"
    return {"case": "prefill", "preset": preset, "hot": hot or "off", "context": ctx, "chunk": chunk,
            "kernel_us": round(t_kernel, 1), "step_us": round(t_step, 1), "sdpa_bf16_us": round(t_sdpa, 1),
            "sdpa": base, "kernel_vs_sdpa": round(t_kernel / t_sdpa, 3), "step_vs_sdpa": round(t_step / t_sdpa, 3),
            "max_rel_err_fp32": err32, "max_rel_err_bf16": err16, "correct": err32 < 1e-4 and err16 < 3e-2}


def write(results, meta):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tq_triton_gpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = ["# TurboQuant attention: Triton over compressed blocks vs SDPA on dense bf16 KV", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta.get('triton')}, {meta['shape']}, bf16 "
             f"queries. Copy bandwidth (read + write) measured in the run: {meta['copy_GBps']:.0f} GB/s. "
             "Times per layer-call (CUDA events). decode us: the whole decode (rotation, splits, hot pass, "
             "merge, de-rotation), eager; graph us: replayed from a CUDA graph; GB/s: compressed KV bytes / "
             "graph us.", "",
             "| preset | hot | context | batch | tiles (keys, warps, stages) | decode us | graph us | SDPA bf16 us "
             "| graph / SDPA | GB/s | of copy bw | KV MB | dense MB | rel err fp32 | rel err bf16 | correct |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in results if r["case"] == "decode"):
        cells = [r["preset"], r["hot"], r["context"], r["batch"], tuple(r["tiles"]), r["decode_us"], r["graph_us"],
                 r["sdpa_bf16_us"], f"{r['graph_vs_sdpa']}x", r["GBps"], f"{r['of_copy_bw']:.0%}",
                 f"{r['kv_bytes'] / 2**20:.1f}", f"{r['dense_bf16_bytes'] / 2**20:.1f}",
                 f"{r['max_rel_err_fp32']:.1e}", f"{r['max_rel_err_bf16']:.1e}", "yes" if r["correct"] else "**NO**"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "prefill step us: the layer's store (K/V, hot copies, new rows) and attention (rotation, coded "
              "and HOT launches, merge, de-rotation), eager; kernel us: the coded launch alone.", "",
              "| prefill | hot | context | chunk | kernel us | step us | SDPA bf16 us | SDPA | kernel / SDPA | "
              "step / SDPA | rel err fp32 | rel err bf16 | correct |", "|" + "---|" * 13]
    for r in (r for r in results if r["case"] == "prefill"):
        cells = [r["preset"], r["hot"], r["context"], r["chunk"], r["kernel_us"], r["step_us"], r["sdpa_bf16_us"],
                 r["sdpa"], f"{r['kernel_vs_sdpa']}x", f"{r['step_vs_sdpa']}x", f"{r['max_rel_err_fp32']:.1e}",
                 f"{r['max_rel_err_bf16']:.1e}", "yes" if r["correct"] else "**NO**"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "| verify (1 + k rows per sequence) | hot | context | batch | rows | step us | graph us | "
              "SDPA bf16 us (masked) | graph / SDPA | rel err fp32 | rel err bf16 | correct |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in results if r["case"] == "verify"):
        cells = [r["preset"], r["hot"], r["context"], r["batch"], r["rows"], r["step_us"], r["graph_us"],
                 r["sdpa_bf16_us"], f"{r['graph_vs_sdpa']}x", f"{r['max_rel_err_fp32']:.1e}",
                 f"{r['max_rel_err_bf16']:.1e}", "yes" if r["correct"] else "**NO**"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    (OUT / "tq_triton_gpu.md").write_text("\n".join(lines) + "\n")


def run_verify(preset, ctx, batch, rows, hot, iters):
    from kvcache.metadata import AttentionMetadata, GroupMetadata
    dev = torch.device(DEV)
    cache, bt, ht, g = filled_cache(preset, ctx, batch, hot, dev)
    # Every sequence's last `rows` positions, inside its last block (the hot group holds it).
    assert ctx % BS == 0 and rows <= BS
    qsl = [i * rows for i in range(batch + 1)]
    lens = [ctx] * batch
    pos = torch.arange(ctx - rows, ctx, device=dev).repeat(batch)
    seq = torch.arange(batch, device=dev).repeat_interleave(rows)
    groups = [GroupMetadata(t[seq, pos // BS] * BS + pos % BS, t) for t in ([bt, ht] if hot else [bt])]
    meta = AttentionMetadata(qsl, lens, 0, groups, seq_lens_t=torch.tensor(lens, device=dev),
                             query_start_loc_t=torch.tensor(qsl, device=dev))
    q = torch.randn(batch * rows, HQ, D, device=dev, generator=g, dtype=QDT)
    scale = D ** -0.5
    qr = cache._rotate_q(q.float().view(batch, rows, HQ, D), scale)
    cols = torch.arange(ctx // BS, device=dev).expand(batch, -1)
    qpos = pos.view(batch, rows)
    lens_t = meta.seq_lens_t
    if hot:
        from kvcache.tq_cache import CODED, HOT, merge
        own = (ctx - 1) // BS
        hot_cols = torch.tensor([0, own], device=dev).expand(batch, -1)
        acc = merge(*cache._attend_torch(qr, cols, bt, qpos, lens_t, CODED),
                    *cache._attend_torch(qr, hot_cols, ht, qpos, lens_t, HOT, cache.hot_v_tables(ht, bt)))
    else:
        acc, _ = cache._attend_torch(qr, cols, bt, qpos, lens_t)
    ref = cache._finish(acc, torch.float32).reshape(batch * rows, HQ, D)
    cache.backend = "tq-triton"
    err32 = rel_err(cache.attention(q.float(), meta, scale), ref)
    err16 = rel_err(cache.attention(q, meta, scale), ref)
    step = lambda: cache.attention(q, meta, scale)   # noqa: E731
    t_eager = cuda_time_us(step, iters)
    t_graph = graph_time_us(step, iters)
    kd = torch.randn(batch, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    vd = torch.randn(batch, H, ctx, D, device=dev, dtype=torch.bfloat16, generator=g)
    qd = q.view(batch, rows, HQ, D).transpose(1, 2).to(kd.dtype)                     # [B, HQ, rows, D]
    mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(ctx - rows, ctx, device=dev)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_sdpa = cuda_time_us(lambda: sdpa(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=True), iters)
    return {"case": "verify", "preset": preset, "hot": hot or "off", "context": ctx, "batch": batch, "rows": rows,
            "step_us": round(t_eager, 1), "graph_us": round(t_graph, 1), "sdpa_bf16_us": round(t_sdpa, 1),
            "graph_vs_sdpa": round(t_graph / t_sdpa, 3), "max_rel_err_fp32": err32, "max_rel_err_bf16": err16,
            "correct": err32 < 1e-4 and err16 < 3e-2}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--presets", default="tq4,tq3,k8v4")
    ap.add_argument("--hot", default="off,k", help="hot-token modes to time: off, k, kv")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time other decode tiles at 8K batch 16 tq4")
    ap.add_argument("--cpu-check", action="store_true", help="run the script's steps on CPU (interpreter, tiny)")
    a = ap.parse_args()
    global DEV, QDT
    if a.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, QDT, a.contexts, a.batches, a.iters = "cpu", torch.float16, "64", "1,2", 1
    elif not torch.cuda.is_available():
        print("tq_triton_gpu: CUDA is not available; this benchmark needs a GPU (nothing written).")
        sys.exit(1)
    meta = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (--cpu-check)", "torch": torch.__version__,
            "shape": f"Hq={HQ} Hkv={H} D={D} block={BS}", "copy_GBps": copy_bandwidth_gbps()}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    log(json.dumps(meta))
    results = []
    from kvcache.kv_formats import parse_preset
    for preset in a.presets.split(","):
        for hot in ("" if h == "off" else h for h in a.hot.split(",")):
            kf, vf = parse_preset(preset)
            if hot and not (kf.kind == "tq" or (hot == "kv" and vf.kind == "tq")):
                continue                       # no hot copies of int8 / f16 components
            for ctx in map(int, a.contexts.split(",")):
                for batch in map(int, a.batches.split(",")):
                    results.append(run_decode(preset, ctx, batch, a.iters, hot, meta["copy_GBps"]))
                    log(json.dumps(results[-1]))
                    torch.cuda.empty_cache()
    if a.sweep:
        for tiles in [(16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 8, 3), (64, 4, 2), (64, 8, 2), (64, 8, 1)]:
            results.append(run_decode("tq4", 8192 if DEV == "cuda" else 64, 16 if DEV == "cuda" else 2, a.iters, "",
                                      meta["copy_GBps"], tiles))
            log(json.dumps(results[-1]))
    for preset in a.presets.split(","):
        for hot in ("" if h == "off" else h for h in a.hot.split(",")):
            kf, vf = parse_preset(preset)
            if hot and not (kf.kind == "tq" or (hot == "kv" and vf.kind == "tq")):
                continue
            ctx, batch = (8192, 16) if DEV == "cuda" else (64, 2)
            results.append(run_verify(preset, ctx, batch, 4, hot, max(5, a.iters // 5)))
            log(json.dumps(results[-1]))
            torch.cuda.empty_cache()
    for preset in a.presets.split(","):
        for hot in ("" if h == "off" else h for h in a.hot.split(",")):
            kf, vf = parse_preset(preset)
            if hot and not (kf.kind == "tq" or (hot == "kv" and vf.kind == "tq")):
                continue
            # CPU: chunks longer than block_size + 1 too (the hot pass over the store's new rows).
            for ctx, chunk in ((8192, 2048), (2048, 2048)) if DEV == "cuda" else ((64, 32), (32, 32)):
                results.append(run_prefill(preset, ctx, chunk, max(5, a.iters // 5), hot))
                log(json.dumps(results[-1]))
                torch.cuda.empty_cache()
    bad = [r for r in results if not r["correct"]]
    if DEV == "cpu":
        log(f"cpu check: {len(results)} configs ran, {len(bad)} incorrect (nothing written)")
        sys.exit(1 if bad else 0)
    write(results, meta)
    log(f"wrote {OUT / 'tq_triton_gpu.md'}" + (f"; {len(bad)} configs INCORRECT" if bad else ""))


if __name__ == "__main__":
    main()
