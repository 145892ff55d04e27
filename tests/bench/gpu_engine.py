"""The engine on a GPU, end to end, with dummy weights of published shapes.

    python tests/bench/gpu_engine.py [--models llama-3.2-1b,qwen3-8b] [--only 1,2,3,4]

Runs as is on a bare GPU machine (torch, triton, transformers; no internet,
no weights: `load_format="dummy"` fills parameters on the device; gguf,
fastapi, uvicorn and pydantic are not needed). bf16 throughout. Sections:

1. single-stream decode tok/s next to the roofline: weight bytes read per
   token (every parameter, less an untied input embedding, of which one row
   is read) over the card's copy bandwidth measured in the same run;
2. 64 concurrent requests, 1,024 random prompt tokens, 256 output tokens,
   ignore_eos: output tok/s and TTFT p50, next to transformers `generate`
   (bf16, the same batch, greedy) in the same run;
3. the same with kv_cache_dtype=tq4, and how many concurrent 8K-token
   sequences the KV pool holds at the same memory budget, f16 vs tq4;
4. the Llama-3.2-1B shape at batch 1 eager, with CUDA graphs, and with graphs
   and --async-scheduling (the next step scheduled while one runs);
5. n-gram speculative decoding (k = 4) on the first model at concurrency 1
   and 8, prompts that repeat themselves (random weights: acceptance is
   whatever the dummy model's greedy output makes it; what this measures is
   the cost of a verification step against a decode step): output tok/s
   with and without, mean acceptance length, greedy outputs identical.

Each section is guarded: one that fails is recorded with its error and the
others still run. Writes tests/bench/results/gpu_engine.{json,md} with the
GPU's name, torch / triton / CUDA versions and the commit.

`--device cpu --tiny` runs the same code on tiny shapes to check the script
itself on a CPU (its numbers mean nothing).
"""
import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench_paths import OUT, ROOT, log  # puts the repo on sys.path

# Published shapes (the models' config.json on their hubs).
SHAPES = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16"},
    # --tiny: the script's own check on a CPU.
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
}


def write_config(folder: Path, name: str) -> Path:
    d = folder / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(SHAPES[name], indent=1))
    return d


