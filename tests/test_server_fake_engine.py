"""Fast HTTP tests of the server against a stand-in engine (no model, no torch).

FakeAsyncLLM has AsyncLLM's interface and uses the engine's real
OutputProcessor (detokenization, stop strings, n-way fan-in), so only the
"model" is fake: a byte-level tokenizer and a deterministic text source. The
app runs in uvicorn on a thread, so requests go through real HTTP.
The real-model tests are in test_server_openai.py and friends.
"""
import asyncio
import json
import random
import socket
import threading
import time

import httpx
import pytest
import torch

from engine.engine_core import EngineCoreOutput
from engine.errors import InvalidRequest
from engine.multimodal import PromptImages
from engine.output_processor import OutputProcessor, child_params
from engine.pooling_params import PoolingParams

CORPUS = ("the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs! "
          "how vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. ")


class FakeTokenizer:
    """Byte-level: id = byte + 4; 1 = <s>, 2 = <pad>, 3 = </s>."""
    bos_token, eos_token, eos_token_id = "<s>", "</s>", 3
    all_special_ids = [1, 2, 3]
    vocab_size = 260
    _special = {1: "<s>", 2: "<pad>", 3: "</s>"}

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [b + 4 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True):
        out, buf = [], bytearray()
        for i in ids:
            if i >= 4:
                buf.append(i - 4)
                continue
            out.append(buf.decode("utf-8", "replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self._special.get(i, ""))
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def convert_ids_to_tokens(self, ids):
        return [self._special.get(i) or chr(i - 4) for i in ids]


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class FakeAsyncLLM:
    """One token per request per step, every `step_s` seconds; greedy text is a
    deterministic slice of CORPUS chosen by the prompt; eos after `eos_after` tokens.
    With `script` (text), every request's output is that text's UTF-8 bytes, then eos."""

    def __init__(self, max_model_len=256, max_num_seqs=8, capacity_tokens=4096, step_s=0.004,
                 eos_after=40, load_s=0.0, script: str | None = None):
        self.script = None if script is None else script.encode()
        self.params: list = []                 # every request's SamplingParams, in arrival order
        self.prompts: list = []                # and its prompt token ids
        self.model_name = "fake"
        self.max_model_len = max_model_len
        self.max_logprobs = 20
        self.classifier_labels = None       # not a classifier
        self.classifier_pooling = lambda: None
        self.max_num_seqs = max_num_seqs
        self.step_s, self.eos_after, self.load_s = step_s, eos_after, load_s
        self.tokenizer = FakeTokenizer()
        self.chat_template = CHAT_TEMPLATE
        self.default_sampling: dict = {}       # the model's recommended sampling (--generation-config)
        self.default_pooling = PoolingParams()  # embeddings: a request's vector is EMBED_DIM values from its ids
        self.poolings: list = []               # every embedding request's PoolingParams
        self.cache_salts: list = []            # every request's cache_salt
        self.kv_info = {"capacity_tokens": capacity_tokens, "bytes_per_token": 46080, "block_size": 16,
                        "bytes_per_token_by_kind": {"full": 46080}, "hot_bytes_per_seq": 190080,
                        "compression_ratio": 3.76}
        self.processor = OutputProcessor(self.tokenizer)
        self.images = PromptImages(None, self.tokenizer)     # a text-only model
        self.no_images = "this model takes no images (text only)"
        self.streams: dict[str, asyncio.Queue] = {}
        self.waiting: list = []
        self.running: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.counters = {"num_preemptions_total": 0, "prefix_cache_queries_total": 0,
                         "prefix_cache_hits_total": 0, "spec_decode_num_drafts_total": 7,
                         "spec_decode_num_draft_tokens_total": 28, "spec_decode_num_accepted_tokens_total": 9,
                         "spec_decode_num_accepted_tokens_per_pos": [5, 3, 1, 0]}
        self._task = None

    async def start(self):
        await asyncio.sleep(self.load_s)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self):
        if self._task:
            self._task.cancel()

    def stats(self):
        used = sum(len(r["prompt"]) + len(r["out"]) for r in self.running.values())
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": used / self.kv_info["capacity_tokens"], **self.counters}

    async def generate(self, prompt, params, request_id, priority=0, pooling=None, cache_salt=None,
                       lora_request=None):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.params.append(params)
        self.prompts.append(ids)
        self.cache_salts.append(cache_salt)
        if pooling is not None:
            self.poolings.append(pooling)
            if (pooling.dimensions or 0) > EMBED_DIM:
                raise InvalidRequest(f"dimensions must be at most the model's {EMBED_DIM}, got {pooling.dimensions}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"maximum context length is {self.max_model_len} tokens, "
                                 f"but the prompt has {len(ids)} tokens")
        q = asyncio.Queue()
        self.streams[request_id] = q
        now = time.monotonic()
        cids = self.processor.add(request_id, None, ids, params, now)
        for i, cid in enumerate(cids):
            p = child_params(params, i)
            rng = random.Random(p.seed) if p.seed is not None else random.Random()
            start = sum(ids) % len(CORPUS) if p.greedy else rng.randrange(len(CORPUS))
            self.waiting.append({"id": cid, "prompt": ids, "params": p, "pos": start, "out": [],
                                 "arrival": now, "pooling": pooling})
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id):
        # As AsyncLLM.abort: the stream's last output, its unfinished choices "abort".
        final, running = self.processor.abort(request_id)
        q = self.streams.get(request_id)
        if q is not None and final is not None:
            q.put_nowait(final)
        for cid in running:
            self.aborted.append(cid)
            self.running.pop(cid, None)
            self.waiting = [r for r in self.waiting if r["id"] != cid]

    async def _loop(self):
        while True:
            await asyncio.sleep(self.step_s)
            now = time.monotonic()
            while self.waiting and len(self.running) < self.max_num_seqs:
                r = self.waiting.pop(0)
                r["scheduled"] = now
                self.running[r["id"]] = r
            outs = []
            for cid, r in list(self.running.items()):
                p = r["params"]
                eo = EngineCoreOutput(cid, first_scheduled_time=r["scheduled"])
                if not r["out"] and p.prompt_logprobs is not None:
                    eo.prompt_logprobs = [None] + [{t: -1.0 - (t % 7) / 10} for t in r["prompt"][1:]]
                done_len = p.max_tokens is not None and len(r["out"]) >= p.max_tokens
                if r["pooling"] is not None:
                    eo.embedding = fake_embedding(r["prompt"], r["pooling"])
                if not done_len:
                    if self.script is not None:
                        tok = self.script[len(r["out"])] + 4 if len(r["out"]) < len(self.script) else 3
                    elif len(r["out"]) >= self.eos_after and not p.ignore_eos:
                        tok = 3
                    else:
                        tok = ord(CORPUS[r["pos"] % len(CORPUS)]) + 4
                        r["pos"] += 1
                    r["out"].append(tok)
                    eo.new_token_ids = [tok]
                    if p.logprobs is not None:
                        lp = {tok: -0.25}
                        for k in range(p.logprobs):
                            lp.setdefault(4 + 97 + k, -1.0 - k)
                        eo.new_logprobs = [lp]
                    if tok == 3 or tok in p.stop_token_ids:
                        eo.finish_reason, eo.stop_reason = "stop", (None if tok == 3 else tok)
                        eo.stopped_on_token = True
                    elif p.max_tokens is not None and len(r["out"]) >= p.max_tokens:
                        eo.finish_reason = "length"
                else:
                    eo.finish_reason = "length"
                if eo.finish_reason:
                    del self.running[cid]
                outs.append(eo)
            if not outs:
                continue
            results, to_abort = self.processor.process(outs)
            for cid in to_abort:
                self.running.pop(cid, None)
            for res in results:
                q = self.streams.get(res.request_id)
                if q is not None:
                    q.put_nowait(res)


