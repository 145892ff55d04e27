"""/v1/messages (Anthropic's Messages API) with the official anthropic client,
on the stand-in engine of test_server_fake_engine (a fixed script; prompts
recorded): the request becomes the chat request it should (its prompt is what
the chat template renders for the equivalent chat messages), content blocks
and stream events as the client's own accumulator takes them, stop reasons,
count_tokens, x-api-key auth, errors in Anthropic's shape."""
import anthropic
import pytest
from test_server_fake_engine import FakeAsyncLLM, LiveServer
from test_server_responses import TEMPLATE
from test_server_tools_fake import ONE_CALL, THINK

from model_zoo.chat_template import render_chat

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                         "required": ["city", "unit"]}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"],
                                                "description": "Weather for a city"}}]


@pytest.fixture
def served(request):
    script, config = getattr(request, "param", (THINK, {"reasoning_parser": "qwen3"}))
    srv = LiveServer(FakeAsyncLLM(script=script, max_model_len=4096), **config)
    srv.llm.chat_template = TEMPLATE
    client = anthropic.Anthropic(base_url=srv.url, api_key=(config.get("api_keys") or ["none"])[0], max_retries=0,
                                 timeout=30)
    yield srv, client
    srv.stop()


def prompt(srv) -> str:
    return srv.llm.tokenizer.decode(srv.llm.prompts[-1])


def blocks(content) -> list[tuple]:
    out = []
    for b in content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", b.name, b.input, b.id.startswith("call_")))
    return out


def test_a_tool_turn_whole_and_streamed(served):
    srv, client = served
    kw = dict(model="fake", max_tokens=500, system="Be brief.", tools=[TOOL],
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    m = client.messages.create(**kw)
    assert prompt(srv) == render_chat(TEMPLATE, [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Weather in Paris?"}], tools=CHAT_TOOLS)
    assert blocks(m.content) == [("thinking", "The user wants weather.\nI should call the tool."),
                                 ("text", "\n\nLet me check.\n"),
                                 ("tool_use", "get_weather", {"city": "Paris", "unit": "c"}, True)]
    assert m.stop_reason == "tool_use" and m.stop_sequence is None and m.id.startswith("msg_")
    assert m.usage.input_tokens == len(srv.llm.prompts[-1]) and m.usage.output_tokens == len(THINK.encode()) + 1
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert blocks(final.content) == blocks(m.content) and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == m.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    raw = "".join(e.delta.partial_json for e in events
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert raw == '{"city": "Paris", "unit": "c"}'


def test_the_conversation_is_rebuilt(served):
    """Thinking, text and tool_use go back as one assistant turn; tool_result blocks
    as tool messages before the user's text; a last assistant turn is continued."""
    srv, client = served
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Paris."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "Thanks."}]}]
    client.messages.create(model="fake", max_tokens=50, tools=[TOOL], messages=history)
    assert prompt(srv) == render_chat(TEMPLATE, [
        {"role": "user", "content": "Weather?\nIn Paris."},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "Thanks."}], tools=CHAT_TOOLS)
    # a failed tool says so; prefill: the last assistant turn is continued, no new turn opened
    client.messages.create(model="fake", max_tokens=50, messages=[
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}]},
        {"role": "assistant", "content": "One, two,"}])
    assert prompt(srv).endswith("<|tool|>Error: boom[for t]<|assistant|>One, two,")


@pytest.mark.parametrize("served", [(ONE_CALL, {})], indirect=True)
def test_stop_reasons_and_choices(served):
    srv, client = served
    ask = [{"role": "user", "content": "hi"}]
    m = client.messages.create(model="fake", max_tokens=500, messages=ask, stop_sequences=["check"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "check") and m.content[0].text == "Let me "
    m = client.messages.create(model="fake", max_tokens=5, messages=ask)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    m = client.messages.create(model="fake", max_tokens=500, messages=ask)
    assert m.stop_reason == "end_turn"         # no tools: the call is text
    client.messages.create(model="fake", max_tokens=500, messages=ask, tools=[TOOL], tool_choice={"type": "any"})
    assert "get_weather" in srv.llm.params[-1].structured_outputs.grammar
    client.messages.create(model="fake", max_tokens=500, messages=ask, tools=[TOOL],
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert "get_weather" in srv.llm.params[-1].structured_outputs.grammar
    m = client.messages.create(model="fake", max_tokens=500, messages=ask, tools=[TOOL], tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and m.content[0].text == ONE_CALL
    srv.llm.chat_template = "{{ enable_thinking }}/{{ thinking }}|{{ messages[0]['content'] }}"
    client.messages.create(model="fake", max_tokens=5, messages=ask,
                           thinking={"type": "enabled", "budget_tokens": 1024})
    assert prompt(srv) == "True/True|hi"
    client.messages.create(model="fake", max_tokens=5, messages=ask, thinking={"type": "disabled"})
    assert prompt(srv) == "False/False|hi"
    client.messages.create(model="fake", max_tokens=5, messages=ask, extra_body={"top_k": 3, "seed": 9})
    assert (srv.llm.params[-1].top_k, srv.llm.params[-1].seed) == (3, 9)
    n = client.messages.count_tokens(model="fake", messages=ask, system="Be brief.")
    client.messages.create(model="fake", max_tokens=5, messages=ask, system="Be brief.")
    assert n.input_tokens == len(srv.llm.prompts[-1])


@pytest.mark.parametrize("body, match", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "tool_use block in a user message"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "server tools"),
    ({"tool_choice": {"type": "tool"}}, "needs a name"),
])
def test_errors_in_anthropics_shape(served, body, match):
    _, client = served
    base = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in {**base, **body}.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError, match=match) as e:
        client.post("/v1/messages", cast_to=object, body=body)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("served", [(ONE_CALL, {"api_keys": ["sekrit"]})], indirect=True)
def test_x_api_key(served):
    srv, client = served
    ask = dict(model="fake", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert client.messages.create(**ask).content
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**ask)
