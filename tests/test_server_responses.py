"""/v1/responses (OpenAI's Responses API) with the official openai client, on
the stand-in engine of test_server_fake_engine (it writes a fixed script; its
prompts are recorded): the request becomes the chat request it should (same
prompt as /v1/chat/completions renders), output items and stream events as
the client's own stream accumulator accepts them, stored responses and
previous_response_id, errors in OpenAI's shape."""
import json
import time

import openai
import pytest
from openai import OpenAI
from test_server_fake_engine import FakeAsyncLLM, LiveServer
from test_server_tools_fake import ONE_CALL, THINK

from model_zoo.chat_template import render_chat

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}}
# Renders tool calls and tool results, so the prompts show how a conversation was rebuilt.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['reasoning_content'] is defined %}[thought: {{ m['reasoning_content'] }}]{% endif %}"
            "{% for c in m['tool_calls'] or [] %}[call {{ c['id'] }} {{ c['function']['name'] }}"
            "{{ c['function']['arguments'] | tojson }}]{% endfor %}"
            "{% if m['tool_call_id'] is defined %}[for {{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
            "{% if tools %}<|tools|>{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n"
            "{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def served(request):
    script, config = getattr(request, "param", (ONE_CALL, {}))
    srv = LiveServer(FakeAsyncLLM(script=script, max_model_len=4096), **config)
    srv.llm.chat_template = TEMPLATE
    client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
    yield srv, client
    srv.stop()


def prompt(srv) -> str:
    return srv.llm.tokenizer.decode(srv.llm.prompts[-1])


def shape(items) -> list[tuple]:
    """Output items without their ids."""
    out = []
    for i in items:
        d = i.model_dump() if hasattr(i, "model_dump") else i
        if d["type"] == "message":
            out.append(("message", d["status"], "".join(c["text"] for c in d["content"])))
        elif d["type"] == "reasoning":
            out.append(("reasoning", d["status"], "".join(c["text"] for c in d["content"])))
        else:
            out.append(("function_call", d["status"], d["name"], d["arguments"], d["call_id"].startswith("call_")))
    return out


def stream(client, **kw):
    """(final response, events) through the client's own accumulator, which checks
    the events' identities and order."""
    with client.responses.stream(**kw) as s:
        events = list(s)
        # an incomplete response ends with response.incomplete, which the helper leaves alone
        final = s.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return final, events


def test_text_and_call_stream_as_they_do_whole(served):
    srv, client = served
    kw = dict(model="fake", input="Weather in Paris?", instructions="Be brief.", tools=[WEATHER], temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert prompt(srv) == render_chat(TEMPLATE, [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Weather in Paris?"}],
                                      tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                               if k != "type"}}])
    assert shape(r.output) == [("message", "completed", "Let me check.\n"),
                               ("function_call", "completed", "get_weather", '{"city": "Paris", "unit": "c"}', True)]
    assert r.output_text == "Let me check.\n"
    n_in = len(srv.llm.prompts[-1])
    assert (r.usage.input_tokens, r.usage.output_tokens) == (n_in, len(ONE_CALL.encode()) + 1)  # + eos
    assert r.usage.total_tokens == n_in + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.tools[0].name == "get_weather" and r.temperature == 0

    final, events = stream(client, **kw)
    assert shape(final.output) == shape(r.output) and final.usage == r.usage
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "Let me check.\n" and args == '{"city": "Paris", "unit": "c"}'
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in final.output]


def test_same_prompt_and_text_as_chat(served):
    srv, client = served
    srv.llm.script = None             # the stand-in's own text: a function of the prompt
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                          {"type": "input_text", "text": "there"}]}]
    r = client.responses.create(model="fake", input=parts, max_output_tokens=12, temperature=0)
    via_responses = prompt(srv)
    c = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}],     # parts: joined as chat joins them
                                       max_tokens=12, temperature=0)
    assert prompt(srv) == via_responses
    assert r.output_text == c.choices[0].message.content
    # cut by max_output_tokens: incomplete, as OpenAI reports it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 12
    final, events = stream(client, model="fake", input=parts, max_output_tokens=12, temperature=0)
    assert events[-1].type == "response.incomplete" and final.output_text == r.output_text


