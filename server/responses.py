"""OpenAI's Responses API (/v1/responses), over the chat pipeline.

A request's `input` items (messages, function_call, function_call_output,
reasoning) become chat messages (an assistant's text, reasoning and calls one
turn, each function output a tool message), `instructions` a system message
first, and the rest a ChatCompletionRequest that is validated, rendered and
run as /v1/chat/completions runs it. The output comes back as Responses items:
reasoning (`reasoning_text`), message (`output_text`), function_call; a
stream sends OpenAI's typed events (response.created ... response.completed,
each with its sequence_number).

With `store` (OpenAI's default), a finished response and its conversation stay
in a bounded in-memory store (least recently used out first, see
--responses-store-size): `previous_response_id` continues from it (its
instructions are not carried over, as OpenAI's), GET and DELETE
/v1/responses/{id} read and drop it. `background` answers at once with a
"queued" response that runs on (GET shows it in_progress, then its end;
POST /v1/responses/{id}/cancel stops it: "cancelled"); with `stream` too, its
events are also kept (server/response_store.EventLog): the POST streams
them, and GET /v1/responses/{id}?stream=true&starting_after=N reads them
again from any point, live until the end, while the response runs on
whoever reads it or no one. truncation "auto" drops the oldest turns until
the prompt leaves room for the output. Not supported (a 400): input items
other than the four above, non-text content.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from server import serving
from server.errors import APIError, from_validation_error
from server.protocol import SAMPLING_EXTRAS, ChatCompletionRequest, ResponsesRequest
from server.media import load_images
from server.response_store import EventLog, StoredResponse
from server.state import ServerState

_TEXT_PARTS = ("input_text", "output_text", "text")


def _bad(message: str, param: str = "input") -> APIError:
    return APIError(400, message, param=param)


def _text(content, where: str) -> str:
    return serving.joined_text(content, where + ".content", _TEXT_PARTS, "input")


def _content(content, where: str, role: str):
    """A message's content: its text, or with input_image parts chat's text
    and image_url parts in their order (images in user messages only)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    if role != "user":
        raise _bad(f"{where}.content: input_image parts are taken in user messages only")
    parts = []
    for j, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{where}.content[{j}].image_url must be a URL string (file_id is not supported)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text([p], where)})
    return parts


