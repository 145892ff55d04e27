"""Serving benchmark: drive OpenAI-compatible endpoints at fixed concurrencies
and report request/s, output tok/s, TTFT, TPOT and ITL (p50/p99) and errors.

    .venv/bin/python tests/bench/serving_bench.py --launch-tqserve \
        [--target llama-server=http://127.0.0.1:8080/v1] \
        [--concurrency 1 4 16 64] [--num-requests 32] [--output-len 128] \
        [--prompt-len 80 400]

Every request streams `/v1/completions` (a text prompt, `ignore_eos`, fixed
output length, `stream_options.include_usage`), so any OpenAI-compatible
server can be measured, tqserve and llama.cpp's `llama-server` alike, in one
run. Prompts are fresh excerpts of ../shared/data/tinyshakespeare.txt drawn
with a new random seed per run (recorded in the results), so no two runs (and
no two concurrency levels) share prompts and no prompt cache is flattered.
Prompt lengths are in SmolLM2 tokens (the model zoo's tokenizer; the servers'
own counts from `usage` are reported too).

TTFT: request sent -> first streamed token. TPOT: (e2e - TTFT) / (output
tokens - 1) per request. ITL: gaps between streamed chunks, each divided by
the tokens it carried. Results go to tests/bench/results/serving_<time>.{json,md}.
"""
import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench_paths import ROOT, DATA, OUT, log  # puts the repo on sys.path



# --------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------
class PromptSource:
    """Fresh excerpts of the text, `lo`..`hi` tokens long, never the same start twice."""

    def __init__(self, lo: int, hi: int, seed: int, tokenizer_model: str | None):
        self.text = DATA.read_text()
        self.lo, self.hi = lo, hi
        self.rng = random.Random(seed)
        self.used: set[int] = set()
        self.tok = None
        if tokenizer_model:
            try:
                from model_zoo.resolve import open_model
                self.tok = open_model(tokenizer_model).tokenizer
            except Exception as e:     # any endpoint can be measured without it
                log(f"no tokenizer ({e}); prompt lengths are estimated at 4 characters per token")

    def take(self) -> str:
        n = self.rng.randint(self.lo, self.hi)
        while True:
            start = self.rng.randrange(0, len(self.text) - 8 * n)
            start = self.text.find("\n", start) + 1          # begin at a line start
            if start not in self.used:
                self.used.add(start)
                break
        chunk = self.text[start:start + 8 * n]
        if self.tok is None:
            return chunk[:4 * n]
        ids = self.tok.encode(chunk, add_special_tokens=False)[:n]
        return self.tok.decode(ids)


# --------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, out_len: int,
                      headers: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = {"ok": False, "ttft": None, "e2e": None, "itl": [], "output_tokens": 0, "prompt_tokens": None,
         "error": None}
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url + "/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r["error"] = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    r["error"] = f"stream error: {json.dumps(ev['error'])[:300]}"
                    return r
                if ev.get("usage"):
                    r["output_tokens"] = ev["usage"].get("completion_tokens", r["output_tokens"])
                    r["prompt_tokens"] = ev["usage"].get("prompt_tokens")
                text = "".join(c.get("text") or "" for c in ev.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                chunks += 1
                if r["ttft"] is None:
                    r["ttft"] = now - t0
                else:
                    r["itl"].append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
        return r
    r["e2e"] = time.perf_counter() - t0
    if not r["output_tokens"]:
        r["output_tokens"] = chunks            # a server without usage in streams: one token per chunk
    if r["ttft"] is None:
        r["error"] = "no tokens streamed"
        return r
    # Chunks may carry several tokens: spread each gap over them.
    if chunks > 1 and r["output_tokens"] > chunks:
        per = (r["output_tokens"] - 1) / (chunks - 1)
        r["itl"] = [g / per for g in r["itl"] for _ in range(round(per))]
    r["ok"] = True
    return r


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    i, f = int(k), k - int(k)
    return xs[i] if i + 1 >= len(xs) else xs[i] * (1 - f) + xs[i + 1] * f


async def run_level(url, model, prompts, out_len, concurrency, headers, timeout) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:
        async def worker():
            while True:
                try:
                    p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, url, model, p, out_len, headers))
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    itl = [g for r in ok for g in r["itl"]]
    errors = [r["error"] for r in results if not r["ok"]]
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    return {
        "concurrency": concurrency, "requests": len(results), "completed": len(ok), "errors": len(errors),
        "error_samples": sorted(set(errors))[:5], "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 3), "output_tok_per_s": round(out_tokens / wall, 2),
        "output_tokens": out_tokens,
        "prompt_tokens_mean": round(sum(r["prompt_tokens"] or 0 for r in ok) / max(1, len(ok)), 1),
        "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
        "tpot_ms_p50": ms(pct(tpot, 50)), "tpot_ms_p99": ms(pct(tpot, 99)),
        "itl_ms_p50": ms(pct(itl, 50)), "itl_ms_p99": ms(pct(itl, 99)),
    }


