"""Where the CPU GGUF path should switch from the fused GEMV to dequantized
tiles + matmul: for every distinct (type, shape) weight of the real GGUF
files, GGUFBlocks.matmul timed both ways at M rows of x, interleaved, best
of --reps. parallel/quant/gguf_cpu.py's GEMV_MAX_M_BY_TYPE is chosen from
this (the GEMV decodes W once per 8 rows, so its cost steps at 8, 16, 24...).
Types the real files lack (Q4_0, Q5_K: --synthetic) are timed on random
blocks at the real files' layer shapes (--shapes): gguf's quantizer where it
has one, else random bytes with finite scales (speed does not depend on the
values).

    .venv/bin/python tests/bench/gguf_cpu_crossover.py [--models gemma3-270m,smollm2-135m] [--rows 8,16,24,32,40]
        [--synthetic Q4_0,Q5_K] [--shapes 640x2048,2048x1024,1024x2048,576x1536]

Writes tests/bench/results/gguf_cpu_crossover.{json,md} (CPU model and flags,
threads, commit).
"""
import argparse
import time

from bench_paths import log, machine, write_results  # puts the repo on sys.path

import numpy as np
import torch

from parallel.quant import gguf_cpu
from parallel.quant.base import GGUFBlocks, QuantizedTensor


def layers(model: str):
    """(tensor name, type, GGUFBlocks) for the first tensor of each distinct (type, shape)."""
    from gguf import GGUFReader

    from model_zoo.resolve import resolve_path
    reader = GGUFReader(str(resolve_path(model)))
    seen = set()
    for t in reader.tensors:
        fmt = t.tensor_type.name
        if fmt not in gguf_cpu._TYPES or len(t.shape) != 2:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        if (fmt, n, k) in seen:
            continue
        seen.add((fmt, n, k))
        raw = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(n, -1)
        layer = GGUFBlocks(n, k)
        layer.load("w", 0, QuantizedTensor(fmt, raw, (n, k)), torch.device("cpu"), torch.float32)
        yield t.name, fmt, layer


# Byte offsets of the fp16 super-block scales (d, dmin) in the K-quant blocks (ggml's structs).
_K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def synthetic(fmts: str, shapes: str):
    """(name, type, GGUFBlocks) of random blocks per type and N x K shape."""
    import gguf
    from gguf import quants
    g = np.random.default_rng(0)
    for fmt in fmts.split(","):
        qt = getattr(gguf.GGMLQuantizationType, fmt)
        block, size = gguf.GGML_QUANT_SIZES[qt]
        for shape in shapes.split(","):
            n, k = map(int, shape.split("x"))
            if fmt in _K_SCALES:
                raw = g.integers(0, 256, (n, k // block * size), dtype=np.uint8)
                blocks = raw.reshape(n, k // block, size)
                for off in _K_SCALES[fmt]:
                    blocks[..., off:off + 2] = np.array([0.01], np.float16).view(np.uint8)
            else:
                raw = quants.quantize(g.standard_normal((n, k), dtype=np.float32), qt)
            layer = GGUFBlocks(n, k)
            layer.load("w", 0, QuantizedTensor(fmt, torch.from_numpy(raw.copy()), (n, k)), torch.device("cpu"),
                       torch.float32)
            yield f"random {n}x{k}", fmt, layer


def best_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma3-270m,smollm2-135m")
    ap.add_argument("--rows", default="8,16,24,32,40")
    ap.add_argument("--reps", type=int, default=20, help="best of this many (a quarter for LM heads)")
    ap.add_argument("--synthetic", default="Q4_0,Q5_K", help="types timed on random blocks ('' for none)")
    ap.add_argument("--shapes", default="640x2048,2048x1024,1024x2048,576x1536",
                    help="their N x K shapes (K: a multiple of 256, the K-quants' block)")
    ap.add_argument("--out", default="gguf_cpu_crossover")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    res = {"config": vars(args), "machine": machine(), "runs": []}
    sources = [(model, layers(model)) for model in args.models.split(",")]
    if args.synthetic:
        sources.append(("synthetic", synthetic(args.synthetic, args.shapes)))
    for model, source in sources:
        for name, fmt, layer in source:
            reps = max(3, args.reps // 4) if layer.n * layer.k > 50_000_000 else args.reps
            r = {"model": model, "tensor": name, "type": fmt, "n": layer.n, "k": layer.k, "gemv_ms": [], "tiles_ms": []}
            for m in rows:
                x = torch.randn(m, layer.k)
                # The path forced through the per-shard limit GGUFBlocks reads.
                for key, limit in (("gemv_ms", 1 << 30), ("tiles_ms", 0)):
                    layer._gemv = [(s, g, limit) for s, g, _ in layer._gemv_args()]
                    r[key].append(round(best_ms(lambda: layer.matmul(None, x), reps), 3))
            layer._gemv = None
            # The most rows up to which the GEMV is no slower at every M measured.
            r["gemv_wins_up_to"] = 0
            for m, g, d in zip(rows, r["gemv_ms"], r["tiles_ms"]):
                if g > d:
                    break
                r["gemv_wins_up_to"] = m
            log(f"{model} {name} {fmt} {layer.n}x{layer.k}: GEMV / tiles ms "
                + ", ".join(f"M={m} {g}/{d}" for m, g, d in zip(rows, r["gemv_ms"], r["tiles_ms"])))
            res["runs"].append(r)
    m = res["machine"]
    res["limits_in_code"] = {t: gguf_cpu.gemv_max_m(t) for t in sorted({r["type"] for r in res["runs"]})}
    lines = [f"CPU GGUF: fused GEMV vs dequantized tiles + matmul (GGUFBlocks.matmul), fp32, ms per call, best of "
             f"{args.reps} (LM heads: of {max(3, args.reps // 4)}). Machine: {m['cpu_line']}; torch {m['torch']}, "
             f"{m['torch_threads']} threads; commit {m['commit']}; load average {m['loadavg'][0]:.2f}.", "",
             "Command: `.venv/bin/python tests/bench/gguf_cpu_crossover.py`", "",
             "| model | tensor | type | N x K | " + " | ".join(f"M={r} GEMV / tiles" for r in rows)
             + " | GEMV no slower up to | gemv_max_m in code |",
             "|---|---|---|---|" + "---|" * len(rows) + "---|---|"]
    for r in res["runs"]:
        cells = " | ".join(f"{g:.2f} / {d:.2f}" for g, d in zip(r["gemv_ms"], r["tiles_ms"]))
        lines.append(f"| {r['model']} | {r['tensor']} | {r['type']} | {r['n']} x {r['k']} | {cells} | "
                     f"{r['gemv_wins_up_to']} | {gguf_cpu.gemv_max_m(r['type'])} |")
    write_results(args.out, res, lines)


if __name__ == "__main__":
    main()
