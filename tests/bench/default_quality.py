"""Quality of the fast settings against fp32 on the real GGUF models: the
evidence behind the CPU defaults (engine/auto_defaults.py).

For each model and each configuration DTYPE[:QUANTIZATION][/KV] (and "auto":
the engine's defaults on this machine), through the engine:
  - perplexity on 8 x 1024 tokens of tinyshakespeare (teacher-forced prompt
    logprobs), and its delta against fp32 (dense fp32 weights dequantized
    from the same GGUF, fp32 KV);
  - greedy agreement with fp32 on chat prompts (the real-model tests' two,
    and six more), 32 tokens each: tokens equal before the first divergence.

    .venv/bin/python tests/bench/default_quality.py [--models smollm2-135m,gemma3-270m] \
        [--configs float32,float32:gguf,bfloat16,bfloat16:gguf,auto]

Writes tests/bench/results/default_quality.{json,md}.
"""
import argparse
import json
import math
import time

from bench_paths import DATA, OUT, log, machine, variant_args  # puts the repo on sys.path

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain in two sentences why the sky is blue.", "List three uses of a paperclip.",
         "Translate 'good morning' into Spanish and German.", "What is 17 times 23?",
         "Give me a short tip for learning to cook.", "Describe a cat to someone who has never seen one."]
REFERENCE = "float32"


def measure(model, config, num_seqs, seq_len):
    from engine import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model, kv_cache_memory=512 << 20, max_model_len=seq_len + 64, enable_prefix_caching=False,
              **variant_args(config))
    _, ids = llm.encode(DATA.read_text()[: num_seqs * seq_len * 8])
    seqs = [ids[i * seq_len:(i + 1) * seq_len] for i in range(num_seqs)]
    outs = llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=0))
    nll = n = 0
    for s, o in zip(seqs, outs):
        for t, lp in zip(s[1:], o.prompt_logprobs[1:]):
            nll -= lp[t]
            n += 1
    from model_zoo.chat_template import render_chat
    tok = llm.tokenizer
    prompts = [tok.encode(render_chat(llm.chat_template, [{"role": "user", "content": c}], bos_token=tok.bos_token,
                                      eos_token=tok.eos_token), add_special_tokens=False) for c in CHATS]
    chats = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    a = llm.core.args
    row = {"config": config, "resolved": {"dtype": a.dtype, "quantization": a.quantization,
                                          "kv_cache_dtype": a.kv_cache_dtype},
           "ppl": math.exp(nll / n), "tokens": n, "chat_tokens": [c.outputs[0].token_ids for c in chats],
           "weights_mib": llm.core.resident_bytes / 2**20, "seconds": round(time.time() - t0, 1)}
    llm.close()
    return row


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int, int]:
    """(prompts identical, tokens equal before the first divergence, tokens)."""
    same = prefix = total = 0
    for r, g in zip(ref, got):
        k = next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
        same += r == g
        prefix += k
        total += len(r)
    return same, prefix, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--configs", default="float32,float32:gguf,bfloat16,bfloat16:gguf,bfloat16:gguf/f16,auto")
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", default="default_quality")
    args = ap.parse_args()
    configs = args.configs.split(",")
    if REFERENCE not in configs:
        configs.insert(0, REFERENCE)
    res = {"config": vars(args), "machine": machine(), "models": {}}
    for model in args.models.split(","):
        rows = []
        for c in configs:
            log(f"{model} {c} ...")
            rows.append(measure(model, c, args.num_seqs, args.seq_len))
            log(f"{model} {c}: ppl {rows[-1]['ppl']:.4f} ({rows[-1]['resolved']})")
        ref = next(r for r in rows if r["config"] == REFERENCE)
        for r in rows:
            r["ppl_delta_pct"] = 100 * (r["ppl"] / ref["ppl"] - 1)
            r["chat_same"], r["chat_prefix"], r["chat_total"] = agreement(ref["chat_tokens"], r["chat_tokens"])
        res["models"][model] = rows
    m = res["machine"]
    lines = [f"Perplexity ({args.num_seqs} x {args.seq_len} tokens of tinyshakespeare, teacher-forced) and greedy "
             f"agreement with fp32 on {len(CHATS)} chat prompts x 32 tokens, through the engine. Reference: fp32 "
             f"weights dequantized from the GGUF, fp32 KV. Machine: {m['cpu_line']}; torch {m['torch']}; "
             f"commit {m['commit']}.", ""]
    for model, rows in res["models"].items():
        lines += [f"## {model}", "", "| config | resolves to | weights MiB | PPL | delta vs fp32 | chats identical | "
                  "tokens before first divergence |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            rv = r["resolved"]
            lines.append(f"| {r['config']} | {rv['dtype']}, {rv['quantization'] or 'dense'}, KV {rv['kv_cache_dtype']} "
                         f"| {r['weights_mib']:.0f} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.3f}% | "
                         f"{r['chat_same']}/{len(CHATS)} | {r['chat_prefix']}/{r['chat_total']} |")
        lines.append("")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.out}.json").write_text(json.dumps(res, indent=1))
    (OUT / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
