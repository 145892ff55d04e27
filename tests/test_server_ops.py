"""Operations on the real server: 503 while loading, API keys (flag and
TQSERVE_API_KEY), 429 with Retry-After when the waiting queue is full, and
SIGTERM draining (in-flight work finishes or is cut at the grace period; exit 0)."""
import asyncio
import http.client
import json
import threading
import time

import httpx
import openai
import pytest
from test_server_process import SMALL, ServerProcess, metric

MODEL = "smollm2-135m"
KEYS = ("flag-key", "env-key")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A 4,000-token request outlasts the 5 s drain on any CPU slower than 800 tok/s (900 tokens
    # did not outlast 15 s once decoding got faster).
    srv = ServerProcess(tmp_path_factory.mktemp("ops") / "server.log", *SMALL, "--max-model-len", "4096",
                        "--kv-cache-memory", "256MiB", "--max-num-seqs", "2",
                        "--max-queue", "2", "--api-key", KEYS[0], "--drain-timeout", "5", "--enable-sleep-mode",
                        env={"TQSERVE_API_KEY": KEYS[1], "VLLM_SERVER_DEV_MODE": "1"}, wait=False)
    yield srv
    srv.terminate()


def auth(key=KEYS[0]):
    return {"Authorization": f"Bearer {key}"}


def test_503_while_loading_then_ready(server):
    # The socket is bound before the model loads: the first answers are 503s.
    r = httpx.get(server.url + "/health", timeout=30)
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=auth(), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    server.wait_ready()
    assert httpx.get(server.url + "/health").status_code == 200


def test_auth_on_every_v1_route(server):
    u = server.url
    routes = [("GET", "/v1/models", None),
              ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
              ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                "messages": [{"role": "user", "content": "hi"}]})]
    for method, path, body in routes:
        for headers in ({}, auth("wrong"), {"Authorization": "flag-key"}):
            r = httpx.request(method, u + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
        for key in KEYS:
            assert httpx.request(method, u + path, json=body, headers=auth(key), timeout=120).status_code == 200
    # Not behind the key: health, metrics, version.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(u + path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=u + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=u + "/v1", api_key=KEYS[1], max_retries=0).models.list().data[0].id == MODEL


def test_reset_prefix_cache_in_dev_mode(server):
    """vLLM's POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1, behind the key):
    a prompt seen before hits the cache until the reset; 409 while busy."""
    u = server.url
    body = {"model": MODEL, "prompt": "The prefix cache keeps whole blocks of tokens. " * 6, "max_tokens": 1}

    def hits():
        return metric(server.metrics(), "tqserve:prefix_cache_hits_total")
    for _ in range(2):
        assert httpx.post(u + "/v1/completions", json=body, headers=auth(), timeout=120).status_code == 200
    assert hits() > 0
    assert httpx.post(u + "/reset_prefix_cache").status_code == 401
    assert httpx.post(u + "/reset_prefix_cache", headers=auth(), timeout=30).status_code == 200
    before = hits()
    assert httpx.post(u + "/v1/completions", json=body, headers=auth(), timeout=120).status_code == 200
    assert hits() == before
    long = {"model": MODEL, "prompt": "Go on:", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", u + "/v1/completions", json={**long, "stream": True}, headers=auth(), timeout=120) as r:
        lines = r.iter_lines()      # (kept: a dropped iterator closes the stream)
        next(lines)                 # running now
        busy = httpx.post(u + "/reset_prefix_cache", headers=auth(), timeout=30)
    assert busy.status_code == 409 and "hold KV blocks" in busy.json()["error"]["message"]


def test_sleep_and_wake_up_in_dev_mode(server):
    """vLLM's sleep mode routes (VLLM_SERVER_DEV_MODE=1, behind the key):
    asleep, the model routes answer 503 and the tokenizer still serves; awake
    (at once, or weights then KV cache), the same greedy text; 409 while busy."""
    u = server.url
    body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}

    def complete():
        return httpx.post(u + "/v1/completions", json=body, headers=auth(), timeout=120)
    want = complete().json()["choices"][0]["text"]
    assert httpx.post(u + "/sleep").status_code == 401

    def sleep_state():
        m = server.metrics()
        return [s for s in ("awake", "weights_offloaded", "discard_all")
                if metric(m, "tqserve:engine_sleep_state", engine="0", sleep_state=s) == 1]
    assert sleep_state() == ["awake"]
    for level, wakes in ((1, [[]]), (2, [["weights"], ["kv_cache"]])):
        assert httpx.post(u + "/sleep", params={"level": level}, headers=auth(), timeout=60).status_code == 200
        assert httpx.get(u + "/is_sleeping", headers=auth()).json() == {"is_sleeping": True}
        assert sleep_state() == [("weights_offloaded", "discard_all")[level - 1]]
        r = complete()
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
        assert httpx.post(u + "/tokenize", json={"prompt": "hi"}).status_code == 200
        assert httpx.get(u + "/health").status_code == 200
        for tags in wakes:
            r = httpx.post(u + "/wake_up", params={"tags": tags}, headers=auth(), timeout=120)
            assert r.status_code == 200
        assert httpx.get(u + "/is_sleeping", headers=auth()).json() == {"is_sleeping": False}
        assert complete().json()["choices"][0]["text"] == want and sleep_state() == ["awake"]
    r = httpx.post(u + "/sleep", params={"level": 3}, headers=auth(), timeout=30)
    assert r.status_code == 400 and "level" in r.json()["error"]["message"]
    long = {"model": MODEL, "prompt": "Go on:", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", u + "/v1/completions", json={**long, "stream": True}, headers=auth(), timeout=120) as r:
        lines = r.iter_lines()
        next(lines)                 # running now
        busy = httpx.post(u + "/sleep", headers=auth(), timeout=30)
    assert busy.status_code == 409 and "hold KV blocks" in busy.json()["error"]["message"]
    assert httpx.get(u + "/is_sleeping", headers=auth()).json() == {"is_sleeping": False}


def test_429_when_queue_full(server):
    # 2 run at once and 2 may wait: of 10 simultaneous requests some must get a 429.
    async def burst():
        async with httpx.AsyncClient(timeout=300, headers=auth()) as c:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
            return await asyncio.gather(*[c.post(server.url + "/v1/completions", json=body) for _ in range(10)])
    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    r = next(r for r in rs if r.status_code == 429)
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    # The official client sees a RateLimitError (no retries here).
    assert issubclass(openai.RateLimitError, openai.APIStatusError)


def test_idle_connection_outlives_the_clients_pool(server):
    # httpx (the openai client) reuses a pooled connection for up to 5 s idle; a server
    # that closes idle connections at 5 s too races it, and the request that reuses
    # the closing socket fails with "Server disconnected without sending a response".
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    for pause in (0, 6.0):
        time.sleep(pause)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and not r.will_close
        r.read()
    conn.close()


def test_sigterm_drains_and_exits_0(server):
    u = server.url
    events = {"short": [], "long": []}
    done = {}

    def stream(name, max_tokens):
        body = {"model": MODEL, "prompt": "The king said", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        done[name] = False
        try:
            with httpx.stream("POST", u + "/v1/completions", json=body, headers=auth(), timeout=300) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done[name] = True
                    elif line.startswith("data: "):
                        events[name].append(json.loads(line[6:]))
        except httpx.HTTPError as e:
            done[name + "_error"] = repr(e)

    threads = [threading.Thread(target=stream, args=("short", 3)), threading.Thread(target=stream, args=("long", 4000))]
    for t in threads:
        t.start()
    deadline = time.time() + 300                     # both are generating
    while time.time() < deadline and not (events["short"] and events["long"]):
        time.sleep(0.05)
    assert events["short"] and events["long"]
    t0 = time.time()
    server.proc.send_signal(15)
    time.sleep(1.0)
    r = httpx.get(u + "/health", timeout=5)           # still listening: draining, not dead
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"], r.text
    for t in threads:
        t.join(120)
    rc = server.proc.wait(60)
    took = time.time() - t0
    assert rc == 0, server.log()[-3000:]
    # the short one finished within the grace period (5 s) ...
    assert done["short"] and events["short"][-1]["choices"][0]["finish_reason"] == "length", (done, events["short"])
    # ... the long one was cut at its end, yet ended properly
    assert done["long"] and events["long"][-1]["choices"][0]["finish_reason"] == "abort", done
    assert 5 <= took < 5 + 20, took
    log = server.log()
    assert "draining" in log and "drain: aborting 1 request" in log
    assert "Traceback" not in log, log[-3000:]