def _str(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise _bad(f"{where}.{key} must be a string")
    return v


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning = None            # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}")
            msg = {"role": role, "content": _content(item.get("content"), where, role)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where),
                                 "arguments": _str(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and reasoning is None:
                out[-1].setdefault("tool_calls", []).append(call)     # the same turn as its text
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": _text(output, where + ".output") if not isinstance(output, str) else output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise _bad(f"{where}.content must be a list of reasoning_text parts")
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise _bad(f"{where}: input items of type {kind!r} are not supported "
                       "(message, function_call, function_call_output, reasoning)")
    return out


_ITEM_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def input_items(items: str | list[dict]) -> list[dict]:
    """A request's input as OpenAI lists it back (GET /v1/responses/{id}/input_items):
    items with ids, a message's text as input_text (an assistant's: output_text) parts."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message" if "role" in item else None)
        item = {"type": kind, **item}
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", _ITEM_ID_PREFIX.get(kind, "item_") + uuid.uuid4().hex)
        out.append(item)
    return out


def list_input_items(state: ServerState, response_id: str, limit: int = 20, order: str = "desc",
                     after: str | None = None) -> dict:
    """OpenAI's GET /v1/responses/{id}/input_items: a page of the request's input items."""
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, got {order!r}", param="order")
    items = stored.inputs if order == "asc" else stored.inputs[::-1]
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise APIError(400, f"No input item with id '{after}' in response '{response_id}'.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request a Responses request runs as, and its conversation (no instructions)."""
    conversation = history + input_messages(req.input)
    if not conversation:
        raise _bad("input is empty")
    return chat_for(req, conversation), conversation


def fitted(state: ServerState, req: ResponsesRequest, chat: ChatCompletionRequest,
           conversation: list[dict]) -> ChatCompletionRequest:
    """truncation "auto" (OpenAI's): while the prompt leaves no room for the
    output, drop the oldest turn (its messages up to the next user message;
    the instructions stay, and the last turn). Otherwise the request as it is
    (too long: prepare_chat's 400)."""
    room = state.llm.max_model_len - (req.max_output_tokens or 1)
    while req.truncation == "auto" and len(serving.chat_prompt(state, chat)[1]) > room:
        nxt = next((i for i in range(1, len(conversation)) if conversation[i]["role"] == "user"), None)
        if nxt is None:
            break
        conversation = conversation[nxt:]
        chat = chat_for(req, conversation)
    return chat


def chat_for(req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    body: dict = {"model": req.model, "messages": conversation, "parallel_tool_calls": req.parallel_tool_calls}
    if req.instructions:
        body["messages"] = [{"role": "system", "content": req.instructions}] + conversation
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    for key, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                       ("top_p", req.top_p), ("user", req.user),
                       ("reasoning_effort", req.reasoning.effort if req.reasoning else None)):
        if value is not None:
            body[key] = value
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in SAMPLING_EXTRAS if k in extra})
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def output_items(msg: dict, status: str = "completed") -> list[dict]:
    """A finished choice's message fields (ChatTools.message) -> Responses output items."""
    items = []
    if msg.get("reasoning_content"):
        items.append({"id": _id("rs_"), "type": "reasoning", "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        items.append({"id": _id("msg_"), "type": "message", "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": msg["content"], "annotations": [],
                                   "logprobs": []}]})
    for call in msg.get("tool_calls") or []:
        items.append({"id": _id("fc_"), "type": "function_call", "status": status, "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    return items


def assistant_message(items: list[dict]) -> dict:
    """Output items -> the assistant chat message a follow-up request sees."""
    msg: dict = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            msg["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            msg["content"] += item["content"][0]["text"]
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return msg


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":          # the server drained before it finished
        return "cancelled", None
    return "completed", None


@dataclass
class _Turn:
    """What a response body repeats of its request, and its conversation."""
    id: str
    req: ResponsesRequest
    model: str
    created: int
    conversation: list[dict]
    inputs: list[dict]          # the request's input items, with ids (input_items)

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             incomplete: dict | None = None, store: bool = True) -> dict:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": req.background, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": store, "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                            else req.tool_choice.model_dump()) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "metadata": req.metadata or {},
            "user": req.user,
            "usage": usage,
        }


def _usage(state: ServerState, final, items: list[dict]) -> dict:
    n_in = len(final.prompt_token_ids) if final is not None else 0
    n_out = sum(len(o.token_ids) for o in final.outputs) if final is not None else 0
    reasoning = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
    tok = state.llm.tokenizer
    n_reasoning = min(n_out, len(tok.encode(reasoning, add_special_tokens=False))) if reasoning else 0
    cached = getattr(final, "num_cached_tokens", 0) or 0
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": n_reasoning},
            "total_tokens": n_in + n_out}


