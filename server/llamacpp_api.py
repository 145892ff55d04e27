"""llama.cpp's native API, for the clients written against llama.cpp's
server: POST /completion (and /completions), POST /infill (code completion
in editors: llama.vscode, llama.vim) and GET /props.

Requests carry llama.cpp's names and defaults (server.protocol's
LlamaCompletionRequest: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
n_predict -1 = up to the context) and run through the same engine path as
/v1/completions. Responses are llama.cpp's: `content`, `tokens`, `stop`,
`stop_type` ("eos", "word", "limit", "none"), `stopping_word`,
`tokens_predicted`, `tokens_evaluated`, `timings`, `completion_probabilities`
(n_probs); a stream is `data:` events of content deltas ending with one whose
`stop` is true (no [DONE]; an error after the headers is an `error:` event,
as llama.cpp sends it).

Two stops of llama.cpp's that code completion relies on are kept here,
outside the engine: n_indent (a new line indented less than n_indent ends
the text before that line's first character) and t_max_predict_ms (once a
line has ended, generating longer than this ends it); either ends the engine
request (an abort) and reports stop_type "limit".
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pydantic import ValidationError

from model_zoo.fim import fim_token_ids, infill_prompt
from server import serving, structured
from server.errors import APIError, error_body, from_validation_error
from server.media import load_base64_images
from server.protocol import CompletionRequest, InfillRequest, LlamaCompletionRequest, MediaPrompt
from server.state import ServerState

# llama.cpp's default batch (-b): /infill cuts the prefix and suffix to fit it.
INFILL_BATCH = 2048


# --------------------------------------------------------------------------
# Request -> prompts and sampling.
# --------------------------------------------------------------------------
def _tokenizer(state: ServerState, param: str):
    tok = state.llm.tokenizer
    if tok is None:
        raise APIError(400, f"This model has no tokenizer; send the {param} as token ids.", param=param)
    return tok


def mixed_ids(state: ServerState, p, add_special: bool, param: str = "prompt") -> list[int]:
    """A llama.cpp prompt (text, token ids, or both in one list) as token ids;
    the first text piece gets the tokenizer's start token (add_special)."""
    pieces = [p] if isinstance(p, str) else p
    ids: list[int] = []
    for i, x in enumerate(pieces):
        if isinstance(x, int):
            ids.append(x)
        elif x:
            ids += _tokenizer(state, param).encode(x, add_special_tokens=add_special and i == 0)
    return ids


def media_marker() -> str:
    return os.environ.get("LLAMA_MEDIA_MARKER", "<__media__>")      # llama.cpp's (mtmd_default_marker)


async def prompts_with_media(state: ServerState, req: LlamaCompletionRequest) -> tuple[list[list[int]], list[list]]:
    """Each prompt's ids and images: a {prompt_string, multimodal_data} prompt's
    markers become the model's image placeholder, expanded as its processor
    does (Gemma 3: "\n\n<start_of_image>", its image tokens, "<end_of_image>\n\n",
    where llama.cpp puts the bare begin / end tokens)."""
    ids, images = [], []
    for p in req.prompts():
        if not isinstance(p, MediaPrompt):
            ids.append(mixed_ids(state, p, add_special=True))
            images.append([])
            continue
        pixels = await load_base64_images(state, p.multimodal_data, "prompt.multimodal_data")
        text = p.prompt_string
        if pixels:
            text = text.replace(media_marker(), state.llm.images.processor.placeholder)
            try:
                text = state.llm.images.expand_text(text, len(pixels))
            except ValueError as e:
                raise APIError(400, f"prompt.prompt_string: {e} (one {media_marker()} per image)",
                               param="prompt") from None
        ids.append(_tokenizer(state, "prompt").encode(text, add_special_tokens=True))
        images.append(pixels)
    return ids, images


def infill_ids(state: ServerState, req: InfillRequest, n_predict: int) -> list[list[int]]:
    fim = fim_token_ids(state.llm.tokenizer)
    if fim is None:
        raise APIError(400, "Infill needs a fill-in-the-middle model (a code model with prefix / suffix / "
                            "middle tokens); this one has none.")
    tok = state.llm.tokenizer
    ctx = state.llm.max_model_len
    return [infill_prompt(tok, fim, mixed_ids(state, req.input_prefix, False, "input_prefix"),
                          mixed_ids(state, req.input_suffix, False, "input_suffix"),
                          mixed_ids(state, req.prompt, False), [(c.filename, c.text) for c in req.input_extra],
                          n_batch=min(INFILL_BATCH, ctx), n_predict=max(n_predict, 0), n_ctx=ctx)]


