"""What serving LoRA adapters costs: offline generation throughput on a real
GGUF model (SmolLM2-135M by default, the served defaults) with the same
requests run as the base model (LoRA off, and LoRA on but unused), all
through one adapter, and spread over several adapters (as many slots, and
fewer slots than adapters, so requests wait for one), in one run on one
machine; the first case runs again last, to show the run-to-run noise. The adapters are random, rank 16 on all seven projections of
every layer (the most work an adapter of that rank can add).

    .venv/bin/python tests/bench/lora.py [--model smollm2-135m] [--num-prompts 32] [--output-len 64]

Writes tests/bench/results/lora.{json,md}.
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

from bench_paths import log, machine, make_prompts, write_results  # puts the repo on sys.path


def write_adapter(config: dict, path: Path, rank: int, seed: int) -> None:
    """A random PEFT adapter (lora_B nonzero) on every projection, shapes from the HF config."""
    from tests.tiny_models import peft_tensors, random_lora, write_peft
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    shapes = {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h), "self_attn.v_proj": (kv * hd, h),
              "self_attn.o_proj": (h, heads * hd), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    parts = random_lora({f"model.layers.{i}.{n}": s for i in range(layers) for n, s in shapes.items()}, rank, seed,
                        b_scale=0.01)
    write_peft(path, peft_tensors(parts), r=rank, lora_alpha=2 * rank, target_modules=[n.split(".")[1] for n in shapes])


def run(model, prompts, output_len, threads, adapters, enable_lora, max_loras, repeats):
    import torch

    from engine import LLM, LoRARequest, SamplingParams
    torch.set_num_threads(threads)
    kw = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=16) if enable_lora else {}
    llm = LLM(model, max_num_seqs=64, kv_cache_memory=1 << 30, enable_prefix_caching=False, **kw)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    picks = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), lora_request=picks[:2])    # warm-up, adapters read
    dt = float("inf")
    for _ in range(repeats):        # the best of a few: this kind of machine drifts by 10-15% between runs
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=picks)
        dt = min(dt, time.perf_counter() - t0)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    a = llm.core.args
    res = {"output_tok_s": out_tokens / dt, "total_tok_s": (out_tokens + sum(map(len, prompts))) / dt,
           "total_s": dt, "resolves_to": f"{a.dtype}, {a.quantization or 'dense'}",
           "lora_mib": llm.core.lora.nbytes / 2**20 if llm.core.lora is not None else 0.0,
           "tokens": [o.outputs[0].token_ids for o in outs]}
    llm.close()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case; the fastest counts")
    args = ap.parse_args()

    from model_zoo.resolve import open_model
    source = open_model(args.model, weights=False)
    prompts = make_prompts(source.tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed)
    res = {"config": vars(args), "machine": machine(), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [Path(tmp) / f"a{i}" for i in range(4)]
        for i, p in enumerate(adapters):
            write_adapter(source.config, p, 16, i)
        cases = {"base model, LoRA off": (False, [], 1),
                 "base model, LoRA on (no request uses it)": (True, [], 1),
                 "1 adapter": (True, adapters[:1], 1),
                 "4 adapters, 4 slots": (True, adapters, 4),
                 "4 adapters, 2 slots": (True, adapters, 2),
                 "base model, LoRA off (again: the run-to-run noise)": (False, [], 1)}
        for name, (on, ads, slots) in cases.items():
            log(f"{name}: {len(prompts)} requests x {args.output_len} tokens ...")
            res["results"][name] = run(args.model, prompts, args.output_len, args.threads, ads, on, slots,
                                       args.repeats)
            log(f"{name}: {res['results'][name]['output_tok_s']:.1f} output tok/s")
    r = res["results"]
    base = r["base model, LoRA off"]
    # LoRA on but unused must not change a token; the adapters must.
    res["unused_lora_same_tokens"] = r["base model, LoRA on (no request uses it)"]["tokens"] == base["tokens"]
    res["adapters_change_tokens"] = r["1 adapter"]["tokens"] != base["tokens"]
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    m = res["machine"]
    lines = [f"LoRA serving cost, {args.model} ({base['resolves_to']}), {len(prompts)} requests of "
             f"{args.min_len}-{args.max_len} prompt tokens x {args.output_len} output tokens (ignore_eos, greedy), "
             f"rank-16 adapters on all 7 projections, best of {args.repeats} runs, {args.threads} threads; "
             f"{m['cpu_line']}, torch {m['torch']}, "
             f"commit {m['commit']}, load average {m['loadavg'][0]:.2f}.", "",
             "| requests | output tok/s | total tok/s | vs LoRA off | adapter slots (MiB) |", "|---|---|---|---|---|"]
    for k, v in r.items():
        lines.append(f"| {k} | {v['output_tok_s']:.1f} | {v['total_tok_s']:.0f} | "
                     f"{v['output_tok_s'] / base['output_tok_s']:.2f}x | {v['lora_mib']:.1f} |")
    lines += ["", f"LoRA on but unused gives the same tokens as LoRA off: {res['unused_lora_same_tokens']}; "
              f"the adapters change them: {res['adapters_change_tokens']}.", "",
              "Command: `.venv/bin/python tests/bench/lora.py`"]
    for v in r.values():
        v.pop("tokens")
    write_results("lora", res, lines)


if __name__ == "__main__":
    main()
