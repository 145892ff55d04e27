"""Malformed requests against one live `tqserve serve` (SmolLM2-135M, SMALL
settings, started once for the module): a corpus of bad JSON, non-object bodies,
wrong and lax-coerced types, out-of-range sampling values, oversized inputs,
unknown models, bad roles and contents, bad routes and methods. Each gets a 4xx
in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}) and
none reaches the engine; afterwards good requests (limits at their bounds
included) still succeed and the server reports itself healthy. Also: the
official client's exceptions carry the server's message, and fast checks of the
strict request models themselves (no server)."""
import json
from dataclasses import dataclass

import httpx
import openai
import pytest
from pydantic import ValidationError
from test_server_process import SMALL, ServerProcess, metric

from server.errors import from_validation_error
from server.protocol import (MAX_LOGIT_BIAS, MAX_PROMPTS_X_N, MAX_SEED, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS,
                             ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                             has_lone_surrogate)

MODEL = "smollm2-135m"
MAX_BYTES = 64 << 10          # --max-request-bytes here: small, so that the 413 bodies stay small
CTX = 1024                    # SMALL's --max-model-len
CHAT, CMPL, TOK, DETOK = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
RESP, EMB = "/v1/responses", "/v1/embeddings"
MSGS = [{"role": "user", "content": "hi"}]


@dataclass
class Raw:
    """A body sent as these exact bytes (dicts and lists in the table are sent as JSON)."""
    data: bytes
    content_type: str | None = "application/json"
    chunks: int = 0           # > 0: sent in this many pieces, chunked (no Content-Length)


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 1, **kw}


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **kw}


def message(**kw) -> dict:
    """A chat request whose one message is {"role": "user", "content": "hi"} updated by kw
    (a None value removes the key)."""
    m = {"role": "user", "content": "hi", **kw}
    return chat(messages=[{k: v for k, v in m.items() if v is not None}])


def raw_chat(tail: bytes) -> Raw:
    return Raw(b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], ' + tail + b"}")