# ---------------------------------------------------------------- machine
def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "device": device}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        info.update(cpu=cpu, threads=torch.get_num_threads())
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:
        info["commit"] = None
    return info


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """GB/s of a device-to-device copy, reads + writes counted."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    iters = 20
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    del src, dst
    return 2 * nbytes / dt / 1e9


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the engine
def engine(path, device, **kw):
    from engine import LLM
    return LLM(str(path), device=device, dtype="bfloat16", load_format="dummy", seed=0, **kw)


def weight_bytes_per_token(llm) -> int:
    model = llm.core.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = llm.core.source.config
    if not cfg.get("tie_word_embeddings", False):
        total -= cfg["vocab_size"] * cfg["hidden_size"] * 2      # one embedding row is read, not the table
    return total


def random_prompts(n, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def run_batch(llm, prompts, out_len):
    from engine import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = time.monotonic()
    outs = llm.generate(prompts, sp)
    wall = time.monotonic() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    assert ntok == len(prompts) * out_len, (ntok, len(prompts), out_len)
    return {"output_tok_s": ntok / wall, "wall_s": wall, "ttft_p50_s": statistics.median(ttft),
            "output_tokens": ntok}


def decode_rate(llm, vocab, out_len, prompt_len=128):
    """Single stream: tokens after the first over the time after the first."""
    from engine import SamplingParams
    run_batch(llm, random_prompts(1, prompt_len, vocab, 1), 8)           # warm-up
    o = llm.generate(random_prompts(1, prompt_len, vocab, 2),
                     SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))[0]
    m = o.metrics
    return (out_len - 1) / (m["finished_time"] - m["first_token_time"])


# ---------------------------------------------------------------- transformers
def hf_generate(path, device, prompts, out_len):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :16], attention_mask=torch.ones_like(ids[:1, :16]), max_new_tokens=4,
                       do_sample=False, pad_token_id=0)                # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        sync(device)
        wall = time.perf_counter() - t0
    ntok = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model, out
    free(device)
    return {"output_tok_s": ntok / wall, "wall_s": wall, "output_tokens": ntok}


# ---------------------------------------------------------------- sections
def section(results, name, fn):
    log(f"== {name}")
    t0 = time.monotonic()
    try:
        results[name] = fn()
    except Exception as e:
        traceback.print_exc()
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    results[name]["seconds"] = round(time.monotonic() - t0, 1)
    log(f"   {name}: {json.dumps(results[name])}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and counts: check the script on a CPU")
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--only", default="1,2,3,4,5", help="sections to run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--long-context", type=int, default=8192)
    ap.add_argument("--out", default=str(OUT / "gpu_engine"))
    args = ap.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_engine.py: no CUDA device (torch.cuda.is_available() is False); "
              "use --device cpu --tiny to check the script", file=sys.stderr)
        return 2
    if args.tiny:
        models = ["tiny-llama"]
        args.batch, args.prompt_len, args.output_len, args.long_context = 4, 32, 8, 256
    else:
        models = args.models.split(",")
    only = {int(s) for s in args.only.split(",")}
    results = {"machine": machine(device), "args": vars(args), "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="gpu_engine_"))
    bw_bytes = (2 << 30) if device == "cuda" else (64 << 20)
    section(results, "copy_bandwidth", lambda: {"gb_s": copy_bandwidth(device, bw_bytes)})
    bw = results["copy_bandwidth"].get("gb_s")
    big = dict(max_num_seqs=max(args.batch, 8), max_num_batched_tokens=8192 if not args.tiny else 256,
               max_model_len=max(args.long_context, args.prompt_len + args.output_len) + 64)
    for name in models:
        path = write_config(tmp, name)
        vocab = SHAPES[name]["vocab_size"]
        r = results["models"][name] = {}
        prompts = random_prompts(args.batch, args.prompt_len, vocab, 0)
        if 2 in only:
            section(r, "transformers_generate", lambda: hf_generate(path, device, prompts, args.output_len))

        def f16_engine():
            llm = engine(path, device, kv_cache_dtype="auto", **big)
            out = {"weight_bytes_per_token": weight_bytes_per_token(llm)}
            if 1 in only:
                out["single_stream_tok_s"] = decode_rate(llm, vocab, args.output_len)
                if bw:
                    out["roofline_tok_s"] = bw * 1e9 / out["weight_bytes_per_token"]
                    out["fraction_of_roofline"] = out["single_stream_tok_s"] / out["roofline_tok_s"]
            if 2 in only:
                run_batch(llm, prompts[:2], 4)                              # warm-up
                out["batch"] = run_batch(llm, prompts, args.output_len)
            out["kv"] = kv_capacity(llm, args.long_context)
            del llm
            free(device)
            return out
        section(r, "engine_bf16_kv", f16_engine)
        hf = r.get("transformers_generate", {}).get("output_tok_s")
        eb = r["engine_bf16_kv"].get("batch", {}).get("output_tok_s")
        if hf and eb:
            r["engine_bf16_kv"]["batch"]["vs_transformers"] = eb / hf
        if 3 in only:
            def tq4_engine():
                llm = engine(path, device, kv_cache_dtype="tq4", **big)
                run_batch(llm, prompts[:2], 4)
                out = {"batch": run_batch(llm, prompts, args.output_len), "kv": kv_capacity(llm, args.long_context)}
                del llm
                free(device)
                f16 = r["engine_bf16_kv"].get("kv", {}).get("seqs_at_context")
                if f16:
                    out["kv"]["vs_f16_seqs"] = out["kv"]["seqs_at_context"] / f16
                return out
            section(r, "engine_tq4_kv", tq4_engine)
    if 4 in only:
        name = models[0]
        path = write_config(tmp, name)
        vocab = SHAPES[name]["vocab_size"]

        def graphs():
            # Eager, graphs, then graphs with the next step scheduled while one runs.
            out = {}
            for key, kw in (("eager", dict(enforce_eager=True)), ("cuda_graphs", {}),
                            ("cuda_graphs_async", dict(async_scheduling=True))):
                llm = engine(path, device, max_num_seqs=8, **kw)
                rate = decode_rate(llm, vocab, args.output_len)
                out[key] = {"tok_s": rate, "step_ms": 1e3 / rate}
                if key != "eager":
                    g = llm.core.graphs
                    out[key]["captured"] = g is not None
                    out[key]["replays"] = g.replays if g is not None else 0
                del llm
                free(device)
            out["step_time_ratio"] = out["cuda_graphs"]["step_ms"] / out["eager"]["step_ms"]
            out["async_step_time_ratio"] = out["cuda_graphs_async"]["step_ms"] / out["cuda_graphs"]["step_ms"]
            return out
        section(results, f"cuda_graphs_{name}_batch1", graphs)
    if 5 in only:
        name = models[0]
        path = write_config(tmp, name)
        vocab = SHAPES[name]["vocab_size"]
        section(results, f"ngram_speculation_{name}", lambda: speculation(path, device, vocab, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(markdown(results))
    log(f"wrote {out}.json / .md")
    return 0


def speculation(path, device, vocab, args) -> dict:
    """Section 5: ngram drafts vs none at concurrency 1 and 8."""
    from engine import SamplingParams
    half = args.prompt_len // 2
    prompts = [p + p for p in random_prompts(16, half, vocab, 5)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    out = {}
    for c in (1, 8):
        ref = None
        for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4}):
            llm = engine(path, device, max_num_seqs=c, speculative_config=spec)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm-up
            sync(device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:2 * c], sp)
            sync(device)
            wall = time.perf_counter() - t0
            st = llm.core.get_stats()
            toks = [o.outputs[0].token_ids for o in outs]
            row = {"output_tok_s": sum(map(len, toks)) / wall, "steps": st.steps_total}
            if spec:
                d = st.spec_decode_num_drafts_total
                row["acceptance_length"] = 1 + st.spec_decode_num_accepted_tokens_total / d if d else None
                row["greedy_mismatches"] = sum(a != b for a, b in zip(toks, ref))
                row["speedup"] = row["output_tok_s"] / out[f"c{c}_off"]["output_tok_s"]
            else:
                ref = toks
            out[f"c{c}_{'ngram' if spec else 'off'}"] = row
            del llm
            free(device)
    return out


def kv_capacity(llm, context: int) -> dict:
    """Concurrent sequences of `context` tokens the pool holds: full-attention
    blocks, plus each sequence's hot-token blocks (TurboQuant)."""
    plan = llm.core.plan
    per_seq = context * plan.bytes_per_token + plan.hot_bytes_per_seq
    return {"pool_bytes": plan.total_bytes, "bytes_per_token": plan.bytes_per_token,
            "hot_bytes_per_seq": plan.hot_bytes_per_seq, "context": context,
            "seqs_at_context": int(plan.total_bytes // per_seq)}


def markdown(res) -> str:
    m = res["machine"]
    head = m.get("gpu") or m.get("cpu")
    lines = [f"# GPU engine benchmark ({head})", "",
             f"torch {m['torch']}, triton {m.get('triton')}, CUDA {m.get('cuda')}, commit {m.get('commit')}; "
             f"copy bandwidth {res.get('copy_bandwidth', {}).get('gb_s', float('nan')):.0f} GB/s "
             "(device-to-device, reads + writes). Dummy weights, bf16.", "",
             "| model | single stream tok/s | roofline tok/s | % of roofline | batch tok/s (bf16 KV) | "
             "TTFT p50 | transformers tok/s | x transformers | batch tok/s (tq4) | 8K seqs f16 | 8K seqs tq4 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return fmt.format(x) if isinstance(x, (int, float)) else "-"
    for name, r in res["models"].items():
        e, t, q = r.get("engine_bf16_kv", {}), r.get("transformers_generate", {}), r.get("engine_tq4_kv", {})
        b = e.get("batch", {})
        lines.append(f"| {name} | {f(e.get('single_stream_tok_s'))} | {f(e.get('roofline_tok_s'))} | "
                     f"{f(100 * e['fraction_of_roofline'] if 'fraction_of_roofline' in e else None)} | "
                     f"{f(b.get('output_tok_s'))} | {f(b.get('ttft_p50_s'), '{:.2f} s')} | "
                     f"{f(t.get('output_tok_s'))} | {f(b.get('vs_transformers'), '{:.2f}x')} | "
                     f"{f(q.get('batch', {}).get('output_tok_s'))} | {e.get('kv', {}).get('seqs_at_context', '-')} | "
                     f"{q.get('kv', {}).get('seqs_at_context', '-')} |")
    for key, val in res.items():
        if key.startswith("ngram_speculation_"):
            lines += ["", f"n-gram speculation, k=4 ({key}): " + (", ".join(
                f"c={c}: {val[f'c{c}_off']['output_tok_s']:.1f} -> {val[f'c{c}_ngram']['output_tok_s']:.1f} tok/s "
                f"({val[f'c{c}_ngram']['speedup']:.2f}x, acceptance length "
                f"{val[f'c{c}_ngram']['acceptance_length'] or 0:.2f}, "
                f"{val[f'c{c}_ngram']['greedy_mismatches']} greedy mismatches)" for c in (1, 8))
                if "error" not in val else val["error"])]
        if key.startswith("cuda_graphs_"):
            lines += ["", f"CUDA graphs ({key}): " + (
                f"eager {val['eager']['step_ms']:.2f} ms/step, graphs {val['cuda_graphs']['step_ms']:.2f} ms/step "
                f"({val['step_time_ratio']:.2f}x), graphs + --async-scheduling "
                f"{val['cuda_graphs_async']['step_ms']:.2f} ms/step ({val['async_step_time_ratio']:.2f}x of graphs)"
                if "error" not in val else val["error"])]
    errors = [f"- {m}/{s}: {v['error']}" for m, r in res["models"].items() for s, v in r.items()
              if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
