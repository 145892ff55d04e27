"""DeepSeek-V4's attention over compressed entries on a GPU: the dsv4-triton
kernels (kvcache/dsv4_triton.py) vs the dsv4-torch reference (gather + masked
attention), one layer of one decode step at DeepSeek-V4-Flash's shapes: 64
query heads, 512-dim K = V entries, a 128-token window ring, CSA (ratio 4)
with a lightning indexer of 64 heads x 128 picking the top 512, HCA (ratio
128); entries bf16 or tq4 (TurboQuant codes), batch 1 and 16, context 8K to
128K tokens, each sequence's entries scattered over the pool.

- hca: attention over all ctx / 128 entries and the window;
- csa: indexer scores over ctx / 4 keys, top-512, attention over the picks
  and the window.

Each is timed eagerly (CUDA events) and replayed from a CUDA graph (what a
captured engine step pays); `MB` is what the kernels must read (the entries
used, the indexer keys, the window), GB/s = MB / graph time, next to the
card's copy bandwidth measured in the same run. The torch reference reads
what it gathers (whole tables). Outputs are checked against the reference
first (err: max |diff| / max |ref|; CSA with the reference's picks).

    .venv/bin/python tests/bench/dsv4_attn_gpu.py [--contexts 8192,32768,131072]
        [--batches 1,16] [--formats bf16,tq4] [--iters 30] [--out PATH]

Writes tests/bench/results/dsv4_attn_gpu.{json,md}. Needs CUDA (torch,
triton; no other package). --cpu-check runs every step on the CPU under
Triton's interpreter at tiny shapes (timings meaningless, nothing written).
"""
import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from bench_paths import log, machine, write_results  # puts the repo on sys.path
import tq_triton_gpu as tg  # its timers and the copy-bandwidth probe (after bench_paths: the repo on sys.path)

FLASH = dict(H=64, D=512, W=128, IH=64, ID=128, TOPK=512, CSA=4, HCA=128)
TINY = dict(H=4, D=32, W=8, IH=8, ID=16, TOPK=8, CSA=4, HCA=16)


def _store(fmt, rows, D, dtype, dev, g):
    """rows random entries as the pool holds them (bf16, or a Codec's rows) and the bytes of one."""
    from kvcache.turboquant import Codec, ComponentFormat
    x = torch.randn(rows, D, generator=g, device=dev)
    if fmt == "bf16":
        return SimpleNamespace(codec=None, entries={"comp": x.to(dtype)}), D * 2
    codec = Codec(ComponentFormat("tq", int(fmt[2:])), 1, D, seed=0)
    coded = codec.alloc(rows, dev)
    for i in range(0, rows, 1 << 16):           # encode in slices: the rotation's fp32 copy stays small
        for k, v in codec.encode(x[i:i + (1 << 16)].unsqueeze(1)).items():
            coded[k][i:i + v.shape[0]] = v
    return SimpleNamespace(codec=codec, coded=coded, entries={}), sum(t[0].numel() * t.element_size()
                                                                       for t in coded.values())


