"""Serving benchmark, as the repo's results were made: `tqserve bench serve`
(server/bench.py) with this folder's defaults: prompts are fresh excerpts of
tests/data/tinyshakespeare.txt (bench_paths.DATA), 80-400 SmolLM2 tokens,
128 output tokens with ignore_eos, concurrency 1 4 16 64, 32 requests per
level, results in tests/bench/results/serving_<time>.{json,md}.

    .venv/bin/python tests/bench/serving_bench.py --launch-tqserve \
        [--target llama-server=http://127.0.0.1:8080/v1] \
        [--concurrency 1 4 16 64] [--num-requests 32] [--output-len 128] \
        [--prompt-len 80 400] [--out STEM]

Every flag of `tqserve bench serve --help` works here too (the old names
--concurrency, --num-requests, --output-len, --tokenizer-model and --timeout
are aliases of --max-concurrency, --num-prompts, --random-output-len,
--tokenizer and --request-timeout).
"""
import argparse
import sys

from bench_paths import DATA, OUT  # puts the repo on sys.path

from server import bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="serving_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_serve_arguments(ap)
    ap.set_defaults(dataset_path=str(DATA), result_dir=str(OUT), save_result=True, ignore_eos=True,
                    tokenizer="smollm2-135m")
    args = ap.parse_args(argv)
    if args.dataset_name == "random":
        args.dataset_path = None
    return bench.run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
