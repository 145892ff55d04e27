"""Offline throughput on the real GGUF models (SmolLM2-135M Q4_1, Gemma3-270M
Q4_K_M): tqserve's engine in several weight formats (fp32 / bf16 dequantized
at load, `--quantization gguf` keeping the file's blocks, bf16 + int4) vs
transformers `generate` (batched, padded) vs llama-cpp-python (sequential,
same GGUF), in one run on one machine.

    .venv/bin/python tests/bench/offline_throughput.py [--models smollm2-135m,gemma3-270m] \
        [--num-prompts 64] [--llama-cpp-python /path/to/venv/bin/python]

llama-cpp-python is not a project dependency (it compiles for minutes); build
it once in its own venv (see tests/bench/README.md) and pass its python.
Writes tests/bench/results/offline_throughput.{json,md}.
"""
import argparse
import json
import os
import subprocess
import textwrap
import time

from bench_paths import OUT, log, machine, make_prompts, variant_args  # puts the repo on sys.path


def bench_tqserve(model, prompts, out_len, threads, variant):
    import torch
    from engine import LLM, SamplingParams
    torch.set_num_threads(threads)
    llm = LLM(model, max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory=4 << 30,
              enable_prefix_caching=False, **variant_args(variant))
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    # Prefill throughput: the same prompts, one output token each.
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    pdt = time.perf_counter() - t0
    # Single-stream decode: time between the first and the last token.
    llm.add_request(prompts[0], sp)
    times = []
    while llm.core.has_work():
        if llm.step():
            times.append(time.perf_counter())
    decode = (len(times) - 1) / (times[-1] - times[0])
    a = llm.core.args
    res = {"output_tok_s": n_out / dt, "total_s": dt, "prefill_tok_s": sum(map(len, prompts)) / pdt,
           "single_stream_decode_tok_s": decode, "weights_mib": llm.core.resident_bytes / 2**20,
           "resolves_to": f"{a.dtype}, {a.quantization or 'dense'}, KV {a.kv_cache_dtype}"}
    llm.close()
    return res


def bench_transformers(model, prompts, out_len, threads, batch):
    import torch
    from transformers import AutoModelForCausalLM
    from model_zoo.resolve import resolve_path
    torch.set_num_threads(threads)
    gguf = resolve_path(model)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    n_out, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        L = max(map(len, chunk))
        ids = torch.tensor([[0] * (L - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False, pad_token_id=0)
        n_out += (out.shape[1] - L) * len(chunk)
        log(f"transformers: {min(i + batch, len(prompts))}/{len(prompts)} prompts")
    dt = time.perf_counter() - t0
    return {"output_tok_s": n_out / dt, "total_s": dt, "batch": batch}


LLAMA_CPP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    path, threads, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.load(sys.stdin)
    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    n_out = n_pre = 0; pre_s = dec_s = 0.0
    t0 = time.perf_counter()
    for p in prompts:
        llm.reset()
        a = time.perf_counter()
        llm.eval(p)
        b = time.perf_counter()
        tok = None
        for i, tok in enumerate(llm.generate(p, top_k=1)):
            if i + 1 >= out_len:
                break
        c = time.perf_counter()
        n_pre += len(p); pre_s += b - a; dec_s += c - b; n_out += out_len
    dt = time.perf_counter() - t0
    print(json.dumps({"output_tok_s": n_out / dt, "total_s": dt, "prefill_tok_s": n_pre / pre_s,
                      "single_stream_decode_tok_s": n_out / dec_s}))
""")


def bench_llama_cpp(python, model, prompts, out_len, threads):
    from model_zoo.resolve import resolve_path
    gguf = resolve_path(model)
    r = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT, str(gguf), str(threads), str(out_len)],
                       input=json.dumps(prompts), capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def label(variant: str) -> str:
    dtype, _, quant = variant.partition(":")
    return f"tqserve {dtype}" + (f" + {quant}" if quant else "")


def bench_model(model, args, res):
    from model_zoo.resolve import open_model
    tok = open_model(model, weights=False).tokenizer
    prompts = make_prompts(tok, args.num_prompts, args.min_len, args.max_len, args.seed)
    out = res.setdefault(model, {})
    for variant in args.dtypes.split(","):
        log(f"{model} {label(variant)}: {len(prompts)} prompts ...")
        out[label(variant)] = bench_tqserve(model, prompts, args.output_len, args.threads, variant)
        log(f"{model} {label(variant)}: {out[label(variant)]}")
    if args.hf_prompts:
        out["transformers"] = bench_transformers(model, prompts[:args.hf_prompts], args.output_len, args.threads,
                                                 args.hf_batch)
        log(f"{model} transformers: {out['transformers']}")
    if args.llama_cpp_python:
        out["llama-cpp-python"] = bench_llama_cpp(args.llama_cpp_python, model, prompts[:args.llama_cpp_prompts],
                                                  args.output_len, args.threads)
        log(f"{model} llama-cpp-python: {out['llama-cpp-python']}")


def table(out: dict) -> list[str]:
    rows = ["| system | weights MiB | output tok/s | prefill tok/s | single-stream decode tok/s | "
            "output vs transformers | output vs llama-cpp-python | single-stream vs llama-cpp-python |",
            "|---|---|---|---|---|---|---|---|"]
    hf, lc = out.get("transformers"), out.get("llama-cpp-python")
    for k, r in out.items():
        f = lambda x, d=1: f"{r[x]:.{d}f}" if x in r else "-"   # noqa: E731
        ratio = lambda ref, x: f"{r[x] / ref[x]:.2f}x" if ref and x in r and x in ref and ref is not r else "-"  # noqa
        rows.append(f"| {k} | {f('weights_mib', 0)} | {f('output_tok_s')} | {f('prefill_tok_s')} | "
                    f"{f('single_stream_decode_tok_s')} | {ratio(hf, 'output_tok_s')} | {ratio(lc, 'output_tok_s')} | "
                    f"{ratio(lc, 'single_stream_decode_tok_s')} |")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-prompts", type=int, default=32, help="transformers is slow: a subset")
    ap.add_argument("--llama-cpp-prompts", type=int, default=16)
    ap.add_argument("--llama-cpp-python", default=None, help="python of a venv with llama-cpp-python")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--dtypes", default="float32,bfloat16,float32:gguf,bfloat16:gguf",
                    help="tqserve variants: DTYPE[:QUANTIZATION],...")
    ap.add_argument("--out", default="offline_throughput", help="results file stem under tests/bench/results/")
    args = ap.parse_args()
    res = {"config": vars(args), "machine": machine()}
    for model in args.models.split(","):
        bench_model(model, args, res)
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.out}.json").write_text(json.dumps(res, indent=2))
    m = res["machine"]
    text = [f"Offline throughput, {args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
            f"{args.output_len} output tokens, ignore_eos, {args.threads} threads (transformers: {args.hf_prompts} "
            f"prompts at batch {args.hf_batch}; llama-cpp-python: {args.llama_cpp_prompts} prompts sequentially, "
            f"its wall time including prefill). Machine: {m['cpu_line']}; torch {m['torch']}; commit {m['commit']}; "
            f"load average {m['loadavg'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end.", ""]
    for model in args.models.split(","):
        text += [f"## {model}", ""] + table(res[model]) + [""]
    (OUT / f"{args.out}.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
