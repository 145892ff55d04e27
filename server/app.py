"""The FastAPI app: routes, auth, body limits, errors in OpenAI's shape.

`create_app(state)` takes a ServerState around anything with AsyncLLM's
interface; the CLI (server.cli) builds the real engine, starts uvicorn and
flips `state.ready` once the model has loaded.
"""
import dataclasses
import hmac
import json
import logging
import os
import time
import uuid

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from engine.errors import EngineDeadError, InvalidRequest, RequestFailed
from server import embeddings, llamacpp_api, lora, messages_api, responses, scoring, serving
from server.errors import APIError, api_error_response, error_response, from_validation_error
from server.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest, CountTokensRequest,
                             DetokenizeRequest, EmbeddingRequest, InfillRequest, LlamaCompletionRequest,
                             LoadLoRAAdapterRequest, MessagesRequest, PoolingRequest, RerankRequest,
                             ResponsesRequest, ScoreRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from server.state import ServerState

log = logging.getLogger("tqserve.server")

VERSION = "0.1.0"
# Routes outside /v1 that run the model: behind the API key too.
COMPUTE_ROUTES = ("/score", "/rerank", "/classify", "/pooling", "/invocations", "/reset_prefix_cache", "/sleep",
                  "/wake_up", "/is_sleeping", "/server_info", "/completion", "/completions", "/infill", "/props")
# vLLM's switch for its development routes (/reset_prefix_cache, sleep mode's, /server_info).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class _AnyBody(BaseModel):
    """A JSON object of any fields (/invocations reads which it has)."""
    model_config = ConfigDict(extra="allow")


class _Gate:
    """Pure ASGI middleware (streaming-safe): API key on /v1, /v2 and COMPUTE_ROUTES, Content-Length limit."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.keys = [k.encode() for k in state.config.api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # Counted per route template when the whole response has gone (streams included).
        t0, status = time.monotonic(), [500]
        rid = _request_id(scope) if self.state.config.request_id_headers else None

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if rid is not None:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)
        posted = scope.get("method") == "POST"
        self.state.server_load += posted
        try:
            await self._gate(scope, receive, send_status)
        finally:
            self.state.server_load -= posted
            self.state.metrics.observe_http(self._handler(scope), scope.get("method", ""), status[0],
                                            time.monotonic() - t0)

    def _handler(self, scope) -> str:
        for route in self.app.routes:
            if route.matches(scope)[0] == Match.FULL:
                return route.path
        return "none"       # unknown paths share one series (instrumentator's name for them)

    async def _gate(self, scope, receive, send):
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.keys and (path.startswith(("/v1", "/v2")) or path in COMPUTE_ROUTES):
            auth = headers.get(b"authorization", b"")
            # Bearer (OpenAI's clients) or x-api-key (Anthropic's)
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"").strip()
            if not any(hmac.compare_digest(token, k) for k in self.keys):
                msg = ("Missing API key: send it as 'Authorization: Bearer <key>'." if not token
                       else "Incorrect API key provided.")
                return await error_response(401, msg, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.state.config.max_body_bytes
            except ValueError:
                return await error_response(400, "Invalid Content-Length header.")(scope, receive, send)
            if too_big:
                await discard_body(receive, 8 * self.state.config.max_body_bytes)
                return await _too_large(self.state)(scope, receive, send)
        return await self.app(scope, receive, send)


def _request_id(scope) -> bytes:
    """The request's X-Request-Id (a sane one), else a new one."""
    for k, v in scope.get("headers") or []:
        if k == b"x-request-id" and 0 < len(v) <= 256 and v.isascii() and v.decode().isprintable():
            return v
    return uuid.uuid4().hex.encode()