@pytest.mark.parametrize("served", [(THINK, {"reasoning_parser": "qwen3"})], indirect=True)
def test_reasoning_items(served):
    srv, client = served
    r = client.responses.create(model="fake", input="Weather?", tools=[WEATHER])
    assert shape(r.output) == [
        ("reasoning", "completed", "The user wants weather.\nI should call the tool."),
        ("message", "completed", "\n\nLet me check.\n"),          # as chat: the text after </think> as written
        ("function_call", "completed", "get_weather", '{"city": "Paris", "unit": "c"}', True)]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    final, events = stream(client, model="fake", input="Weather?", tools=[WEATHER])
    assert shape(final.output) == shape(r.output)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "The user wants weather.\nI should call the tool."
    # The reasoning goes back with the turn it belongs to (stateless: the output items as input).
    client.responses.create(model="fake", input=[{"role": "user", "content": "Weather?"}] + r.output + [
        {"type": "function_call_output", "call_id": r.output[2].call_id, "output": "18 C"}], store=False)
    call = r.output[2]
    assert prompt(srv) == render_chat(TEMPLATE, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "\n\nLet me check.\n",
         "reasoning_content": "The user wants weather.\nI should call the tool.",
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}])


def test_previous_response_id_and_the_store(served):
    srv, client = served
    first = client.responses.create(model="fake", input="Weather in Paris?", instructions="Be brief.",
                                    tools=[WEATHER])
    call = first.output[-1]
    second = client.responses.create(model="fake", previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 C"}])
    # the whole conversation, its instructions not carried over (OpenAI's rule)
    assert prompt(srv) == render_chat(TEMPLATE, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.\n", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    for call_api in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                     lambda: client.responses.create(model="fake", previous_response_id=first.id, input="x")):
        with pytest.raises(openai.NotFoundError) as e:
            call_api()
        assert e.value.body["type"] == "invalid_request_error" and first.id in e.value.body["message"]
    unstored = client.responses.create(model="fake", input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_list_a_requests_input(served):
    """OpenAI's GET /v1/responses/{id}/input_items through the client: the
    request's own items with ids, newest first by default, paged by limit /
    after; a text input is one user message of input_text."""
    _, client = served
    first = client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER])
    items = client.responses.input_items.list(first.id).data
    assert len(items) == 1 and items[0].type == "message" and items[0].role == "user"
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Weather in Paris?"
    call = first.output[-1]
    given = [{"type": "message", "role": "user", "content": "one"},
             {"type": "message", "role": "assistant", "content": "two"},
             {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    second = client.responses.create(model="fake", input=given, tools=[WEATHER])
    asc = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in asc] == ["message", "message", "function_call", "function_call_output"]
    assert asc[1].content[0].type == "output_text" and asc[3].output == "18 C"
    assert len({i.id for i in asc}) == 4
    page = client.responses.input_items.list(second.id, limit=2)       # newest first
    assert [i.id for i in page.data] == [asc[3].id, asc[2].id] and page.has_more
    rest = client.responses.input_items.list(second.id, limit=2, after=page.data[-1].id)
    assert [i.id for i in rest.data] == [asc[1].id, asc[0].id] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(second.id).data] == [i.id for i in asc[::-1]]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=500)


@pytest.mark.parametrize("served", [(ONE_CALL, {"responses_store_size": 2})], indirect=True)
def test_store_is_bounded(served):
    _, client = served
    ids = [client.responses.create(model="fake", input=f"q{i}").id for i in range(3)]
    client.responses.retrieve(ids[1])                          # used: the oldest is ids[0]
    client.responses.create(model="fake", input="q3")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[1]).id == ids[1]
    with pytest.raises(openai.NotFoundError):                  # ids[2] went when q3 came
        client.responses.retrieve(ids[2])


def test_formats_choices_and_extras_reach_the_engine(served):
    srv, client = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(model="fake", input="x", text={"format": {"type": "json_schema", "name": "A",
                                                                      "schema": schema, "strict": True}})
    assert srv.llm.params[-1].structured_outputs.json == schema
    client.responses.create(model="fake", input="x", tools=[WEATHER],
                            tool_choice={"type": "function", "name": "get_weather"})
    assert "get_weather" in srv.llm.params[-1].structured_outputs.grammar
    client.responses.create(model="fake", input="x", extra_body={"top_k": 3, "seed": 7})
    p = srv.llm.params[-1]
    assert (p.top_k, p.seed) == (3, 7)


