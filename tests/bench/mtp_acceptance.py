"""MTP speculative decoding on a tiny DeepSeek-V4 that has learned something:
the one tests/bench/train_mtp.py trains on tinyshakespeare (run it first).

    .venv/bin/python tests/bench/mtp_acceptance.py [--model DIR] [--k 1,2,3] \
        [--num-prompts 16] [--max-tokens 96] [--concurrency 1]

Prompts are slices of the held-out text (the last 5%, which training never
saw). For each k: greedy outputs with and without MTP drafts (they must be
identical), mean acceptance length (1 + accepted / drafts, vLLM's
definition), acceptance rate per draft position, engine steps and tok/s
both ways. Writes tests/bench/results/mtp_acceptance.{json,md}.
"""
import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from bench_paths import DATA, OUT, log  # puts the repo on sys.path

DEFAULT_MODEL = Path.home() / ".cache" / "tqserve" / "tiny-dsv4-shakespeare"


def prompts(tok, n, length, seed=0):
    import random
    text = DATA.read_text()
    held = tok.encode(text[int(len(text) * 0.95):], add_special_tokens=False)
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(len(held) - length), n))
    return [held[s:s + length] for s in starts]


def run(llm, ps, max_tokens):
    from engine import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    s0 = llm.core.get_stats()
    before = (s0.steps_total, s0.spec_decode_num_drafts_total, s0.spec_decode_num_accepted_tokens_total,
              list(s0.spec_decode_num_accepted_tokens_per_pos))
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp)
    wall = time.perf_counter() - t0
    s = llm.core.get_stats()
    drafts = s.spec_decode_num_drafts_total - before[1]
    acc = s.spec_decode_num_accepted_tokens_total - before[2]
    per = [a - b for a, b in zip(s.spec_decode_num_accepted_tokens_per_pos, before[3] or
                                 [0] * len(s.spec_decode_num_accepted_tokens_per_pos))]
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": [o.outputs[0].token_ids for o in outs], "tok_s": ntok / wall, "steps": s.steps_total - before[0],
            "drafts": drafts, "accepted": acc, "per_position": per,
            "acceptance_length": 1 + acc / drafts if drafts else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--k", default="1,2,3")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=1, help="max_num_seqs (requests in flight)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=OUT / "mtp_acceptance")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        print(f"mtp_acceptance.py: no model at {args.model}; train one with tests/bench/train_mtp.py",
              file=sys.stderr)
        return 2
    import torch

    from engine import LLM
    from server.bench import machine_info
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(block_size=16, max_num_seqs=args.concurrency, kv_cache_memory=64 << 20)
    base = LLM(str(args.model), **kw)
    ps = prompts(base.tokenizer, args.num_prompts, args.prompt_len)
    run(base, ps[:1], 8)                                      # warm-up
    log("no speculation ...")
    ref = run(base, ps, args.max_tokens)
    rows = []
    for k in [int(x) for x in args.k.split(",")]:
        llm = LLM(str(args.model), speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw)
        run(llm, ps[:1], 8)
        log(f"mtp k={k} ...")
        r = run(llm, ps, args.max_tokens)
        r["mismatches"] = sum(a != b for a, b in zip(r.pop("tokens"), ref["tokens"]))
        r["rate_per_position"] = [a / r["drafts"] for a in r["per_position"]] if r["drafts"] else []
        r.update(k=k, speedup=r["tok_s"] / ref["tok_s"], steps_off=ref["steps"])
        rows.append(r)
        log(f"   k={k}: acceptance length {r['acceptance_length']:.2f}, per position "
            f"{[round(x, 2) for x in r['rate_per_position']]}, {r['tok_s']:.1f} tok/s "
            f"({r['speedup']:.2f}x), mismatches {r['mismatches']}")
    ref.pop("tokens")
    info = json.loads((args.model / "training_info.json").read_text()) if (args.model / "training_info.json").exists() \
        else {}
    res = {"command": "python tests/bench/mtp_acceptance.py " + shlex.join(sys.argv[1:]),
           "machine": {**machine_info(), "torch": torch.__version__, "threads": torch.get_num_threads()},
           "model": str(args.model),
           "training": {"minutes": round(info["meta"]["minutes"], 1), "steps": info["meta"]["steps"],
                        "held_out": info["eval"]} if info else {},
           "args": {k: str(v) for k, v in vars(args).items()}, "no_speculation": ref, "mtp": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    m = res["machine"]
    lines = [f"# MTP speculative decoding, tiny DeepSeek-V4 trained on tinyshakespeare ({m.get('cpu_model')}, "
             f"{m['threads']} threads, torch {m['torch']})", "", f"`{res['command']}`", "",
             f"{args.num_prompts} held-out prompts of {args.prompt_len} tokens, {args.max_tokens} greedy tokens each, "
             f"{args.concurrency} in flight. Without speculation: {ref['tok_s']:.1f} tok/s, {ref['steps']} steps.", "",
             "| k | acceptance length | accepted per position | steps | tok/s | speedup | greedy mismatches |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['acceptance_length']:.2f} | "
                     f"{', '.join(f'{x:.0%}' for x in r['rate_per_position'])} | {r['steps']} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['mismatches']}/{args.num_prompts} |")
    if res["training"]:
        lines += ["", f"Model: {json.dumps(res['training'])}"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    log(f"wrote {args.out}.json / .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