# --------------------------------------------------------------------------
# Launching tqserve (optional)
# --------------------------------------------------------------------------
def launch_tqserve(extra: list[str], log_path: Path):
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *extra]
    log(f"starting: {' '.join(cmd)} (log: {log_path})")
    f = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    url = None
    while time.time() < deadline and proc.poll() is None:
        m = re.search(r"listening on (http://[\d.:]+)", log_path.read_text(errors="replace"))
        if m:
            url = m.group(1)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url + "/v1"
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"tqserve did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


def stop(proc):
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


# --------------------------------------------------------------------------
def to_markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [f"# Serving benchmark ({res['started']})", "",
             f"{cfg['num_requests']} requests per level, prompts {cfg['prompt_len'][0]}-{cfg['prompt_len'][1]} "
             f"tokens (fresh tinyshakespeare excerpts, seed {cfg['seed']}), {cfg['output_len']} output tokens "
             f"(ignore_eos, greedy), streamed /v1/completions.", "",
             "| target | conc | ok/err | req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in res["targets"]:
        for lv in t["levels"]:
            lines.append(f"| {t['name']} | {lv['concurrency']} | {lv['completed']}/{lv['errors']} | "
                         f"{lv['req_per_s']} | {lv['output_tok_per_s']} | {lv['ttft_ms_p50']}/{lv['ttft_ms_p99']} | "
                         f"{lv['tpot_ms_p50']}/{lv['tpot_ms_p99']} | {lv['itl_ms_p50']}/{lv['itl_ms_p99']} |")
    errs = [(t["name"], lv["concurrency"], e) for t in res["targets"] for lv in t["levels"] for e in lv["error_samples"]]
    if errs:
        lines += ["", "Errors (samples):", ""] + [f"- {n} @ {c}: `{e}`" for n, c, e in errs]
    lines += ["", f"Machine: {res['machine']}", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", default=[],
                    help="NAME=BASE_URL (…/v1), optionally NAME=BASE_URL@MODEL; repeatable")
    ap.add_argument("--launch-tqserve", action="store_true", help="start tqserve here and measure it as 'tqserve'")
    ap.add_argument("--tqserve-args", default="--model smollm2-135m --max-num-seqs 64 --max-queue 0",
                    help="arguments for the launched tqserve")
    ap.add_argument("--model", default="smollm2-135m", help="`model` sent when a target names none")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[80, 400], metavar=("MIN", "MAX"))
    ap.add_argument("--tokenizer-model", default="smollm2-135m", help="model zoo name for prompt lengths")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: new each run)")
    ap.add_argument("--timeout", type=float, default=1800, help="per-request timeout, seconds")
    ap.add_argument("--out", default=None, help="results path stem (default tests/bench/results/serving_<time>)")
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    prompts = PromptSource(args.prompt_len[0], args.prompt_len[1], seed, args.tokenizer_model)
    targets = []
    for t in args.target:
        name, _, rest = t.partition("=")
        url, _, model = rest.partition("@")
        targets.append((name, url.rstrip("/"), model or args.model))
    proc = None
    OUT.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = Path(args.out) if args.out else OUT / f"serving_{stamp}"
    if args.launch_tqserve:
        proc, url = launch_tqserve(args.tqserve_args.split(), stem.parent / (stem.name + "_tqserve.log"))
        targets.insert(0, ("tqserve", url, args.model))
    if not targets:
        ap.error("give --target NAME=URL and/or --launch-tqserve")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    res = {"started": stamp, "config": {"num_requests": args.num_requests, "output_len": args.output_len,
                                        "prompt_len": args.prompt_len, "seed": seed,
                                        "concurrency": args.concurrency},
           "machine": f"{os.cpu_count()} CPUs, {sys.platform}", "targets": []}
    try:
        for name, url, model in targets:
            entry = {"name": name, "url": url, "model": model, "levels": []}
            res["targets"].append(entry)
            # warm-up (not measured; its prompt is fresh too)
            asyncio.run(run_level(url, model, [prompts.take()], 4, 1, headers, args.timeout))
            for c in args.concurrency:
                batch = [prompts.take() for _ in range(args.num_requests)]
                log(f"{name}: concurrency {c}, {len(batch)} requests ...")
                lv = asyncio.run(run_level(url, model, batch, args.output_len, c, headers, args.timeout))
                log(f"{name} @ {c}: {lv['output_tok_per_s']} out tok/s, {lv['req_per_s']} req/s, "
                    f"TTFT p50 {lv['ttft_ms_p50']} ms, TPOT p50 {lv['tpot_ms_p50']} ms, errors {lv['errors']}")
                entry["levels"].append(lv)
    finally:
        stop(proc)
        Path(f"{stem}.json").write_text(json.dumps(res, indent=2))
        Path(f"{stem}.md").write_text(to_markdown(res))
        log(f"wrote {stem}.json and {stem}.md")
    print(to_markdown(res))


if __name__ == "__main__":
    main()
