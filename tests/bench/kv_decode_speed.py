"""Decode step time over a compressed KV cache vs f16, SmolLM2-135M on CPU.

For every (context, batch, preset): fill `batch` sequences with `context`
tokens (prefill, untimed), then time `--steps` engine steps in which every
sequence decodes one token (`llm.core.step()`), after `--warmup` untimed
ones. Reports the median ms/step and its ratio to the f16 step of the same
(context, batch) in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/kv_decode_speed.py \
        [--presets f16,tq4,tq3,k4v3,k8v4,tq4:off] [--contexts 1024,4096,8000] [--batches 1,16] \
        [--steps 8] [--dtype float32] [--distinct]

By default the batch's sequences share one prompt, so prefix caching prefills
it once and they read the same physical blocks (cheap to fill; the decode
still gathers and scores every sequence's history separately, but the reads
hit the CPU caches more than `--distinct` prompts, which cost batch x more
prefill). Writes tests/bench/results/kv_decode_speed.{json,md}.
"""
import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from bench_paths import OUT, kv_args, log  # puts the repo on sys.path

# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x 2 bytes (f16).
F16_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2



def run_case(preset, ctx, batch, steps, warmup, dtype, distinct, threads):
    import torch
    from engine import LLM, SamplingParams
    torch.set_num_threads(threads)
    n_prompts = batch if distinct else 1
    wide = 2 if preset.partition(":")[0] in ("f32", "float32") else 1     # 4-byte KV (an fp32 model's "auto")
    kv_bytes = int(n_prompts * (ctx + steps + warmup + 64) * F16_BYTES_PER_TOKEN * 1.2 * wide) \
        + batch * 4 * 16 * F16_BYTES_PER_TOKEN * wide + (64 << 20)
    llm = LLM("smollm2-135m", **kv_args(preset), dtype=dtype, max_model_len=ctx + steps + warmup + 8,
              kv_cache_memory=kv_bytes, max_num_seqs=batch, max_num_batched_tokens=max(2048, ctx),
              enable_prefix_caching=not distinct)
    vocab = llm.core.info.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(ctx)] for _ in range(n_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=steps + warmup + 1, ignore_eos=True)
    core = llm.core
    t0 = time.perf_counter()
    if not distinct:
        # One request first so its blocks are cached before the others are scheduled.
        llm.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        for _ in range(ctx):
            if not core.has_work():
                break
            llm.step()
    for i in range(batch):
        llm.add_request(prompts[i % n_prompts], sp, request_id=f"r{i}")
    # Prefill until every request has its first token (bounded: one step per chunk).
    started = set()
    for _ in range(batch * (ctx // 512 + 4)):
        for o in core.step():
            started.add(o.request_id)
        if len(started) == batch:
            break
    assert len(started) == batch, f"prefill did not finish: {len(started)}/{batch}"
    prefill_s = time.perf_counter() - t0
    times = []
    for i in range(warmup + steps):
        a = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - a
        assert len(outs) == batch, f"step {i}: {len(outs)} outputs, expected {batch} decodes"
        if i >= warmup:
            times.append(dt)
    caches = core.runner.kv_caches
    nbytes = sum(c.nbytes for c in caches) if isinstance(caches, list) else None
    del llm, core
    return {"ms_step": 1e3 * statistics.median(times), "ms_step_min": 1e3 * min(times),
            "prefill_s": prefill_s, "kv_pool_bytes": nbytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="f16,tq4,tq3,k4v3,k8v4")
    ap.add_argument("--contexts", default="1024,4096,8000")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="default: torch's (OMP_NUM_THREADS)")
    ap.add_argument("--distinct", action="store_true", help="one prompt per sequence (no shared blocks)")
    ap.add_argument("--out", default=str(OUT / "kv_decode_speed"), help="path stem for .json/.md")
    args = ap.parse_args()
    import torch
    threads = args.threads or torch.get_num_threads()
    presets = args.presets.split(",")
    if "f16" not in presets:
        presets = ["f16"] + presets     # the ratio needs the baseline from the same run
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for ctx in contexts:
        for batch in batches:
            base = None
            for p in presets:
                log(f"{p} ctx={ctx} batch={batch} ...")
                r = run_case(p, ctx, batch, args.steps, args.warmup, args.dtype, args.distinct, threads)
                if p == "f16":
                    base = r["ms_step"]
                r.update(preset=p, context=ctx, batch=batch, ratio_vs_f16=r["ms_step"] / base)
                rows.append(r)
                log(f"{p} ctx={ctx} batch={batch}: {r['ms_step']:.1f} ms/step "
                    f"({r['ratio_vs_f16']:.2f}x f16), prefill {r['prefill_s']:.1f}s")
    meta = {"model": "smollm2-135m", "dtype": args.dtype, "threads": threads, "cpu_count": os.cpu_count(),
            "steps": args.steps, "warmup": args.warmup, "distinct_prompts": args.distinct,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# KV decode step time, SmolLM2-135M, {args.dtype}, {threads} thread(s)", "",
             f"Median of {args.steps} decode steps (after {args.warmup} warm-up), ms/step and ratio to "
             f"the f16 KV step of the same context and batch. "
             f"{'Distinct prompts.' if args.distinct else 'The batch shares one prompt (prefix-cached blocks).'}",
             "", "| context | batch | " + " | ".join(presets) + " |",
             "|---|---|" + "---|" * len(presets)]
    for ctx in contexts:
        for batch in batches:
            cells = []
            for p in presets:
                r = next(r for r in rows if (r["preset"], r["context"], r["batch"]) == (p, ctx, batch))
                cells.append(f"{r['ms_step']:.1f}" + ("" if p == "f16" else f" ({r['ratio_vs_f16']:.2f}x)"))
            lines.append(f"| {ctx} | {batch} | " + " | ".join(cells) + " |")
    lines += ["", f"torch {torch.__version__}, {os.cpu_count()} CPUs, {meta['date']}", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
