"""`tqserve run-batch -i requests.jsonl -o results.jsonl --model ...`: vLLM's
run_batch, offline inference over a file in OpenAI's Batch API format.

Each input line is {"custom_id", "method": "POST", "url", "body"} with url
/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score or
/v1/rerank (and their vLLM spellings); each output line, in input order, is
{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}. The requests run through the server's own app in this process
(httpx's ASGI transport: the same validation, defaults and responses as over
HTTP), all at once up to --max-concurrency, so the engine batches them; a
line that cannot run gets its error (in OpenAI's shape) and the others go on.
Progress is logged every 10 s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid

log = logging.getLogger("tqserve.batch")

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank", "/score",
        "/rerank", "/pooling", "/classify")


def add_parser(sub) -> argparse.ArgumentParser:
    from server.cli import add_engine_args
    p = sub.add_parser("run-batch", help="offline inference over a JSONL file of OpenAI Batch API requests "
                                         "(vLLM's run_batch)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object per line ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, help="where the results go, one per line ('-': stdout)")
    p.add_argument("--model", default="smollm2-135m", help="as `tqserve serve --model`")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the requests' `model` may use [default: --model]")
    p.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at once")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    return p


def _error_line(custom_id, status: int, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": None},
            "error": {"code": str(status), "message": message}}


def parse_line(n: int, line: str) -> tuple[object, str, dict] | dict:
    """(custom_id, url, body), or the line's error output."""
    try:
        req = json.loads(line)
    except json.JSONDecodeError as e:
        return _error_line(None, 400, f"line {n}: not valid JSON ({e})")
    if not isinstance(req, dict):
        return _error_line(None, 400, f"line {n}: a request is a JSON object")
    cid, url, body = req.get("custom_id"), req.get("url"), req.get("body")
    if req.get("method", "POST") != "POST":
        return _error_line(cid, 400, f"line {n}: method must be POST, got {req.get('method')!r}")
    if url not in URLS:
        return _error_line(cid, 400, f"line {n}: url must be one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        return _error_line(cid, 400, f"line {n}: body must be a JSON object")
    if body.get("stream"):
        return _error_line(cid, 400, f"line {n}: stream is not supported in a batch")
    return cid, url, body


async def _run_one(client, sem, parsed, done: list[int]) -> dict:
    if isinstance(parsed, dict):
        done[0] += 1
        return parsed
    cid, url, body = parsed
    async with sem:
        r = await client.post(url, json=body)
    done[0] += 1
    out = r.json()
    rid = out.get("id") if isinstance(out, dict) else None
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": cid,
            "response": {"status_code": r.status_code, "request_id": rid or f"req_{uuid.uuid4().hex}",
                         "body": out if r.is_success else None}, "error": None}
    if not r.is_success:
        err = out.get("error", {}) if isinstance(out, dict) else {}
        line["error"] = {"code": err.get("code") or str(r.status_code), "message": err.get("message", r.text)}
    return line


async def run_batch(args, lines: list[str]) -> list[dict]:
    import httpx

    from engine import AsyncLLM, EngineArgs
    from server.app import create_app
    from server.cli import engine_fields
    from server.state import ServerConfig, ServerState
    llm = AsyncLLM(EngineArgs(model=args.model, **{f.name: getattr(args, f.name) for f in engine_fields()}))
    await llm.start()
    try:
        state = ServerState(llm, ServerConfig(model_names=args.served_model_name or [args.model], max_queue=None,
                                              max_num_seqs=args.max_num_seqs))
        state.set_ready()
        parsed = [parse_line(n, line) for n, line in enumerate(lines, 1)]
        sem, done = asyncio.Semaphore(max(1, args.max_concurrency)), [0]
        t0 = time.monotonic()

        async def progress():
            while True:
                await asyncio.sleep(10)
                log.info("%d of %d requests done (%.0fs)", done[0], len(parsed), time.monotonic() - t0)
        reporter = asyncio.create_task(progress())
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
            try:
                results = await asyncio.gather(*[_run_one(client, sem, p, done) for p in parsed])
            finally:
                reporter.cancel()
        ok = sum(r["error"] is None for r in results)
        log.info("%d requests in %.1fs: %d succeeded, %d failed", len(results), time.monotonic() - t0, ok,
                 len(results) - ok)
        return results
    finally:
        await llm.shutdown()


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)        # (one line per request is tqserve's own)
    try:
        src = sys.stdin if args.input_file == "-" else open(args.input_file, encoding="utf-8")
    except OSError as e:
        log.error("cannot read %s: %s", args.input_file, e.strerror or e)
        return 2
    with src:
        lines = [line for line in src.read().splitlines() if line.strip()]
    try:
        results = asyncio.run(run_batch(args, lines))
    except ValueError as e:
        log.error("bad engine settings: %s", e)
        return 2
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if args.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    return 0
