"""The OpenAI API on the real engine and SmolLM2-135M, through the official
`openai` client, with `tqserve serve` running as a subprocess on 127.0.0.1."""
import asyncio
import math
import time

import httpx
import openai
import pytest
from fixtures_models import SHAKESPEARE, hf_gguf_model
from test_server_process import SMALL, ServerProcess, metric

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("srv") / "server.log", *SMALL, "--max-num-seqs", "32",
                        "--max-queue", "0")
    yield srv
    rc = srv.terminate()
    assert rc == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, "temperature": 0,
                                             "max_tokens": 16, **kw})


def stream_text(chunks) -> tuple[dict, dict, list]:
    """Texts and finish reasons by choice index, and the chunk list."""
    texts, reasons = {}, {}
    chunks = list(chunks)
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                assert ch.index not in reasons, "two finish chunks for one choice"
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, chunks


# --------------------------------------------------------------------------
def test_startup_line(server):
    log = server.log()
    line = next(ln for ln in log.splitlines() if "ready:" in ln)
    assert MODEL in line and "context 1024 tokens" in line and server.url in line
    assert "KV cache" in line and "bytes/token" in line


def test_chat_greedy_stream_equals_nonstream(client):
    full = chat(client)
    c = full.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert "Paris" in c.message.content
    texts, reasons, chunks = stream_text(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts[0] == c.message.content and reasons[0] == c.finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_usage_numbers(server, client):
    r = chat(client, max_tokens=5)
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": QUESTION}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == len(ids) + 5
    lp = chat(client, max_tokens=5, logprobs=True).choices[0].logprobs.content
    assert len(lp) == 5


def test_max_tokens_length_and_max_completion_tokens(client):
    r = chat(client, max_tokens=None, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_n2_nonstream_and_stream(client):
    kw = dict(n=2, temperature=0.9, seed=3, max_tokens=8, extra_body={"ignore_eos": True})
    r = chat(client, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16 and all(c.finish_reason == "length" for c in r.choices)
    texts, reasons, _ = stream_text(chat(client, stream=True, **kw))
    assert set(texts) == {0, 1} and set(reasons) == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices]


def test_stop_string(client):
    full = chat(client, max_tokens=16).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = chat(client, max_tokens=16, stop=[stop, "zzzz"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == full[:full.index(stop)]
    assert c.model_extra.get("stop_reason") == stop
    texts, reasons, _ = stream_text(chat(client, max_tokens=16, stop=stop, stream=True))
    assert texts[0] == c.message.content and reasons[0] == "stop"


def test_seed_repeatable(client):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=8)
    a = chat(client, seed=1234, **kw).choices[0].message.content
    b = chat(client, seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {chat(client, seed=s, **kw).choices[0].message.content for s in (1, 2)}
    assert len(others | {a}) > 1                  # the seed does something


def test_chat_logprobs_consistent(client):
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=10)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    # the eos token (counted, as vLLM counts it) shows as itself
    assert "".join(t.token for t in content).removesuffix("<|im_end|>") == c.message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token and math.isclose(t.logprob, tops[0], abs_tol=1e-5)
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
    # streamed logprobs are the same
    chunks = list(chat(client, logprobs=True, top_logprobs=3, max_tokens=10, stream=True))
    streamed = [t for ch in chunks for x in ch.choices if x.logprobs for t in x.logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_completions_prompt_forms(server, client):
    text = "The capital of France is"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    a = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)
    m = client.completions.create(model=MODEL, prompt=[text, "Once upon a time"], max_tokens=4, temperature=0)
    assert [c.index for c in m.choices] == [0, 1] and m.choices[0].text == a.choices[0].text[:len(m.choices[0].text)]
    m = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(m.choices) == 2 and m.usage.prompt_tokens == len(ids) + 3
    e = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, echo=True).choices[0].text
    assert e.startswith(text) and a.choices[0].text.startswith(e[len(text):])
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == a.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_template_options(server, client):
    u = server.url
    partial = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    ids = httpx.post(u + "/tokenize", json={"messages": partial, "continue_final_message": True,
                                            "add_generation_prompt": False}).json()["tokens"]
    text = httpx.post(u + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe capital of France is"), text
    r = chat(client, messages=partial, max_tokens=4,
             extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in r.choices[0].message.content
    # tool and system roles and text parts reach the template
    msgs = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"}]
    ids = httpx.post(u + "/tokenize", json={"messages": msgs}).json()["tokens"]
    text = httpx.post(u + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "Be brief." in text and "sunny, 21C" in text and text.endswith("<|im_start|>assistant\n")
    r = chat(client, messages=msgs, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(ids)
    e = httpx.post(u + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "continue_final_message": True,
                                                     "add_generation_prompt": False})
    assert e.status_code == 400 and "assistant" in e.json()["error"]["message"]
    e = httpx.post(u + "/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert e.status_code == 400 and "takes no images" in e.json()["error"]["message"]


def _transformers_logprobs(ids: list[int]) -> list[float]:
    torch = pytest.importorskip("torch")
    model = hf_gguf_model("smollm2-135m")      # loaded once per session (test_loaders shares it)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_perplexity_matches_transformers(server, client):
    text = SHAKESPEARE.read_text()[2000:2400]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"][:64]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert r.usage.completion_tokens == 0 and c.finish_reason == "length"
    ours = c.logprobs.token_logprobs
    assert len(ours) == len(ids) and ours[0] is None
    ref = _transformers_logprobs(ids)
    diffs = [abs(a - b) for a, b in zip(ours[1:], ref)]
    assert max(diffs) < 0.05, max(diffs)
    ppl_ours = math.exp(-sum(ours[1:]) / len(ref))
    ppl_ref = math.exp(-sum(ref) / len(ref))
    assert abs(ppl_ours - ppl_ref) / ppl_ref < 0.01, (ppl_ours, ppl_ref)


def test_embeddings_match_transformers(server, client):
    torch = pytest.importorskip("torch")
    texts = ["The capital of France is Paris.", SHAKESPEARE.read_text()[:600], "Hi"]
    r = client.embeddings.create(model=MODEL, input=texts)
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and [d.index for d in r.data] == [0, 1, 2]
    model = hf_gguf_model("smollm2-135m")
    for d, p in zip(r.data, ids):
        with torch.no_grad():
            ref = model.model(torch.tensor([p])).last_hidden_state[0, -1].float()
        ours = torch.tensor(d.embedding)
        assert len(d.embedding) == 576 and abs(ours.norm().item() - 1) < 1e-5
        # Last-token pooling, normalized (the default); Q4_1 blocks as transformers dequantizes them.
        assert torch.nn.functional.cosine_similarity(ours, ref, dim=0).item() > 0.995
    alone = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float").data[0].embedding
    assert max(abs(a - b) for a, b in zip(alone, r.data[1].embedding)) < 1e-3
    cut = client.embeddings.create(model=MODEL, input=ids[0], dimensions=32, encoding_format="float")
    full = torch.tensor(r.data[0].embedding)
    want = torch.nn.functional.normalize(full[:32], dim=0)
    assert torch.allclose(torch.tensor(cut.data[0].embedding), want, atol=1e-3)
    with pytest.raises(openai.BadRequestError, match="at most the model's 576"):
        client.embeddings.create(model=MODEL, input="Hi", dimensions=577)
    # Rerank: cosine similarities of the same embeddings, best first.
    res = httpx.post(server.url + "/v1/rerank", json={"query": texts[2], "documents": texts[:2]}, timeout=60).json()
    vec = [torch.tensor(d.embedding, dtype=torch.float64) for d in r.data]
    want = {i: float(vec[2] @ vec[i]) for i in range(2)}
    assert [x["index"] for x in res["results"]] == sorted(want, key=lambda i: -want[i])
    assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-3 for x in res["results"])


# --------------------------------------------------------------------------
# Errors (auth off here; auth on in test_server_ops.py)
# --------------------------------------------------------------------------
def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_errors_400(server):
    u = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": QUESTION}
    assert _err(httpx.post(u, json={**base, "temperature": "hot"}), 400)["param"] == "temperature"
    assert _err(httpx.post(u, json={**base, "top_p": 5}), 400)["param"] == "top_p"
    assert _err(httpx.post(u, json={**base, "messages": [{"role": "robot", "content": "x"}]}), 400)
    assert _err(httpx.post(u, json={**base, "n": "two"}), 400)["param"] == "n"
    assert _err(httpx.post(u, json={**base, "logit_bias": {"999999": 5}}), 400)["param"] == "logit_bias"
    e = _err(httpx.post(u, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}), 400)
    assert "JSON" in e["message"]
    _err(httpx.post(u, content=b"\xff\xfe garbage"), 400)
    long = " ".join(["word"] * 1500)
    e = _err(httpx.post(u, json={**base, "messages": [{"role": "user", "content": long}]}), 400)
    n = len(httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": long}]}).json()["tokens"])
    assert "1024" in e["message"] and str(n) in e["message"]
    e = _err(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "suffix": "!"}), 400)
    assert "suffix" in e["message"]
    # unknown fields are accepted
    r = httpx.post(u, json={**base, "max_tokens": 1, "some_future_field": {"x": 1}}, timeout=120)
    assert r.status_code == 200


def test_errors_404_413_and_client(server, client):
    u = server.url + "/v1/chat/completions"
    e = _err(httpx.post(u, json={"model": "gpt-9", "messages": QUESTION}), 404)
    assert "gpt-9" in e["message"] and e["code"] == "model_not_found"
    _err(httpx.post(u, content=b"x" * (9 << 20), headers={"content-type": "application/json"}), 413)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    # vLLM's request priority, refused by a server that schedules fcfs (the default)
    for call in (lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                                        extra_body={"priority": 1}),
                 lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True,
                                                   extra_body={"priority": -1})):
        with pytest.raises(openai.BadRequestError, match="needs --scheduling-policy priority"):
            call()
    assert _err(httpx.post(u, json={"model": MODEL, "messages": QUESTION, "priority": "high"}), 400)["param"] \
        == "priority"


def test_info_routes(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 1024
    assert httpx.get(server.url + "/version").json()["version"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"


# --------------------------------------------------------------------------
# Load: 32 streaming clients, 8 of them leave early; KV back to 0; metrics add up.
# --------------------------------------------------------------------------
def idle_metrics(server, limit: float = 30) -> dict:
    """/metrics once every engine request is gone and its blocks are back
    (asserted; waited for at most `limit` seconds)."""
    t_end = time.time() + limit
    while True:
        m = server.metrics()
        if (metric(m, "tqserve:num_requests_running") == 0 and metric(m, "tqserve:kv_cache_usage_perc") == 0
                or time.time() > t_end):
            break
        time.sleep(0.2)
    assert metric(m, "tqserve:num_requests_running") == 0 and metric(m, "tqserve:num_requests_waiting") == 0
    assert metric(m, "tqserve:kv_cache_usage_perc") == 0
    return m


def test_concurrent_streams_disconnects_and_metrics(server):
    lines = [ln for ln in SHAKESPEARE.read_text().splitlines() if len(ln) > 30]
    before = server.metrics()

    async def one(ac: openai.AsyncOpenAI, i: int, leave: bool):
        msgs = [{"role": "user", "content": f"Continue this line: {lines[i * 7]}"}]
        stream = await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24 if leave else 12,
                                                  temperature=0.7, seed=i, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        got, usage, finish = 0, None, None
        async for c in stream:
            for ch in c.choices:
                got += bool(ch.delta.content)
                finish = ch.finish_reason or finish
            usage = c.usage or usage
            if leave and got >= 3:
                await stream.close()
                return msgs, None, None
        return msgs, usage, finish

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        return await asyncio.gather(*[one(ac, i, i % 4 == 0) for i in range(32)])

    results = asyncio.run(run())
    finished = [r for r in results if r[1] is not None]
    assert len(finished) == 24 and all(f == "length" for _, _, f in finished)
    assert all(u.completion_tokens == 12 for _, u, _ in finished)

    after = idle_metrics(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("tqserve:request_success_total", finished_reason="length") == 24
    assert delta("tqserve:request_success_total", finished_reason="abort") == 8
    assert delta("tqserve:e2e_request_latency_seconds_count") == 32
    assert delta("tqserve:time_to_first_token_seconds_count") == 32
    assert delta("tqserve:request_prompt_tokens_count") == 32
    prompt_tokens = sum(len(httpx.post(server.url + "/tokenize", json={"messages": m}).json()["tokens"])
                        for m, _, _ in results)
    assert delta("tqserve:prompt_tokens_total") == prompt_tokens
    gen = delta("tqserve:generation_tokens_total")
    assert 24 * 12 + 8 * 3 <= gen <= 24 * 12 + 8 * 24
    assert delta("tqserve:request_generation_tokens_sum") == gen
    assert delta("tqserve:request_max_num_generation_tokens_sum") == gen       # n = 1: its one sequence
    assert metric(after, "tqserve:kv_cache_capacity_tokens") > 0
    config = next(dict(labels) for name, labels in after if name == "tqserve:cache_config_info")
    assert int(config["block_size"]) > 0 and int(config["num_gpu_blocks"]) * int(config["block_size"]) >= \
        metric(after, "tqserve:kv_cache_capacity_tokens") and config["enable_prefix_caching"] == "True"
    assert metric(after, "tqserve:kv_cache_bytes_per_token", kind="all") > 0
    assert metric(after, "tqserve:kv_cache_compression_ratio") == 0.5      # fp32 KV against 16-bit


def test_nonstreaming_disconnect_aborts(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(3, connect=10))
    t_end = time.time() + 30
    while time.time() < t_end:
        after = server.metrics()
        if metric(after, "tqserve:request_success_total", finished_reason="abort") > \
                metric(before, "tqserve:request_success_total", finished_reason="abort") and \
                metric(after, "tqserve:num_requests_running") == 0 and metric(after, "tqserve:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    assert metric(after, "tqserve:request_success_total", finished_reason="abort") == \
        metric(before, "tqserve:request_success_total", finished_reason="abort") + 1
    assert metric(after, "tqserve:num_requests_running") == 0
    assert metric(after, "tqserve:kv_cache_usage_perc") == 0
    assert metric(after, "tqserve:generation_tokens_total") - metric(before, "tqserve:generation_tokens_total") < 500


def test_async_scheduling_server_answers_the_same(client, tmp_path):
    """`tqserve serve --async-scheduling`: concurrent greedy chats (one
    streamed, one ended by a stop string, one by max_tokens) answer exactly
    as the synchronous server does."""
    from concurrent.futures import ThreadPoolExecutor
    asks = [dict(max_tokens=24), dict(max_tokens=40, stop=["."]), dict(max_tokens=5),
            dict(max_tokens=30, messages=[{"role": "user", "content": "Write a haiku about rain."}]),
            dict(max_tokens=20, logprobs=True, top_logprobs=2), dict(max_tokens=24, stream=True)]

    def answers(c):
        def one(kw):
            if kw.get("stream"):
                texts, reasons, _ = stream_text(chat(c, **kw))
                return texts[0], reasons[0], None
            ch = chat(c, **kw).choices[0]
            lps = [t.token for t in ch.logprobs.content] if ch.logprobs else None
            return ch.message.content, ch.finish_reason, lps
        with ThreadPoolExecutor(len(asks)) as pool:
            return list(pool.map(one, asks))
    want = answers(client)
    srv = ServerProcess(tmp_path / "server.log", *SMALL, "--async-scheduling")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = answers(c)
    finally:
        assert srv.terminate() == 0, srv.log()[-3000:]
    assert got == want
    assert want[1][1] == "stop" and want[2][1] == "length" and want[4][2]


def test_responses_api_matches_chat(client, server):
    """/v1/responses on the real model: the same greedy text as chat, whole and
    streamed; a follow-up through previous_response_id sees the first turn."""
    c = chat(client)
    r = client.responses.create(model=MODEL, input=QUESTION[0]["content"], temperature=0, max_output_tokens=16)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    with client.responses.stream(model=MODEL, input=QUESTION[0]["content"], temperature=0,
                                 max_output_tokens=16) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text and len(deltas) > 1
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, input="And of Italy?",
                                     temperature=0, max_output_tokens=8)
    whole = chat(client, max_tokens=8, messages=QUESTION + [{"role": "assistant", "content": r.output_text},
                                                            {"role": "user", "content": "And of Italy?"}])
    assert follow.output_text == whole.choices[0].message.content
    assert f"{r.id} responses " in server.log()          # one log line per request, as the others


def test_messages_api_matches_chat(client, server):
    """/v1/messages (Anthropic's client) on the real model: chat's greedy text, whole and streamed."""
    import anthropic
    c = chat(client)
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    greedy = {"temperature": 0}       # a body field; this client version no longer has the argument
    m = a.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=greedy)
    assert m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[c.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    with a.messages.stream(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=greedy) as s:
        assert "".join(s.text_stream) == m.content[0].text


def test_return_token_ids(server, client):
    """vLLM's return_token_ids (agent RL trains on the sampled ids, not a re-tokenization)."""
    extra = {"return_token_ids": True}
    full = chat(client, max_tokens=24, extra_body=extra).model_dump()
    ids = full["choices"][0]["token_ids"]
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"]
    assert len(ids) == full["usage"]["completion_tokens"]
    detok = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert detok.startswith(full["choices"][0]["message"]["content"])     # (+ "<|im_end|>" when it stopped)
    chunks = [c.model_dump() for c in chat(client, max_tokens=24, stream=True, extra_body=extra)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == ids
    plain = chat(client).model_dump()          # not asked: not sent
    assert plain["choices"][0].get("token_ids") is None and plain.get("prompt_token_ids") is None
    prompts = ["The sea", "Once upon a time"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2,
                                  extra_body=extra).model_dump()
    for c in r["choices"]:
        want = httpx.post(server.url + "/tokenize", json={"prompt": prompts[c["index"] // 2]}).json()["tokens"]
        assert c["prompt_token_ids"] == want and len(c["token_ids"]) == 6
        assert httpx.post(server.url + "/detokenize", json={"tokens": c["token_ids"]}).json()["prompt"] == c["text"]
    got: dict = {}
    for c in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True,
                                       extra_body=extra):
        ch = c.model_dump()["choices"][0]
        slot = got.setdefault(ch["index"], {"ids": [], "prompt": []})
        slot["ids"] += ch["token_ids"]
        slot["prompt"] += ch.get("prompt_token_ids") or []
    assert {i: (g["prompt"], g["ids"]) for i, g in got.items()} == \
        {c["index"]: (c["prompt_token_ids"], c["token_ids"]) for c in r["choices"]}


def test_allowed_token_ids_and_bad_words(server, client):
    """vLLM's allowed_token_ids, bad_words and return_tokens_as_token_ids over
    HTTP (what the engine does with them: test_sampling_constraints.py)."""
    def tokens(text):
        return httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    yes_no = tokens(" yes") + tokens(" no")
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=4, temperature=0,
                                  logprobs=1, extra_body={"allowed_token_ids": yes_no, "return_token_ids": True,
                                                          "return_tokens_as_token_ids": True}).model_dump()
    c = r["choices"][0]
    assert set(c["token_ids"]) <= set(yes_no) and len(c["token_ids"]) == 4
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)
    # bad_words: the greedy answer's first word, in both spellings, never comes out.
    plain = chat(client, extra_body={"return_token_ids": True}).model_dump()["choices"][0]
    word = next(w for w in plain["message"]["content"].split() if w.isalpha())
    seqs = [tokens(word), tokens(" " + word)]
    assert any(plain["token_ids"][i:i + len(s)] == s for s in seqs for i in range(len(plain["token_ids"])))
    ids = chat(client, extra_body={"return_token_ids": True, "bad_words": [word]}).model_dump()["choices"][0]["token_ids"]
    assert ids != plain["token_ids"]
    assert not any(ids[i:i + len(s)] == s for s in seqs for i in range(len(ids)))
    u = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    assert _err(httpx.post(u, json={**base, "allowed_token_ids": []}), 400)["param"] == "allowed_token_ids"
    assert "out of vocabulary" in _err(httpx.post(u, json={**base, "allowed_token_ids": [10**7]}), 400)["message"]
    assert "bad_words" in _err(httpx.post(u, json={**base, "bad_words": ["  "]}), 400)["message"]


def test_beam_search(server, client):
    """vLLM's use_beam_search over HTTP: `n` beams, best first, the same as
    the offline LLM.beam_search with the server's settings (the comparison
    with transformers' beam search: test_beam_search.py); streamed as one
    piece; what it cannot honour is a 400."""
    from engine import LLM, BeamSearchParams
    prompt = "The capital of France is"
    extra = {"use_beam_search": True, "return_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, logprobs=2,
                                  extra_body=extra).model_dump()
    ids = r["choices"][0]["prompt_token_ids"]
    llm = LLM(MODEL, max_model_len=1024, kv_cache_memory=192 << 20, max_num_batched_tokens=512)
    want = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
    assert [c["token_ids"] for c in r["choices"]] == [b.tokens[len(ids):] for b in want]
    assert [c["text"] for c in r["choices"]] == [b.text for b in want]
    assert len({c["text"] for c in r["choices"]}) == 3 and r["usage"]["completion_tokens"] == 18
    for c, b in zip(r["choices"], want):
        chosen = [d[t] for d, t in zip(b.logprobs, b.tokens[len(ids):])]
        assert c["logprobs"]["token_logprobs"] == pytest.approx(chosen, abs=1e-3)
    kw = dict(n=2, max_tokens=8, extra_body={"use_beam_search": True, "length_penalty": 0.5})
    full = [c.message.content for c in chat(client, **kw).choices]
    texts, _, _ = stream_text(chat(client, stream=True, **kw))
    assert [texts[i] for i in range(2)] == full and len(set(full)) == 2
    u = server.url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "use_beam_search": True}
    assert _err(httpx.post(u, json={**base, "stop": ["x"]}), 400)["param"] == "stop"
    assert _err(httpx.post(u, json={**base, "presence_penalty": 0.5}), 400)["param"] == "presence_penalty"


def test_embeddings_beside_chats_leak_nothing(server, client):
    """Embeddings, reranks and streamed chats at once: every result as alone,
    and afterwards no request runs and every KV block is back."""
    lines = [ln for ln in SHAKESPEARE.read_text().splitlines() if len(ln) > 30][200:212]
    alone = [d.embedding for d in client.embeddings.create(model=MODEL, input=lines[:6]).data]

    async def chat_one(ac, i):
        stream = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": lines[i]}], max_tokens=10, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        return sum([len(c.choices[0].delta.content or "") for c in [x async for x in stream] if c.choices]) > 0

    async def embed_one(ac, i):
        r = await ac.embeddings.create(model=MODEL, input=lines[i:i + 3])
        return i, [d.embedding for d in r.data]

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        async with httpx.AsyncClient(timeout=300) as h:
            rerank = h.post(server.url + "/v1/rerank", json={"query": lines[0], "documents": lines[1:6]})
            return await asyncio.gather(*[chat_one(ac, i) for i in range(6)], *[embed_one(ac, i) for i in (0, 3)],
                                        rerank)

    out = asyncio.run(run())
    assert all(out[:6])
    for i, vecs in out[6:8]:
        for v, w in zip(vecs, alone[i:i + 3]):
            assert max(abs(a - b) for a, b in zip(v, w)) < 1e-3
    assert out[8].status_code == 200 and len(out[8].json()["results"]) == 5
    idle_metrics(server)
