"""The engine's own host time per decode step, by phase, as batch and context
grow: what a GPU step pays on top of its kernels (a CUDA graph replays the
model's launches in one call, so the rest of the step is this).

A tiny llama (gpu_engine.py's "tiny-llama" config, dummy weights, fp32) runs
decode-only steps on the CPU; each phase is timed around the engine's own
calls: the scheduler's schedule() and update(), the runner's prepare() (the
step's packed inputs: ids, positions, slot mappings, block tables) and
forward() (here the tiny model itself; on a GPU one graph replay), the
sampler, collect() (the tokens to the host: on a GPU the wait for the
device), and the rest of LLM.step() (output processing, detokenizing). The
host time is the step minus forward; a step's host work should not grow with
the context (its block tables are the only per-step input that does, and
they are copied as arrays: one copy per sequence). With penalties on (every
request: repetition_penalty 1.1, frequency_penalty 0.1, as chat UIs set
them), the sampler's inputs do grow with the context (the token ids the
penalties count, uploaded each step), from token arrays the requests keep.
A second table times that host part alone (the sampler's _plan_penalties,
what a GPU step pays whatever the model) for long prompts and long outputs,
which the decode steps above cannot reach on a CPU: prompts of random ids
(every id nearly distinct) and of English text (tinyshakespeare through
SmolLM2's tokenizer: a repetition penalty touches each distinct prompt id
once).

    .venv/bin/python tests/bench/host_overhead.py [--batch 1,64] [--context 128,2048,8192] [--penalties off,on]
        [--steps 32]

Writes tests/bench/results/host_overhead.{json,md}.
"""
import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_paths import DATA, log, machine, write_results  # puts the repo on sys.path
from gpu_engine import random_prompts, write_config

PHASES = ["schedule", "prepare", "forward", "sample", "collect", "update"]


def timed(obj, name, key, acc):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def run(model_dir, batch, context, steps, penalties: bool) -> dict:
    import engine.model_runner as model_runner
    from engine import LLM, SamplingParams
    budget = max(8192, context)
    # Chunked prefills take ~batch * context / budget steps, while the first
    # sequences already decode: every sequence keeps decoding through the timed steps.
    out_len = steps + 16 + batch * context // budget
    llm = LLM(str(model_dir), device="cpu", dtype="float32", load_format="dummy", seed=0, max_num_seqs=batch,
              max_model_len=context + out_len, max_num_batched_tokens=budget, enable_prefix_caching=False)
    core = llm.core
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                        **(dict(repetition_penalty=1.1, frequency_penalty=0.1) if penalties else {}))
    for p in random_prompts(batch, context, 500, seed=1):
        llm.add_request(p, sp)
    sched = core.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):   # the prefills, untimed
        llm.step()
    for _ in range(3):                                       # warm decode steps
        llm.step()
    acc: dict[str, float] = {}
    sample = model_runner.sample_async
    timed(core.scheduler, "schedule", "schedule", acc)
    timed(core.scheduler, "update", "update", acc)
    timed(core.runner, "prepare", "prepare", acc)
    timed(core.runner, "forward", "forward", acc)
    timed(model_runner, "sample_async", "sample", acc)
    timed(core.runner, "collect", "collect", acc)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            n = len(llm.step())
            assert n == batch, f"a step decoded {n} of {batch} sequences"   # decode-only steps, all of them
        wall = time.perf_counter() - t0
    finally:
        model_runner.sample_async = sample
        llm.close()
    ms = {k: 1e3 * v / steps for k, v in acc.items()}
    step_ms = 1e3 * wall / steps
    ms["other"] = step_ms - sum(ms[k] for k in PHASES)
    return {"batch": batch, "context": context, "penalties": penalties, "steps": steps, "step_ms": step_ms,
            "host_ms": step_ms - ms["forward"], "phases_ms": ms}


# batch, prompt tokens, output tokens, prompt ids ("random" or "text")
PLAN_CASES = [(1, 8192, 48, "random"), (64, 2048, 48, "random"), (64, 8192, 48, "random"),
              (64, 2048, 4096, "random"), (64, 8192, 48, "text"), (64, 32768, 48, "text")]


def text_ids() -> list[int]:
    """tinyshakespeare through SmolLM2's tokenizer (~300K ids)."""
    from engine import LLM
    with LLM("smollm2-135m", kv_cache_memory=16 << 20, max_model_len=256) as llm:
        return llm.tokenizer.encode(DATA.read_text())


