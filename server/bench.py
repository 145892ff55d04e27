"""`tqserve bench serve`: a serving benchmark for any OpenAI-compatible server
(the flags follow vLLM's `vllm bench serve` where they exist).

    tqserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 \\
        --max-concurrency 1 4 16 --random-input-len 256 --random-output-len 128 --ignore-eos
    tqserve bench serve --launch-tqserve --target llama-server=http://127.0.0.1:8080/v1 \\
        --dataset-path tests/data/tinyshakespeare.txt --prompt-len 80 400 --save-result

Each concurrency level sends --num-prompts streamed requests (`/v1/completions`
by default, or `/v1/chat/completions`) with at most that many in flight, and
reports request/s, output tok/s, TTFT, TPOT and ITL (p50/p99) and errors.
Several servers (--target, --launch-tqserve) are measured one after another
with the same settings. Prompts are made here, nothing is downloaded:
  random  random token ids of the tokenizer (--tokenizer, default the model;
          any model zoo name, .gguf or HF directory), decoded to text; without
          a tokenizer, random common English words (about one token each)
  text    fresh excerpts of a text file (--dataset-path), each starting at a
          line not used before in the run
A new prompt seed is drawn each run unless --seed is given (it is recorded),
so no two runs, levels or targets share prompts and no prefix cache is
flattered. Prompt lengths are in the tokenizer's tokens; the servers' own
counts (`usage`) are reported as prompt_tokens_mean.

TTFT: request sent -> first streamed token. TPOT: (e2e - TTFT) / (output
tokens - 1) per request. ITL: gaps between streamed chunks, each spread over
the tokens it carried. Every level is bounded: --request-timeout per request,
--level-timeout per level (requests not done by then count as errors).
Results (--save-result, --result-dir, --result-filename or --out): a .json and
a .md table, with the machine the benchmark ran on (CPU model and flags, GPUs).
"""
import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROG = "tqserve bench serve"
DEFAULT_PROMPT_LEN = (80, 400)