def _bias(state: ServerState, req: LlamaCompletionRequest) -> dict[str, float]:
    """llama.cpp's logit_bias ([[id or text, bias]] or {"id or text": bias};
    false = never, a text biases each of its tokens) as {"id": bias}."""
    pairs = req.logit_bias.items() if isinstance(req.logit_bias, dict) else (req.logit_bias or ())
    out: dict[str, float] = {}
    for key, bias in pairs:
        if bias is True:
            raise APIError(400, "logit_bias: a bias is a number or false", param="logit_bias")
        value = -100.0 if bias is False else float(bias)
        if isinstance(key, str) and key.isdigit() and isinstance(req.logit_bias, dict):
            ids = [int(key)]
        elif isinstance(key, str):
            ids = _tokenizer(state, "logit_bias").encode(key, add_special_tokens=False)
        else:
            ids = [key]
        out.update({str(t): max(-100.0, min(100.0, value)) for t in ids})
    return out


def engine_request(state: ServerState, req: LlamaCompletionRequest, ids: list[list[int]]) -> CompletionRequest:
    """The request in this server's own terms (validated as /v1/completions'
    is: stop, bias and seed limits); n_predict goes to sampling_params."""
    body = {"prompt": ids, "max_tokens": None, "temperature": max(req.temperature, 0.0),
            "top_k": max(req.top_k, 0) if req.top_p > 0 else 1, "top_p": req.top_p if req.top_p > 0 else 1.0,
            "min_p": req.min_p, "repetition_penalty": req.repeat_penalty, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "stop": req.stop or None, "ignore_eos": req.ignore_eos,
            "logit_bias": _bias(state, req) or None, "seed": None if req.seed == -1 else req.seed}
    if state.loras.get(req.model) is not None:
        body["model"] = req.model
    if req.grammar is not None:
        body["structured_outputs"] = {"grammar": req.grammar}
    elif req.json_schema is not None:
        body["structured_outputs"] = {"json": req.json_schema}
    body = {k: v for k, v in body.items() if v is not None or k == "max_tokens"}
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


# --------------------------------------------------------------------------
# One prompt's text as it arrives: the n_indent and time stops.
# --------------------------------------------------------------------------
@dataclass
class Progress:
    """One prompt's generation so far, cut where llama.cpp's own stops end it."""
    n_indent: int
    t_max_ms: int
    t0: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: str | None = None           # the engine's finish reason, or "limit" (a stop here)
    stop_reason: object = None
    first: float | None = None
    last: float | None = None
    cached: int = 0
    scan: int = 0               # where n_indent's check looks next: the last line not yet passed
    newline: bool = False       # a line has ended (t_max_predict_ms counts from then)

    def feed(self, out) -> bool:
        """Take the prompt's cumulative output; True when a stop here ends it."""
        o = out.outputs[0]
        now = time.monotonic()
        if len(o.token_ids) > len(self.token_ids):
            self.first = self.first or now
            self.last = now
        # (the output's own lists, not copies: a stop here freezes them)
        self.token_ids, self.logprobs, self.cached = o.token_ids, o.logprobs or [], out.num_cached_tokens
        self.newline = self.newline or "\n" in o.text[len(self.text):]
        self.text, self.finish, self.stop_reason = o.text, o.finish_reason, o.stop_reason
        if self.finish is None and self._cut():
            self.finish = "limit"
            self.token_ids, self.logprobs = list(self.token_ids), list(self.logprobs)
            return True
        return False

    def _cut(self) -> bool:
        """n_indent, then t_max_predict_ms; each line is checked once its first
        character is in (the scan resumes at the last line not yet passed)."""
        if self.n_indent > 0:
            text, start = self.text, self.scan or self.text.find("\n") + 1
            while start > 0:
                self.scan = start
                end = start
                while end < len(text) and text[end] in " \t":
                    end += 1
                if end < len(text) and text[end] != "\n" and end - start < self.n_indent:
                    self.text = text[:end]
                    return True
                start = text.find("\n", start) + 1
        return (self.t_max_ms > 0 and self.newline and self.first is not None
                and (time.monotonic() - self.first) * 1000 > self.t_max_ms)

    def stop_type(self) -> tuple[str, str]:
        if self.finish in ("limit", "length"):
            return "limit", ""
        if self.finish == "stop":
            return ("word", self.stop_reason) if isinstance(self.stop_reason, str) else ("eos", "")
        return "none", ""

    def timings(self, n_prompt: int) -> dict:
        first = self.first or time.monotonic()
        prompt_ms = (first - self.t0) * 1000
        n_new = max(n_prompt - self.cached, 0)
        predicted_ms = ((self.last or first) - first) * 1000
        n_out = len(self.token_ids)
        return {"cache_n": self.cached, "prompt_n": n_new, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / max(n_new, 1),
                "prompt_per_second": 1000 * n_new / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": n_out, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / max(n_out - 1, 1),
                "predicted_per_second": 1000 * (n_out - 1) / predicted_ms if predicted_ms > 0 else 0.0}


