"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), over the
chat pipeline, for clients that speak it (Claude Code and the anthropic SDK
pointed at a local model, as vLLM and llama.cpp's server serve them).

`system` becomes a system message; a user turn's tool_result blocks become
tool messages (then its text a user message); an assistant turn's thinking,
text and tool_use blocks one assistant message (reasoning, content, calls); a
last assistant turn is continued (Anthropic's prefill). tools / tool_choice
(auto, any = required, tool = a named function, none) and `thinking` (the
template's enable_thinking / thinking switch) map onto the chat request,
which is validated, rendered and run as /v1/chat/completions runs it. The
reply is content blocks (thinking, text, tool_use with its input parsed) and
a stop_reason; a stream sends Anthropic's events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors
come in Anthropic's shape. Not supported (a 400): images and documents,
server tools.
"""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from server import serving
from server.errors import APIError, from_validation_error
from server.media import load_images
from server.protocol import SAMPLING_EXTRAS, ChatCompletionRequest, MessagesRequest
from server.state import ServerState

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message), status_code=e.status, headers=e.headers)


def _bad(message: str) -> APIError:
    return APIError(400, message, param="messages")


def _texts(content, where: str) -> str:
    return serving.joined_text(content, where, ("text",), "messages")


def chat_messages(system, messages: list[dict]) -> list[dict]:
    """Anthropic system + messages -> chat messages."""
    out = [{"role": "system", "content": _texts(system, "system")}] if system else []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be user or assistant, got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"{where}.content must be a string or a list of content blocks")
        msg: dict = {"role": role, "content": ""}
        texts, parts = [], []           # parts: text and images in order, when there are images
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), at)}})
            elif kind == "tool_result" and role == "user" and isinstance(b.get("tool_use_id"), str):
                result = _texts(b.get("content", ""), at + ".content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {result}" if b.get("is_error") else result})
            elif kind == "tool_use" and role == "assistant" and isinstance(b.get("id"), str) \
                    and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict):
                msg.setdefault("tool_calls", []).append(
                    {"id": b["id"], "type": "function",
                     "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
                msg["reasoning_content"] = b["thinking"]
            elif kind == "redacted_thinking" and role == "assistant":
                continue            # encrypted by another server: nothing here can read it
            elif kind in ("text", "tool_result", "tool_use", "thinking"):
                raise _bad(f"{at}: a {kind} block in a {role} message is not allowed, or a field of it is "
                           "missing or of the wrong type")
            else:
                raise _bad(f"{at}: content blocks of type {kind!r} are not supported")
        images = len(parts) > len(texts)
        msg["content"] = parts if images else "\n".join(texts)
        if role == "assistant" or texts or images:
            out.append(msg)
    return out


def _image_url(source, at: str) -> str:
    """An Anthropic image block's source -> a URL for server.media (base64: a data: URL)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _bad(f"{at}: an image block's source must be {{type: base64, media_type, data}} or {{type: url, url}}")


def chat_request(req, max_tokens: int | None = None) -> ChatCompletionRequest:
    """The chat request an Anthropic request runs as (count_tokens: its prompt only)."""
    messages = chat_messages(req.system, req.messages)
    prefill = bool(req.messages) and req.messages[-1].get("role") == "assistant"
    body: dict = {"model": req.model, "messages": messages, "max_tokens": max_tokens,
                  "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description}
                                                              if t.description else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        on = req.thinking.type != "disabled"
        body["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in SAMPLING_EXTRAS if k in extra and k != "chat_template_kwargs"})
    if isinstance(extra.get("chat_template_kwargs"), dict):
        body["chat_template_kwargs"] = {**body.get("chat_template_kwargs", {}), **extra["chat_template_kwargs"]}
    for key, value in (("temperature", getattr(req, "temperature", None)), ("top_p", getattr(req, "top_p", None)),
                       ("top_k", getattr(req, "top_k", None)), ("stop", getattr(req, "stop_sequences", None)),
                       ("stream", getattr(req, "stream", False) or None)):
        if value is not None:
            body[key] = value
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def stop_reason(o, called: bool) -> tuple[str, str | None]:
    if o.finish_reason == "length":
        return "max_tokens", None
    if o.finish_reason == "abort":        # the server drained: the turn can be sent again to go on
        return "pause_turn", None
    if called:
        return "tool_use", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def content_blocks(msg: dict) -> list[dict]:
    blocks = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def _usage(final) -> dict:
    n_in = len(final.prompt_token_ids) if final is not None else 0
    cached = (getattr(final, "num_cached_tokens", 0) or 0) if final is not None else 0
    n_out = sum(len(o.token_ids) for o in final.outputs) if final is not None else 0
    # Anthropic's input_tokens leave out what was read from the cache
    return {"input_tokens": n_in - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": n_out}


async def create_message(state: ServerState, request: Request, req: MessagesRequest,
                         rlog: serving.RequestLog) -> Response:
    chat = chat_request(req, req.max_tokens)
    serving.admit(state, [])        # (before fetching images)
    await load_images(state, chat.messages)
    run = serving.prepare_chat(state, chat, rlog)
    gen = serving.generate(state, run.prompt_ids, run.params, rlog.id, rlog, chat.priority,
                           cache_salt=chat.cache_salt, model=chat.model, images=run.images)
    if req.stream:
        first = await serving.first_output(request, gen)
        events = _events(req, rlog, serving.ChoiceDeltas(gen, first, run.tools.stream()))
        return StreamingResponse(serving.guarded(events, gen, rlog,
                                                 lambda status, message: _event("error", error_body(status, message))),
                                 media_type="text/event-stream", headers=serving.SSE_HEADERS)

    final = await serving.last_output(request, gen)
    o = final.outputs[0]
    msg, called = run.tools.message(o.text)
    reason, sequence = stop_reason(o, called)
    rlog.done(200)
    return JSONResponse({"id": rlog.id, "type": "message", "role": "assistant", "model": req.model,
                         "content": content_blocks(msg), "stop_reason": reason, "stop_sequence": sequence,
                         "usage": _usage(final)})


def count_tokens(state: ServerState, req) -> dict:
    if not state.ready:
        raise APIError(503, "The model is still loading.", headers={"Retry-After": "5"})
    serving.check_model(state, req.model)
    _, ids = serving.chat_prompt(state, chat_request(req))
    return {"input_tokens": len(ids)}


def _event(kind: str, data: dict) -> str:
    return serving.sse({"type": kind, **data}, event=kind)


class StreamedBlocks:
    """Chat deltas -> content_block_start / _delta / _stop events; one block
    open at a time, a delta of another kind closes it and opens the next."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _start(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def feed(self, d: dict) -> list[str]:
        out = []
        if d.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        elif d.get("content"):
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for call in d.get("tool_calls") or []:
            fn = call["function"]
            if call.get("id") is not None:
                out += self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"],
                                                "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


async def _events(req: MessagesRequest, rlog: serving.RequestLog, deltas: serving.ChoiceDeltas):
    blocks = StreamedBlocks()
    yield _event("message_start", {"message": {
        "id": rlog.id, "type": "message", "role": "assistant", "model": req.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": rlog.prompt_tokens, "output_tokens": 0}}})
    async for ds in deltas:
        parts = [e for d in ds for e in blocks.feed(d)]
        if parts:
            yield "".join(parts)
    final = deltas.final
    reason, sequence = stop_reason(final.outputs[0], deltas.chat.called) if final else ("end_turn", None)
    yield "".join(blocks.close()) + _event("message_delta", {
        "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": _usage(final)}) + \
        _event("message_stop", {})