class BenchError(Exception):
    """A one-line error for the user; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _one_line(x) -> str:
    return " ".join(str(x).split())


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="benchmarks (`tqserve bench serve`: load an OpenAI-compatible server)",
                       description="Benchmarks.")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    s = bsub.add_parser("serve", help="serving benchmark: req/s, output tok/s, TTFT, TPOT, ITL at fixed concurrency",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(s)
    return b


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted) "
                        "[default: http://HOST:PORT unless --target or --launch-tqserve]")
    g.add_argument("--host", default="127.0.0.1", help="with --port, when there is no --base-url")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions or /v1/chat/completions (the prompt as one user message)")
    g.add_argument("--model", default=None,
                   help="`model` sent in requests [default: the first one the server's /v1/models lists]")
    g.add_argument("--label", default=None, help="name of the --base-url target in the results")
    g.add_argument("--target", action="append", default=[], metavar="NAME=URL[@MODEL]",
                   help="another server to measure (URL with or without /v1); repeatable")
    g.add_argument("--launch-tqserve", action="store_true",
                   help="start `tqserve serve` here on a free port and measure it first, as 'tqserve'")
    g.add_argument("--tqserve-args", default="--model smollm2-135m --max-num-seqs 64 --max-queue 0",
                   help="arguments for the launched tqserve (default: %(default)s)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token [default: $OPENAI_API_KEY]")

    g = s.add_argument_group("load")
    g.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int, default=32,
                   help="requests per concurrency level (default: %(default)s)")
    g.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int, nargs="+",
                   default=[1, 4, 16, 64], metavar="N",
                   help="requests in flight; several values run one level each (default: 1 4 16 64)")
    g.add_argument("--num-warmups", type=int, default=1,
                   help="unmeasured requests (4 tokens) per target first; a failed one stops the run "
                        "(default: %(default)s)")
    g.add_argument("--request-timeout", "--timeout", dest="request_timeout", type=float, default=1800,
                   help="seconds one request may take (default: %(default)s)")
    g.add_argument("--level-timeout", type=float, default=3600,
                   help="seconds one concurrency level may take; requests not done by then count as "
                        "errors (default: %(default)s)")
    g.add_argument("--progress-interval", type=float, default=10,
                   help="seconds between progress lines on stderr (default: %(default)s)")

    g = s.add_argument_group("prompts and sampling")
    g.add_argument("--dataset-name", choices=["random", "text"], default=None,
                   help="random token ids, or excerpts of --dataset-path "
                        "[default: text with --dataset-path, else random]")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="a text file to cut prompts from (e.g. tests/data/tinyshakespeare.txt in the repo)")
    g.add_argument("--random-input-len", type=int, default=None,
                   help="prompt tokens (default: 80-400, as --prompt-len 80 400)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="prompt lengths uniform in [len*(1-r), len*(1+r)] (default: %(default)s)")
    g.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompt tokens uniform in MIN..MAX (instead of --random-input-len)")
    g.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128, metavar="N",
                   help="max_tokens of every request (default: %(default)s)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="ask the server to ignore EOS, so that every request makes exactly the output length")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s, greedy)")
    g.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", default=None,
                   help="model zoo name, .gguf or HF directory whose tokenizer measures prompts; 'none' for "
                        "none [default: --model, else the first target's model]")
    g.add_argument("--seed", type=int, default=None, help="prompt seed (default: a new one each run)")

    g = s.add_argument_group("results")
    g.add_argument("--save-result", action="store_true", help="write <result-dir>/<result-filename>.{json,md}")
    g.add_argument("--result-dir", default=None, help="folder for the results (default: .; implies --save-result)")
    g.add_argument("--result-filename", default=None,
                   help="results file name, .json and .md added (default: serving_<time>; implies --save-result)")
    g.add_argument("--out", default=None, metavar="STEM", help="results path stem (implies --save-result)")


def run(args) -> int:
    if getattr(args, "bench_command", "serve") == "serve":
        return run_serve(args)
    return 2


# --------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------
WORDS = (
    "the of and to in is was for on that with as it by at from his an be are this which or her had not "
    "but one have they were all we their been has there who so more can when would what up out about into "
    "time only some could them two than other new may first then do any these its like over such our man "
    "me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us "
    "great old year off come since against go came right used take three house water light small place "
    "hand number part word name city line sun sea land river tree king book door night room face "
    "voice heart fire friend child mother father head eye road ship story game mind music paper money"
).split()


def load_tokenizer(name: str | None):
    """The tokenizer of a model zoo name, .gguf or HF directory (nothing is downloaded), or None."""
    if not name or name.lower() == "none":
        return None
    try:
        from model_zoo.resolve import open_model
        tok = open_model(name).tokenizer
        if tok is None:
            raise ValueError("the model has no tokenizer")
        return tok
    except Exception as e:   # any endpoint can be measured without it
        log(f"no tokenizer from {name!r} ({_one_line(e)[:200]}); prompt lengths are estimated")
        return None


class PromptSource:
    """Prompts `lo`..`hi` tokens long: random token ids / words, or fresh excerpts of a text."""

    def __init__(self, dataset: str, lo: int, hi: int, seed: int, tokenizer=None, text: str | None = None):
        self.dataset, self.lo, self.hi = dataset, lo, hi
        self.rng = random.Random(seed)
        self.tok = tokenizer
        self.text = text
        self.used: set[int] = set()
        self.ids = None
        if tokenizer is not None and dataset == "random":
            special = set(getattr(tokenizer, "all_special_ids", ()) or ())
            self.ids = [i for i in range(len(tokenizer)) if i not in special]

    def take(self) -> str:
        n = self.rng.randint(self.lo, self.hi)
        if self.dataset == "random":
            if self.tok is None:
                return " ".join(self.rng.choice(WORDS) for _ in range(n))
            text = self.tok.decode([self.rng.choice(self.ids) for _ in range(n)])
            return self.tok.decode(self.tok.encode(text, add_special_tokens=False)[:n])
        text = self.text
        span = max(1, len(text) - 8 * n)
        start = 0
        for _ in range(100):                      # never the same start twice, if the text allows
            start = self.rng.randrange(0, span)
            start = text.find("\n", start) + 1    # begin at a line start
            if start not in self.used:
                break
        self.used.add(start)
        chunk = text[start:start + 8 * n]
        if self.tok is None:
            return chunk[:4 * n]
        return self.tok.decode(self.tok.encode(chunk, add_special_tokens=False)[:n])


# --------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------
def _result(error=None) -> dict:
    return {"ok": False, "ttft": None, "e2e": None, "itl": [], "output_tokens": 0, "prompt_tokens": None,
            "error": error}


async def one_request(client, url: str, model: str, prompt: str, out_len: int, headers: dict,
                      chat: bool, ignore_eos: bool, temperature: float) -> dict:
    import httpx

    body = {"model": model, "max_tokens": out_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    r = _result()
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r["error"] = f"HTTP {resp.status_code}: {_one_line(text)[:300]}"
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
                if chat:
                    text = "".join((c.get("delta") or {}).get("content") or "" for c in ev.get("choices") or [])
                else:
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
        r["error"] = f"{type(e).__name__}: {_one_line(e)[:300]}"
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


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


async def run_level(target: dict, prompts: list[str], cfg: dict, concurrency: int, label: str | None) -> dict:
    """Sends every prompt, `concurrency` at a time, within the per-request and per-level time limits."""
    import httpx

    results: list[dict] = []
    next_i = 0
    deadline = time.monotonic() + cfg["level_timeout"]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(cfg["request_timeout"], connect=min(30.0, cfg["request_timeout"]))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker():
            nonlocal next_i
            while next_i < len(prompts):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                p = prompts[next_i]
                next_i += 1
                limit = min(cfg["request_timeout"], left)
                try:
                    r = await asyncio.wait_for(
                        one_request(client, target["endpoint_url"], target["model"], p, cfg["output_len"],
                                    cfg["headers"], cfg["chat"], cfg["ignore_eos"], cfg["temperature"]), limit)
                except TimeoutError:
                    r = _result(f"timeout: no complete response in {limit:.0f}s")
                results.append(r)

        async def progress(t0):
            while True:
                await asyncio.sleep(cfg["progress_interval"])
                bad = sum(not r["ok"] for r in results)
                log(f"{label}: {len(results)}/{len(prompts)} done, {bad} errors, {time.perf_counter() - t0:.0f} s")

        t0 = time.perf_counter()
        ticker = asyncio.create_task(progress(t0)) if label and cfg["progress_interval"] > 0 else None
        try:
            await asyncio.gather(*[worker() for _ in range(min(concurrency, len(prompts)))])
        finally:
            if ticker:
                ticker.cancel()
        wall = max(time.perf_counter() - t0, 1e-9)
    for _ in range(len(prompts) - len(results)):
        results.append(_result(f"not sent: the level's time limit ({cfg['level_timeout']:g}s) was reached"))
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
        "ttft_ms_mean": ms(_mean(ttft)), "tpot_ms_mean": ms(_mean(tpot)), "itl_ms_mean": ms(_mean(itl)),
    }


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------
def _root_url(url: str, what: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"https?://[^/\s]+", url):
        raise BenchError(f"{what} must look like http://HOST:PORT, got {url!r}", 2)
    return url[:-3] if url.endswith("/v1") else url


def _make_target(name: str, root: str, model: str | None, endpoint: str) -> dict:
    ep = "/" + endpoint.strip("/")
    api = ep[:-len("/chat/completions")] if ep.endswith("/chat/completions") else ep.rsplit("/", 1)[0]
    return {"name": name, "url": root + api, "endpoint_url": root + ep, "models_url": root + api + "/models",
            "model": model}


def probe(target: dict, headers: dict) -> None:
    """Reach the server's /v1/models (a one-line error if not); learn the model if none was given."""
    import httpx

    try:
        resp = httpx.get(target["models_url"], headers=headers, timeout=httpx.Timeout(15, connect=5))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {target['name']} at {target['models_url']}: "
                         f"{type(e).__name__}: {_one_line(e) or 'no answer'}")
    if resp.status_code == 401:
        raise BenchError(f"{target['models_url']} answered 401: give --api-key (or $OPENAI_API_KEY)")
    if target["model"]:
        return
    if resp.status_code != 200:
        raise BenchError(f"{target['models_url']} answered HTTP {resp.status_code} "
                         f"({_one_line(resp.text)[:200]}); give --model")
    try:
        target["model"] = resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"{target['models_url']} lists no model; give --model")