async def _stop(state: ServerState, request_id: str) -> None:
    """End an engine request at one of llama.cpp's stops (counted as a stop, not an abort)."""
    state.stopped_here.add(request_id)
    await state.llm.abort(request_id)


def _probs(state: ServerState, ids: list[int], lps: list, k: int) -> list[dict]:
    """llama.cpp's completion_probabilities: each token with its top k."""
    def entry(t, lp):
        s = state.tok_str(t)
        return {"id": t, "token": s, "bytes": list(s.encode("utf-8", "replace")), "logprob": serving._lp(lp)}
    return [{**entry(t, d.get(t)), "top_logprobs": [entry(a, v) for a, v in serving._top(d, k)]}
            for t, d in zip(ids, lps) if d is not None]


def _nested(fields: list[str], body: dict) -> dict:
    """llama.cpp's response_fields: {"a/b": body["a"]["b"], ...} for the paths found."""
    out = {}
    for path in fields:
        v = body
        for key in path.split("/"):
            if not isinstance(v, dict) or key not in v:
                break
            v = v[key]
        else:
            out[path] = v
    return out


# --------------------------------------------------------------------------
# The handlers.
# --------------------------------------------------------------------------
async def create_completion(state: ServerState, request: Request, req: LlamaCompletionRequest,
                            rlog: serving.RequestLog) -> Response:
    serving.admit(state, [])        # 503 while loading or draining, 429 when the queue is full
    ids, images = await prompts_with_media(state, req)
    return await _run(state, request, req, rlog, ids, images)


async def create_infill(state: ServerState, request: Request, req: InfillRequest,
                        rlog: serving.RequestLog) -> Response:
    serving.admit(state, [])
    return await _run(state, request, req, rlog, infill_ids(state, req, req.limit()))


async def _run(state: ServerState, request: Request, req: LlamaCompletionRequest, rlog: serving.RequestLog,
               ids: list[list[int]], images: list[list] | None = None) -> Response:
    limit = req.limit()
    max_tokens = None if limit == -1 else limit
    for p in ids:
        serving.check_length(state, len(p), max_tokens, what="prompt")
    inner = engine_request(state, req, ids)
    serving.check_vocab(state, inner, ids)
    rlog.prompt_tokens = sum(len(p) for p in ids)
    params = serving.sampling_params(state, inner, max_tokens, req.n_probs or None,
                                     structured=structured.build(structured.constraint(inner)),
                                     logprobs_param="n_probs")
    rids = [rlog.id if len(ids) == 1 else f"{rlog.id}-{i}" for i in range(len(ids))]
    serving.admit(state, rids)
    images = images or [[] for _ in ids]
    gens = [serving.generate(state, p, params, rid, rlog, cache_salt=None, model=inner.model, images=im)
            for p, rid, im in zip(ids, rids, images)]
    merged = serving._merge(gens)
    t0 = time.monotonic()
    progress = [Progress(req.n_indent, req.t_max_predict_ms, t0) for _ in ids]
    model = req.model or state.model_name
    if req.stream:
        first = await serving.first_output(request, merged)
        return StreamingResponse(serving.guarded(_stream(state, req, rlog, merged, first, ids, rids, progress, model),
                                                 merged, rlog, _error_event),
                                 media_type="text/event-stream", headers=serving.SSE_HEADERS)

    async def to_end():
        async for i, out in merged:
            if progress[i].finish is None and progress[i].feed(out):
                await _stop(state, rids[i])
    await serving.run_to_end(request, merged, to_end())
    bodies = [_final(state, req, p, pr, model, stream=False, index=i) for i, (p, pr) in enumerate(zip(ids, progress))]
    rlog.output_tokens = sum(len(pr.token_ids) for pr in progress)
    rlog.done(200)
    if req.response_fields:
        bodies = [_nested(req.response_fields, b) for b in bodies]
    return JSONResponse(bodies[0] if len(bodies) == 1 else bodies)