async def create_response(state: ServerState, request: Request, req: ResponsesRequest,
                          rlog: serving.RequestLog) -> Response:
    history = []
    if req.previous_response_id is not None:
        prev = state.responses.get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id")
        if _running(state, req.previous_response_id):
            raise APIError(400, f"Response '{req.previous_response_id}' is still in progress.",
                           param="previous_response_id")
        history = prev.messages
    if req.background and state.responses.size <= 0:
        raise APIError(400, "This server keeps no responses (--responses-store-size 0), so a background one "
                            "could never be read.", param="background")
    chat, conversation = chat_request(req, history)
    serving.admit(state, [])        # (before the prompt is rendered and its images fetched)
    chat = fitted(state, req, chat, conversation)
    await load_images(state, chat.messages, param="input")
    run = serving.prepare_chat(state, chat, rlog)
    gen = serving.generate(state, run.prompt_ids, run.params, rlog.id, rlog, chat.priority,
                           cache_salt=chat.cache_salt, model=chat.model, images=run.images)
    turn = _Turn(rlog.id, req, req.model or state.model_name, int(time.time()), conversation, input_items(req.input))
    if req.background and not req.stream:
        queued = turn.body("queued", [])
        state.responses.put(turn.id, StoredResponse(queued, conversation, inputs=turn.inputs))
        _run_in_background(state, turn.id, _background(state, turn, run, gen, rlog))
        return JSONResponse(queued)
    if req.stream:
        first = await serving.first_output(request, gen)
        so = StreamedOutput()

        def error(status: int, message: str) -> str:
            code = "invalid_request_error" if status == 400 else "server_error"
            return so.event("error", code=code, message=message, param=None)
        events = _events(state, turn, serving.ChoiceDeltas(gen, first, run.tools.stream()), so)
        stream = serving.guarded(events, gen, rlog, error)
        if req.background:
            # It runs on whoever reads it: this stream, a GET that resumes it, or no one.
            log = EventLog()
            state.responses.put(turn.id, StoredResponse(turn.body("queued", []), conversation, log, turn.inputs))
            _run_in_background(state, turn.id, _record_events(state, turn, stream, log))
            stream = log.tail()
        return StreamingResponse(stream, media_type="text/event-stream", headers=serving.SSE_HEADERS)

    final = await serving.last_output(request, gen)
    o = final.outputs[0]
    status, incomplete = _status(o.finish_reason)
    msg, _ = run.tools.message(o.text)
    items = output_items(msg, "incomplete" if status == "incomplete" else "completed")
    body = _finish(state, turn, status, items, _usage(state, final, items), incomplete)
    rlog.done(200)
    return JSONResponse(body)