# --------------------------------------------------------------------------
# Lax coercions: each was accepted (coerced) before the request models became
# strict. (name, path, body, param). Also checked on the models directly below.
# --------------------------------------------------------------------------
LAX = [
    # chat booleans
    ("chat-logprobs-str-yes", CHAT, chat(logprobs="yes"), "logprobs"),
    ("chat-logprobs-int-1", CHAT, chat(logprobs=1), "logprobs"),
    ("chat-stream-str-true", CHAT, chat(stream="true"), "stream"),
    ("chat-ignore-eos-str-false", CHAT, chat(ignore_eos="false"), "ignore_eos"),
    ("chat-include-stop-str-int", CHAT, chat(include_stop_str_in_output=1), "include_stop_str_in_output"),
    ("chat-skip-special-str-no", CHAT, chat(skip_special_tokens="no"), "skip_special_tokens"),
    ("chat-add-generation-prompt-int-0", CHAT, chat(add_generation_prompt=0), "add_generation_prompt"),
    ("chat-continue-final-str-false", CHAT, chat(continue_final_message="false"), "continue_final_message"),
    ("chat-stream-options-include-usage-1", CHAT, chat(stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage"),
    ("chat-stream-options-continuous-str", CHAT,
     chat(stream=True, stream_options={"continuous_usage_stats": "true"}), "stream_options.continuous_usage_stats"),
    # chat integers (bool is an int in Python; 2.0 and "2" are not integers in JSON's sense)
    ("chat-n-str", CHAT, chat(n="2"), "n"),
    ("chat-n-float", CHAT, chat(n=2.0), "n"),
    ("chat-seed-str", CHAT, chat(seed="7"), "seed"),
    ("chat-seed-float", CHAT, chat(seed=7.0), "seed"),
    ("chat-max-tokens-bool", CHAT, chat(max_tokens=True), "max_tokens"),
    ("chat-max-tokens-fraction", CHAT, chat(max_tokens=1.5), "max_tokens"),
    ("chat-max-tokens-float-integral", CHAT, chat(max_tokens=16.0), "max_tokens"),
    ("chat-max-tokens-str", CHAT, chat(max_tokens="16"), "max_tokens"),
    ("chat-max-completion-tokens-str", CHAT, chat(max_completion_tokens="4"), "max_completion_tokens"),
    ("chat-top-logprobs-bool", CHAT, chat(logprobs=True, top_logprobs=True), "top_logprobs"),
    ("chat-top-k-str", CHAT, chat(top_k="5"), "top_k"),
    ("chat-top-k-float", CHAT, chat(top_k=5.0), "top_k"),
    ("chat-min-tokens-str", CHAT, chat(min_tokens="1"), "min_tokens"),
    ("chat-stop-token-ids-str", CHAT, chat(stop_token_ids=["3"]), "stop_token_ids.0"),
    ("chat-stop-token-ids-float", CHAT, chat(stop_token_ids=[3.0]), "stop_token_ids.0"),
    ("chat-stop-token-ids-bool", CHAT, chat(stop_token_ids=[True]), "stop_token_ids.0"),
    # chat numbers (JSON integers are numbers; strings and booleans are not)
    ("chat-temperature-str", CHAT, chat(temperature="0.5"), "temperature"),
    ("chat-temperature-bool", CHAT, chat(temperature=True), "temperature"),
    ("chat-top-p-str", CHAT, chat(top_p="1"), "top_p"),
    ("chat-min-p-str", CHAT, chat(min_p="0"), "min_p"),
    ("chat-presence-penalty-str", CHAT, chat(presence_penalty="0"), "presence_penalty"),
    ("chat-frequency-penalty-bool", CHAT, chat(frequency_penalty=False), "frequency_penalty"),
    ("chat-repetition-penalty-str", CHAT, chat(repetition_penalty="1"), "repetition_penalty"),
    ("chat-logit-bias-value-str", CHAT, chat(logit_bias={"5": "10"}), "logit_bias.5"),
    ("chat-logit-bias-value-bool", CHAT, chat(logit_bias={"5": True}), "logit_bias.5"),
    # logit_bias keys: int() takes " 5", "+5", "5_0" and non-ASCII digits
    ("chat-logit-bias-key-space", CHAT, chat(logit_bias={" 5": 1}), "logit_bias"),
    ("chat-logit-bias-key-plus", CHAT, chat(logit_bias={"+5": 1}), "logit_bias"),
    ("chat-logit-bias-key-underscore", CHAT, chat(logit_bias={"5_0": 1}), "logit_bias"),
    ("chat-logit-bias-key-arabic-digit", CHAT, chat(logit_bias={"\u0665": 1}), "logit_bias"),
    # chat strings (no number -> string)
    ("chat-model-int", CHAT, chat(model=5), "model"),
    ("chat-user-int", CHAT, chat(user=5), "user"),
    ("chat-stop-int", CHAT, chat(stop=5), "stop"),
    ("chat-stop-list-int", CHAT, chat(stop=[5]), "stop"),
    ("chat-content-int", CHAT, message(content=5), "messages.0.content"),
    ("chat-content-part-text-int", CHAT, message(content=[{"type": "text", "text": 5}]), "messages.0"),
    ("chat-message-name-int", CHAT, message(name=5), "messages.0"),
    # completions
    ("cmpl-prompt-ids-with-str", CMPL, cmpl(prompt=[1, "2"]), "prompt"),
    ("cmpl-prompt-ids-with-bool", CMPL, cmpl(prompt=[True, 2]), "prompt"),
    ("cmpl-prompt-ids-float", CMPL, cmpl(prompt=[1.0, 2.0]), "prompt"),
    ("cmpl-prompt-int", CMPL, cmpl(prompt=5), "prompt"),
    ("cmpl-prompt-nested-ids-with-str", CMPL, cmpl(prompt=[[1, "2"]]), "prompt"),
    ("cmpl-echo-str-false", CMPL, cmpl(echo="false"), "echo"),
    ("cmpl-echo-int-0", CMPL, cmpl(echo=0), "echo"),
    ("cmpl-logprobs-bool", CMPL, cmpl(logprobs=True), "logprobs"),
    ("cmpl-logprobs-str", CMPL, cmpl(logprobs="1"), "logprobs"),
    ("cmpl-logprobs-float", CMPL, cmpl(logprobs=1.0), "logprobs"),
    ("cmpl-prompt-logprobs-bool", CMPL, cmpl(prompt_logprobs=True), "prompt_logprobs"),
    ("cmpl-best-of-str", CMPL, cmpl(best_of="1"), "best_of"),
    ("cmpl-max-tokens-float", CMPL, cmpl(max_tokens=4.0), "max_tokens"),
    ("cmpl-suffix-int", CMPL, cmpl(suffix=5), "suffix"),
    # tokenize / detokenize
    ("tokenize-prompt-int", TOK, {"prompt": 5}, "prompt"),
    ("tokenize-add-special-str", TOK, {"prompt": "hi", "add_special_tokens": "true"}, "add_special_tokens"),
    ("tokenize-return-token-strs-int", TOK, {"prompt": "hi", "return_token_strs": 1}, "return_token_strs"),
    ("tokenize-model-int", TOK, {"prompt": "hi", "model": 5}, "model"),
    ("detokenize-tokens-str", DETOK, {"tokens": ["3"]}, "tokens.0"),
    ("detokenize-tokens-float", DETOK, {"tokens": [3.0]}, "tokens.0"),
    ("detokenize-tokens-bool", DETOK, {"tokens": [True]}, "tokens.0"),
    ("detokenize-tokens-as-str", DETOK, {"tokens": "3"}, "tokens"),
]

# --------------------------------------------------------------------------
# The corpus: (name, method, path, body, expected status, expected param).
# --------------------------------------------------------------------------
TOO_BIG = b'{"model": "smollm2-135m", "prompt": "' + b"x" * MAX_BYTES + b'"}'
LONG_TEXT = "hello " * (CTX + 100)           # over the context in any tokenization

CASES = [
    # --- bad JSON ---
    ("json-syntax", "POST", CHAT, Raw(b"{not json"), 400, None),
    ("json-truncated", "POST", CHAT, Raw(b'{"model": "smollm2-135m", "messages": ['), 400, None),
    ("json-truncated-string", "POST", CMPL, Raw(b'{"model": "smollm2-135m", "prompt": "hi'), 400, None),
    ("json-empty-body", "POST", CHAT, Raw(b""), 400, None),
    ("json-whitespace-only", "POST", CMPL, Raw(b"  \n "), 400, None),
    ("json-trailing-garbage", "POST", CMPL, Raw(b'{"model": "smollm2-135m", "prompt": "hi"} x'), 400, None),
    ("json-single-quotes", "POST", CHAT, Raw(b"{'model': 'smollm2-135m'}"), 400, None),
    ("json-trailing-comma", "POST", CMPL, Raw(b'{"prompt": "hi",}'), 400, None),
    ("json-invalid-utf8", "POST", CHAT, Raw(b"\xff\xfe garbage"), 400, None),
    ("json-invalid-utf8-in-string", "POST", CMPL, Raw(b'{"prompt": "\xc3\x28"}'), 400, None),
    ("json-nan-literal", "POST", CHAT, raw_chat(b'"temperature": NaN'), 400, "temperature"),
    ("json-infinity-literal", "POST", CHAT, raw_chat(b'"repetition_penalty": Infinity'), 400,
     "repetition_penalty"),
    ("json-nested-too-deep", "POST", CMPL, Raw(b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}"), 400, None),
    ("json-nested-unclosed", "POST", CHAT, Raw(b"[" * 30000), 400, None),
    ("json-integer-5000-digits", "POST", CMPL, Raw(b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"), 400, None),
    ("json-lone-surrogate-chat", "POST", CHAT,
     Raw(b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400, None),
    ("json-lone-surrogate-prompt", "POST", CMPL, Raw(b'{"prompt": "\\udfff", "max_tokens": 1}'), 400, None),
    ("json-lone-surrogate-tokenize", "POST", TOK, Raw(b'{"prompt": "\\ud83d"}'), 400, None),
    # --- non-object bodies ---
    ("body-array-empty", "POST", CHAT, Raw(b"[]"), 400, None),
    ("body-array", "POST", CMPL, Raw(b"[1, 2]"), 400, None),
    ("body-null", "POST", CHAT, Raw(b"null"), 400, None),
    ("body-string", "POST", CMPL, Raw(b'"write me a poem"'), 400, None),
    ("body-number", "POST", CHAT, Raw(b"42"), 400, None),
    ("body-true", "POST", TOK, Raw(b"true"), 400, None),
    ("body-array-of-requests", "POST", CHAT, [chat()], 400, None),
    # --- content types that carry no JSON ---
    ("content-type-text-plain", "POST", CHAT, Raw(b"hello", "text/plain"), 400, None),
    ("content-type-form", "POST", CMPL, Raw(b"model=smollm2-135m&prompt=hi", "application/x-www-form-urlencoded"),
     400, None),
    ("content-type-none", "POST", CMPL, Raw(b"prompt=hi", None), 400, None),
    # --- missing or mistyped required fields ---
    ("chat-no-messages", "POST", CHAT, {"model": MODEL}, 400, "messages"),
    ("chat-messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("chat-messages-string", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("chat-messages-of-strings", "POST", CHAT, chat(messages=["hi"]), 400, "messages.0"),
    ("chat-messages-object", "POST", CHAT, chat(messages={"role": "user", "content": "hi"}), 400, "messages"),
    ("cmpl-no-prompt", "POST", CMPL, {"model": MODEL}, 400, "prompt"),
    ("cmpl-prompt-null", "POST", CMPL, cmpl(prompt=None), 400, "prompt"),
    ("cmpl-prompt-empty-list", "POST", CMPL, cmpl(prompt=[]), 400, None),
    ("cmpl-prompt-empty-ids", "POST", CMPL, cmpl(prompt=[[]]), 400, None),
    ("cmpl-prompt-empty-string", "POST", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("cmpl-prompt-object", "POST", CMPL, cmpl(prompt={"text": "hi"}), 400, "prompt"),
    ("tokenize-neither", "POST", TOK, {}, 400, None),
    ("tokenize-both", "POST", TOK, {"prompt": "hi", "messages": MSGS}, 400, None),
    ("detokenize-no-tokens", "POST", DETOK, {}, 400, "tokens"),
    # --- roles and contents ---
    ("role-unknown", "POST", CHAT, message(role="wizard"), 400, "messages.0.role"),
    ("role-missing", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages.0.role"),
    ("role-uppercase", "POST", CHAT, message(role="USER"), 400, "messages.0.role"),
    ("role-int", "POST", CHAT, message(role=1), 400, "messages.0.role"),
    ("content-missing", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0"),
    ("content-null-system", "POST", CHAT, chat(messages=[{"role": "system", "content": None}]), 400, "messages.0"),
    ("content-object", "POST", CHAT, message(content={"text": "hi"}), 400, "messages.0.content"),
    ("content-part-image", "POST", CHAT,
     message(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400, "messages.0"),
    ("content-part-no-type", "POST", CHAT, message(content=[{"text": "hi"}]), 400, "messages.0.content"),
    ("content-part-text-missing", "POST", CHAT, message(content=[{"type": "text"}]), 400, "messages.0"),
    ("content-part-int", "POST", CHAT, message(content=[5]), 400, "messages.0.content"),
    ("tool-calls-int", "POST", CHAT,
     chat(messages=[{"role": "assistant", "content": None, "tool_calls": 5}, *MSGS]), 400, "messages.0"),
    ("tool-calls-list-of-str", "POST", CHAT,
     chat(messages=[{"role": "assistant", "tool_calls": ["f()"]}, *MSGS]), 400, "messages.0"),
    ("tool-call-id-int", "POST", CHAT, chat(messages=[*MSGS, {"role": "tool", "content": "4", "tool_call_id": 4}]),
     400, "messages.1"),
    ("continue-final-after-user", "POST", CHAT,
     chat(continue_final_message=True, add_generation_prompt=False), 400, None),
    ("continue-final-and-generation-prompt", "POST", CHAT, chat(continue_final_message=True), 400, None),
    ("chat-template-kwargs-clash", "POST", CHAT, chat(chat_template_kwargs={"messages": 5}), 400, "messages"),
    ("chat-template-kwargs-list", "POST", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("tools-not-objects", "POST", CHAT, chat(tools=["f"]), 400, "tools.0"),
    # --- out-of-range sampling values ---
    ("temperature-above-2", "POST", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("temperature-negative", "POST", CHAT, chat(temperature=-0.1), 400, "temperature"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-above-1", "POST", CMPL, cmpl(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-1", "POST", CHAT, chat(top_k=-2), 400, "top_k"),
    ("top-k-over-int64", "POST", CMPL, cmpl(top_k=2**63), 400, "top_k"),
    ("min-p-above-1", "POST", CHAT, chat(min_p=1.5), 400, "min_p"),
    ("presence-penalty-above-2", "POST", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty-below-2", "POST", CMPL, cmpl(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", "POST", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("chat-max-tokens-zero", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("chat-max-completion-tokens-negative", "POST", CHAT, chat(max_completion_tokens=-1), 400,
     "max_completion_tokens"),
    ("cmpl-max-tokens-negative", "POST", CMPL, cmpl(max_tokens=-1), 400, "max_tokens"),
    ("cmpl-max-tokens-zero-without-echo", "POST", CMPL, cmpl(max_tokens=0), 400, None),
    ("min-tokens-negative", "POST", CHAT, chat(min_tokens=-1), 400, "min_tokens"),
    ("min-tokens-over-max-tokens", "POST", CHAT, chat(min_tokens=5, max_tokens=1), 400, "min_tokens"),
    ("n-zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("n-129", "POST", CMPL, cmpl(n=129), 400, "n"),
    ("n-huge", "POST", CHAT, chat(n=10**6), 400, "n"),
    ("seed-over-int64", "POST", CHAT, chat(seed=2**64), 400, "seed"),
    ("seed-under-int64", "POST", CMPL, cmpl(seed=-2**63 - 1), 400, "seed"),
    ("top-logprobs-21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, None),
    ("cmpl-logprobs-21", "POST", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    ("cmpl-prompt-logprobs-negative", "POST", CMPL, cmpl(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("logit-bias-value-101", "POST", CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit-bias-key-word", "POST", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-key-negative", "POST", CMPL, cmpl(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("logit-bias-key-out-of-vocab", "POST", CHAT, chat(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("stop-token-ids-out-of-vocab", "POST", CHAT, chat(stop_token_ids=[999999]), 400, "stop_token_ids"),
    ("stop-token-ids-negative", "POST", CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids.0"),
    ("prompt-ids-negative", "POST", CMPL, cmpl(prompt=[-1]), 400, "prompt"),
    ("prompt-ids-out-of-vocab", "POST", CMPL, cmpl(prompt=[999999]), 400, "prompt"),
    ("prompt-ids-over-int32", "POST", CMPL, cmpl(prompt=[2**40]), 400, "prompt"),
    ("detokenize-out-of-vocab", "POST", DETOK, {"tokens": [999999]}, 400, "tokens"),
    ("detokenize-negative", "POST", DETOK, {"tokens": [-1]}, 400, "tokens.0"),
    ("stop-empty-string", "POST", CHAT, chat(stop=""), 400, "stop"),
    ("stop-list-with-empty", "POST", CMPL, cmpl(stop=["x", ""]), 400, "stop"),
    ("best-of-not-n", "POST", CMPL, cmpl(best_of=2), 400, None),
    ("suffix-without-fim-tokens", "POST", CMPL, cmpl(suffix="!"), 400, "suffix"),
    ("prompts-times-n-too-many", "POST", CMPL, cmpl(prompt=["a"] * (MAX_PROMPTS_X_N // 2 + 1), n=2), 400, None),
    ("stream-options-without-stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400, None),
    # --- oversized inputs ---
    ("chat-prompt-longer-than-context", "POST", CHAT, message(content=LONG_TEXT), 400, "messages"),
    ("cmpl-prompt-longer-than-context", "POST", CMPL, cmpl(prompt=LONG_TEXT), 400, "prompt"),
    ("cmpl-ids-longer-than-context", "POST", CMPL, cmpl(prompt=[1] * (CTX + 1)), 400, "prompt"),
    ("chat-max-tokens-over-context", "POST", CHAT, chat(max_tokens=2 * CTX), 400, "max_tokens"),
    ("cmpl-max-tokens-trillion", "POST", CMPL, cmpl(max_tokens=10**12), 400, "max_tokens"),
    ("stop-1000-strings", "POST", CHAT, chat(stop=["x"] * 1000), 400, "stop"),
    ("stop-one-too-many", "POST", CMPL, cmpl(stop=[f"s{i}" for i in range(MAX_STOP + 1)]), 400, "stop"),
    ("stop-string-too-long", "POST", CHAT, chat(stop="x" * (MAX_STOP_CHARS + 1)), 400, "stop"),
    ("stop-list-string-too-long", "POST", CMPL, cmpl(stop=["ok", "y" * (MAX_STOP_CHARS + 1)]), 400, "stop"),
    ("stop-token-ids-too-many", "POST", CHAT, chat(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), 400,
     "stop_token_ids"),
    ("logit-bias-too-many", "POST", CMPL, cmpl(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}), 400,
     "logit_bias"),
    ("body-over-limit", "POST", CMPL, Raw(TOO_BIG), 413, None),
    # Chunked (no Content-Length): whether the excess comes in the body's last piece
    # depends on how the server reads the socket; it used to hang when it did.
    ("body-over-limit-chunked-1", "POST", CMPL, Raw(TOO_BIG, chunks=1), 413, None),
    ("body-over-limit-chunked-2", "POST", CMPL, Raw(TOO_BIG, chunks=2), 413, None),
    ("body-over-limit-chunked-7", "POST", CHAT, Raw(TOO_BIG, chunks=7), 413, None),
    ("body-over-limit-chat", "POST", CHAT, Raw(TOO_BIG), 413, None),
    ("body-over-limit-tokenize", "POST", TOK, Raw(TOO_BIG, chunks=2), 413, None),
    ("body-over-limit-detokenize", "POST", DETOK, Raw(TOO_BIG, chunks=1), 413, None),
    # --- unknown models (404, as OpenAI) ---
    ("model-unknown-chat", "POST", CHAT, chat(model="gpt-9"), 404, "model"),
    ("model-unknown-completions", "POST", CMPL, cmpl(model="nope"), 404, "model"),
    ("model-empty-string", "POST", CMPL, cmpl(model=""), 404, "model"),
    ("model-unknown-tokenize", "POST", TOK, {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("model-unknown-detokenize", "POST", DETOK, {"model": "nope", "tokens": [1]}, 404, "model"),
    ("model-unknown-retrieve", "GET", "/v1/models/gpt-9", None, 404, "model"),
    # --- bad routes and methods ---
    ("get-chat-completions", "GET", CHAT, None, 405, None),
    ("put-completions", "PUT", CMPL, cmpl(), 405, None),
    ("delete-models", "DELETE", "/v1/models", None, 405, None),
    ("post-models", "POST", "/v1/models", {}, 405, None),
    ("post-health", "POST", "/health", {}, 405, None),
    ("get-tokenize", "GET", TOK, None, 405, None),
    ("route-typo", "POST", "/v1/chat/completion", chat(), 404, None),
    ("route-unknown", "GET", "/v1/nothing", None, 404, None),
    ("route-v2", "POST", "/v2/chat/completions", chat(), 404, None),
    ("route-root", "GET", "/", None, 404, None),
    ("route-audio", "POST", "/v1/audio/transcriptions", {"model": MODEL}, 404, None),
    # --- /v1/embeddings ---
    ("embeddings-no-input", "POST", EMB, {"model": MODEL}, 400, "input"),
    ("embeddings-input-number", "POST", EMB, {"model": MODEL, "input": 5}, 400, "input"),
    ("embeddings-input-mixed", "POST", EMB, {"model": MODEL, "input": ["a", [1]]}, 400, "input"),
    ("embeddings-input-empty-list", "POST", EMB, {"model": MODEL, "input": []}, 400, "input"),
    ("embeddings-input-empty-string", "POST", EMB, {"model": MODEL, "input": ["a", ""]}, 400, "input"),
    ("embeddings-negative-id", "POST", EMB, {"model": MODEL, "input": [[1, -1]]}, 400, "input"),
    ("embeddings-id-out-of-vocab", "POST", EMB, {"model": MODEL, "input": [49152]}, 400, "input"),
    ("embeddings-too-long", "POST", EMB, {"model": MODEL, "input": [1] * (CTX + 1)}, 400, "input"),
    ("embeddings-dimensions-zero", "POST", EMB, {"model": MODEL, "input": "a", "dimensions": 0}, 400, "dimensions"),
    ("embeddings-dimensions-str", "POST", EMB, {"model": MODEL, "input": "a", "dimensions": "8"}, 400, "dimensions"),
    ("embeddings-format", "POST", EMB, {"model": MODEL, "input": "a", "encoding_format": "int8"}, 400,
     "encoding_format"),
    ("embeddings-truncate-zero", "POST", EMB, {"model": MODEL, "input": "a", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("embeddings-normalize-str", "POST", EMB, {"model": MODEL, "input": "a", "normalize": "yes"}, 400, "normalize"),
    ("embeddings-unknown-model", "POST", EMB, {"model": "nope", "input": "a"}, 404, "model"),
    # --- /v1/responses (its input items become chat messages; the chat checks apply) ---
    ("responses-no-input", "POST", RESP, {"model": MODEL}, 400, "input"),
    ("responses-input-number", "POST", RESP, {"model": MODEL, "input": 5}, 400, "input"),
    ("responses-item-unknown", "POST", RESP, {"model": MODEL, "input": [{"type": "web_search_call"}]}, 400, "input"),
    ("responses-image-part", "POST", RESP, {"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ("responses-call-no-arguments", "POST", RESP, {"model": MODEL, "input": [
        {"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "input"),
    ("responses-temperature-high", "POST", RESP, {"model": MODEL, "input": "hi", "temperature": 3}, 400,
     "temperature"),
    ("responses-max-output-zero", "POST", RESP, {"model": MODEL, "input": "hi", "max_output_tokens": 0}, 400,
     "max_output_tokens"),
    ("responses-top-k-str", "POST", RESP, {"model": MODEL, "input": "hi", "top_k": "3"}, 400, "top_k"),
    ("responses-background-no-store", "POST", RESP, {"model": MODEL, "input": "hi", "background": True,
                                                     "stream": True, "store": False}, 400, None),
    ("responses-unknown-model", "POST", RESP, {"model": "nope", "input": "hi"}, 404, "model"),
    ("responses-unknown-previous", "POST", RESP, {"model": MODEL, "input": "hi", "previous_response_id": "resp_x"},
     404, "previous_response_id"),
    ("responses-get-unknown", "GET", RESP + "/resp_x", None, 404, "response_id"),
    ("responses-delete-unknown", "DELETE", RESP + "/resp_x", None, 404, "response_id"),
    # --- lax coercions (table above) ---
    *[(name, "POST", path, body, 400, param) for name, path, body, param in LAX],
]


def send(base_url: str, method: str, path: str, body) -> httpx.Response:
    headers, content = {}, None
    if isinstance(body, Raw):
        if body.chunks:
            cut = [len(body.data) * i // body.chunks for i in range(body.chunks + 1)]
            content = iter([body.data[a:b] for a, b in zip(cut, cut[1:])])
        else:
            content = body.data
        if body.content_type:
            headers["content-type"] = body.content_type
    elif body is not None:
        content = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    return httpx.request(method, base_url + path, content=content, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("malformed") / "server.log", *SMALL,
                        "--max-request-bytes", str(MAX_BYTES))
    yield srv
    rc = srv.terminate()
    assert rc == 0, srv.log()[-3000:]


def test_corpus_is_large_and_named_once():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    assert len(CASES) >= 60 and len(LAX) >= 40


@pytest.mark.parametrize("name,method,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_malformed(server, name, method, path, body, status, param):
    r = send(server.url, method, path, body)
    assert r.status_code == status, (name, r.status_code, r.text[:500])
    assert 400 <= r.status_code < 500
    assert r.headers["content-type"].startswith("application/json")
    payload = r.json()
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip()
    assert isinstance(err["type"], str) and err["type"] == "invalid_request_error"
    assert err["code"] is None or isinstance(err["code"], str)
    assert err["param"] == param, (name, err)
    if status == 413:
        assert err["code"] == "request_too_large" and str(MAX_BYTES) in err["message"]
    if status == 404:                   # OpenAI: model_not_found for a model, null for a route
        assert err["code"] == ("model_not_found" if param == "model" else None), err


def test_official_client_errors_carry_the_message(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, logprobs="yes")
    assert e.value.status_code == 400 and e.value.param == "logprobs"
    assert "logprobs" in e.value.message and "valid boolean" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, stop=["x"] * (MAX_STOP + 1))
    assert e.value.param == "stop" and f"at most {MAX_STOP} stop strings" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, "2"], max_tokens=1)
    assert e.value.param == "prompt" and "no accepted form" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, temperature=5)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MSGS, max_tokens=1)
    assert e.value.code == "model_not_found" and "gpt-9" in e.value.message


def test_still_works_after_the_corpus(server):
    u = server.url
    # No malformed request reached the engine.
    m = server.metrics()
    assert ("tqserve:prompt_tokens_total", frozenset()) in m
    assert sum(v for (name, _), v in m.items() if name == "tqserve:request_success_total") == 0
    assert metric(m, "tqserve:prompt_tokens_total") == 0
    assert "Traceback" not in server.log(), server.log()[-3000:]

    # What the official client sends: integer temperature, stop list, logprobs, seed, extra_body.
    client = openai.OpenAI(base_url=u + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, stop=["\n\n"], max_tokens=3,
                                       logprobs=True, top_logprobs=2, seed=7, n=1,
                                       extra_body={"top_k": 5, "ignore_eos": True, "min_tokens": 1})
    assert r.choices[0].message.content and len(r.choices[0].logprobs.content) >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, temperature=1,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1
    c = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, logprobs=1, echo=False, seed=3)
    assert c.usage.prompt_tokens == 3

    # Every limit at its bound is accepted; JSON integers are numbers.
    body = chat(max_tokens=2, n=2, temperature=1, top_p=1, seed=MAX_SEED, top_k=2**31 - 1,
                stop=["z" * (MAX_STOP_CHARS - 1) + chr(65 + i) for i in range(MAX_STOP)],
                stop_token_ids=list(range(1000, 1000 + MAX_STOP_TOKEN_IDS)),
                logit_bias={str(2000 + i): 1 for i in range(MAX_LOGIT_BIAS)})
    r = send(u, "POST", CHAT, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    # A JSON body is read as JSON whatever its Content-Type (`curl -d` sends form-urlencoded).
    r = send(u, "POST", CMPL, Raw(json.dumps(cmpl()).encode(), "application/x-www-form-urlencoded"))
    assert r.status_code == 200, r.text
    # A valid surrogate pair (an escaped emoji, as json.dumps writes it) is text.
    r = send(u, "POST", TOK, Raw(b'{"prompt": "hi \\ud83d\\ude00"}'))
    assert r.status_code == 200 and r.json()["count"] >= 2

    assert httpx.get(u + "/health", timeout=30).status_code == 200
    m = server.metrics()
    assert sum(v for (name, _), v in m.items() if name == "tqserve:request_success_total") >= 5
    assert metric(m, "tqserve:prompt_tokens_total") > 0
    assert ("tqserve:num_requests_running", frozenset()) in m and metric(m, "tqserve:num_requests_running") == 0
    assert "Traceback" not in server.log(), server.log()[-3000:]


# --------------------------------------------------------------------------
# The request models on their own (no server).
# --------------------------------------------------------------------------
MODELS = {CHAT: ChatCompletionRequest, CMPL: CompletionRequest, TOK: TokenizeRequest, DETOK: DetokenizeRequest}


@pytest.mark.parametrize("name,path,body,param", LAX, ids=[c[0] for c in LAX])
def test_model_rejects_lax_coercion(name, path, body, param):
    with pytest.raises(ValidationError) as e:
        MODELS[path].model_validate(body)
    err = from_validation_error(e.value)
    assert err.status == 400 and err.param == param and err.message.startswith(param)


def test_model_accepts_what_clients_send():
    r = ChatCompletionRequest.model_validate(chat(temperature=0, top_p=1, stop=["x"], logprobs=True, top_logprobs=0,
                                                  max_tokens=16, seed=-5, n=2, presence_penalty=-2,
                                                  logit_bias={"50": -100}, stream=True,
                                                  stream_options={"include_usage": True}, future_field="x"))
    assert r.temperature == 0.0 and isinstance(r.temperature, float) and isinstance(r.top_p, float)
    assert r.logprobs is True and r.max_tokens == 16 and r.seed == -5 and r.stream_options.include_usage
    c = CompletionRequest.model_validate(cmpl(prompt=[[1, 2], [3]], echo=True, max_tokens=0, logprobs=0))
    assert c.prompts() == [[1, 2], [3]]
    assert CompletionRequest.model_validate(cmpl(prompt=["a", "b"])).prompts() == ["a", "b"]
    assert DetokenizeRequest.model_validate({"tokens": [0, 5]}).tokens == [0, 5]
    t = TokenizeRequest.model_validate({"messages": MSGS, "add_special_tokens": False})
    assert t.add_special_tokens is False


@pytest.mark.parametrize("field,ok,bad", [
    ("stop", ["s"] * MAX_STOP, ["s"] * (MAX_STOP + 1)),
    ("stop", "x" * MAX_STOP_CHARS, "x" * (MAX_STOP_CHARS + 1)),
    ("stop_token_ids", [7] * MAX_STOP_TOKEN_IDS, [7] * (MAX_STOP_TOKEN_IDS + 1)),
    ("logit_bias", {str(i): 0 for i in range(MAX_LOGIT_BIAS)}, {str(i): 0 for i in range(MAX_LOGIT_BIAS + 1)}),
    ("seed", MAX_SEED, MAX_SEED + 1),
    ("seed", -MAX_SEED - 1, -MAX_SEED - 2),
    ("n", 128, 129),
])
def test_model_limits_at_their_bounds(field, ok, bad):
    ChatCompletionRequest.model_validate(chat(**{field: ok}))
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(chat(**{field: bad}))
    assert from_validation_error(e.value).param == field


def test_prompt_fan_out_bounded():
    CompletionRequest.model_validate(cmpl(prompt=[[1]] * MAX_PROMPTS_X_N))
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(cmpl(prompt=[[1]] * (MAX_PROMPTS_X_N // 4 + 1), n=4))


def test_union_errors_name_the_field():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(chat(messages=[*MSGS, {"role": "user", "content": 5}]))
    err = from_validation_error(e.value)
    assert err.param == "messages.1.content" and "no accepted form" in err.message


def test_lone_surrogates():
    def check(raw: bytes) -> bool:
        return has_lone_surrogate(raw, json.loads(raw))
    assert check(b'{"a": "\\ud800"}') and check(b'{"\\udfff": 1}') and check(b'{"a": [{"b": "x\\udc00"}]}')
    assert not check(b'{"a": "\\ud83d\\ude00"}')          # a pair: one code point
    assert not check(b'{"a": "\\\\ud800"}')               # an escaped backslash, then text
    assert not check(b'{"a": "plain"}')