async def discard_body(receive, limit: int) -> None:
    """Read what the client is still sending (up to `limit` bytes) before answering:
    closing a socket with unread data resets the connection, and the client may then
    lose the answer (a 413) that was already on its way."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _too_large(state: ServerState) -> JSONResponse:
    return error_response(413, f"Request body too large: the limit is {state.config.max_body_bytes} bytes.",
                          headers={"Connection": "close"})


async def parse_body(request: Request, state: ServerState, model: type[BaseModel]):
    """Read the body (bounded, also without Content-Length) and validate it."""
    limit = state.config.max_body_bytes
    chunks, size = [], 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            # Read the rest (bounded) before answering, as discard_body does, but through
            # the same stream: it knows when the body has ended (receive() would then wait
            # for the client to disconnect, and the 413 would never be sent).
            async for rest in stream:
                size += len(rest)
                if size > 9 * limit:
                    break
            raise APIError(413, f"Request body too large: the limit is {limit} bytes.",
                           headers={"Connection": "close"})
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"Malformed JSON in the request body: {e}") from None
    except RecursionError:      # e.g. 100,000 nested "[": json.loads recurses per level
        raise APIError(400, "Malformed JSON in the request body: nested too deeply.") from None
    if not isinstance(obj, dict):
        raise APIError(400, "The request body must be a JSON object.")
    from server.protocol import has_lone_surrogate
    if has_lone_surrogate(body, obj):
        raise APIError(400, "Malformed JSON in the request body: a string holds an unpaired UTF-16 "
                            "surrogate escape (e.g. \\ud800), which is not valid Unicode.")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tqserve", version=VERSION, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tq = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return api_error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        msg = {404: f"Not found: {request.method} {request.url.path}",
               405: f"Method {request.method} not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, msg, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return error_response(503, str(e))

    @app.exception_handler(RequestFailed)
    async def _request_failed(request: Request, e: RequestFailed):
        return error_response(500, str(e))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"Internal server error: {type(e).__name__}: {e}")

    async def generation(request: Request, prefix: str, kind: str, model, handler, body: dict | None = None):
        rlog = serving.RequestLog(prefix, kind)
        try:
            if body is None:
                req = await parse_body(request, state, model)
            else:
                try:
                    req = model.model_validate(body)
                except ValidationError as e:
                    raise from_validation_error(e) from None
            return await handler(state, request, req, rlog)
        except APIError as e:
            rlog.done(e.status)
            raise
        except serving.ClientGone:
            rlog.done("aborted")
            return Response(status_code=499)
        except Exception:
            rlog.done(500)
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, "chatcmpl-", "chat", ChatCompletionRequest, serving.chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, "cmpl-", "completion", CompletionRequest, serving.completion)

    @app.post("/v1/embeddings")
    async def embeddings_create(request: Request):
        return await generation(request, "embd-", "embeddings", EmbeddingRequest, embeddings.create_embeddings)

    async def score(request: Request):
        return await generation(request, "score-", "score", ScoreRequest, scoring.create_score)

    async def rerank(request: Request):
        return await generation(request, "rerank-", "rerank", RerankRequest, scoring.create_rerank)

    @app.post("/pooling")
    async def pooling(request: Request):
        return await generation(request, "pool-", "pooling", PoolingRequest, embeddings.create_pooling)

    # SageMaker's route (vLLM's): the body's fields pick the API it runs as.
    @app.post("/invocations")
    async def invocations(request: Request):
        body = (await parse_body(request, state, _AnyBody)).model_dump()
        for field, route in (("messages", (("chatcmpl-", "chat", ChatCompletionRequest, serving.chat_completion))),
                             ("prompt", ("cmpl-", "completion", CompletionRequest, serving.completion)),
                             ("documents", ("rerank-", "rerank", RerankRequest, scoring.create_rerank)),
                             ("text_1", ("score-", "score", ScoreRequest, scoring.create_score)),
                             ("input", ("embd-", "embeddings", EmbeddingRequest, embeddings.create_embeddings))):
            if field in body:
                return await generation(request, *route, body=body)
        raise APIError(400, "/invocations: the body has none of messages (chat), prompt (completions), input "
                            "(embeddings), text_1 (score) or query + documents (rerank)")

    @app.post("/classify")
    async def classify(request: Request):
        return await generation(request, "classify-", "classify", ClassificationRequest, scoring.create_classify)

    # vLLM's paths (its /rerank and /v2/rerank are Jina's and Cohere's spellings).
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    @app.post("/v1/responses")
    async def responses_create(request: Request):
        return await generation(request, "resp_", "responses", ResponsesRequest, responses.create_response)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, stream: bool = False, starting_after: int | None = None):
        return responses.get_response(state, response_id, stream, starting_after)

    @app.get("/v1/responses/{response_id}/input_items")
    async def responses_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        return responses.list_input_items(state, response_id, limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str):
        return await responses.delete_response(state, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str):
        return await responses.cancel_response(state, response_id)

    @app.post("/v1/messages")
    async def messages_create(request: Request):
        try:
            return await generation(request, "msg_", "messages", MessagesRequest, messages_api.create_message)
        except APIError as e:
            return messages_api.error_response(e)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        try:
            req = await parse_body(request, state, CountTokensRequest)
            return messages_api.count_tokens(state, req)
        except APIError as e:
            return messages_api.error_response(e)

    # llama.cpp's native routes (server/llamacpp_api.py).
    async def llama_completion(request: Request):
        return await generation(request, "cmpl-", "llama-completion", LlamaCompletionRequest,
                                llamacpp_api.create_completion)
    for path in ("/completion", "/completions"):
        app.add_api_route(path, llama_completion, methods=["POST"])

    @app.post("/infill")
    async def infill(request: Request):
        return await generation(request, "cmpl-", "infill", InfillRequest, llamacpp_api.create_infill)

    @app.get("/props")
    async def props():
        if not state.ready:
            raise APIError(503, "The model is still loading.", headers={"Retry-After": "5"})
        return llamacpp_api.props(state, VERSION)

    @app.get("/v1/models")
    async def models():
        if not state.ready:
            raise APIError(503, "The model is still loading.", headers={"Retry-After": "5"})
        root = getattr(state.llm, "model_name", state.model_name)
        data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "tqserve",
                 "root": root, "parent": None, "max_model_len": state.llm.max_model_len}
                for name in state.config.model_names]
        # LoRA adapters as vLLM lists them: root their path, parent the base model's name.
        data += [{"id": name, "object": "model", "created": int(state.started), "owned_by": "tqserve",
                  "root": lora.lora_path, "parent": state.loras.parents.get(name) or state.model_name,
                  "max_model_len": state.llm.max_model_len}
                 for name, lora in state.loras.adapters.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return PlainTextResponse(await lora.load_adapter(state, await parse_body(request, state,
                                                                                   LoadLoRAAdapterRequest)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return PlainTextResponse(await lora.unload_adapter(state, await parse_body(request, state,
                                                                                     UnloadLoRAAdapterRequest)))

    def dev_route(method: str, path: str) -> None:
        if os.environ.get(DEV_MODE_ENV) != "1":
            raise APIError(404, f"Not found: {method} {path} (a development route: {DEV_MODE_ENV}=1)")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        dev_route("POST", "/reset_prefix_cache")
        serving.admit(state, [])
        if not await state.llm.reset_prefix_cache():
            raise APIError(409, "The prefix cache was not reset: requests hold KV blocks. Retry when idle.")
        return Response(status_code=200)

    # vLLM's sleep mode (--enable-sleep-mode; engine/sleep_mode.py): model routes answer 503 while asleep.
    @app.post("/sleep")
    async def sleep(level: int = 1):
        dev_route("POST", "/sleep")
        if not state.sleeping:
            serving.admit(state, [])
        try:
            asleep = await state.llm.sleep(level)
        except InvalidRequest as e:
            raise APIError(400, str(e), param="level") from None
        if not asleep:
            raise APIError(409, "Not asleep: requests hold KV blocks. Retry when idle.")
        state.sleep_level = state.sleep_level or level
        state.sleeping = True
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        dev_route("POST", "/wake_up")
        try:
            await state.llm.wake_up(tags)
        except InvalidRequest as e:
            raise APIError(400, str(e), param="tags") from None
        state.sleeping = await state.llm.is_sleeping()
        state.sleep_level = state.sleep_level if state.sleeping else 0
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        dev_route("GET", "/is_sleeping")
        return {"is_sleeping": state.sleeping}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        listing = await models()
        for m in listing["data"]:
            if m["id"] == model_id:
                return m
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health check (vLLM's): /health's answer."""
        return await health()

    @app.get("/server_info")
    async def server_info():
        dev_route("GET", "/server_info")
        args = getattr(state.llm, "args", None)
        return {"version": VERSION, "engine_args": dataclasses.asdict(args) if args is not None else None,
                "server_config": {k: v for k, v in dataclasses.asdict(state.config).items() if k != "api_keys"}}

    @app.get("/health")
    async def health():
        if state.load_error:
            return error_response(503, f"The model failed to load: {state.load_error}")
        if state.draining:
            # The listener stays up while draining, so that a load balancer sees
            # "draining" (503) rather than "dead" (connection refused).
            return error_response(503, state.draining_message(), headers={"Connection": "close"})
        if not state.ready:
            return error_response(503, "The model is still loading.", headers={"Retry-After": "5"})
        if not state.engine_alive():
            return error_response(503, "The engine core is not running.")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/load")
    async def load():
        """vLLM's: the POST requests being handled now (this one is a GET)."""
        return {"server_load": state.server_load}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def _tokenizer():
        if not state.ready:
            raise APIError(503, "The model is still loading.", headers={"Retry-After": "5"})
        tok = state.llm.tokenizer
        if tok is None:
            raise APIError(400, "This model has no tokenizer.")
        return tok

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_body(request, state, TokenizeRequest)
        serving.check_model(state, req.model)
        tok = _tokenizer()
        if req.messages is not None:
            text, ids = serving.chat_prompt(state, req)
            if req.add_special_tokens:
                ids = tok.encode(text, add_special_tokens=True)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=True if req.add_special_tokens is None
                             else req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": state.llm.max_model_len, "tokens": ids}
        if req.with_pieces:
            body["tokens"] = [{"id": t, "piece": tok.decode([t], skip_special_tokens=False)} for t in ids]
        if req.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse_body(request, state, DetokenizeRequest)
        serving.check_model(state, req.model)
        tok = _tokenizer()
        vocab = getattr(tok, "vocab_size", None)
        if vocab:
            bad = [t for t in req.tokens if t >= vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is out of vocabulary (size {vocab})", param="tokens")
        text = tok.decode(req.tokens, skip_special_tokens=False)
        return {"prompt": text, "content": text}        # vLLM's name, llama.cpp's

    # CORS outside the gate: a browser's preflight carries no API key, and a 401
    # or 413 needs the CORS headers for the page to read it.
    c = state.config
    return CORSMiddleware(_Gate(app, state), allow_origins=c.allowed_origins, allow_methods=c.allowed_methods,
                          allow_headers=c.allowed_headers, allow_credentials=c.allow_credentials)

