"""Chat and text completions: request -> prompt ids + SamplingParams -> engine ->
OpenAI response or SSE stream.

The engine yields cumulative RequestOutputs; here they become deltas. Every
engine request goes through `generate`, which keeps the numbers for metrics
and makes sure an abandoned request (client gone, error) is aborted in the
engine, even when the surrounding task is being cancelled.
"""
import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine import BeamSearchParams, CompletionOutput, RequestOutput, SamplingError, SamplingParams
from engine.errors import EngineDeadError, EngineSleeping, InvalidRequest, RequestFailed
from model_zoo.fim import fim_prompt, fim_token_ids
from server import structured
from server.errors import APIError, error_body
from server.media import load_images
from server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from server.state import ServerState
from server.structured import ChatTools

log = logging.getLogger("tqserve.request")

MIN_LOGPROB = -9999.0           # JSON has no -inf


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


# --------------------------------------------------------------------------
# One HTTP request: its log line.
# --------------------------------------------------------------------------
class RequestLog:
    def __init__(self, prefix: str, kind: str):
        self.id = prefix + uuid.uuid4().hex            # prefix: "chatcmpl-", "cmpl-", "resp_" (OpenAI's)
        self.kind = kind
        self.t0 = time.monotonic()
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.images = 0
        self.first_token: float | None = None
        self._done = False

    def token_seen(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def done(self, status) -> None:
        if self._done:
            return
        self._done = True
        ttft = f"{self.first_token - self.t0:.3f}s" if self.first_token is not None else "-"
        log.info("%s %s prompt_tokens=%d%s output_tokens=%d ttft=%s total=%.3fs status=%s",
                 self.id, self.kind, self.prompt_tokens, f" images={self.images}" if self.images else "",
                 self.output_tokens, ttft, time.monotonic() - self.t0, status)


# --------------------------------------------------------------------------
# Engine requests.
# --------------------------------------------------------------------------
async def generate(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                   request_id: str, rlog: RequestLog, priority: int = 0, pooling=None,
                   cache_salt: str | None = None, model: str | None = None, images: list | None = None
                   ) -> AsyncIterator:
    """llm.generate with metrics; aborts the engine request if left unfinished.
    pooling (engine.PoolingParams): an embedding request; model: the
    request's `model` (a LoRA adapter's name runs with it); images: the
    prompt's, whose placeholder runs prompt_ids holds."""
    llm, metrics = state.llm, state.metrics
    t0 = time.monotonic()
    first = last = None
    seen = 0
    final = None
    rejected = False
    state.start_request(request_id)
    rlog.images = len(images or ())
    prompt = {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": images}} if images else prompt_ids
    gen = llm.generate(prompt, params, request_id, priority, pooling=pooling, cache_salt=cache_salt,
                       lora_request=state.loras.get(model))
    try:
        try:
            async for out in gen:
                now = time.monotonic()
                ntok = sum(len(o.token_ids) for o in out.outputs)
                if ntok > seen:
                    if first is None:
                        first = now
                        rlog.token_seen()
                    else:
                        metrics.observe_itl((now - last) / (ntok - seen), ntok - seen)
                    rlog.output_tokens += ntok - seen
                    last, seen = now, ntok
                final = out
                failed = next((o for o in out.outputs if o.finish_reason == "error"), None)
                if failed is not None:
                    raise RequestFailed(str(failed.stop_reason))
                yield out
        except InvalidRequest:
            if request_id not in state.drain_aborted:
                rejected = final is None        # refused up front: a 400, not a finished request
                raise
            # Aborted by the end of a drain: finish normally, with finish_reason "abort".
            final = _aborted(final, prompt_ids, params.n, request_id)
            yield final
    finally:
        state.end_request(request_id)
        with anyio.CancelScope(shield=True):
            try:
                await gen.aclose()
                if final is None or not final.finished:
                    await llm.abort(request_id)
            except Exception:
                log.exception("aborting %s failed", request_id)
        if not rejected:
            _record(state, final, len(prompt_ids), params, t0, first)


async def beam_generate(state: ServerState, prompt_ids: list[int], params: SamplingParams, length_penalty: float,
                        request_id: str, rlog: RequestLog, priority: int = 0, cache_salt: str | None = None,
                        model: str | None = None) -> AsyncIterator:
    """vLLM's use_beam_search: the best params.n beams (engine/beam_search.py),
    as one output when the search ends (a stream gets it in one piece)."""
    llm, t0, final, rejected = state.llm, time.monotonic(), None, False
    max_tokens = params.max_tokens or llm.max_model_len - len(prompt_ids)
    bs = BeamSearchParams(params.n, max_tokens, params.ignore_eos, length_penalty=length_penalty,
                          include_stop_str_in_output=params.include_stop_str_in_output)
    state.start_request(request_id)
    try:
        try:
            out = await llm.beam_search(prompt_ids, bs, request_id, priority, lora_request=state.loras.get(model),
                                        cache_salt=cache_salt, skip_special_tokens=params.skip_special_tokens)
        except InvalidRequest:
            rejected = True         # refused up front: a 400, not a finished request
            raise
        outs = [CompletionOutput(i, b.tokens[len(prompt_ids):], b.text or "",
                                 b.logprobs if params.logprobs is not None else None, b.finish_reason, b.stop_reason)
                for i, b in enumerate(out.sequences)]
        final = RequestOutput(request_id, None, list(prompt_ids), outs, finished=True)
        rlog.token_seen()
        rlog.output_tokens += sum(len(o.token_ids) for o in outs)
        yield final
    finally:
        state.end_request(request_id)
        if not rejected:
            _record(state, final, len(prompt_ids), params, t0, None)


def engine_outputs(state: ServerState, req: _SamplingFields, prompt_ids: list[int], params: SamplingParams,
                   request_id: str, rlog: RequestLog, images: list | None = None) -> AsyncIterator:
    """A chat or completion prompt's outputs: sampled (generate), or with
    use_beam_search the best n beams at the end (beam_generate). images: the
    prompt's (its placeholder runs already in prompt_ids)."""
    if req.use_beam_search:
        if images:
            raise APIError(400, "beam search does not take images", param="use_beam_search")
        return beam_generate(state, prompt_ids, params, req.length_penalty, request_id, rlog, req.priority,
                             req.cache_salt, req.model)
    return generate(state, prompt_ids, params, request_id, rlog, req.priority, cache_salt=req.cache_salt,
                    model=req.model, images=images)


# What beam search leaves out (vLLM ignores them; here they are a 400).
_NOT_WITH_BEAMS = (("stop", lambda p: p.stop), ("structured_outputs", lambda p: p.structured_outputs),
                   ("bad_words", lambda p: p.bad_words), ("allowed_token_ids", lambda p: p.allowed_token_ids),
                   ("logit_bias", lambda p: p.logit_bias), ("min_tokens", lambda p: p.min_tokens),
                   ("prompt_logprobs", lambda p: p.prompt_logprobs is not None),
                   ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
                   ("frequency_penalty", lambda p: p.frequency_penalty),
                   ("presence_penalty", lambda p: p.presence_penalty))


def _aborted(out, prompt_ids: list[int], n: int, request_id: str):
    if out is None:
        return RequestOutput(request_id, None, list(prompt_ids),
                             [CompletionOutput(i, finish_reason="abort") for i in range(n)], finished=True)
    outs = [CompletionOutput(o.index, o.token_ids, o.text, o.logprobs, o.finish_reason or "abort", o.stop_reason)
            for o in out.outputs]
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, outs, out.prompt_logprobs, True,
                         out.num_cached_tokens, out.metrics)


def _record(state: ServerState, out, n_prompt: int, params: SamplingParams, t0: float, first: float | None) -> None:
    state.metrics.observe_params(n=params.n, max_tokens=params.max_tokens)
    if out is None:         # gone before the engine said anything
        state.metrics.observe_finished(prompt_tokens=n_prompt, generation_tokens=0,
                                       finish_reasons=["abort"] * params.n, ttft=None, e2e=time.monotonic() - t0,
                                       queue_time=None)
        return
    m = out.metrics or {}
    if all(k in m for k in ("first_scheduled_time", "first_token_time", "last_token_time")):
        state.metrics.observe_phases(scheduled=m["first_scheduled_time"], first_token=m["first_token_time"],
                                     last_token=m["last_token_time"],
                                     tokens=max(len(o.token_ids) for o in out.outputs))
    now = time.monotonic()
    arrival = m.get("arrival_time", t0)
    ttft = (m["first_token_time"] - arrival) if "first_token_time" in m else (
        first - t0 if first is not None else None)
    queue = m["first_scheduled_time"] - arrival if "first_scheduled_time" in m else None
    e2e = m.get("finished_time", now) - arrival
    stopped = out.request_id in state.stopped_here       # (the abort that ended it was a stop rule's)
    state.stopped_here.discard(out.request_id)
    reasons = ["stop" if stopped and o.finish_reason in (None, "abort") else o.finish_reason or "abort"
               for o in out.outputs]
    state.metrics.observe_finished(
        prompt_tokens=len(out.prompt_token_ids),
        generation_tokens=sum(len(o.token_ids) for o in out.outputs),
        finish_reasons=reasons, ttft=ttft, e2e=e2e, queue_time=queue,
        max_generation_tokens=max((len(o.token_ids) for o in out.outputs), default=0))


async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators; yields (which, item)."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            with anyio.CancelScope(shield=True):
                await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    DONE = object()

    async def pump(i, g):
        try:
            async for item in g:
                await queue.put((i, item, None))
        except BaseException as e:       # noqa: BLE001 - handed to the consumer
            await queue.put((i, DONE, e))
            return
        await queue.put((i, DONE, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, exc = await queue.get()
            if item is DONE:
                remaining -= 1
                if exc is not None and not isinstance(exc, asyncio.CancelledError):
                    raise exc
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and raising ClientGone) if the client goes away."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:       # noqa: BLE001 - the task's own end does not matter now
        pass
    raise ClientGone()


# --------------------------------------------------------------------------
# Request -> engine inputs.
# --------------------------------------------------------------------------
def truncated(state: ServerState, ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: the context; None: all)."""
    if keep is None:
        return ids
    keep = state.llm.max_model_len if keep == -1 else keep
    return ids[-keep:]


def encode_prompts(state: ServerState, prompts: list, add_special_tokens: bool = True,
                   param: str = "prompt") -> list[list[int]]:
    """Texts (tokenized as the model's tokenizer adds special tokens) or
    token-id lists as token ids; an empty one is a 400."""
    tok = state.llm.tokenizer
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                raise APIError(400, f"This model has no tokenizer; send the {param} as token ids.", param=param)
            p = tok.encode(p, add_special_tokens=add_special_tokens)
        ids.append(list(p))
    if any(not p for p in ids):
        raise APIError(400, f"The {param} is empty (no tokens).", param=param)
    return ids


def fim_prompts(state: ServerState, prompts: list, suffix: str) -> list[list[int]]:
    """Completions with `suffix`: each prompt is the text before the gap, laid
    out in the model's fill-in-the-middle format (400 for a model without one)."""
    fim = fim_token_ids(state.llm.tokenizer)
    if fim is None:
        raise APIError(400, "suffix needs a fill-in-the-middle model (a code model with prefix / suffix / middle "
                            "tokens); this one has none.", param="suffix")
    return [fim_prompt(state.llm.tokenizer, fim, p, suffix) for p in prompts]


def check_model(state: ServerState, model: str | None) -> None:
    """The base model's served names and the LoRA adapters' are known; others 404."""
    if model is not None and model not in state.config.model_names and model not in state.loras.adapters:
        raise APIError(404, f"The model `{model}` does not exist.", param="model")


def sampling_params(state: ServerState, req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, structured=None,
                    skip_special_tokens: bool | None = None, logprobs_param: str = "logprobs") -> SamplingParams:
    """The request's sampling, with what it leaves unset from the model's
    recommended settings (--generation-config), else vLLM's neutral values.
    logprobs_param: the request field `logprobs` came from (errors name it)."""
    cap = state.llm.max_logprobs
    for param, k in ((logprobs_param, logprobs), ("prompt_logprobs", prompt_logprobs)):
        if k is not None and 0 <= cap < k:
            raise APIError(400, f"{param} {k} is greater than the maximum allowed, {cap} (--max-logprobs)",
                           param=param)
    kw = dict(n=req.n, structured_outputs=structured, max_tokens=max_tokens, min_tokens=req.min_tokens,
              stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
              stop_token_ids=list(req.stop_token_ids or []),
              include_stop_str_in_output=req.include_stop_str_in_output,
              ignore_eos=req.ignore_eos, speculative=req.speculative, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
              logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
              allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
              skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
              seed=req.seed)
    model = state.llm.default_sampling
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        v = getattr(req, name)
        kw[name] = model.get(name, default) if v is None else v
    if max_tokens is not None and kw["min_tokens"] > max_tokens:
        raise APIError(400, f"min_tokens ({kw['min_tokens']}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens")
    try:
        params = SamplingParams(**kw)
    except SamplingError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    if req.use_beam_search:
        for name, used in _NOT_WITH_BEAMS:
            if used(params):
                raise APIError(400, f"{name} cannot be used with use_beam_search", param=name)
    return params


def default_max_tokens(state: ServerState, n_prompt: int, endpoint_default: int | None = None) -> int | None:
    """max_tokens for a request that gives none: the endpoint's own default
    (completions: 16; chat: up to the context) capped by the model's
    recommended max_new_tokens and by the context left (vLLM's rule)."""
    limits = [v for v in (endpoint_default, state.llm.default_sampling.get("max_tokens")) if v is not None]
    if not limits:
        return None
    return max(1, min(*limits, state.llm.max_model_len - n_prompt))


def check_length(state: ServerState, n_prompt: int, max_tokens: int | None, what: str = "input",
                 param: str | None = None) -> None:
    ctx = state.llm.max_model_len
    if n_prompt > ctx or (n_prompt == ctx and max_tokens != 0):
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, your "
                            f"request has {n_prompt} {what} tokens. Please reduce the length of the input.",
                       param=param or ("messages" if what == "input" else "prompt"))
    if max_tokens is not None and n_prompt + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you "
                            f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the {what}, "
                            f"{max_tokens} in the completion). Please reduce the length of the input "
                            f"or max_tokens.", param="max_tokens")


def _vocab(state: ServerState) -> int | None:
    tok = state.llm.tokenizer
    return getattr(tok, "vocab_size", None) if tok is not None else None


def check_prompt_vocab(state: ServerState, prompts: list[list[int]], param: str = "prompt") -> None:
    vocab = _vocab(state)
    for p in prompts if vocab else ():
        bad = [t for t in p if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of vocabulary (size {vocab})", param=param)


def check_vocab(state: ServerState, req: _SamplingFields, prompts: list[list[int]] = ()) -> None:
    check_prompt_vocab(state, prompts)
    vocab = _vocab(state)
    if not vocab:
        return
    for t in (req.stop_token_ids or []):
        if t >= vocab:
            raise APIError(400, f"stop_token_ids: token id {t} is out of vocabulary (size {vocab})",
                           param="stop_token_ids")
    for k in (req.logit_bias or {}):
        if int(k) >= vocab:
            raise APIError(400, f"logit_bias: token id {k} is out of vocabulary (size {vocab})",
                           param="logit_bias")
    for t in (req.allowed_token_ids or []):
        if t >= vocab:
            raise APIError(400, f"allowed_token_ids: token id {t} is out of vocabulary (size {vocab})",
                           param="allowed_token_ids")


def admit(state: ServerState, request_ids: list[str]) -> None:
    """503 while loading or draining, 429 when the waiting queue is full; then
    counts `request_ids` as about to be submitted (see ServerState.queue_depth)."""
    if state.draining:
        raise APIError(503, "The server is shutting down.", headers={"Retry-After": "5"})
    if not state.ready:
        raise APIError(503, "The model is still loading.", headers={"Retry-After": "5"})
    if not state.engine_alive():
        raise APIError(503, "The engine core is not running.")
    if state.sleeping:
        raise APIError(503, "The model is sleeping (sleep mode): POST /wake_up first.")
    limit = state.config.max_queue
    if limit is not None:
        depth = state.queue_depth()
        if depth >= limit:
            raise APIError(429, f"The server is overloaded: {depth} requests are waiting "
                                f"(limit {limit}). Retry later.",
                           headers={"Retry-After": str(max(1, min(60, depth // max(1, state.config.max_num_seqs))))})
    state.reserve(request_ids)


def chat_prompt(state: ServerState, req) -> tuple[str, list[int]]:
    """Render the model's chat template and tokenize as transformers does."""
    llm = state.llm
    tok = llm.tokenizer
    if tok is None:
        raise APIError(400, "This model has no tokenizer, so it cannot serve chat; use "
                            "/v1/completions with token ids.")
    from model_zoo.chat_template import render_chat
    template = llm.chat_template
    if req.chat_template is not None:
        # vLLM's rule: a template from a request renders only where the operator allows it (a
        # sandboxed jinja environment still lets a template cost unbounded time and memory).
        if not state.config.trust_request_chat_template:
            raise APIError(400, "Chat template is passed with request, but --trust-request-chat-template is not "
                                "set. Refused request with untrusted chat template.", param="chat_template")
        template = req.chat_template
    if not template:
        raise APIError(400, "This model has no chat template; use /v1/completions.")
    parts = state.config.chat_template_content_format == "openai"
    messages = [m.to_template(parts) for m in req.messages]
    try:
        text = render_chat(template, messages,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           bos_token=getattr(tok, "bos_token", None),
                           eos_token=getattr(tok, "eos_token", None),
                           tools=_template_tools(_prompt_tools(state, req)), **_template_kwargs(req))
    except (ValueError, TypeError, LookupError) as e:
        raise APIError(400, f"Chat template rendering failed: {e}", param="messages") from None
    except Exception as e:     # jinja2 TemplateError (raise_exception in templates) and friends
        if type(e).__module__.startswith("jinja2"):
            raise APIError(400, f"Chat template rendering failed: {e}", param="messages") from None
        raise
    images = [p for m in req.messages for p in m.images()]
    if images:
        try:
            return text, tok.encode(state.llm.images.expand_text(text, len(images)), add_special_tokens=False)
        except ValueError as e:     # a template that places no image (or too few)
            raise APIError(400, f"image_url content parts: {e}", param="messages") from None
    return text, tok.encode(text, add_special_tokens=False)


def request_images(req) -> list:
    """The decoded images of a chat request's messages, in order (server.media.load_images)."""
    images = [p._image for m in req.messages for p in m.images()]
    if any(im is None for im in images):
        raise APIError(400, "image_url content parts are not taken by this route", param="messages")
    return images


def joined_text(content, where: str, kinds: tuple[str, ...], param: str) -> str:
    """A string, or a list of text parts (of `kinds`) joined with newlines as
    chat's content parts are (/v1/responses, /v1/messages); else a 400 naming
    the part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}]: parts of type {kind!r} are not supported here (text only)",
                           param=param)
        texts.append(part["text"])
    return "\n".join(texts)


def _template_kwargs(req) -> dict:
    # reasoning_effort reaches the template as vLLM passes it; chat_template_kwargs win
    effort = getattr(req, "reasoning_effort", None)     # /tokenize's chat form has none
    extra = {} if effort is None else {"reasoning_effort": effort}
    if getattr(req, "documents", None) is not None:
        extra["documents"] = req.documents
    return {**extra, **(req.chat_template_kwargs or {})}


def _prompt_tools(state: ServerState, req):
    """The tools the prompt shows (none with tool_choice "none" under
    --exclude-tools-when-tool-choice-none, vLLM's flag)."""
    tools = getattr(req, "tools", None)
    if tools and state.config.exclude_tools_when_tool_choice_none and getattr(req, "tool_choice", None) == "none":
        return None
    return tools


def _template_tools(tools) -> list[dict] | None:
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


# --------------------------------------------------------------------------
# Output formatting.
# --------------------------------------------------------------------------
def _lp(x: float) -> float:
    return MIN_LOGPROB if x is None or math.isnan(x) or x < MIN_LOGPROB else float(x)


def _top(d: dict, k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []


def token_namer(state: ServerState, req: _SamplingFields) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:{id}" (vLLM's
    --return-tokens-as-token-ids, or the request's return_tokens_as_token_ids)."""
    as_ids = req.return_tokens_as_token_ids
    if as_ids is None:
        as_ids = state.config.return_tokens_as_token_ids
    return (lambda t: f"token_id:{t}") if as_ids else state.tok_str


def chat_logprobs(tok_str: Callable[[int], str], token_ids: list[int], lps: list[dict], top_k: int) -> list[dict]:
    out = []
    for tid, d in zip(token_ids, lps):
        s = tok_str(tid)
        out.append({"token": s, "logprob": _lp(d.get(tid)), "bytes": list(s.encode("utf-8", "replace")),
                    "top_logprobs": [{"token": (ts := tok_str(t)), "logprob": _lp(v),
                                      "bytes": list(ts.encode("utf-8", "replace"))} for t, v in _top(d, top_k)]})
    return out


def completion_logprobs(tok_str: Callable[[int], str], token_ids: list[int], lps: list, top_k: int,
                        offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        s = tok_str(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(d.get(tid)))
        top = {s: _lp(d.get(tid))}
        for t, v in _top(d, top_k):
            top.setdefault(tok_str(t), _lp(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None, metrics: dict | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    if metrics and "accepted_prediction_tokens" in metrics:        # a predicted output's drafts
        u["completion_tokens_details"] = {k: metrics[k] for k in ("accepted_prediction_tokens",
                                                                  "rejected_prediction_tokens")}
    return u


def sse(obj, event: str | None = None) -> str:
    """One server-sent event; `event` names it (the Responses and Messages streams do)."""
    head = f"event: {event}\n" if event else ""
    return head + "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# --------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------
@dataclass
class ChatRun:
    """A validated chat request, ready to submit: its prompt, sampling
    parameters and output parsing (/v1/chat/completions and /v1/responses)."""
    prompt_ids: list[int]
    params: SamplingParams
    tools: ChatTools
    top_k: int              # top logprobs per token (0: none)
    images: list = field(default_factory=list)   # the prompt's images (PIL), in order


def prepare_chat(state: ServerState, req: ChatCompletionRequest, rlog: RequestLog) -> ChatRun:
    check_model(state, req.model)
    admit(state, [])
    prompt_text, prompt_ids = chat_prompt(state, req)
    prompt_ids = truncated(state, prompt_ids, req.truncate_prompt_tokens)
    rlog.prompt_tokens = len(prompt_ids)
    max_tokens = req.output_limit()
    check_length(state, len(prompt_ids), max_tokens)
    if max_tokens is None:
        max_tokens = default_max_tokens(state, len(prompt_ids))
    check_vocab(state, req)
    top_k = (req.top_logprobs or 0) if req.logprobs else 0
    try:
        tools = ChatTools.for_request(req, prompt_text, state.tool_call_parser, state.config.reasoning_parser)
    except ValueError as e:       # a tool's schema the grammar cannot embed
        raise APIError(400, f"tools: {e}", param="tools") from None
    kw = tools.constraint(req)
    so = structured.build(kw, tools.start_after(state.llm.tokenizer) if kw else [])
    # Formats whose markers are special tokens need them in the text to parse.
    skip = req.skip_special_tokens and tools.skip_special_tokens
    params = sampling_params(state, req, max_tokens, top_k if req.logprobs else None, structured=so,
                             skip_special_tokens=skip, logprobs_param="top_logprobs")
    if req.prediction is not None:          # drafts for n-gram speculation (engine/speculative.py)
        text = joined_text(req.prediction.content, "prediction.content", ("text",), "prediction")
        params.prediction_token_ids = state.llm.tokenizer.encode(text, add_special_tokens=False) or None
    admit(state, [rlog.id])
    return ChatRun(prompt_ids, params, tools, top_k, request_images(req))


async def chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest,
                          rlog: RequestLog) -> Response:
    admit(state, [])                # (before fetching images: 503 while loading, 429 when full)
    await load_images(state, req.messages)
    run = prepare_chat(state, req, rlog)
    prompt_ids, tools, top_k = run.prompt_ids, run.tools, run.top_k
    gen = engine_outputs(state, req, prompt_ids, run.params, rlog.id, rlog, images=run.images)
    created = int(time.time())
    model = req.model or state.model_name
    if req.stream:
        first = await first_output(request, gen)
        return StreamingResponse(guarded(_chat_stream(state, req, rlog, gen, first, created, model, top_k, tools),
                                         gen, rlog), media_type="text/event-stream", headers=SSE_HEADERS)

    final = await last_output(request, gen)
    choices = []
    for o in final.outputs:
        msg, called = tools.message(o.text)
        msg["role"] = chat_role(state, req)
        lp = ({"content": chat_logprobs(token_namer(state, req), o.token_ids, o.logprobs or [], top_k)}
              if req.logprobs else None)
        choices.append({"index": o.index, "message": msg, "logprobs": lp,
                        "finish_reason": _finish(o.finish_reason, called), "stop_reason": o.stop_reason,
                        **({"token_ids": list(o.token_ids)} if req.return_token_ids else {})})
    n_out = sum(len(o.token_ids) for o in final.outputs)
    rlog.output_tokens = n_out
    body = {"id": rlog.id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(len(prompt_ids), n_out, final.num_cached_tokens, final.metrics),
            **({"prompt_token_ids": list(prompt_ids)} if req.return_token_ids else {})}
    rlog.done(200)
    return JSONResponse(body)


def chat_role(state: ServerState, req: ChatCompletionRequest) -> str:
    """vLLM's: --response-role when the prompt asks for a new turn, else the last message's role."""
    return state.config.response_role if req.add_generation_prompt else req.messages[-1].role


def _finish(reason: str | None, called: bool) -> str | None:
    # OpenAI: a choice that ends by calling tools finishes with "tool_calls".
    return "tool_calls" if called and reason == "stop" else reason


async def first_output(request: Request, gen):
    """The first output, before any header is sent, so that engine-side request
    errors still become a proper 400 (and a client gone meanwhile aborts)."""
    try:
        return await until_disconnect(request, gen.__anext__())
    except StopAsyncIteration:
        return None
    except EngineSleeping as e:
        raise APIError(503, str(e)) from None
    except InvalidRequest as e:
        raise APIError(400, str(e)) from None


class ChoiceDeltas:
    """One choice's chat deltas (a ChatStream's, a list per engine output) as
    the outputs arrive; `final` is the last output (the Responses and Messages
    streams: one choice each)."""

    def __init__(self, gen, first, chat):
        self.gen, self.first, self.chat, self.final = gen, first, chat, None

    async def __aiter__(self):
        out, sent = self.first, 0
        while out is not None:
            self.final = out
            o = out.outputs[0]
            yield self.chat.feed(o.text[sent:], final=o.finish_reason is not None)
            sent = len(o.text)
            try:
                out = await self.gen.__anext__()
            except StopAsyncIteration:
                out = None


def sse_error(status: int, message: str) -> str:
    return sse(error_body(status, message)) + SSE_DONE


async def guarded(body: AsyncIterator[str], gen, rlog: RequestLog,
                  error_event: Callable[[int, str], str] = sse_error) -> AsyncIterator[str]:
    """A stream's chunks; an error after the headers went out becomes its last
    event (error_event), and the engine request is closed (aborted if
    unfinished: a client gone cancels here) and logged however it ends."""
    status = "aborted"
    try:
        async with aclosing(body) as chunks:
            async for chunk in chunks:
                yield chunk
        status = 200
    except InvalidRequest as e:
        status = 400
        yield error_event(400, str(e))
    except EngineDeadError as e:
        status = 503
        yield error_event(503, str(e))
    except RequestFailed as e:
        status = 500
        yield error_event(500, str(e))
    except Exception as e:
        status = 500
        log.exception("stream %s failed", rlog.id)
        yield error_event(500, f"internal error: {type(e).__name__}: {e}")
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()
        rlog.done(status)


async def last_output(request: Request, gen):
    """Run an engine request to its end (a client gone aborts it): its final output."""
    async def to_end():
        final = None
        async for out in gen:
            final = out
        return final
    return await run_to_end(request, gen, to_end())


async def last_outputs(request: Request, merged, n: int) -> list:
    """The final output of each of n engine requests merged by _merge (a
    client gone aborts them all)."""
    async def to_end():
        finals = [None] * n
        async for i, out in merged:
            finals[i] = out
        return finals
    return await run_to_end(request, merged, to_end())


async def run_to_end(request: Request, gen, coro):
    try:
        return await until_disconnect(request, coro)
    except EngineSleeping as e:
        raise APIError(503, str(e)) from None
    except InvalidRequest as e:
        raise APIError(400, str(e)) from None
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()


async def _chat_stream(state, req, rlog, gen, first, created, model, top_k, tools):
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage) or state.config.force_include_usage
    continuous = bool(opts and opts.continuous_usage_stats)
    n_prompt = rlog.prompt_tokens
    sent_text = [0] * req.n
    sent_tok = [0] * req.n
    started = [False] * req.n
    finished = [False] * req.n
    streams = [tools.stream() for _ in range(req.n)]
    names = token_namer(state, req)

    ids_sent = [False]      # return_token_ids: the prompt's ids go in the first chunk
    prompt_ids = list(first.prompt_token_ids) if first is not None else []

    def chunk(index, delta, logprobs=None, finish_reason=None, stop_reason=None, n_out=0, token_ids=()):
        c = {"id": rlog.id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason, **({"stop_reason": stop_reason} if finish_reason else {})}]}
        if req.return_token_ids:
            c["choices"][0]["token_ids"] = list(token_ids)
            if not ids_sent[0]:
                c["prompt_token_ids"], ids_sent[0] = list(prompt_ids), True
        if continuous:
            c["usage"] = usage(n_prompt, n_out)
        elif include_usage:
            c["usage"] = None
        return sse(c)

    out = first
    final = None
    while out is not None:
        final = out
        n_out = sum(len(o.token_ids) for o in out.outputs)
        rlog.output_tokens = n_out
        parts = []
        for o in out.outputs:
            i = o.index
            if finished[i]:
                continue
            if not started[i]:
                started[i] = True
                parts.append(chunk(i, {"role": chat_role(state, req), "content": ""}, n_out=n_out))
            text = o.text[sent_text[i]:]
            new_ids = o.token_ids[sent_tok[i]:]
            lp = None
            if req.logprobs and new_ids:
                lp = {"content": chat_logprobs(names, new_ids, (o.logprobs or [])[sent_tok[i]:], top_k)}
            deltas = streams[i].feed(text, final=o.finish_reason is not None)
            if (lp or (req.return_token_ids and new_ids)) and not deltas:
                deltas = [{"content": ""}]
            for d in deltas:
                parts.append(chunk(i, d, lp, n_out=n_out, token_ids=new_ids))
                lp, new_ids = None, ()
            sent_text[i] = len(o.text)
            sent_tok[i] = len(o.token_ids)
            if o.finish_reason is not None:
                finished[i] = True
                parts.append(chunk(i, {}, None, _finish(o.finish_reason, streams[i].called), o.stop_reason,
                                   n_out=n_out))
        if parts:
            yield "".join(parts)
        try:
            out = await gen.__anext__()
        except StopAsyncIteration:
            out = None
    n_out = sum(len(o.token_ids) for o in final.outputs) if final else 0
    rlog.output_tokens = n_out
    if include_usage:
        yield sse({"id": rlog.id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": usage(n_prompt, n_out, final.num_cached_tokens if final else None,
                                                 final.metrics if final else None)})
    yield SSE_DONE


# --------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------
async def completion(state: ServerState, request: Request, req: CompletionRequest,
                     rlog: RequestLog) -> Response:
    check_model(state, req.model)
    admit(state, [])
    tok = state.llm.tokenizer
    prompts = req.prompts()
    encoded = encode_prompts(state, prompts) if req.suffix is None else fim_prompts(state, prompts, req.suffix)
    ids = [truncated(state, p, req.truncate_prompt_tokens) for p in encoded]
    # echo shows a prompt's own text, or its kept tokens' when truncated
    texts = [p if isinstance(p, str) and len(i) == len(e) else None for p, i, e in zip(prompts, ids, encoded)]
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set:
        max_tokens = default_max_tokens(state, max(len(p) for p in ids), max_tokens)
    for p in ids:
        check_length(state, len(p), max_tokens, what="prompt")
    check_vocab(state, req, ids)
    rlog.prompt_tokens = sum(len(p) for p in ids)
    echo_lp = req.echo and req.logprobs is not None
    prompt_lp = req.prompt_logprobs
    if echo_lp:
        prompt_lp = max(req.logprobs, prompt_lp or 0)
    # max_tokens 0 (echo only): the engine scores the prompt and generates nothing.
    params = sampling_params(state, req, max_tokens, req.logprobs, prompt_lp,
                             structured=structured.build(structured.constraint(req)))
    rids = [rlog.id if len(ids) == 1 else f"{rlog.id}-{i}" for i in range(len(ids))]
    admit(state, rids)
    gens = [engine_outputs(state, req, p, params, rid, rlog) for p, rid in zip(ids, rids)]
    merged = _merge(gens)
    created = int(time.time())
    model = req.model or state.model_name

    def echo_text(i):
        if texts[i] is None:
            texts[i] = tok.decode(ids[i], skip_special_tokens=False) if tok is not None else ""
        return texts[i]

    if req.stream:
        first = await first_output(request, merged)
        return StreamingResponse(guarded(_completion_stream(state, req, rlog, merged, first, ids, echo_text,
                                                            created, model), merged, rlog),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    finals = await last_outputs(request, merged, len(ids))
    choices = []
    n_out = 0
    cached = 0
    for i, final in enumerate(finals):
        cached += final.num_cached_tokens
        for o in final.outputs:
            tids, lps, text, reason = _visible(req, o)
            n_out += len(tids)
            lp = None
            prefix = ""
            if req.echo:
                prefix = echo_text(i)
            if req.logprobs is not None:
                if req.echo:
                    plp = final.prompt_logprobs or [None] * len(ids[i])
                    lp = completion_logprobs(token_namer(state, req), ids[i] + tids, list(plp) + lps, req.logprobs, 0)
                else:
                    lp = completion_logprobs(token_namer(state, req), tids, lps, req.logprobs, 0)
            choice = {"index": i * req.n + o.index, "text": prefix + text, "logprobs": lp,
                      "finish_reason": reason, "stop_reason": o.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(state, ids[i], final.prompt_logprobs)
            if req.return_token_ids:
                choice.update(prompt_token_ids=list(ids[i]), token_ids=list(tids))
            choices.append(choice)
    rlog.output_tokens = n_out
    body = {"id": rlog.id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(rlog.prompt_tokens, n_out, cached)}
    rlog.done(200)
    return JSONResponse(body)


def _visible(req: CompletionRequest, o):
    """Token ids, logprobs, text and finish reason the client sees (max_tokens 0 drops the step)."""
    if req.max_tokens == 0:
        return [], [], "", "length"
    return list(o.token_ids), list(o.logprobs or [None] * len(o.token_ids)), o.text, o.finish_reason


def _vllm_prompt_logprobs(state, prompt_ids, plp):
    if plp is None:
        return None
    return [None if d is None else {str(t): {"logprob": _lp(v), "decoded_token": state.tok_str(t)}
                                    for t, v in d.items()} for d in plp]


async def _completion_stream(state, req, rlog, merged, first, ids, echo_text, created, model):
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage) or state.config.force_include_usage
    continuous = bool(opts and opts.continuous_usage_stats)
    n = req.n
    slots = len(ids) * n
    sent_text = [0] * slots
    sent_tok = [0] * slots
    offsets = [0] * slots
    started = [False] * slots
    finished = [False] * slots
    n_out_by_prompt = [0] * len(ids)
    cached = [0] * len(ids)
    ids_sent = [False] * slots

    def chunk(index, text, lp, finish_reason=None, stop_reason=None, token_ids=()):
        c = {"id": rlog.id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
        if req.return_token_ids:
            # Each choice's first chunk carries its prompt's ids.
            c["choices"][0]["token_ids"] = list(token_ids)
            if not ids_sent[index]:
                c["choices"][0]["prompt_token_ids"], ids_sent[index] = list(ids[index // n]), True
        if continuous:
            c["usage"] = usage(rlog.prompt_tokens, sum(n_out_by_prompt))
        elif include_usage:
            c["usage"] = None
        return sse(c)

    item = first
    while item is not None:
        p, out = item
        cached[p] = out.num_cached_tokens
        parts = []
        n_out_by_prompt[p] = 0 if req.max_tokens == 0 else sum(len(o.token_ids) for o in out.outputs)
        rlog.output_tokens = sum(n_out_by_prompt)
        for o in out.outputs:
            s = p * n + o.index
            if finished[s]:
                continue
            tids, lps, text, reason = _visible(req, o)
            if reason is not None and not out.finished and req.max_tokens == 0:
                reason = None
            if not started[s]:
                started[s] = True
                if req.echo:
                    # The prompt first, in a chunk of its own (with its logprobs when asked).
                    ptext = echo_text(p)
                    lp = None
                    if req.logprobs is not None:
                        plp = out.prompt_logprobs or [None] * len(ids[p])
                        lp = completion_logprobs(token_namer(state, req), ids[p], list(plp), req.logprobs, 0)
                        offsets[s] = sum(len(t) for t in lp["tokens"])
                    parts.append(chunk(s, ptext, lp))
            new_text = text[sent_text[s]:]
            new_ids = tids[sent_tok[s]:]
            lp = None
            if req.logprobs is not None and new_ids:
                lp = completion_logprobs(token_namer(state, req), new_ids, lps[sent_tok[s]:], req.logprobs, offsets[s])
                offsets[s] += sum(len(t) for t in lp["tokens"])
            sent_text[s] = len(text)
            sent_tok[s] = len(tids)
            if reason is not None and (out.finished or o.finish_reason is not None):
                finished[s] = True
                parts.append(chunk(s, new_text, lp, reason, o.stop_reason, new_ids))
            elif new_text or lp or (req.return_token_ids and new_ids):
                parts.append(chunk(s, new_text, lp, token_ids=new_ids))
        if parts:
            yield "".join(parts)
        try:
            item = await merged.__anext__()
        except StopAsyncIteration:
            item = None
    rlog.output_tokens = sum(n_out_by_prompt)
    if include_usage:
        yield sse({"id": rlog.id, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage(rlog.prompt_tokens, sum(n_out_by_prompt), sum(cached))})
    yield SSE_DONE
