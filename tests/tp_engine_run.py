"""The offline engine over two tensor-parallel ranks (this process rank 0, its
follower spawned), run as its own process: a torch.distributed group must not
outlive its test inside the pytest process (tests/test_async_scheduling.py).

    python tests/tp_engine_run.py MODEL_DIR PORT [--async-scheduling] [--stop ID] [--shared-prefix]
                                  [--no-prefix-caching] [--mtp K] [--block-size N] [--grid N]

Generates for a fixed set of prompts and sampling parameters (greedy, seeded,
penalties; the first prompt again, greedy with min_tokens and stop token ID)
and prints one JSON line: per request its token ids and finish reason, and
per launched step how many of its ids came from the step in flight and
whether its sampling waited for that step. --shared-prefix: the prompts
share a 41-token prefix and run as [0], [1], [2, 3, 4], so that the last
three hit it (state snapshots every 8 tokens: a hybrid model's prefix cache).
--mtp K: the model's MTP head drafts K tokens; the JSON then has "drafts":
(token ids, drafts) of every draft list the leader proposed."""
import argparse
import json

from engine import LLM, SamplingParams
from test_async_scheduling import count_ahead
from tiny_models import token_prompts


def params(stop: int | None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=11, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.4),
            SamplingParams(temperature=0, max_tokens=14, min_tokens=2, ignore_eos=True,
                           stop_token_ids=[stop] if stop is not None else None),
            SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True, presence_penalty=0.5)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("port", type=int)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--stop", type=int)
    ap.add_argument("--shared-prefix", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--mtp", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--grid", type=int, default=8)
    return ap.parse_args(argv)


def run(a: argparse.Namespace, ranks: int = 2) -> dict:
    """The JSON result; ranks=1 runs the same requests on one rank, in this
    process (the reference the two-rank runs are compared with)."""
    llm = LLM(a.model, tensor_parallel_size=ranks, master_port=a.port, block_size=a.block_size,
              kv_cache_memory=4 << 20, max_model_len=128, max_num_seqs=3, async_scheduling=a.async_scheduling,
              mamba_block_size=a.grid,
              enable_prefix_caching=not a.no_prefix_caching,
              speculative_config={"method": "mtp", "num_speculative_tokens": a.mtp} if a.mtp else None)
    steps = count_ahead(llm)
    drafts = []
    if a.mtp:
        propose = llm.core.proposer.propose

        def recording(reqs, room):
            out = propose(reqs, room)
            drafts.extend((list(r.token_ids), d) for r, d in zip(reqs, out) if d)
            return out
        llm.core.proposer.propose = recording
    vocab = llm.core.info.vocab_size
    prompts = [[t % vocab for t in p] for p in token_prompts(5, 5, 30, seed=11)]
    prompts[3] = prompts[0]
    sp = params(a.stop)
    if a.shared_prefix:
        system = [t % vocab for t in token_prompts(1, 41, 42, seed=12)[0]]
        prompts = [system + p for p in prompts]
        outs = [o for batch in ([0], [1], [2, 3, 4]) for o in llm.generate([prompts[i] for i in batch],
                                                                          [sp[i] for i in batch])]
    else:
        outs = llm.generate(prompts, sp)
    res = {"outputs": [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], "steps": steps,
           "async": llm.core.async_scheduling, "used_blocks": llm.core.kv.num_used_blocks,
           "hits": [o.num_cached_tokens for o in outs], "drafts": drafts}
    llm.close()
    return json.loads(json.dumps(res))


def main() -> None:
    print(json.dumps(run(parse())))


if __name__ == "__main__":
    main()
