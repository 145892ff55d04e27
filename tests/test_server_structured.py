"""Structured outputs and tool calls on real models through the official
openai client against `tqserve serve` on 127.0.0.1: every parsed answer
validates (20 schemas x 20 prompts on SmolLM2, x 5 on Gemma3; streamed too),
each constraint kind holds, bad constraints are 400s, neighbours of a constrained request are unaffected,
and a whole tool loop runs with forced tool choices."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field
from structured_schemas import PROMPTS, SCHEMAS
from test_server_process import ServerProcess

ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--max-num-batched-tokens", "512",
        "--max-num-seqs", "32"]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def served(request, tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("srv") / "server.log", *ARGS, "--model", request.param)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    yield request.param, srv, client
    assert srv.terminate() == 0, srv.log()[-3000:]


def ask(prompt):
    return [{"role": "user", "content": prompt}]


def _parse(client, model, schema, prompt):
    r = client.chat.completions.parse(model=model, messages=ask(prompt), response_format=schema,
                                      temperature=0, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "stop", (schema.__name__, prompt, c.message.content)
    assert isinstance(c.message.parsed, schema)
    schema.model_validate_json(c.message.content)          # strict: the text itself validates
    return c.message.content


def _stream(client, model, schema, prompt):
    fmt = {"type": "json_schema", "json_schema": {"name": schema.__name__, "strict": True,
                                                  "schema": to_strict_json_schema(schema)}}
    text, finish = "", None
    for ch in client.chat.completions.create(model=model, messages=ask(prompt), response_format=fmt,
                                             temperature=0, max_tokens=300, stream=True):
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop", (schema.__name__, prompt, text)
    schema.model_validate_json(text)
    return text


# Prompts per schema: 10 on SmolLM2 (200 requests), 5 on Gemma3 (100), each
# schema a different set so all 20 prompts run with 10 (5) schemas each.
# Gemma3's 262k-row LM head costs ~0.3 s a 32-row step on 2 CPU cores, and its
# 20 x 20 took ~290 s of CI, SmolLM2's ~95 s: what the full cross product adds
# is more of the same masks on the same tokenizer.
PROMPTS_PER_SCHEMA = {"smollm2-135m": 10, "gemma3-270m": 5}


def test_parse_20_schemas_x_many_prompts(served):
    model, _, client = served
    per = PROMPTS_PER_SCHEMA[model]
    jobs = [(schema, PROMPTS[(i * per + j) % len(PROMPTS)]) for i, schema in enumerate(SCHEMAS) for j in range(per)]
    assert {p for _, p in jobs} == set(PROMPTS) and len(jobs) == per * len(SCHEMAS)
    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(lambda j: _parse(client, model, *j), jobs))
    assert len(texts) == len(jobs)
    # Streamed, every schema once (a different prompt each): the concatenated
    # deltas validate, and (greedy) equal the non-streamed text.
    picks = [i * per + i % per for i in range(len(SCHEMAS))]
    with ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(lambda i: _stream(client, model, *jobs[i]), picks))
    assert streamed == [texts[i] for i in picks] and len(streamed) == len(SCHEMAS)


def test_each_constraint_kind(served):
    model, _, client = served

    def complete(extra, prompt="Answer:", extra_body=None):
        r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=60,
                                      extra_body=extra_body or {"structured_outputs": extra})
        return r.choices[0]

    c = complete({"choice": ["alpha", "beta", "gamma delta"]})
    assert c.text in ("alpha", "beta", "gamma delta") and c.finish_reason == "stop"
    c = complete({"regex": r"[A-Z]{2}-[0-9]{4}"}, prompt="A licence plate:")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", c.text)
    c = complete({"grammar": 'root ::= "x=" [0-9] [0-9]? ";"'})
    assert re.fullmatch(r"x=[0-9][0-9]?;", c.text)
    r = client.chat.completions.create(model=model, messages=ask("Some JSON, please."), temperature=0,
                                       max_tokens=200, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert isinstance(json.loads(text), dict) or r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=model, messages=ask("Pick one."), temperature=0, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].message.content in ("left", "right")
    # vLLM's older field names (guided_*), still sent by many clients.
    c = complete(None, prompt="A licence plate:", extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}",
                                                              "guided_decoding_backend": "xgrammar"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", c.text)
    r = client.chat.completions.create(model=model, messages=ask("Pick one."), temperature=0, max_tokens=10,
                                       extra_body={"guided_choice": ["up", "down"]})
    assert r.choices[0].message.content in ("up", "down")


@pytest.mark.parametrize("body, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "strin"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"json": '{"type": "object", "properties": '}}, "json"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "give one of guided_json"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "not both"),
])
def test_bad_constraints_are_400(served, body, match):
    model, srv, client = served
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=5, extra_body=body)
    assert e.value.body["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2).choices  # still serving


def test_constrained_neighbours_unaffected(served):
    """Greedy unconstrained requests give the same text alone and batched with constrained ones."""
    model, _, client = served
    prompts = ["Write a haiku about rain.", "What is 2+2?", "Name three colours."]

    def free(p):
        return client.chat.completions.create(model=model, messages=ask(p), temperature=0, max_tokens=24,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
    alone = [free(p) for p in prompts]

    def constrained(i):
        return _parse(client, model, SCHEMAS[i], PROMPTS[i])
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(constrained, i) for i in range(3)] + [pool.submit(free, p) for p in prompts]
        mixed = [f.result() for f in futs[3:]]
    assert mixed == alone


class WeatherArgs(BaseModel):
    city: str = Field(max_length=24)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class TimeArgs(BaseModel):
    timezone: str = Field(max_length=24)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                       "required": ["timezone"], "additionalProperties": False}}}]
ARG_MODELS = {"get_weather": WeatherArgs, "get_time": TimeArgs}


def _stream_call(client, model, messages, **kw):
    calls, finish = {}, None
    for ch in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                             max_tokens=200, stream=True, **kw):
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                cur = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
                if tc.id:
                    cur["id"], cur["name"] = tc.id, tc.function.name
                cur["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_loop(served, choice):
    model, _, client = served
    messages = ask("What is the weather in Paris right now?")
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, temperature=0, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    (call,) = c.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    ARG_MODELS[call.function.name].model_validate_json(call.function.arguments)
    # Streamed, the deltas reassemble to the same call.
    calls, finish = _stream_call(client, model, messages, tool_choice=choice, parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == \
        (call.function.name, json.loads(call.function.arguments))
    # The tool's result goes back through the template; the model answers in text.
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=40)
    c = r.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")


def test_parallel_required_calls(served):
    """parallel_tool_calls: one or more calls; whatever the model completes within
    max_tokens parses and validates (a cut last call stays content)."""
    model, _, client = served
    r = client.chat.completions.create(model=model, messages=ask("Weather in Paris and the time in Tokyo?"),
                                       tools=TOOLS, tool_choice="required", temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.message.tool_calls and c.finish_reason in ("tool_calls", "length")
    for call in c.message.tool_calls:
        ARG_MODELS[call.function.name].model_validate_json(call.function.arguments)
