"""OpenAI's predicted outputs with n-gram speculation on SmolLM2-135M-Instruct:
output tok/s without speculation, with n-gram (prompt lookup) drafts, and
with a prediction as well, on the spec_decode bench's editing tasks, in one
run on one machine.

    .venv/bin/python tests/bench/predicted_outputs.py [--num-prompts 12] [--max-tokens 160] [--k 4]

Workload: spec_decode.py's rewrite (fix the spelling mistakes of a passage or
a scene) and code (fix one injected bug in a function of this repository)
prompts, one request at a time (an editor's single stream), greedy, up to
--max-tokens, stop at EOS. Configurations:

- off: no speculation;
- ngram: n-gram drafts (prompt lookup 2..4, k drafts);
- ngram + input: the request's `prediction` is the text the task hands
  over (the passage with its typos, the buggy code), what an editor sends;
- ngram + answer: the prediction is off's own output (the best case).

Every configuration's tokens must equal off's (mismatches: 0). Prediction
accepted / rejected are the requests' accepted_prediction_tokens and
rejected_prediction_tokens summed. Writes
tests/bench/results/predicted_outputs.{json,md}.
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

from bench_paths import ROOT, log, write_results  # puts the repo on sys.path
from spec_decode import MAX_MODEL_LEN, MODEL, build_prompts, mismatches, run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="float32: speculation cannot change a greedy token "
                                                       "(bf16 rows of other batch shapes round differently)")
    args = ap.parse_args()
    import torch

    from engine import LLM, SamplingParams
    from model_zoo.resolve import open_model
    from server.bench import machine_info, machine_line
    t_start = time.perf_counter()
    machine = {**machine_info(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "loadavg_start": list(os.getloadavg())}
    src = open_model(MODEL)
    tok = src.tokenizer
    # Twice the prompts asked for, of which the editing tasks (rewrite, code) are kept.
    prompts = [p for p in build_prompts(tok, src.chat_template, 3 * args.num_prompts, args.seed, 150, 600)
               if p["task"] in ("rewrite", "code")][:args.num_prompts]
    log(f"{len(prompts)} prompts: {sum(p['task'] == 'code' for p in prompts)} code, "
        f"{sum(p['task'] == 'rewrite' for p in prompts)} rewrite")
    ids = [p["ids"] for p in prompts]

    def params(predictions=None):
        return [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                               prediction_token_ids=None if predictions is None else predictions[i])
                for i in range(len(ids))]

    kw = dict(max_num_seqs=1, max_model_len=MAX_MODEL_LEN, kv_cache_memory=256 << 20, enable_prefix_caching=False,
              dtype=args.dtype)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    rows = []
    off_llm = LLM(MODEL, **kw)
    run(off_llm, ids[:1], params()[:1])         # warm-up
    log("off ...")
    off = run(off_llm, ids, params())
    del off_llm
    llm = LLM(MODEL, **kw, speculative_config=spec)
    run(llm, ids[:1], params()[:1])
    inputs = [tok.encode(p["text"], add_special_tokens=False) for p in prompts]
    configs = [("off", None, off), ("ngram", None, None), ("ngram + input", inputs, None),
               ("ngram + answer", off["token_ids"], None)]
    for name, predictions, r in configs:
        if r is None:
            log(f"{name} ...")
            r = run(llm, ids, params(predictions))
        pred = r["prediction"]      # (accepted, rejected), summed over the requests
        rows.append({"config": name, "output_tokens": r["output_tokens"], "total_s": r["total_s"],
                     "output_tok_s": r["output_tok_s"], "speedup": r["output_tok_s"] / off["output_tok_s"],
                     "steps": r["steps"], "tokens_per_step": r["output_tokens"] / max(r["steps"], 1),
                     "mismatches": len(mismatches(off["token_ids"], r["token_ids"])), "prediction": pred,
                     "spec": r["spec"]})
    machine["loadavg_end"] = list(os.getloadavg())
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                         text=True, timeout=10).stdout.strip() or "?"
    res = {"command": shlex.join([".venv/bin/python", "tests/bench/predicted_outputs.py", *sys.argv[1:]]),
           "git": git, "config": vars(args), "machine": machine, "rows": rows, "wall_s": time.perf_counter() - t_start,
           "prompts": [{"task": p["task"], "source": p["source"], "tokens": len(p["ids"])} for p in prompts]}
    L = ["# Predicted outputs (OpenAI's `prediction`) with n-gram speculation", "",
         f"Command: `{res['command']}`", "",
         f"SmolLM2-135M-Instruct ({args.dtype}), one request at a time, greedy, up to {args.max_tokens} tokens; "
         f"{len(prompts)} editing prompts of spec_decode.py (rewrite a passage / scene fixing its typos, fix a "
         f"bug in a function); ngram: k={args.k}, prompt lookup 2..4. Machine: {machine_line(machine)}, "
         f"{machine['torch_threads']} torch threads, torch {machine['torch']}; load average "
         f"{machine['loadavg_start'][0]:.2f} at start, {machine['loadavg_end'][0]:.2f} at end. Git {git}.", "",
         "| config | output tok/s | speedup vs off | tokens per step | prediction tokens accepted / rejected "
         "| mismatches vs off |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = r["prediction"]
        L.append(f"| {r['config']} | {r['output_tok_s']:.1f} | {r['speedup']:.2f}x | {r['tokens_per_step']:.2f} | "
                 f"{'-' if p is None else f'{p[0]} / {p[1]}'} | {r['mismatches']} |")
    L += ["", f"Total run time {res['wall_s']:.0f} s."]
    write_results("predicted_outputs", res, L)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    main()
