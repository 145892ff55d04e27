"""Tool calls and reasoning through the HTTP layer, on recorded model texts: a
stand-in engine (test_server_fake_engine.FakeAsyncLLM) writes a fixed script,
the official openai client reads the result, streamed and not. The grammar
each forced tool_choice sends to the engine is checked here too; that the
engine enforces it is tests/test_server_structured.py's job (real model)."""
import json

import pytest
from openai import OpenAI
from test_server_fake_engine import FakeAsyncLLM, LiveServer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                           "required": ["tz"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]
ONE_CALL = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>')
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tōkyō"}}\n</tool_call>')
MALFORMED = '<tool_call>\nget_weather(city="Paris")\n</tool_call>'
BAD_ARGS = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}\n</tool_call>'
THINK = "<think>The user wants weather.\nI should call the tool.</think>\n\n" + ONE_CALL


def serve(script, **config):
    srv = LiveServer(FakeAsyncLLM(script=script, max_model_len=1024), **config)
    client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
    return srv, client


@pytest.fixture
def server(request):
    script, config = request.param if isinstance(request.param, tuple) else (request.param, {})
    srv, client = serve(script, **config)
    yield srv, client
    srv.stop()


def create(client, **kw):
    return client.chat.completions.create(**{"model": "fake", "messages": ASK, "tools": TOOLS,
                                             "max_tokens": 400, "temperature": 0, **kw})


