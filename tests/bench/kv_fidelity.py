"""KV-format fidelity: perplexity through the engine (teacher-forced prompt
logprobs, every token attending over the compressed cache) on
tinyshakespeare, and passkey retrieval (a 5-digit key hidden at 10 depths in
~600 and ~1,500 tokens of repeated filler; greedy answer must contain it),
for f16 and each preset, with the measured bits per value.

    .venv/bin/python tests/bench/kv_fidelity.py [--models smollm2-135m,gemma3-270m] \
        [--presets f16,tq4,tq4:off,tq4:kv,...] [--num-seqs 8] [--seq-len 1024]

A preset may name its hot tokens after a colon (kv_hot: off | k | kv; the
engine's default, k, otherwise).

Writes tests/bench/results/kv_fidelity.{json,md}.
"""
import argparse
import json
import math
import time
from pathlib import Path

from bench_paths import DATA, OUT, kv_args, log  # puts the repo on sys.path

PRESETS = ["f16", "k8v4", "tq4", "k4v3", "k3v3", "k3v3g32", "k4v2", "tq3", "tq2"]



def windows(tokenizer_llm, num_seqs, seq_len):
    text = DATA.read_text()
    _, ids = tokenizer_llm.encode(text[: num_seqs * seq_len * 8])
    assert len(ids) >= num_seqs * seq_len, "text too short"
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(num_seqs)]


FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
DEPTHS = [i / 9 for i in range(10)]


def passkey_prompts(llm, lengths=(600, 1500)) -> list[tuple[str, str]]:
    """(prompt, key) pairs: the key sentence at 10 relative depths of about
    `length` tokens of filler, then the question."""
    import random
    rnd = random.Random(1234)
    per = len(llm.encode(FILLER)[1]) - 1
    out = []
    for length in lengths:
        n = max(1, length // per)
        for d in DEPTHS:
            key = str(rnd.randint(10000, 99999))
            at = round(d * n)
            text = (FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. "
                    + FILLER * (n - at) + "What is the pass key? The pass key is")
            out.append((text, key))
    return out


def passkey(llm, prompts) -> dict:
    from engine import SamplingParams
    outs = llm.generate([p for p, _ in prompts], SamplingParams(max_tokens=8, temperature=0.0))
    hits = [key in o.outputs[0].text for (_, key), o in zip(prompts, outs)]
    half = len(hits) // 2
    return {"short": sum(hits[:half]), "long": sum(hits[half:]), "of": half,
            "tokens": [len(o.prompt_token_ids) for o in outs[::half]]}


def bits_per_value(llm) -> dict:
    """Measured from the pool plan (real tensors), per layer kind."""
    plan = llm.core.plan
    specs = {s.layer_idx: s for s in llm.core.model.kv_cache_spec()}
    out = {}
    for g in plan.groups:
        if g.hot:       # per sequence, reported apart (hot KB/seq)
            continue
        kind = "full" if g.sliding_window is None else f"sliding_{g.sliding_window}"
        values = sum(2 * specs[i].num_kv_heads * specs[i].head_dim for i in g.layer_ids)
        out[kind] = sum(plan.layer_bytes_per_token[i] for i in g.layer_ids) * 8 / values
    return out


def run(model, presets, num_seqs, seq_len, protect, mem):
    from engine import LLM, SamplingParams
    rows, seqs = [], None
    for p in presets:
        t0 = time.time()
        llm = LLM(model, **kv_args(p), kv_cache_memory=mem, max_model_len=max(seq_len, 2048) + 16,
                  kv_protect_layers=protect, enable_prefix_caching=False)
        if seqs is None:
            seqs = windows(llm, num_seqs, seq_len)
        outs = llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=0))
        nll, n = 0.0, 0
        for ids, o in zip(seqs, outs):
            for t, lp in zip(ids[1:], o.prompt_logprobs[1:]):
                nll -= lp[t]
                n += 1
        pk = passkey(llm, passkey_prompts(llm))
        row = {"preset": p, "ppl": math.exp(nll / n), "tokens": n, "passkey": pk,
               "bits_per_value": bits_per_value(llm),
               "bytes_per_token": llm.core.plan.bytes_per_token, "hot_bytes_per_seq": llm.core.plan.hot_bytes_per_seq,
               "seconds": round(time.time() - t0, 1)}
        log(f"{model} {p}: ppl {row['ppl']:.4f}, passkey {pk['short']}+{pk['long']}/{2 * pk['of']}, "
            f"bits/value {row['bits_per_value']}")
        rows.append(row)
        del llm
    base = next((r["ppl"] for r in rows if r["preset"] == "f16"), None)
    for r in rows:
        r["delta_vs_f16_pct"] = None if base is None else 100 * (r["ppl"] / base - 1)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--protect-layers", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--out", default=str(OUT / "kv_fidelity"))
    a = ap.parse_args()
    date = time.strftime("%Y-%m-%d %H:%M")
    res = {"num_seqs": a.num_seqs, "seq_len": a.seq_len, "protect_layers": a.protect_layers,
           "data": "tinyshakespeare.txt, consecutive windows from the start", "date": date, "models": {}}
    lines = [f"# KV fidelity: {a.num_seqs} x {a.seq_len} tokens of tinyshakespeare, "
             f"protect_layers={a.protect_layers} ({date})", "",
             "PPL through the engine (teacher-forced prompt logprobs over the compressed cache); "
             "bits/value measured from the pool's real tensors, per layer kind "
             "(sliding-window layers stay 16-bit by default).", ""]
    for model in a.models.split(","):
        rows = run(model, a.presets.split(","), a.num_seqs, a.seq_len, a.protect_layers, a.kv_cache_memory)
        res["models"][model] = rows
        lines += [f"## {model}", "", "| preset | bits/value | bytes/token (full layers) | hot KB/seq | PPL "
                  "| delta vs f16 | passkey ~600 | passkey ~1500 |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            d = "" if r["delta_vs_f16_pct"] is None else f"{r['delta_vs_f16_pct']:+.2f}%"
            bpv = ", ".join(f"{k} {v:.3f}" for k, v in r["bits_per_value"].items())
            pk = r["passkey"]
            lines.append(f"| {r['preset']} | {bpv} | {r['bytes_per_token']} | {r['hot_bytes_per_seq'] / 1024:.0f} "
                         f"| {r['ppl']:.4f} | {d} "
                         f"| {pk['short']}/{pk['of']} | {pk['long']}/{pk['of']} |")
        lines.append("")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
