"""Prefix caching for models with per-sequence state (state snapshots,
kvcache/kv_manager.py): what an agent's turns cost with it and without.

Two scaled-down models with dummy weights (fp32, CPU): a Qwen3-Next hybrid
(6 Gated DeltaNet layers, 2 full attention) and gpu_engine's V4 shape of
dsv4_decode.py (sliding / CSA ratio 4 / HCA ratio 128). The workload is an
agent's: a long system prompt (tools, instructions), then requests that each
add a user message to it, one after another, then a follow-up turn (one
request's prompt, its answer and a new message). Each runs with prefix
caching (state snapshots every --mamba-block-size tokens, the default grid
when not given) and without, in one process: time to first token per
request, the prompt tokens served from the cache, decode tok/s (what the
snapshot copies cost a decode step), and whether the tokens agree.

    .venv/bin/python tests/bench/state_prefix_cache.py [--models qwen3-next,deepseek-v4] [--system 2048]
        [--users 4] [--tokens 16] [--mtp K]

Writes tests/bench/results/state_prefix_cache.{json,md}; with --mtp K (each
model with an MTP head drafting K tokens, both runs; its snapshots wait for
the head) state_prefix_cache_mtp.{json,md}. Dummy weights: the head's drafts
are almost never accepted, so decode tok/s there is the cost of drafting,
not its gain.
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_paths import log, machine, write_results  # puts the repo on sys.path
from dsv4_decode import CONFIG as DSV4_CONFIG

QWEN3_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=8192, hidden_size=512,
    intermediate_size=1024, moe_intermediate_size=256, shared_expert_intermediate_size=512, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MODELS = {"qwen3-next": QWEN3_NEXT, "deepseek-v4": {**DSV4_CONFIG, "max_position_embeddings": 16384}}


def workload(vocab: int, system: int, users: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    import random
    rng = random.Random(seed)
    sys_ids = [rng.randrange(3, vocab) for _ in range(system)]
    return sys_ids, [sys_ids + [rng.randrange(3, vocab) for _ in range(rng.randrange(48, 80))]
                     for _ in range(users)]


def run(path: Path, caching: bool, system: list[int], prompts: list[list[int]], tokens: int, mtp: int) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(str(path), load_format="dummy", dtype="float32", block_size=16, max_num_seqs=4,
              enable_prefix_caching=caching, max_model_len=len(system) + 512,
              speculative_config={"method": "mtp", "num_speculative_tokens": mtp} if mtp else None)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rows, outs = [], []

    def one(p):
        t0 = time.perf_counter()
        o = llm.generate([p], sp)[0]
        m = o.metrics
        ttft = m["first_token_time"] - m["arrival_time"]
        total = time.perf_counter() - t0
        rows.append({"prompt": len(p), "cached": o.num_cached_tokens, "ttft_s": ttft,
                     "decode_tok_s": (tokens - 1) / max(total - ttft, 1e-9)})
        outs.append(o.outputs[0].token_ids)
        return o
    for p in prompts:
        one(p)
    one(prompts[-1] + list(outs[-1]) + prompts[0][-40:])      # a follow-up turn
    plan, st = llm.core.plan, llm.core.get_stats()
    return {"rows": rows, "tokens": outs, "snapshots": plan.num_snapshots, "interval": plan.snapshot_interval,
            "snapshot_mib": plan.snapshot_bytes / 2**20, "draft_tokens": st.spec_decode_num_draft_tokens_total,
            "accepted_tokens": st.spec_decode_num_accepted_tokens_total}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-next,deepseek-v4")
    ap.add_argument("--system", type=int, default=0, help="system prompt tokens (default: 4 snapshot grid steps)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--mtp", type=int, default=0, help="an MTP head drafts this many tokens (both runs)")
    a = ap.parse_args()
    res = {"machine": machine(), "users": a.users, "tokens": a.tokens, "mtp": a.mtp, "models": {}}
    lines = [f"# Prefix caching with per-sequence state{' and MTP drafts' if a.mtp else ''} "
             f"({res['machine']['cpu_line']}, commit {res['machine']['commit']})", "",
             f"Agent turns: a system prompt, {a.users} requests adding 48-79 tokens each, one after another, "
             f"then a follow-up turn (the last request's prompt + its {a.tokens} output tokens + 40); fp32, "
             f"dummy weights, block size 16."
             + (f" An MTP head drafts {a.mtp} tokens per step in both runs (random: drafts almost never "
                f"accepted, so decode tok/s is drafting's cost here, not its gain)." if a.mtp else ""), "",
             "| model | system prompt | snapshots (grid, MiB) | request | cached / prompt tokens | TTFT off s | "
             "TTFT on s | TTFT off / on | decode tok/s off / on | tokens agree |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        for name in a.models.split(","):
            cfg = MODELS[name]
            if a.mtp:
                cfg = {**cfg, "num_nextn_predict_layers" if name == "deepseek-v4" else "mtp_num_hidden_layers": 1}
            path = Path(d) / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(cfg))
            grid = 512 if name == "qwen3-next" else 2048        # the default grids at block size 16
            system, prompts = workload(cfg["vocab_size"], a.system or 4 * grid + 100, a.users)
            log(f"{name}: system prompt {len(system)} tokens, {a.users} requests + a follow-up, caching off")
            off = run(path, False, system, prompts, a.tokens, a.mtp)
            log(f"{name}: caching on")
            on = run(path, True, system, prompts, a.tokens, a.mtp)
            res["models"][name] = {"off": off, "on": on, "system": len(system)}
            for i, (x, y) in enumerate(zip(off["rows"], on["rows"])):
                label = "follow-up" if i == a.users else str(i + 1)
                lines.append(f"| {name} | {len(system)} | {on['snapshots']} ({on['interval']}, "
                             f"{on['snapshot_mib']:.1f}) | {label} | {y['cached']} / {y['prompt']} | "
                             f"{x['ttft_s']:.3f} | {y['ttft_s']:.3f} | {x['ttft_s'] / y['ttft_s']:.1f}x | "
                             f"{x['decode_tok_s']:.1f} / {y['decode_tok_s']:.1f} | "
                             f"{'yes' if off['tokens'][i] == on['tokens'][i] else 'no'} |")
    if a.mtp:
        lines += ["", "Drafted / accepted tokens (off, on): " + "; ".join(
            f"{n} {m['off']['draft_tokens']} / {m['off']['accepted_tokens']}, {m['on']['draft_tokens']} / "
            f"{m['on']['accepted_tokens']}" for n, m in res["models"].items())]
    write_results("state_prefix_cache_mtp" if a.mtp else "state_prefix_cache", res, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