EMBED_DIM = 8


def fake_embedding(ids: list[int], pooling) -> list[float]:
    """What the stand-in engine pools: position-weighted sums of the ids."""
    v = [sum((t + 1) * (k + 1) * (i + 1) % 13 for i, t in enumerate(ids)) + 1.0 for k in range(EMBED_DIM)]
    return pooling.finish(torch.tensor(v), len(ids))


# --------------------------------------------------------------------------
# A live server on a thread.
# --------------------------------------------------------------------------
class LiveServer:
    def __init__(self, llm, **config):
        import uvicorn

        from server.app import create_app
        from server.state import ServerConfig, ServerState
        self.llm = llm
        self.state = ServerState(llm, ServerConfig(model_names=config.pop("model_names", ["fake"]),
                                                   max_num_seqs=llm.max_num_seqs, **config))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), lifespan="off", log_config=None,
                                                    access_log=False, timeout_graceful_shutdown=2))
        self.server.install_signal_handlers = lambda: None
        self.loop = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.state.ready and time.time() < deadline:
            time.sleep(0.01)
        assert self.state.ready

    def _run(self):
        async def main():
            self.loop = asyncio.get_running_loop()
            task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
            await self.llm.start()
            self.state.set_ready()
            await task
            await self.llm.shutdown()
        asyncio.run(main())

    def call(self, fn):
        """Run fn() on the server's loop (to look at engine state safely)."""
        return asyncio.run_coroutine_threadsafe(_wrap(fn), self.loop).result(5)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


