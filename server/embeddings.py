"""POST /v1/embeddings: each input (or a chat's rendered messages, vLLM's
chat form) is one engine request that pools the prompt's final hidden
states (engine/pooling_params.py) instead of generating; they run in the
same steps as generation requests."""
import base64
import dataclasses
import struct
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.sampling_params import SamplingParams
from server.errors import APIError
from server.protocol import EmbeddingRequest, PoolingRequest
from server.serving import (RequestLog, _merge, admit, chat_prompt, check_length, check_model,
                            check_prompt_vocab, encode_prompts, generate, last_outputs, truncated)
from server.state import ServerState


def prompt_ids(state: ServerState, inputs: list, add_special_tokens: bool = True, keep: int | None = None,
               param: str = "input") -> list[list[int]]:
    """Texts or token-id lists as checked token ids; keep: the last k tokens
    of each (vLLM's truncate_prompt_tokens; -1: the context)."""
    ids = [truncated(state, p, keep) for p in encode_prompts(state, inputs, add_special_tokens, param)]
    for p in ids:
        check_length(state, len(p), 0, what="input", param=param)
    check_prompt_vocab(state, ids, param=param)
    return ids


async def embed(state: ServerState, request: Request, ids: list[list[int]], pooling, rlog: RequestLog,
                priority: int = 0, model: str | None = None) -> list[list[float]]:
    """One vector per prompt, each an engine request (in the same steps as
    others); a client gone aborts them all. model: the request's (a LoRA
    adapter's name embeds with it)."""
    params = SamplingParams(max_tokens=0)
    rids = [rlog.id if len(ids) == 1 else f"{rlog.id}-{i}" for i in range(len(ids))]
    admit(state, rids)
    merged = _merge([generate(state, p, params, rid, rlog, priority, pooling, model=model)
                     for p, rid in zip(ids, rids)])
    finals = await last_outputs(request, merged, len(ids))
    if any(f is None or f.embedding is None for f in finals):     # aborted by a drain's end
        raise APIError(503, "The server is shutting down.", headers={"Retry-After": "5"})
    return [f.embedding for f in finals]


def _encode(vec: list[float], fmt: str):
    # base64: the little-endian float32 bytes, as OpenAI's clients decode them.
    return vec if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


async def _pooled(state: ServerState, request: Request, req: EmbeddingRequest, rlog: RequestLog,
                  pooling=None) -> list[list[float]]:
    """Each input's (or the chat's) pooled output: the model's embedding, or with pooling given that."""
    check_model(state, req.model)
    admit(state, [])
    if req.messages is not None and any(m.images() for m in req.messages):
        raise APIError(400, "embeddings of images are not supported (text only)", param="messages")
    inputs = req.inputs() if req.messages is None else [chat_prompt(state, req)[1]]
    ids = prompt_ids(state, inputs, req.add_special_tokens, req.truncate_prompt_tokens,
                     param="input" if req.messages is None else "messages")
    rlog.prompt_tokens = sum(map(len, ids))
    if pooling is None:
        pooling = state.llm.default_pooling
        pooling = dataclasses.replace(pooling, dimensions=req.dimensions,
                                      normalize=pooling.normalize if req.normalize is None else req.normalize)
    return await embed(state, request, ids, pooling, rlog, req.priority, req.model)


def _listing(state: ServerState, req, rlog: RequestLog, data: list[dict]) -> JSONResponse:
    n = rlog.prompt_tokens
    rlog.done(200)
    return JSONResponse({"object": "list", "data": data, "model": req.model or state.model_name,
                         "created": int(time.time()), "usage": {"prompt_tokens": n, "total_tokens": n},
                         "id": rlog.id})


async def create_embeddings(state: ServerState, request: Request, req: EmbeddingRequest,
                            rlog: RequestLog) -> JSONResponse:
    vectors = await _pooled(state, request, req, rlog)
    return _listing(state, req, rlog, [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                                       for i, v in enumerate(vectors)])


async def create_pooling(state: ServerState, request: Request, req: PoolingRequest,
                         rlog: RequestLog) -> JSONResponse:
    """vLLM's POST /pooling: task "embed" as /v1/embeddings, "classify" as
    /classify's probabilities (a classifier's default)."""
    classifier = state.llm.classifier_pooling() if state.ready else None
    task = req.task or ("classify" if classifier is not None else "embed")
    if task == "classify" and classifier is None:
        raise APIError(400, "task classify needs a classifier (a ForSequenceClassification checkpoint, or a "
                            "yes/no reranker with --hf-overrides)", param="task")
    out = await _pooled(state, request, req, rlog, classifier if task == "classify" else None)
    return _listing(state, req, rlog, [{"object": "pooling", "index": i, "data": _encode(v, req.encoding_format)}
                                       for i, v in enumerate(out)])
