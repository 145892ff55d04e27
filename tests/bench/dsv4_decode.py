"""DeepSeek-V4 decode: every sequence at once (DSV4Rows) vs one at a time.

    .venv/bin/python tests/bench/dsv4_decode.py [--batch 1,8,32] [--context 512] [--tokens 32]
        [--device cpu|cuda] [--kv auto,tq4] [--backends dsv4-torch[,dsv4-triton]] [--out PATH]

A small DeepSeek-V4 of the real layout (sliding / CSA / HCA layers, the
lightning indexer, hash + routed MoE, hyper-connections; dummy weights, its
config.json written here: no download) decodes `--tokens` tokens after a
`--context`-token prompt, for each batch size, two ways in one run:

  per-sequence  the pool's per-sequence views (kvcache/dsv4_paged.py batch):
                a Python loop over the sequences in every layer; what every
                V4 step ran before, and still what prefills run;
  batched       decode steps over device tensors, every sequence at once,
                a row at a time (DSV4Rows); on CUDA also captured as graphs;
                once per attention backend of the entries (kvcache/dsv4_attn.py:
                dsv4-torch gathers whole tables, dsv4-triton's kernels read
                the entries used; default: dsv4-torch on CPU, both on CUDA).

Decode tok/s counts only decode-only steps (timed one by one). Greedy
tokens must be identical every way in fp32 (the run stops if not); in bf16
(CUDA) the rounding differs between the ways, so the share of tokens equal
to per-sequence's before a sequence's first difference is reported. Writes
tests/bench/results/dsv4_decode[_<device>].{json,md} with the machine.
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_paths import log, machine, write_results  # puts the repo on sys.path

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# A scaled-down V4 (DeepSeek-V4-Flash: hidden 4096, 43 layers, head_dim 512,
# window 128, CSA ratio 4 with top-512 indexer, HCA ratio 128).
CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
    vocab_size=8192, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=1, head_dim=128, q_lora_rank=256, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, layer_types=[SWA, CSA, HCA, CSA, HCA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6, compress_rates={CSA: 4, HCA: 128},
    hc_mult=4, sliding_window=128, o_groups=4, o_lora_rank=128, index_n_heads=8, index_head_dim=64,
    index_topk=64, partial_rotary_factor=0.5, max_position_embeddings=4096, rope_theta=10000.0,
    compress_rope_theta=160000.0, rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                       original_max_position_embeddings=1024))


def decode_run(path, batch, context, tokens, device, kv, batched, backend=None):
    """(decode tok/s, decode steps, greedy tokens) for one engine; backend: the entries' (None: the device's)."""
    import os

    import torch

    from engine import LLM, SamplingParams
    from engine.request import EngineRequest
    from kvcache.dsv4_paged import DSV4PagedCache
    orig, env = DSV4PagedCache.batches_spans, os.environ.get("TQSERVE_ATTN_BACKEND")
    if not batched:     # every step per sequence, as before DSV4Rows (and so no graphs)
        DSV4PagedCache.batches_spans = lambda self, q: False
    if backend:
        os.environ["TQSERVE_ATTN_BACKEND"] = backend
    try:
        llm = LLM(str(path), load_format="dummy", device=device, block_size=16, max_num_seqs=batch,
                  max_model_len=context + tokens + 8, max_num_batched_tokens=max(2048, context),
                  kv_cache_dtype=kv, enforce_eager=not batched)
        core = llm.core
        g = torch.Generator().manual_seed(0)
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for i in range(batch):
            core.add_request(EngineRequest(f"r{i}", torch.randint(3, CONFIG["vocab_size"], (context,),
                                                                  generator=g).tolist(), sp))
        out = {f"r{i}": [] for i in range(batch)}
        decode_s, steps = 0.0, 0
        while core.has_work():
            reqs = core.scheduler.requests.values()
            decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for o in core.step():
                out[o.request_id] += o.new_token_ids
            if decoding:
                decode_s += time.perf_counter() - t0
                steps += 1
        n = sum(len(v) for v in out.values()) - batch      # the first token of each came with its prefill
        return n / decode_s, steps, out
    finally:
        DSV4PagedCache.batches_spans = orig
        if env is None:
            os.environ.pop("TQSERVE_ATTN_BACKEND", None)
        else:
            os.environ["TQSERVE_ATTN_BACKEND"] = env


def agreement(toks: dict, ref: dict) -> float:
    """Share of ref's tokens that toks repeats before each sequence's first difference."""
    same = 0
    for k, r in ref.items():
        for a, b in zip(toks[k], r):
            if a != b:
                break
            same += 1
    return same / max(1, sum(len(r) for r in ref.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv", default="auto,tq4")
    ap.add_argument("--backends", help="entries' backends of the batched runs (default: dsv4-torch on CPU, "
                                       "dsv4-triton,dsv4-torch on CUDA)")
    ap.add_argument("--out", type=Path, help="write OUT.{json,md} instead of tests/bench/results/ (checks)")
    a = ap.parse_args()
    rows, res = [], {"machine": machine(), "config": CONFIG, "context": a.context, "tokens": a.tokens,
                     "device": a.device, "runs": []}
    if a.device == "cuda":
        import torch
        res["gpu"] = torch.cuda.get_device_name()
    backends = (a.backends or ("dsv4-triton,dsv4-torch" if a.device == "cuda" else "dsv4-torch")).split(",")
    ways = [("per_seq", False, None)] + [(f"batched {b}", True, b) for b in backends]
    exact = a.device == "cpu"              # fp32: every way's greedy tokens identical
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        for kv in a.kv.split(","):
            for b in map(int, a.batch.split(",")):
                r, ref = {"kv": kv, "batch": b}, None
                for name, batched, backend in ways:
                    log(f"kv {kv}, batch {b}, {name} ...")
                    tps, steps, toks = decode_run(Path(d), b, a.context, a.tokens, a.device, kv, batched, backend)
                    r[name] = {"tok_s": round(tps, 1), "steps": steps}
                    if ref is None:
                        ref = toks
                    elif exact and toks != ref:
                        raise SystemExit(f"kv {kv} batch {b}: {name} tokens differ from per-sequence ones")
                    else:
                        r[name]["same_tokens"] = round(agreement(toks, ref), 3)
                    if batched:
                        r[name]["speedup"] = round(tps / r["per_seq"]["tok_s"], 2)
                res["runs"].append(r)
                cells = [f"{r[n]['tok_s']} ({r[n]['speedup']}x)" for n, batched, _ in ways if batched]
                same = "" if exact else " | " + " / ".join(str(r[n]["same_tokens"]) for n, bt, _ in ways if bt)
                rows.append(f"| {kv} | {b} | {r['per_seq']['tok_s']} | " + " | ".join(cells) + same + " |")
                log(rows[-1])
    m = res["machine"]
    where = res.get("gpu") or m["cpu_line"]
    lines = [f"# DeepSeek-V4 decode, batched (DSV4Rows) vs per sequence ({a.device})", "",
             f"Small V4 (8 layers, hidden 512, window 128, CSA 4 / HCA 128, dummy weights), "
             f"{a.context}-token prompts, {a.tokens} tokens each; decode-only steps timed; "
             + ("greedy tokens identical every way." if exact else
                "same tokens: share of per-sequence's greedy tokens repeated before a first difference (bf16)."),
             "", f"Machine: {where}; torch {m['torch']}, {m['torch_threads']} threads; commit {m['commit']}; "
             f"load {m['loadavg'][0]:.2f}.", "",
             "| KV | batch | per-sequence tok/s | " + " | ".join(f"batched, {b}: tok/s (vs per-sequence)"
                                                         for b in backends)
             + ("" if exact else " | same tokens") + " |",
             "|---" * (3 + len(backends) + (0 if exact else 1)) + "|", *rows, "",
             "Command: `.venv/bin/python tests/bench/dsv4_decode.py" + "".join(
                 f" --{k} {v}" for k, v in (("device", a.device), ("backends", a.backends))
                 if v and v != "cpu") + "`"]
    write_results("dsv4_decode" + ("" if a.device == "cpu" else f"_{a.device}"), res, lines, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