def reassemble(chunks):
    """content, reasoning, calls {index: {id, name, arguments}}, finish reason of one streamed choice."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                cur = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert cur["id"] is None and tc.function.name, "id and name come once, first"
                    cur["id"], cur["name"] = tc.id, tc.function.name
                else:
                    assert cur["id"] is not None, "arguments before the call's name"
                cur["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("server", [ONE_CALL], indirect=True)
def test_one_call(server):
    _, client = server
    c = create(client).choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me check.\n"          # as vLLM: the text before the call
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}
    content, _, calls, finish = reassemble(create(client, stream=True))
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]


@pytest.mark.parametrize("server", [TWO_CALLS], indirect=True)
def test_parallel_calls_stream_like_nonstream(server):
    _, client = server
    m = create(client).choices[0].message
    assert m.content is None
    full = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls]
    assert full == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Asia/Tōkyō"})]
    content, _, calls, finish = reassemble(create(client, stream=True))
    assert content == "" and finish == "tool_calls" and sorted(calls) == [0, 1]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in (0, 1)] == full
    assert len({calls[0]["id"], calls[1]["id"]}) == 2
    # parallel_tool_calls false (OpenAI's "at most one call"): the first call only, whole and streamed
    m = create(client, parallel_tool_calls=False).choices[0]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == full[:1]
    assert m.finish_reason == "tool_calls"
    content, _, calls, finish = reassemble(create(client, stream=True, parallel_tool_calls=False))
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == full[:1]


@pytest.mark.parametrize("server", [MALFORMED], indirect=True)
def test_malformed_call_is_content(server):
    _, client = server
    c = create(client).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == MALFORMED
    content, _, calls, finish = reassemble(create(client, stream=True))
    assert (content, calls, finish) == (MALFORMED, {}, "stop")


@pytest.mark.parametrize("server", [BAD_ARGS], indirect=True)
def test_bad_arguments_are_content(server):
    _, client = server
    c = create(client).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and c.message.content == BAD_ARGS
    # Streamed, the call's name went out before its arguments turned out bad (as in vLLM):
    # the stream still ends cleanly and carries what the model wrote.
    content, _, calls, finish = reassemble(create(client, stream=True))
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert "{city: Paris}" in calls[0]["arguments"] + content


@pytest.mark.parametrize("server", [ONE_CALL], indirect=True)
def test_tool_choice_none_never_calls(server):
    srv, client = server
    for stream in (False, True):
        r = create(client, tool_choice="none", stream=stream)
        if stream:
            content, _, calls, finish = reassemble(r)
        else:
            c = r.choices[0]
            content, calls, finish = c.message.content, c.message.tool_calls, c.finish_reason
        assert content == ONE_CALL and not calls and finish == "stop"
    assert srv.llm.params[-1].structured_outputs is None


@pytest.mark.parametrize("server", [ONE_CALL], indirect=True)
def test_forced_choice_sends_a_grammar(server):
    srv, client = server
    create(client, tool_choice="auto")
    assert srv.llm.params[-1].structured_outputs is None
    create(client, tool_choice="required", parallel_tool_calls=False)
    g = srv.llm.params[-1].structured_outputs.grammar
    assert "get_weather" in g and "get_time" in g and "<tool_call>" in g
    create(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    g = srv.llm.params[-1].structured_outputs.grammar
    assert "get_time" in g and "get_weather" not in g


@pytest.mark.parametrize("server", [(THINK, {"reasoning_parser": "qwen3"})], indirect=True)
def test_reasoning_then_call(server):
    srv, client = server
    m = create(client).choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants weather.\nI should call the tool."
    assert m.content.strip() == "Let me check." and m.tool_calls[0].function.name == "get_weather"
    content, reasoning, calls, finish = reassemble(create(client, stream=True))
    assert reasoning == m.model_extra["reasoning_content"]
    assert content.strip() == "Let me check." and calls[0]["name"] == "get_weather"
    # JSON output of a thinking model: the grammar starts after the thinking.
    create(client, tools=None, response_format={"type": "json_object"})
    so = srv.llm.params[-1].structured_outputs
    assert so.json_object and so.start_after == tuple(srv.llm.tokenizer.encode("</think>", add_special_tokens=False))


@pytest.mark.parametrize("server", [("Paris.", {"reasoning_parser": "qwen3"})], indirect=True)
def test_reasoning_parser_without_thinking(server):
    _, client = server
    m = create(client, tools=None).choices[0].message
    assert m.content == "Paris." and m.model_extra.get("reasoning_content") is None


@pytest.mark.parametrize("server", ["I think it is Paris.</think>Paris."], indirect=True)
def test_no_reasoning_parser_keeps_text(server):
    _, client = server
    m = create(client, tools=None).choices[0].message
    assert m.content == "I think it is Paris.</think>Paris." and "reasoning_content" not in (m.model_extra or {})


@pytest.mark.parametrize("server", [(ONE_CALL, {"reasoning_parser": "deepseek_r1"})], indirect=True)
def test_deepseek_r1_cut_thinking_is_reasoning(server):
    # deepseek_r1's template opens the thinking in the prompt: text with no </think> is still thinking.
    _, client = server
    m = create(client, tools=None).choices[0].message
    assert m.model_extra["reasoning_content"] == ONE_CALL and m.content is None


@pytest.mark.parametrize("server", [ONE_CALL], indirect=True)
@pytest.mark.parametrize("body, match", [
    ({"tool_choice": "required", "tools": None}, "tool_choice needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_400(server, body, match):
    import openai
    _, client = server
    with pytest.raises(openai.BadRequestError, match=match) as e:
        create(client, **body)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"


# Qwen3's chat template's thinking switch (the part that matters here): with
# enable_thinking false the prompt already holds an empty, closed thinking block.
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")


@pytest.mark.parametrize("server", [('<think>Paris is in France.</think>\n\n{"city": "Paris"}',
                                     {"reasoning_parser": "qwen3"})], indirect=True)
def test_qwen3_template_thinking_switch(server):
    srv, client = server
    srv.llm.chat_template = QWEN3_TEMPLATE
    fmt = {"type": "json_object"}
    m = create(client, tools=None, response_format=fmt).choices[0].message
    assert m.model_extra["reasoning_content"] == "Paris is in France."
    assert json.loads(m.content) == {"city": "Paris"}
    marker = tuple(srv.llm.tokenizer.encode("</think>", add_special_tokens=False))
    assert srv.llm.params[-1].structured_outputs.start_after == marker    # JSON after the thinking
    # Thinking off: the prompt closes it, the grammar applies from the first token and all text is content.
    m = create(client, tools=None, response_format=fmt,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert srv.llm.params[-1].structured_outputs.start_after == ()
    assert m.content.startswith("<think>") and m.model_extra.get("reasoning_content") is None


DSML_CALL = ("The user wants weather.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"unit\" string=\"true\">c</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


@pytest.mark.parametrize("server", [(DSML_CALL, {"reasoning_parser": "deepseek_v3"})], indirect=True)
def test_deepseek_v4_agent_turns(server):
    """DeepSeek-V4's built-in template (no --tool-call-parser: its DSML markers pick
    deepseek_v4): thinking switched on per request, the call parsed, and the next
    turn (the call as the client echoes it, then the tool's result) rendered back
    in V4's format, as the model's encoder writes it."""
    import openai
    from model_zoo.chat_template import builtin_template, render_chat
    srv, client = server
    srv.llm.chat_template = template = builtin_template("deepseek_v4")
    srv.llm.max_model_len = 8192      # its tools section is ~1,400 bytes, a token each here
    think = {"chat_template_kwargs": {"thinking": True}}
    m = create(client, max_tokens=1000, extra_body=think).choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]
    prompt = srv.llm.tokenizer.decode(srv.llm.prompts[-1])
    assert prompt == render_chat(template, ASK, tools=TOOLS, thinking=True) and prompt.endswith("<think>")

    turn = m.model_dump(exclude_none=True)
    turn["reasoning_content"] = m.model_extra["reasoning_content"]
    history = ASK + [turn, {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "18 C"}]
    create(client, max_tokens=1000, messages=history, extra_body=think)
    prompt = srv.llm.tokenizer.decode(srv.llm.prompts[-1])
    assert prompt.endswith("<｜Assistant｜><think>The user wants weather.</think>\n\n<｜DSML｜tool_calls>\n"
                           "<｜DSML｜invoke name=\"get_weather\">\n"
                           "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
                           "<｜DSML｜parameter name=\"unit\" string=\"true\">c</｜DSML｜parameter>\n"
                           "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
                           "<｜User｜><tool_result>18 C</tool_result><｜Assistant｜><think>")

    # reasoning_effort reaches the template (V4's "max" preamble); chat mode by default
    create(client, max_tokens=1000, reasoning_effort="max", extra_body=think)
    assert srv.llm.tokenizer.decode(srv.llm.prompts[-1]).startswith(
        "<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    m = create(client, max_tokens=1000).choices[0].message
    assert srv.llm.tokenizer.decode(srv.llm.prompts[-1]).endswith("<｜Assistant｜></think>")
    assert m.model_extra.get("reasoning_content") is None        # chat mode: all of it is content
    with pytest.raises(openai.BadRequestError, match="reasoning_effort") as e:
        create(client, reasoning_effort="extreme")
    assert e.value.status_code == 400


QWEN3_CODER_TEMPLATE = (   # the tool-call part of Qwen3-Coder's template (its <function=...> markers pick the parser)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for tc in m['tool_calls'] or [] %}\n<tool_call>\n<function={{ tc['function']['name'] }}>\n"
    "{% for k, v in tc['function']['arguments'] | items %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
CODER_CALL = ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
              "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("server", [CODER_CALL], indirect=True)
def test_qwen3_coder_calls(server):
    """Qwen3-Coder's XML-like calls through the server: the parser comes from the
    template, whole and streamed give the same call, and the call goes back into
    the next prompt as the model wrote it."""
    srv, client = server
    srv.llm.chat_template = QWEN3_CODER_TEMPLATE
    m = create(client).choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content == "I'll check.\n"
    call = m.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "São Paulo",
                                                                                         "unit": "c"})
    content, _, calls, finish = reassemble(create(client, stream=True))
    assert content == "I'll check.\n" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "São Paulo",
                                                                                                 "unit": "c"})]
    create(client, messages=ASK + [m.message.model_dump(exclude_none=True),
                                   {"role": "tool", "tool_call_id": call.id, "content": "18"}])
    assert srv.llm.tokenizer.decode(srv.llm.prompts[-1]).count(CODER_CALL.split("\n", 1)[1]) == 1