async def _wrap(fn):
    return fn()


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(FakeAsyncLLM(), api_keys=[], max_queue=6)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    from openai import OpenAI
    return OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=30)


# --------------------------------------------------------------------------
def test_chat_basic_and_usage(client):
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and len(c.message.content) == 10
    assert c.finish_reason == "length"
    prompt = "<|user|>hi\n<|assistant|>"
    assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_chat_stream_equals_nonstream(client):
    kw = dict(model="fake", messages=[{"role": "user", "content": [{"type": "text", "text": "abc"}]}],
              max_tokens=25, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_raw_sse_shape(live):
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
            "n": 2, "temperature": 0.7, "seed": 1}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert len("".join(c["delta"].get("content", "") for c in mine)) == 3


def test_stop_string_and_seed(client):
    kw = dict(model="fake", messages=[{"role": "user", "content": "q"}], max_tokens=60, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = full[5:8]
    r = client.chat.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[:full.index(stop)]
    a = client.chat.completions.create(**{**kw, "temperature": 1.0}, seed=7, n=2)
    b = client.chat.completions.create(**{**kw, "temperature": 1.0}, seed=7, n=2)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == -0.25 for t in content)


def test_dev_routes_need_dev_mode(live):
    """vLLM's POST /reset_prefix_cache and the sleep mode routes exist with
    VLLM_SERVER_DEV_MODE=1 only (test_server_ops.py runs them on the real engine)."""
    for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
                         ("GET", "/is_sleeping")):
        r = httpx.request(method, live.url + path)
        assert r.status_code == 404 and "VLLM_SERVER_DEV_MODE=1" in r.json()["error"]["message"], path


