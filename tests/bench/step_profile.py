"""Where a decode step's time goes: torch profiler over engine decode steps,
host (Python, dispatch, the scheduler) vs the ops' own time.

For each configuration (DTYPE[:QUANTIZATION], or "auto": the defaults on this
machine) and batch size, it runs `--steps` decode steps under
torch.profiler and reports per step: wall time, the summed self time of the
ops (aten / the compiled kernels' custom ops), the rest (host overhead: the
Python of the model, scheduler, sampler and output processing), the number
of ops launched, and the top ops.

    .venv/bin/python tests/bench/step_profile.py [--model smollm2-135m] \
        [--configs auto,float32] [--batch 1,16] [--steps 16]

Writes tests/bench/results/step_profile_<model>.{json,md}.
"""
import argparse
import time
from collections import defaultdict

from bench_paths import log, machine, make_prompts, variant_args, write_results  # puts the repo on sys.path


# The compiled CPU kernels are called through ctypes, not as torch ops: the
# profiler would count them as host time. Each call gets a record_function
# range here (bench only), so their time counts as op time.
KERNELS = [("parallel.quant.gguf_cpu", "gemv"), ("parallel.quant.gguf_cpu", "gemv_checked"),
           ("parallel.quant.gguf_cpu", "dequantize_into"), ("kvcache.tq_cpu", "attend"),
           ("kvcache.tq_cpu", "attend_passes"), ("kvcache.dense_cpu", "decode"), ("kvcache.dense_cpu", "store"),
           ("model_zoo.cpu_ops", "rms_norm"), ("model_zoo.cpu_ops", "rope"), ("model_zoo.cpu_ops", "act_and_mul")]


def label_kernels():
    import importlib
    import torch
    for mod_name, fn_name in KERNELS:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)

        def wrapped(*a, _fn=fn, _name=f"{mod_name.rsplit('.', 1)[1]}.{fn_name}", **k):
            with torch.profiler.record_function(_name):
                return _fn(*a, **k)
        setattr(mod, fn_name, wrapped)


def profile(model, config, batch, steps, prompt_len):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from engine import LLM, SamplingParams
    llm = LLM(model, kv_cache_memory=512 << 20, max_model_len=prompt_len + 2 * steps + 64, enable_prefix_caching=False,
              **variant_args(config))
    prompts = make_prompts(llm.tokenizer, batch, prompt_len, prompt_len, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, sp)
    while llm.core.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                            for r in llm.core.scheduler.running):
        llm.step()                                  # prefill, outside the profile
    for _ in range(3):
        llm.step()                                  # warm decode steps
    clean = []
    for _ in range(steps):                          # the same steps without the profiler's own cost
        t0 = time.perf_counter()
        llm.step()
        clean.append(time.perf_counter() - t0)
    walls = []
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            llm.step()
            walls.append(time.perf_counter() - t0)
    a = llm.core.args
    resolved = f"{a.dtype}, {a.quantization or 'dense'}"
    llm.close()
    # Self time of the leaf ops: what the CPU spent computing (and in op
    # dispatch below Python); the rest of the wall time is host overhead.
    by_op, calls, count = defaultdict(float), defaultdict(int), 0
    for e in prof.events():
        by_op[e.name] += e.self_cpu_time_total / 1e3
        calls[e.name] += 1
        count += 1
    wall_ms = 1e3 * sum(walls) / steps
    ops_ms = sum(v for k, v in by_op.items() if not k.startswith("ProfilerStep")) / steps
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:10]
    return {"config": config, "resolved": resolved, "batch": batch, "steps": steps,
            "unprofiled_wall_ms": 1e3 * sum(clean) / steps, "wall_ms": wall_ms, "op_self_ms": ops_ms, "host_ms": wall_ms - ops_ms,
            "host_share": (wall_ms - ops_ms) / wall_ms, "ops_per_step": count / steps,
            "top_ops_ms_per_step": [(k, v / steps) for k, v in top],
            "most_called_per_step": [(k, v / steps) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:10]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", default="auto,float32")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"config": vars(args), "machine": machine(), "runs": []}
    label_kernels()
    for c in args.configs.split(","):
        for b in map(int, args.batch.split(",")):
            log(f"{args.model} {c} batch {b} ...")
            r = profile(args.model, c, b, args.steps, args.prompt_len)
            log(f"  wall {r['wall_ms']:.1f} ms, ops {r['op_self_ms']:.1f} ms, host {r['host_ms']:.1f} ms "
                f"({100 * r['host_share']:.0f}%), {r['ops_per_step']:.0f} ops/step")
            res["runs"].append(r)
    m = res["machine"]
    lines = [f"Decode step profile, {args.model}, prompts of {args.prompt_len} tokens, {args.steps} profiled steps "
             f"after 3 warm ones (torch.profiler, CPU; recording ~10k events per step costs time of its own, so the profiled wall is above the unprofiled one). host = profiled wall - the ops' summed self time (ops: aten ops and the compiled GGUF / TurboQuant kernels). Machine: "
             f"{m['cpu_line']}; torch {m['torch']}, {m['torch_threads']} threads; commit {m['commit']}.", "",
             "| config | resolves to | batch | wall ms/step (no profiler) | wall ms/step (profiled) | ops ms/step | "
             "host ms/step | host share | ops/step | top ops (ms/step) | most called (per step) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        top = ", ".join(f"{k} {v:.2f}" for k, v in r["top_ops_ms_per_step"][:4])
        most = ", ".join(f"{k} {v:.0f}" for k, v in r["most_called_per_step"][:4])
        lines.append(f"| {r['config']} | {r['resolved']} | {r['batch']} | {r['unprofiled_wall_ms']:.1f} | "
                     f"{r['wall_ms']:.1f} | {r['op_self_ms']:.1f} | {r['host_ms']:.1f} | {100 * r['host_share']:.0f}% | "
                     f"{r['ops_per_step']:.0f} | {top} | {most} |")
    write_results(args.out or f"step_profile_{args.model}", res, lines)


if __name__ == "__main__":
    main()