def launch_tqserve(extra: list[str], log_path: Path, timeout: float = 600):
    import httpx

    import server
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", "0", *extra]
    log(f"starting: {shlex.join(cmd)} (log: {log_path})")
    f = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=Path(server.__file__).resolve().parents[1], stdout=f,
                            stderr=subprocess.STDOUT)
    f.close()
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            m = re.search(r"listening on (http://[\d.:]+)", log_path.read_text(errors="replace"))
            if m:
                try:
                    if httpx.get(m.group(1) + "/health", timeout=2).status_code == 200:
                        return proc, m.group(1)
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
    except BaseException:          # Ctrl-C while it loads: do not leave it running
        stop(proc)
        raise
    why = f"exited with {proc.returncode}" if proc.poll() is not None else f"was not ready in {timeout:.0f}s"
    stop(proc)
    raise BenchError(f"the launched tqserve {why}; see {log_path}")


def stop(proc):
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


def machine_info() -> dict:
    """The machine the benchmark runs on (the servers' own when they are local)."""
    info = {"cpus": os.cpu_count(), "platform": sys.platform, "cpu_model": platform.processor() or None,
            "cpu_flags": [], "gpus": []}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        m = re.search(r"^(?:model name|Model|Hardware)\s*:\s*(.+)$", cpuinfo, re.M)
        if m:
            info["cpu_model"] = m.group(1).strip()
        m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.M)
        if m:
            have = set(m.group(1).split())
            info["cpu_flags"] = [f for f in CPU_FLAGS if f in have]
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            info["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def machine_line(info: dict) -> str:
    s = f"{info['cpus']} CPUs, {info['platform']}"
    if info.get("cpu_model"):
        s += f", {info['cpu_model']}"
        if info.get("cpu_flags"):
            s += f" ({' '.join(info['cpu_flags'])})"
    if info.get("gpus"):
        s += f", GPU: {'; '.join(info['gpus'])}"
    return s


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------
def to_markdown(res: dict) -> str:
    cfg = res["config"]
    lo, hi = cfg["prompt_len"]
    lines = [f"# Serving benchmark ({res['started']})", "",
             f"{cfg['num_requests']} requests per level, prompts {lo}-{hi} tokens "
             f"({cfg.get('prompts', 'fresh tinyshakespeare excerpts')}, seed {cfg['seed']}), "
             f"{cfg['output_len']} output tokens "
             f"({'ignore_eos, ' if cfg.get('ignore_eos', True) else ''}"
             f"{'greedy' if not cfg.get('temperature') else 'temperature %g' % cfg['temperature']}), "
             f"streamed {cfg.get('endpoint', '/v1/completions')}.", "",
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


def _results_stem(args, stamp: str) -> Path | None:
    if args.out:
        return Path(args.out)
    if not (args.save_result or args.result_dir or args.result_filename):
        return None
    name = args.result_filename or f"serving_{stamp}"
    for suffix in (".json", ".md"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return Path(args.result_dir or ".") / name


# --------------------------------------------------------------------------
def _check(args) -> tuple[str, int, int, str | None]:
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be >= 1", 2)
    if any(c < 1 for c in args.max_concurrency):
        raise BenchError("--max-concurrency values must be >= 1", 2)
    if args.output_len < 1:
        raise BenchError("--random-output-len must be >= 1", 2)
    if args.num_warmups < 0 or args.request_timeout <= 0 or args.level_timeout <= 0:
        raise BenchError("--num-warmups must be >= 0 and the timeouts > 0", 2)
    if args.prompt_len and args.random_input_len is not None:
        raise BenchError("give --random-input-len or --prompt-len, not both", 2)
    if args.prompt_len:
        lo, hi = args.prompt_len
    elif args.random_input_len is not None:
        if not 0 <= args.random_range_ratio < 1:
            raise BenchError("--random-range-ratio must be in [0, 1)", 2)
        n, r = args.random_input_len, args.random_range_ratio
        lo, hi = max(1, math.floor(n * (1 - r))), math.ceil(n * (1 + r))
    else:
        lo, hi = DEFAULT_PROMPT_LEN
    if not 1 <= lo <= hi:
        raise BenchError(f"prompt lengths must satisfy 1 <= MIN <= MAX, got {lo} {hi}", 2)
    dataset = args.dataset_name or ("text" if args.dataset_path else "random")
    text = None
    if dataset == "text":
        if not args.dataset_path:
            raise BenchError("--dataset-name text needs --dataset-path FILE", 2)
        try:
            text = Path(args.dataset_path).read_text(errors="replace")
        except OSError as e:
            raise BenchError(f"cannot read --dataset-path {args.dataset_path}: {e.strerror or e}", 2)
        if len(text.strip()) < 100:
            raise BenchError(f"--dataset-path {args.dataset_path} holds under 100 characters of text", 2)
    elif args.dataset_path:
        raise BenchError("--dataset-path goes with --dataset-name text", 2)
    return dataset, lo, hi, text


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_serve(args) -> int:
    # SIGTERM (e.g. from `timeout`) ends the run as Ctrl-C does: a launched
    # tqserve is stopped and the results so far are written.
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        return _run_serve(args)
    except BenchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


def _run_serve(args) -> int:
    dataset, lo, hi, text = _check(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    targets = []
    for t in args.target:
        name, sep, rest = t.partition("=")
        if not sep or not name:
            raise BenchError(f"--target must be NAME=URL[@MODEL], got {t!r}", 2)
        url, _, model = rest.partition("@")
        targets.append(_make_target(name, _root_url(url, "--target URL"), model or args.model, args.endpoint))
    if args.base_url or not (targets or args.launch_tqserve):
        root = _root_url(args.base_url or f"http://{args.host}:{args.port}", "--base-url")
        targets.insert(0, _make_target(args.label or root.split("://", 1)[1], root, args.model, args.endpoint))
    for t in targets:                 # before anything slow: a wrong URL fails in seconds
        probe(t, headers)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = _results_stem(args, stamp)
    if stem is not None:
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BenchError(f"cannot create the results folder {stem.parent}: {e.strerror or e}", 2)
    proc = None
    res = None
    try:
        if args.launch_tqserve:
            log_path = (stem.parent / (stem.name + "_tqserve.log") if stem is not None else
                        Path(tempfile.mkstemp(prefix="tqserve-bench-", suffix=".log")[1]))
            proc, url = launch_tqserve(shlex.split(args.tqserve_args), log_path)
            t = _make_target("tqserve", url, args.model, args.endpoint)
            probe(t, headers)
            targets.insert(0, t)

        seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
        tok_name = args.tokenizer or args.model or targets[0]["model"]
        tok = load_tokenizer(tok_name)
        prompts = PromptSource(dataset, lo, hi, seed, tok, text)
        what = (f"fresh excerpts of {Path(args.dataset_path).name}" if dataset == "text" else
                "random token ids" if tok is not None else "random English words")
        if tok is None:
            what += ", lengths estimated"
        info = machine_info()
        cfg = {"num_requests": args.num_prompts, "output_len": args.output_len, "prompt_len": [lo, hi],
               "seed": seed, "concurrency": args.max_concurrency, "dataset_name": dataset,
               "dataset_path": args.dataset_path, "prompts": what,
               "tokenizer": tok_name if tok is not None else None, "endpoint": "/" + args.endpoint.strip("/"),
               "ignore_eos": args.ignore_eos, "temperature": args.temperature, "num_warmups": args.num_warmups,
               "request_timeout_s": args.request_timeout, "level_timeout_s": args.level_timeout}
        res = {"started": stamp, "command": shlex.join(sys.argv),
               "config": cfg, "machine": machine_line(info), "machine_info": info, "targets": []}
        run_cfg = {"output_len": args.output_len, "headers": headers, "chat": args.endpoint.rstrip("/").endswith(
            "chat/completions"), "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "request_timeout": args.request_timeout, "level_timeout": args.level_timeout,
            "progress_interval": args.progress_interval}
        failed = []
        for t in targets:
            entry = {"name": t["name"], "url": t["url"], "model": t["model"], "levels": []}
            res["targets"].append(entry)
            if args.num_warmups:
                warm = asyncio.run(run_level(t, [prompts.take() for _ in range(args.num_warmups)],
                                             {**run_cfg, "output_len": min(4, args.output_len)}, 1, None))
                if not warm["completed"]:
                    raise BenchError(f"warm-up request to {t['name']} ({t['endpoint_url']}, model "
                                     f"{t['model']!r}) failed: {warm['error_samples'][0]}")
            for c in args.max_concurrency:
                batch = [prompts.take() for _ in range(args.num_prompts)]
                log(f"{t['name']}: concurrency {c}, {len(batch)} requests ...")
                lv = asyncio.run(run_level(t, batch, run_cfg, c, f"{t['name']} @ {c}"))
                log(f"{t['name']} @ {c}: {lv['output_tok_per_s']} out tok/s, {lv['req_per_s']} req/s, "
                    f"TTFT p50 {lv['ttft_ms_p50']} ms, TPOT p50 {lv['tpot_ms_p50']} ms, errors {lv['errors']}")
                entry["levels"].append(lv)
            if not any(lv["completed"] for lv in entry["levels"]):
                failed.append(f"{t['name']} ({entry['levels'][0]['error_samples'][0]})")
    finally:
        stop(proc)
        if res is not None and stem is not None:
            Path(f"{stem}.json").write_text(json.dumps(res, indent=2))
            Path(f"{stem}.md").write_text(to_markdown(res))
            log(f"wrote {stem}.json and {stem}.md")
    print(to_markdown(res), flush=True)
    if failed:
        raise BenchError("every request failed for " + "; ".join(failed))
    return 0
