"""POST /v1/score and /v1/rerank (vLLM's; Jina's and Cohere's rerank shape),
and POST /classify. For a token classifier (a yes/no reranker such as
Qwen3-Reranker: --hf-overrides classifier_from_token) a pair is one input,
text_1's tokens then text_2's, and its score the last label's probability
at the last position; a ForSequenceClassification checkpoint's score head
scores the same way (one label: its sigmoid). For other models it is the
cosine similarity of the two texts' embeddings (server/embeddings.py), each
distinct text embedded once."""
import dataclasses
import math
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.pooling_params import pair_token_ids
from server.embeddings import embed, prompt_ids
from server.errors import APIError
from server.protocol import ClassificationRequest, RerankRequest, ScoreRequest
from server.serving import RequestLog, admit, check_model
from server.state import ServerState


async def _similarities(state: ServerState, request: Request, pairs: list[tuple[str, str]], keep: int | None,
                        rlog: RequestLog, priority: int, param: str, model: str | None) -> list[float]:
    pooling = state.llm.classifier_pooling()
    if pooling is not None:         # one input per pair
        if state.llm.tokenizer is None:
            raise APIError(400, "This model has no tokenizer, so it cannot score texts.")
        ids = prompt_ids(state, [pair_token_ids(state.llm.tokenizer, a, b) for a, b in pairs], keep=keep,
                         param=param)
        rlog.prompt_tokens = sum(map(len, ids))
        return [p[-1] for p in await embed(state, request, ids, pooling, rlog, priority, model)]
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    ids = prompt_ids(state, texts, keep=keep, param=param)
    rlog.prompt_tokens = sum(map(len, ids))
    # Unit vectors: their dot product is the cosine.
    pooling = dataclasses.replace(state.llm.default_pooling, normalize=True, dimensions=None)
    vectors = dict(zip(texts, await embed(state, request, ids, pooling, rlog, priority, model)))
    return [math.fsum(x * y for x, y in zip(vectors[a], vectors[b])) for a, b in pairs]


async def create_score(state: ServerState, request: Request, req: ScoreRequest, rlog: RequestLog) -> JSONResponse:
    check_model(state, req.model)
    admit(state, [])
    one, two = req.texts()
    pairs = list(zip(one * len(two) if len(one) == 1 else one, two))
    scores = await _similarities(state, request, pairs, req.truncate_prompt_tokens, rlog, req.priority, "text_1",
                                 req.model)
    n = rlog.prompt_tokens
    rlog.done(200)
    return JSONResponse({"id": rlog.id, "object": "list", "created": int(time.time()),
                         "model": req.model or state.model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})


async def create_rerank(state: ServerState, request: Request, req: RerankRequest, rlog: RequestLog) -> JSONResponse:
    check_model(state, req.model)
    admit(state, [])
    docs = req.texts()
    scores = await _similarities(state, request, [(req.query, d) for d in docs], req.truncate_prompt_tokens,
                                 rlog, req.priority, "documents", req.model)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}}
                                                            if req.return_documents else {})} for i in order]
    rlog.done(200)
    return JSONResponse({"id": rlog.id, "model": req.model or state.model_name, "results": results,
                         "usage": {"total_tokens": rlog.prompt_tokens}})


async def create_classify(state: ServerState, request: Request, req: ClassificationRequest,
                          rlog: RequestLog) -> JSONResponse:
    check_model(state, req.model)
    admit(state, [])            # (first: 503 while the model loads)
    pooling = state.llm.classifier_pooling()
    if pooling is None:
        raise APIError(400, "This model is not a classifier (a ForSequenceClassification checkpoint, or a yes/no "
                            "reranker with --hf-overrides '{\"classifier_from_token\": [...]}').")
    ids = prompt_ids(state, req.inputs(), keep=req.truncate_prompt_tokens)
    rlog.prompt_tokens = sum(map(len, ids))
    probs = await embed(state, request, ids, pooling, rlog, req.priority, req.model)
    labels = state.llm.classifier_labels
    data = [{"index": i, "label": labels[max(range(len(p)), key=p.__getitem__)], "probs": p,
             "num_classes": len(p)} for i, p in enumerate(probs)]
    n = rlog.prompt_tokens
    rlog.done(200)
    return JSONResponse({"id": rlog.id, "object": "list", "created": int(time.time()),
                         "model": req.model or state.model_name, "data": data,
                         "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})