def penalties_plan(batch, prompt, output, source, text, vocab=49152) -> dict:
    """The sampler's host work for penalties (repetition + frequency) over
    `batch` requests of `prompt` + `output` tokens (text prompts: windows of
    `text` at different offsets): best of 5 x 10 calls."""
    import torch
    from engine.request import EngineRequest, Request
    from engine.sampler import _plan_penalties, _Upload
    from engine.sampling_params import SamplingParams
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(batch):
        sp = SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=0.1, max_tokens=output + 8)
        at = i * (len(text) - prompt) // batch
        ids = text[at:at + prompt] if source == "text" else rng.integers(0, vocab, prompt).tolist()
        r = Request(EngineRequest(str(i), ids, sp), prompt + output + 8)
        for t in rng.integers(0, vocab, output).tolist():
            r.append(t)
        reqs.append(r)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            _plan_penalties(reqs, vocab, _Upload(torch.device("cpu")))
        best = min(best, (time.perf_counter() - t0) / 10)
    return {"batch": batch, "prompt": prompt, "output": output, "source": source,
            "distinct_prompt_ids": int(np.mean([len(np.unique(r.token_ids[:prompt])) for r in reqs])),
            "plan_ms": 1e3 * best}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--context", default="128,2048,8192")
    ap.add_argument("--penalties", default="off,on")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=None, help="write OUT.{json,md} instead of results/host_overhead")
    args = ap.parse_args()
    res = {"config": vars(args), "machine": machine(), "runs": [], "penalties_plan": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp), "tiny-llama")
        for pen in (v == "on" for v in args.penalties.split(",")):
            for b in map(int, args.batch.split(",")):
                for c in map(int, args.context.split(",")):
                    log(f"batch {b}, context {c}, penalties {'on' if pen else 'off'} ...")
                    r = run(model_dir, b, c, args.steps, pen)
                    log(f"  step {r['step_ms']:.2f} ms, host {r['host_ms']:.2f} ms")
                    res["runs"].append(r)
        text = text_ids()
        for case in PLAN_CASES:
            res["penalties_plan"].append(penalties_plan(*case, text))
            log(f"penalties' host plan {case}: {res['penalties_plan'][-1]['plan_ms']:.3f} ms")
    m = res["machine"]
    lines = [f"Host time per decode step (tiny llama, dummy weights, fp32, CPU; {args.steps} decode steps after 3 warm "
             f"ones; ms per step). host = step - forward (the tiny model's own time here; on a GPU one graph replay). "
             f"x first context: host time over the batch's shortest context's (same penalties). penalties: every "
             f"request with repetition_penalty 1.1 and frequency_penalty 0.1. Machine: {m['cpu_line']}; torch "
             f"{m['torch']}, {m['torch_threads']} threads; commit {m['commit']}.", "",
             "| penalties | batch | context | step | forward | host | x first context | " + " | ".join(PHASES[:2])
             + " | " + " | ".join(PHASES[3:]) + " | other |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    first = {}
    for r in res["runs"]:
        p = r["phases_ms"]
        base = first.setdefault((r["penalties"], r["batch"]), r["host_ms"])
        lines.append(f"| {'on' if r['penalties'] else 'off'} | {r['batch']} | {r['context']} | {r['step_ms']:.2f} | "
                     f"{p['forward']:.2f} | "
                     f"{r['host_ms']:.2f} | "
                     f"{r['host_ms'] / base:.2f} | " + " | ".join(f"{p[k]:.3f}" for k in PHASES if k != "forward")
                     + f" | {p['other']:.3f} |")
    lines += ["", "The penalties' host work alone (sampler._plan_penalties: repetition_penalty 1.1 and frequency_penalty "
              "0.1 on every request, vocabulary 49,152, best of 5 x 10 calls, ms per step; text: tinyshakespeare "
              "through SmolLM2's tokenizer):", "",
              "| batch | prompt tokens | prompt ids | distinct per prompt | output tokens | host ms |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {p['batch']} | {p['prompt']} | {p['source']} | {p['distinct_prompt_ids']} | {p['output']} | "
              f"{p['plan_ms']:.3f} |" for p in res["penalties_plan"]]
    write_results("host_overhead", res, lines, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