async def _background(state: ServerState, turn: _Turn, run, gen, rlog: serving.RequestLog) -> None:
    """A background response run to its end with no client; its body in the
    store follows it (in_progress, then completed / incomplete / cancelled)."""
    final = None
    try:
        async for out in gen:
            if final is None:
                _update(state, turn.id, turn.body("in_progress", []))
            final = out
    except Exception as e:      # noqa: BLE001 - recorded as the response's error
        body = turn.body("failed", [])
        body["error"] = {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
        _update(state, turn.id, body)
        rlog.done(500)
        return
    finally:
        await gen.aclose()
    o = final.outputs[0]
    status, incomplete = _status(o.finish_reason)
    msg, _ = run.tools.message(o.text)
    items = output_items(msg, "incomplete" if status == "incomplete" else "completed")
    if turn.id in state.responses:       # (not if deleted meanwhile)
        _finish(state, turn, status, items, _usage(state, final, items), incomplete)
    rlog.done(200)


def _run_in_background(state: ServerState, rid: str, coro) -> None:
    task = asyncio.ensure_future(coro)
    state.background[rid] = task        # (a reference: the loop keeps only weak ones)
    task.add_done_callback(lambda _: state.background.pop(rid, None))


async def _record_events(state: ServerState, turn: _Turn, stream, log: EventLog) -> None:
    """A streamed background response's events into its log (the store's
    body follows: in_progress, then its end, or failed after an error event)."""
    try:
        async for chunk in stream:
            if not log.events:
                _update(state, turn.id, turn.body("in_progress", []))
            log.add(chunk)
    finally:
        stored = state.responses.peek(turn.id)
        if stored is not None and stored.body["status"] in ("queued", "in_progress"):   # it ended in an error
            stored.body = turn.body("failed", [])
        log.close()


def _update(state: ServerState, rid: str, body: dict) -> None:
    stored = state.responses.peek(rid)
    if stored is not None:
        stored.body = body


def _running(state: ServerState, rid: str) -> asyncio.Task | None:
    """The task of a background response still running (its id is its engine request's)."""
    task = state.background.get(rid)
    return task if task is not None and not task.done() else None


def _finish(state: ServerState, turn: _Turn, status: str, items: list[dict], usage: dict,
            incomplete: dict | None) -> dict:
    store = turn.req.store and state.responses.size > 0
    body = turn.body(status, items, usage, incomplete, store=store)
    if turn.req.background and turn.id not in state.responses:
        return body         # deleted while it ran: it stays gone
    if store:
        prev = state.responses.peek(turn.id)        # (a streamed background response keeps its events)
        state.responses.put(turn.id, StoredResponse(body, turn.conversation + [assistant_message(items)],
                                                    prev.events if prev is not None else None, turn.inputs))
    return body


class StreamedOutput:
    """Chat deltas (server.structured.ChatStream) -> Responses stream events, and
    the output items they add up to. One item is open at a time: a delta of
    another kind closes it (its .done events) and opens the next."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.seq = 0

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return serving.sse(data, event=kind)

    def _add(self, item: dict) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = item
        return out + [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                item = {"id": _id("rs_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._add(item)
            out.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
            item["content"] = [part]
        self.open["content"][0]["text"] += text
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **self._at(), content_index=0, delta=text))
        else:
            out.append(self.event("response.output_text.delta", **self._at(), content_index=0, delta=text,
                                  logprobs=[]))
        return out

    def feed(self, delta: dict) -> list[str]:
        if delta.get("reasoning_content"):
            return self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            return self._text("message", delta["content"])
        out = []
        for call in delta.get("tool_calls") or []:
            fn = call["function"]
            if call.get("id") is not None:
                out += self._add({"id": _id("fc_"), "type": "function_call", "status": "in_progress",
                                  "call_id": call["id"], "name": fn["name"], "arguments": ""})
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", **self._at(),
                                      delta=fn["arguments"]))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **self._at(),
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append(self.event("response.reasoning_text.done", **self._at(), content_index=0,
                                      text=part["text"]))
            else:
                out.append(self.event("response.output_text.done", **self._at(), content_index=0,
                                      text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", **self._at(), content_index=0, part=part))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.open = None
        return out


async def _events(state: ServerState, turn: _Turn, deltas: serving.ChoiceDeltas, so: StreamedOutput):
    started = turn.body("in_progress", [])
    yield so.event("response.created", response=started)
    yield so.event("response.in_progress", response=started)
    async for ds in deltas:
        parts = [e for d in ds for e in so.feed(d)]
        if parts:
            yield "".join(parts)
    final = deltas.final
    status, incomplete = _status(final.outputs[0].finish_reason if final else None)
    closing = so.close("incomplete" if status == "incomplete" else "completed")
    body = _finish(state, turn, status, so.items, _usage(state, final, so.items), incomplete)
    kind = {"incomplete": "response.incomplete"}.get(status, "response.completed")
    yield "".join(closing) + so.event(kind, response=body)


def get_response(state: ServerState, response_id: str, stream: bool = False, starting_after: int | None = None):
    """The stored body, or (stream) a streamed background response's events
    after sequence number starting_after, live until it ends (OpenAI's resume)."""
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    if not stream:
        return stored.body
    if stored.events is None:
        raise APIError(400, "Only a background response created with stream true can be streamed.",
                       param="stream")
    return StreamingResponse(stored.events.tail(-1 if starting_after is None else starting_after),
                             media_type="text/event-stream", headers=serving.SSE_HEADERS)


async def delete_response(state: ServerState, response_id: str) -> dict:
    stored = state.responses.peek(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    if _running(state, response_id):          # a background one still running stops too
        await state.llm.abort(response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def cancel_response(state: ServerState, response_id: str) -> dict:
    """Stop a background response (OpenAI's POST /v1/responses/{id}/cancel):
    it ends "cancelled" with what it had; one that has ended is returned as it is."""
    stored = state.responses.peek(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    if not stored.body.get("background"):
        raise APIError(400, "Only a background response can be cancelled.", param="response_id")
    task = _running(state, response_id)
    if task is not None:
        await state.llm.abort(response_id)
        await asyncio.shield(task)
    return state.responses.peek(response_id).body