@pytest.mark.parametrize("body, match", [
    ({"background": True, "store": False}, "background needs store"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "takes no images"),
    ({"input": [{"type": "web_search_call"}]}, "web_search_call"),
    ({"input": [{"role": "narrator", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "arguments"),
    ({"input": []}, "empty"),
    ({"temperature": 3}, "temperature"),
    ({"top_k": "3"}, "top_k"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "not in tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"reasoning": {"effort": "extreme"}}, "effort"),
])
def test_bad_requests_are_400(served, body, match):
    _, client = served
    with pytest.raises(openai.BadRequestError, match=match) as e:
        client.post("/responses", cast_to=object, body={"model": "fake", "input": "hi", **body})
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"


def test_reasoning_effort_reaches_the_template(served):
    srv, client = served
    srv.llm.chat_template = "{{ reasoning_effort }}|{{ messages[0]['content'] }}"
    client.responses.create(model="fake", input="x", reasoning={"effort": "high"})
    assert prompt(srv) == "high|x"
    stored = client.responses.create(model="fake", input="y", reasoning={"effort": "low"})
    assert stored.reasoning.effort == "low" and json.loads(stored.model_dump_json())["reasoning"]["effort"] == "low"


def test_client_gone_aborts(served):
    """A stream or a whole response the client leaves is aborted in the engine."""
    import time

    import httpx
    srv, _ = served
    srv.llm.script = None
    before = len(srv.llm.aborted)
    body = {"model": "fake", "input": "x", "max_output_tokens": 200, "stream": True, "extra": 1}
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "ignore_eos": True}, timeout=30) as r:
        for _ in zip(range(6), r.iter_lines()):
            pass
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/responses", json={**body, "stream": False, "ignore_eos": True}, timeout=0.3)
    deadline = time.time() + 5
    while time.time() < deadline and (len(srv.llm.aborted) < before + 2 or srv.call(lambda: srv.llm.running)):
        time.sleep(0.05)
    assert len(srv.llm.aborted) == before + 2
    assert srv.call(lambda: len(srv.llm.running)) == 0 and srv.state.inflight == 0


def _wait(client, rid, states, limit=20.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        r = client.responses.retrieve(rid)
        if r.status in states:
            return r
        time.sleep(0.02)
    raise AssertionError(f"{rid} still {r.status}")


def test_background_responses(served):
    srv, client = served
    srv.llm.script = None             # the stand-in's own text: a function of the prompt
    fg = client.responses.create(model="fake", input="hi", temperature=0, max_output_tokens=20)
    bg = client.responses.create(model="fake", input="hi", temperature=0, max_output_tokens=20, background=True)
    assert bg.status == "queued" and bg.background and bg.output == []
    done = _wait(client, bg.id, ("completed", "incomplete"))
    assert done.output_text == fg.output_text and done.usage.output_tokens == fg.usage.output_tokens
    assert done.background and not fg.background
    # A long one: in progress, not a base to continue from yet, then cancelled in the engine too.
    srv.llm.step_s = 0.02
    long = client.responses.create(model="fake", input="go on", temperature=0, max_output_tokens=2000,
                                   background=True, extra_body={"ignore_eos": True})
    _wait(client, long.id, ("in_progress",))
    with pytest.raises(openai.BadRequestError, match="still in progress"):
        client.responses.create(model="fake", input="and?", previous_response_id=long.id)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    assert long.id in srv.llm.aborted and srv.call(lambda: not srv.llm.running)
    assert client.responses.cancel(long.id).status == "cancelled"           # again: as it is
    with pytest.raises(openai.BadRequestError, match="Only a background response"):
        client.responses.cancel(fg.id)
    # Deleting one that runs stops it.
    gone = client.responses.create(model="fake", input="more", temperature=0, max_output_tokens=2000,
                                   background=True, extra_body={"ignore_eos": True})
    _wait(client, gone.id, ("in_progress",))
    client.responses.delete(gone.id)
    deadline = time.monotonic() + 10
    while gone.id not in srv.llm.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone.id in srv.llm.aborted and not srv.state.background
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_streamed_background_response_resumes(served):
    """OpenAI's background + stream: the POST streams the events, a client
    that leaves does not stop the response, GET ?stream=true&starting_after=N
    (the openai client's retrieve(stream=True)) reads them again from any
    point, live while it runs; its text is the foreground response's."""
    srv, client = served
    srv.llm.script = None
    kw = dict(model="fake", input="hi", temperature=0, max_output_tokens=40)
    fg, _ = stream(client, **kw)
    whole, _ = stream(client, **kw, background=True)        # read to its end through the POST
    assert whole.output_text == fg.output_text and whole.background
    srv.llm.step_s = 0.02
    with client.responses.create(**kw, background=True, stream=True) as s:
        it = iter(s)
        first = [next(it) for _ in range(3)]        # then the client leaves
    rid = first[0].response.id
    assert [e.sequence_number for e in first] == [0, 1, 2] and first[0].response.background
    live = list(client.responses.retrieve(rid, stream=True, starting_after=1))     # joins while it runs
    assert live[0].sequence_number == 2 and [e.sequence_number for e in live] == list(range(2, 2 + len(live)))
    done = _wait(client, rid, ("completed", "incomplete"))
    assert done.output_text == fg.output_text and done.background
    again = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in again] == list(range(len(again))) and again[2:] == live
    text = "".join(e.delta for e in again if e.type == "response.output_text.delta")
    assert text == fg.output_text and again[-1].response.status == done.status
    with pytest.raises(openai.BadRequestError, match="created with stream"):
        list(client.responses.retrieve(fg.id, stream=True))
    # Cancelled while streaming: the events end, the body says so.
    srv.llm.step_s = 0.05
    with client.responses.create(model="fake", input="go on", max_output_tokens=2000, background=True, stream=True,
                                 extra_body={"ignore_eos": True}) as s:
        rid = next(iter(s)).response.id
    _wait(client, rid, ("in_progress",))
    assert client.responses.cancel(rid).status == "cancelled"
    ended = list(client.responses.retrieve(rid, stream=True))
    assert ended[-1].response.status == "cancelled" and not srv.state.background
    # Deleted while streaming: it stops and stays gone.
    with client.responses.create(model="fake", input="more", max_output_tokens=2000, background=True, stream=True,
                                 extra_body={"ignore_eos": True}) as s:
        rid = next(iter(s)).response.id
    _wait(client, rid, ("in_progress",))
    client.responses.delete(rid)
    deadline = time.monotonic() + 10
    while srv.state.background and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not srv.state.background
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)


def test_truncation_auto_drops_the_oldest_turns(served):
    """truncation "auto" (OpenAI's): a conversation over the context loses
    its oldest turns (the instructions and the last turn stay) until the
    prompt leaves room for the output; "disabled" (the default) is a 400."""
    srv, client = served
    turns = []
    for i in range(8):          # ~8 x 1,000 bytes: twice the 4,096-token context of the byte-level stand-in
        turns += [{"role": "user", "content": f"question {i} " + "x" * 500},
                  {"role": "assistant", "content": f"answer {i} " + "y" * 500}]
    turns.append({"role": "user", "content": "last question"})
    kw = dict(model="fake", input=turns, instructions="Be brief.", max_output_tokens=100)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(**kw)
    r = client.responses.create(**kw, truncation="auto")
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    seen = prompt(srv)
    assert "Be brief." in seen and "last question" in seen and "question 0 " not in seen
    assert len(srv.llm.prompts[-1]) <= srv.llm.max_model_len - 100
    kept = [i for i in range(8) if f"question {i} " in seen]
    assert kept and kept == list(range(kept[0], 8)) and kept[0] >= 3         # the newest turns, whole


@pytest.mark.parametrize("served", [(ONE_CALL, {"responses_store_size": 0})], indirect=True)
def test_background_needs_a_store(served):
    srv, client = served
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(model="fake", input="hi", background=True)
    assert not srv.llm.params          # nothing reached the engine
