"""Embedding throughput on a real GGUF model (SmolLM2-135M Q4_1 by default):
tqserve's engine (LLM.embed: last-token pooling, normalized, the prompts in
chunked-prefill steps) in the weight formats it serves vs transformers'
backbone forward (fp32, batched and right-padded, the last real token's
state), in one run on one machine; plus how close the vectors are (cosine
with transformers' fp32 ones).

    .venv/bin/python tests/bench/embeddings.py [--model smollm2-135m] [--num-prompts 256]

Writes tests/bench/results/embeddings.{json,md}.
"""
import argparse
import os
import time

from bench_paths import log, machine, make_prompts, variant_args, write_results  # puts the repo on sys.path


def bench_tqserve(model, prompts, threads, variant):
    import torch

    from engine import LLM, PoolingParams
    torch.set_num_threads(threads)
    llm = LLM(model, max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory=1 << 30,
              enable_prefix_caching=False, **variant_args(variant))
    llm.embed(prompts[:2])          # warm-up
    t0 = time.perf_counter()
    outs = llm.embed(prompts, PoolingParams("last", normalize=True))
    dt = time.perf_counter() - t0
    a = llm.core.args
    res = {"texts_s": len(prompts) / dt, "tokens_s": sum(map(len, prompts)) / dt, "total_s": dt,
           "resolves_to": f"{a.dtype}, {a.quantization or 'dense'}"}
    llm.close()
    return res, [o.outputs.embedding for o in outs]


def bench_transformers(model, prompts, threads, batch):
    import torch
    from transformers import AutoModelForCausalLM

    from model_zoo.resolve import resolve_path
    torch.set_num_threads(threads)
    gguf = resolve_path(model)
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    vecs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        L = max(map(len, chunk))
        ids = torch.tensor([p + [0] * (L - len(p)) for p in chunk])
        mask = torch.tensor([[1] * len(p) + [0] * (L - len(p)) for p in chunk])
        with torch.no_grad():
            h = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = h[torch.arange(len(chunk)), torch.tensor([len(p) - 1 for p in chunk])]
        vecs += torch.nn.functional.normalize(last.float(), dim=-1).tolist()
        log(f"transformers: {min(i + batch, len(prompts))}/{len(prompts)} texts")
    dt = time.perf_counter() - t0
    return {"texts_s": len(prompts) / dt, "tokens_s": sum(map(len, prompts)) / dt, "total_s": dt,
            "batch": batch}, vecs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="auto,float32,float32:gguf",
                    help="tqserve variants: auto (the served defaults) or DTYPE[:QUANTIZATION],...")
    args = ap.parse_args()
    import numpy as np

    from model_zoo.resolve import open_model
    tok = open_model(args.model, weights=False).tokenizer
    prompts = make_prompts(tok, args.num_prompts, args.min_len, args.max_len, args.seed)
    res = {"config": vars(args), "machine": machine(), "results": {}}
    log(f"transformers fp32: {len(prompts)} texts ...")
    res["results"]["transformers fp32"], ref = bench_transformers(args.model, prompts, args.threads, args.hf_batch)
    ref = np.asarray(ref)
    for variant in args.variants.split(","):
        name = f"tqserve {variant}"
        log(f"{name}: {len(prompts)} texts ...")
        r, vecs = bench_tqserve(args.model, prompts, args.threads, variant)
        cos = (np.asarray(vecs) * ref).sum(-1)
        r.update(cosine_min=float(cos.min()), cosine_mean=float(cos.mean()))
        res["results"][name] = r
        log(f"{name}: {r}")
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    hf = res["results"]["transformers fp32"]
    m = res["machine"]
    lines = [f"Embeddings, {args.model}, {len(prompts)} texts of {args.min_len}-{args.max_len} tokens "
             f"({sum(map(len, prompts))} tokens), last-token pooling, normalized, {args.threads} threads; "
             f"{m['cpu_line']}, torch {m['torch']}, commit {m['commit']}, load average {m['loadavg'][0]:.2f}.",
             "", "| system | resolves to | texts/s | tokens/s | vs transformers | cosine with transformers (min / mean) |",
             "|---|---|---|---|---|---|"]
    for k, r in res["results"].items():
        cos = f"{r['cosine_min']:.5f} / {r['cosine_mean']:.5f}" if "cosine_min" in r else "-"
        lines.append(f"| {k} | {r.get('resolves_to', 'float32, dense')} | {r['texts_s']:.1f} | {r['tokens_s']:.0f} | "
                     f"{r['tokens_s'] / hf['tokens_s']:.2f}x | {cos} |")
    lines += ["", "Command: `.venv/bin/python tests/bench/embeddings.py`"]
    write_results("embeddings", res, lines)


if __name__ == "__main__":
    main()