def _final(state: ServerState, req: LlamaCompletionRequest, ids: list[int], pr: Progress, model: str,
           stream: bool, index: int = 0) -> dict:
    stop_type, word = pr.stop_type()
    visible = [] if req.limit() == 0 else pr.token_ids
    body = {"index": index, "content": "" if stream or req.limit() == 0 else pr.text,
            "tokens": visible if req.return_tokens and not stream else [], "id_slot": -1, "stop": True,
            "model": model, "tokens_predicted": len(visible), "tokens_evaluated": len(ids),
            "prompt": state.llm.tokenizer.decode(ids, skip_special_tokens=False) if state.llm.tokenizer else "",
            "has_new_line": "\n" in pr.text, "truncated": False, "stop_type": stop_type, "stopping_word": word,
            "tokens_cached": len(ids) + len(visible), "timings": pr.timings(len(ids))}
    if req.n_probs and not stream:
        body["completion_probabilities"] = _probs(state, visible, pr.logprobs, req.n_probs)
    return body


def _error_event(status: int, message: str) -> str:
    return "error: " + json.dumps(error_body(status, message)["error"] | {"code": status}) + "\n\n"


async def _stream(state, req, rlog, merged, first, ids, rids, progress, model):
    sent_text = [0] * len(ids)
    sent_tok = [0] * len(ids)
    done = [False] * len(ids)
    item = first
    while item is not None:
        i, out = item
        pr = progress[i]
        parts = []
        if not done[i]:
            if pr.feed(out):
                await _stop(state, rids[i])
            text, new_ids = pr.text[sent_text[i]:], pr.token_ids[sent_tok[i]:]
            if req.limit() == 0:
                text, new_ids = "", []
            if text or new_ids:
                chunk = {"index": i, "content": text, "tokens": new_ids if req.return_tokens else [],
                         "stop": False, "id_slot": -1, "tokens_predicted": len(pr.token_ids),
                         "tokens_evaluated": len(ids[i])}
                if req.n_probs:
                    chunk["completion_probabilities"] = _probs(state, new_ids, pr.logprobs[sent_tok[i]:],
                                                               req.n_probs)
                if req.timings_per_token:
                    chunk["timings"] = pr.timings(len(ids[i]))
                parts.append(serving.sse(chunk))
            sent_text[i], sent_tok[i] = len(pr.text), len(pr.token_ids)
            if pr.finish is not None:
                done[i] = True
                parts.append(serving.sse(_final(state, req, ids[i], pr, model, stream=True, index=i)))
        if parts:
            yield "".join(parts)
        try:
            item = await merged.__anext__()
        except StopAsyncIteration:
            item = None
    rlog.output_tokens = sum(len(pr.token_ids) for pr in progress)


def props(state: ServerState, version: str) -> dict:
    """GET /props: what llama.cpp's server says of itself (its web UI and clients read it)."""
    llm = state.llm
    return {"default_generation_settings": {"n_ctx": llm.max_model_len, "params": {
                "n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": -1}},
            "total_slots": state.config.max_num_seqs, "model_path": str(getattr(llm, "model_name", state.model_name)),
            "model_alias": state.model_name, "chat_template": llm.chat_template or "",
            "modalities": {"vision": False, "audio": False}, "infill": fim_token_ids(llm.tokenizer) is not None,
            "build_info": f"tqserve {version}"}