def test_truncate_prompt_tokens(live, client):
    """vLLM's truncate_prompt_tokens on chat and completions: the prompt's last k tokens run."""
    msgs = [{"role": "user", "content": "a fairly long question to cut"}]
    client.chat.completions.create(model="fake", messages=msgs, max_tokens=1)
    full = live.llm.prompts[-1]
    r = client.chat.completions.create(model="fake", messages=msgs, max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert live.llm.prompts[-1] == full[-5:] and r.usage.prompt_tokens == 5
    ids = list(range(10, 30))
    client.completions.create(model="fake", prompt=[ids, ids[::-1]], max_tokens=1,
                              extra_body={"truncate_prompt_tokens": 4})
    assert sorted(live.llm.prompts[-2:]) == sorted([ids[-4:], ids[::-1][-4:]])
    tok = live.llm.tokenizer
    r = client.completions.create(model="fake", prompt="abcdefgh", max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 4})
    kept = tok.encode("abcdefgh")[-4:]
    assert live.llm.prompts[-1] == kept
    assert r.choices[0].text.startswith(tok.decode(kept, skip_special_tokens=False))
    client.completions.create(model="fake", prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert live.llm.prompts[-1] == ids
    bad = httpx.post(live.url + "/v1/completions", json={"model": "fake", "prompt": "x", "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and "truncate_prompt_tokens" in bad.json()["error"]["message"]


def test_return_tokens_as_token_ids_flag(live):
    """vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:{id}"
    (chat streamed and not, completions); a request's own field wins; the
    flag is on the serve command line."""
    from openai import OpenAI

    from server.cli import build_parser
    assert build_parser().parse_args(["serve", "--return-tokens-as-token-ids"]).return_tokens_as_token_ids
    srv = LiveServer(FakeAsyncLLM(), return_tokens_as_token_ids=True)
    try:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
        kw = dict(model="fake", messages=[{"role": "user", "content": "q"}], max_tokens=4, temperature=0,
                  logprobs=True, top_logprobs=2)
        ids = c.chat.completions.create(**kw, extra_body={"return_token_ids": True}).model_dump()
        content = ids["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in content] == [f"token_id:{t}" for t in ids["choices"][0]["token_ids"]]
        assert all(a["token"].startswith("token_id:") for t in content for a in t["top_logprobs"])
        assert all(t["bytes"] == list(t["token"].encode()) for t in content)
        streamed = [t.token for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
                    and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
        assert streamed == [t["token"] for t in content]
        texts = c.chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False})
        assert "".join(t.token for t in texts.choices[0].logprobs.content) == texts.choices[0].message.content
        cmpl = c.completions.create(model="fake", prompt="q", max_tokens=3, logprobs=1)
        assert all(t.startswith("token_id:") for t in cmpl.choices[0].logprobs.tokens)
        too_many = httpx.post(srv.url + "/v1/chat/completions", json={**kw, "top_logprobs": 21})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"
        assert "--max-logprobs" in too_many.json()["error"]["message"]
    finally:
        srv.stop()


def test_completions_variants(client):
    r = client.completions.create(model="fake", prompt=["ab", "cd"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3 + 3 and r.usage.completion_tokens == 16
    r = client.completions.create(model="fake", prompt=[[1, 70, 71], [1, 72]], max_tokens=2, temperature=0)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5
    r = client.completions.create(model="fake", prompt="hello", max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "hello" and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == 6
    chunks = list(client.completions.create(model="fake", prompt="hey", max_tokens=6, temperature=0,
                                            echo=True, stream=True))
    whole = client.completions.create(model="fake", prompt="hey", max_tokens=6, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 2}, 400, "top_p"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, None),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400, "max_tokens"),
])
def test_chat_errors(live, body, status, param):
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "fake", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    if "x" * 300 in json.dumps(body):
        assert "256" in err["message"] and str(len("<|user|>" + "x" * 300 + "\n<|assistant|>")) in err["message"]


def test_malformed_and_misc_errors(live):
    u = live.url
    r = httpx.post(u + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/chat/completions", content=b"[1,2]")
    assert r.status_code == 400
    r = httpx.post(u + "/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/completions", json={"prompt": "x", "unknown_field": 1, "max_tokens": 1})
    assert r.status_code == 200
    r = httpx.post(u + "/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(u + "/v1/completions", content=iter([b'{"prompt": "', b"x" * (9 << 20), b'"}']))  # chunked
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(u + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_info_routes(live):
    u = live.url
    assert httpx.get(u + "/health").status_code == 200
    assert httpx.get(u + "/version").json()["version"]
    m = httpx.get(u + "/v1/models").json()
    assert m["data"][0]["id"] == "fake" and m["data"][0]["max_model_len"] == 256
    t = httpx.post(u + "/tokenize", json={"prompt": "hi"}).json()
    assert t["tokens"] == [1, 108, 109] and t["count"] == 3
    assert httpx.post(u + "/detokenize", json={"tokens": [108, 109]}).json()["prompt"] == "hi"
    t = httpx.post(u + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert t["count"] == len("<|user|>hi\n<|assistant|>")


def test_queue_full_429(live):
    # 8 run at once, 6 may wait: a burst of 20 long requests overflows.
    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"model": "fake", "prompt": "x", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*[c.post(live.url + "/v1/completions", json=body) for _ in range(20)])
    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 8 and codes.count(429) >= 1, str(codes)
    r429 = next(r for r in rs if r.status_code == 429)
    assert int(r429.headers["retry-after"]) >= 1 and r429.json()["error"]["type"] == "rate_limit_error"


def test_disconnect_aborts(live):
    before = len(live.llm.aborted)
    body = {"model": "fake", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        for _ in zip(range(3), r.iter_lines()):
            pass
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.time() + 5
    while time.time() < deadline and (len(live.llm.aborted) < before + 2 or live.call(lambda: live.llm.running)):
        time.sleep(0.05)
    assert len(live.llm.aborted) == before + 2
    assert live.call(lambda: len(live.llm.running)) == 0 and live.state.inflight == 0


def test_metrics_parse(live):
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(live.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
                 "generation_tokens", "request_success", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds", "kv_cache_capacity_tokens", "kv_cache_bytes_per_token",
                 "kv_cache_hot_bytes_per_sequence", "kv_cache_compression_ratio"):
        assert "tqserve:" + name in fams, name
    assert fams["tqserve:kv_cache_hot_bytes_per_sequence"].samples[0].value == 190080
    assert fams["tqserve:kv_cache_compression_ratio"].samples[0].value == 3.76
    # speculative decoding, vLLM's names
    for name, v in (("spec_decode_num_drafts", 7), ("spec_decode_num_draft_tokens", 28),
                    ("spec_decode_num_accepted_tokens", 9)):
        assert fams["tqserve:" + name].samples[0].value == v, name
    per = {s.labels["position"]: s.value for s in fams["tqserve:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per == {"0": 5, "1": 3, "2": 1, "3": 0}


def test_http_metrics(live):
    """vLLM's HTTP series: http_requests_total by route template, method and status
    class (a stream counted once it has ended), http_request_duration_seconds."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts():
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
        return {tuple(s.labels[k] for k in ("handler", "method", "status")): s.value
                for s in fams["http_requests"].samples if s.name == "http_requests_total"}, \
            {tuple(s.labels[k] for k in ("handler", "method")): s.value
             for s in fams["http_request_duration_seconds"].samples
             if s.name == "http_request_duration_seconds_count"}
    before, dur_before = counts()
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(live.url + "/v1/chat/completions", json=chat).status_code == 200
    assert httpx.post(live.url + "/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
    assert httpx.post(live.url + "/v1/chat/completions", json={**chat, "n": 0}).status_code == 400
    assert httpx.get(live.url + "/v1/responses/resp_nope").status_code == 404
    assert httpx.get(live.url + "/no/such/path").status_code == 404
    after, dur_after = counts()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert delta == {("/v1/chat/completions", "POST", "2xx"): 2, ("/v1/chat/completions", "POST", "4xx"): 1,
                     ("/v1/responses/{response_id}", "GET", "4xx"): 1, ("none", "GET", "4xx"): 1,
                     ("/metrics", "GET", "2xx"): 1}
    assert dur_after[("/v1/chat/completions", "POST")] - dur_before.get(("/v1/chat/completions", "POST"), 0) == 3


def test_request_phase_metrics(live):
    """vLLM's per-request phase histograms (prefill, decode, inference = both,
    time per output token) and the n / max_tokens parameter histograms."""
    from prometheus_client.parser import text_string_to_metric_families

    def values():
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
        return {f"{name}{suffix}": s.value for name in (
            "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
            "request_time_per_output_token_seconds", "request_params_n", "request_params_max_tokens")
            for s in fams["tqserve:" + name].samples for suffix in ("_sum", "_count")
            if s.name == f"tqserve:{name}{suffix}"}
    before = values()
    body = {"model": "fake", "prompt": "x", "max_tokens": 6, "n": 2, "ignore_eos": True}
    assert httpx.post(live.url + "/v1/completions", json=body).status_code == 200
    d = {k: v - before[k] for k, v in values().items()}
    for name in ("prefill", "decode", "inference"):
        assert d[f"request_{name}_time_seconds_count"] == 1
    assert d["request_time_per_output_token_seconds_count"] == 1
    assert d["request_prefill_time_seconds_sum"] > 0 and d["request_decode_time_seconds_sum"] > 0
    assert abs(d["request_prefill_time_seconds_sum"] + d["request_decode_time_seconds_sum"]
               - d["request_inference_time_seconds_sum"]) < 1e-6
    assert d["request_time_per_output_token_seconds_sum"] == pytest.approx(d["request_decode_time_seconds_sum"] / 5)
    assert (d["request_params_n_sum"], d["request_params_max_tokens_sum"]) == (2, 6)


def test_auth():
    srv = LiveServer(FakeAsyncLLM(), api_keys=["k1", "k2"])
    try:
        body = {"model": "fake", "prompt": "x", "max_tokens": 1}
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        for k in ("k1", "k2"):
            assert httpx.post(srv.url + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {k}"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_cache_salt_reaches_the_engine(live, client):
    msgs = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="fake", messages=msgs, max_tokens=2, extra_body={"cache_salt": "t1"})
    client.completions.create(model="fake", prompt=["a", "b"], max_tokens=2, extra_body={"cache_salt": "t2"})
    client.responses.create(model="fake", input="hi", max_output_tokens=2, extra_body={"cache_salt": "t3"})
    httpx.post(live.url + "/v1/messages", json={"model": "fake", "max_tokens": 2, "messages": msgs,
                                                "cache_salt": "t4"}, timeout=30).raise_for_status()
    client.chat.completions.create(model="fake", messages=msgs, max_tokens=2)
    assert live.llm.cache_salts[-6:] == ["t1", "t2", "t2", "t3", "t4", None]
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "fake", "messages": msgs, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_documents_reach_the_template(live, client):
    """vLLM's `documents` (RAG templates: Command R, Granite) reach the chat template."""
    template = live.llm.chat_template
    live.llm.chat_template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                              "{{ messages[0]['content'] }}")
    try:
        docs = [{"title": "Tides", "text": "The moon pulls."}, {"title": "Wind", "text": "Air moves."}]
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Why?"}], max_tokens=1,
                                       extra_body={"documents": docs})
        assert live.llm.tokenizer.decode(live.llm.prompts[-1]) == "[Tides: The moon pulls.][Wind: Air moves.]Why?"
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Why?"}], max_tokens=1)
        assert live.llm.tokenizer.decode(live.llm.prompts[-1]) == "Why?"
        r = httpx.post(live.url + "/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}], "documents": [{"title": 1}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("documents")
    finally:
        live.llm.chat_template = template


def test_request_chat_template_needs_the_flag(live, client):
    """vLLM's per-request `chat_template`: refused unless the operator passes
    --trust-request-chat-template; then it renders instead of the model's (chat and /tokenize)."""
    msgs = [{"role": "user", "content": "Why?"}]
    custom = "<<{{ messages[0]['content'] }}>>"
    r = httpx.post(live.url + "/v1/chat/completions",
                   json={"model": "fake", "messages": msgs, "max_tokens": 1, "chat_template": custom})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    trusted = LiveServer(FakeAsyncLLM(), trust_request_chat_template=True)
    try:
        from openai import OpenAI
        c = OpenAI(base_url=trusted.url + "/v1", api_key="none", max_retries=0, timeout=30)
        c.chat.completions.create(model="fake", messages=msgs, max_tokens=1, extra_body={"chat_template": custom})
        assert trusted.llm.tokenizer.decode(trusted.llm.prompts[-1]) == "<<Why?>>"
        c.chat.completions.create(model="fake", messages=msgs, max_tokens=1)      # the model's own again
        assert trusted.llm.tokenizer.decode(trusted.llm.prompts[-1]) != "<<Why?>>"
        tok = httpx.post(trusted.url + "/tokenize", json={"messages": msgs, "chat_template": custom}).json()
        assert trusted.llm.tokenizer.decode(tok["tokens"]) == "<<Why?>>"
        bad = httpx.post(trusted.url + "/v1/chat/completions",
                         json={"model": "fake", "messages": msgs, "chat_template": "{% for %}"})
        assert bad.status_code == 400 and "Chat template rendering failed" in bad.json()["error"]["message"]
    finally:
        trusted.stop()