def case(part, fmt, B, ctx, s, dtype, dev, iters):
    from kvcache.backends import get_backend
    torch_b, tri = get_backend("dsv4-torch"), get_backend("dsv4-triton")
    g = torch.Generator(device=dev).manual_seed(0)
    ratio = s["CSA"] if part == "csa" else s["HCA"]
    E = ctx // ratio
    rows = torch.randperm(B * E, generator=g, device=dev).view(B, E)     # entries scattered over the pool
    count = torch.full((B,), E, device=dev)
    store, entry_bytes = _store(fmt, B * E, s["D"], dtype, dev, g)
    H, D = s["H"], s["D"]
    q = (torch.randn(B, H, D, generator=g, device=dev) * 0.1).to(dtype)
    wkeys = torch.randn(B, s["W"] + 1, D, generator=g, device=dev).to(dtype)
    wmask = torch.ones(B, s["W"] + 1, dtype=torch.bool, device=dev)
    sinks = torch.randn(H, generator=g, device=dev)
    scale = D ** -0.5
    read = B * (s["W"] + 1) * D * 2                      # the window, bf16
    if part == "csa":
        qi = torch.randn(B, s["IH"], s["ID"], generator=g, device=dev).to(dtype)
        w = torch.randn(B, s["IH"], generator=g, device=dev)
        ikeys = torch.randn(B * E, s["ID"], generator=g, device=dev).to(dtype)
        k = min(s["TOPK"], E)
        read += B * E * s["ID"] * 2 + B * k * entry_bytes

        def run(b):
            top = b.index_scores(qi, w, ikeys, rows, count).topk(k, dim=-1).indices
            return b.attend(q, wkeys, wmask, store, rows.gather(1, top), None, sinks, scale)
        ref_scores = torch_b.index_scores(qi, w, ikeys, rows, count)
        got_scores = tri.index_scores(qi, w, ikeys, rows, count)
        sel = rows.gather(1, ref_scores.topk(k, dim=-1).indices)
        ref = torch_b.attend(q, wkeys, wmask, store, sel, None, sinks, scale)
        got = tri.attend(q, wkeys, wmask, store, sel, None, sinks, scale)
        err_scores = float((got_scores - ref_scores).abs().max() / ref_scores.abs().max())
    else:
        read += B * E * entry_bytes

        def run(b):
            return b.attend(q, wkeys, wmask, store, rows, count, sinks, scale)
        ref, got, err_scores = run(torch_b), run(tri), 0.0
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    r = {"part": part, "fmt": fmt, "batch": B, "ctx": ctx, "entries": E, "MB": round(read / 1e6, 2),
         "err": float(f"{max(err, err_scores):.2e}")}
    for name, b in (("triton", tri), ("torch", torch_b)):
        r[f"{name}_us"] = round(tg.cuda_time_us(lambda: run(b), iters), 1)
        r[f"{name}_graph_us"] = round(tg.graph_time_us(lambda: run(b), iters), 1)
    r["speedup"] = round(r["torch_graph_us"] / r["triton_graph_us"], 2)
    r["GB_s"] = round(read / r["triton_graph_us"] / 1e3, 1)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--formats", default="bf16,tq4")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, help="write OUT.{json,md} instead of tests/bench/results/")
    ap.add_argument("--cpu-check", action="store_true")
    a = ap.parse_args()
    if a.cpu_check:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        tg.DEV, dev, dtype, s = "cpu", "cpu", torch.float16, TINY     # the interpreter cannot dot bf16
        contexts, batches = [64, 256], [1, 3]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --cpu-check)")
        dev, dtype, s = "cuda", torch.bfloat16, FLASH
        contexts, batches = [int(c) for c in a.contexts.split(",")], [int(b) for b in a.batches.split(",")]
    copy_bw = tg.copy_bandwidth_gbps()
    res = {"machine": machine(), "shapes": s, "copy_GB_s": round(copy_bw, 1), "runs": []}
    if dev == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    rows = []
    for part in ("hca", "csa"):
        for fmt in a.formats.split(","):
            for B in batches:
                for ctx in contexts:
                    log(f"{part} {fmt} batch {B} context {ctx} ...")
                    r = case(part, fmt, B, ctx, s, dtype, dev, a.iters)
                    res["runs"].append(r)
                    rows.append(f"| {part} | {fmt} | {B} | {ctx} | {r['entries']} | {r['triton_us']} | "
                                f"{r['triton_graph_us']} | {r['torch_graph_us']} | {r['speedup']}x | {r['MB']} | "
                                f"{r['GB_s']} ({100 * r['GB_s'] / copy_bw:.0f}%) | {r['err']} |")
                    log(rows[-1])
                    if r["err"] > (1e-3 if dev == "cpu" else 3e-2):
                        raise SystemExit(f"{part} {fmt} batch {B} context {ctx}: error {r['err']} vs the reference")
    m = res["machine"]
    lines = ["# DeepSeek-V4 attention over compressed entries: dsv4-triton vs dsv4-torch, one layer, one decode "
             "step", "",
             f"Shapes: {s['H']} query heads, {s['D']}-dim entries, window {s['W']}, CSA ratio {s['CSA']} (indexer "
             f"{s['IH']} x {s['ID']}, top {s['TOPK']}), HCA ratio {s['HCA']}; copy bandwidth {copy_bw:.0f} GB/s.",
             "", f"Machine: {res.get('gpu') or m['cpu_line']}; torch {m['torch']}; commit {m['commit']}.", "",
             "| part | entries | batch | context | entries per seq | triton us | triton graph us | torch graph us "
             "| speedup | MB read | GB/s (of copy) | err |", "|---" * 12 + "|", *rows, "",
             "Command: `.venv/bin/python tests/bench/dsv4_attn_gpu.py`"]
    if a.cpu_check:
        print("\n".join(lines))
        return 0
    write_results("dsv4_attn_gpu", res, lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
