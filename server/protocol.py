"""Request bodies of the OpenAI-compatible API, as pydantic models.

Unknown fields are accepted and ignored (as vLLM does); wrong types or values
fail validation and become a 400 in OpenAI's error shape (see server.errors).

Types are strict, as OpenAI's API is: a boolean field takes a JSON boolean only
("yes", "true", 1 are errors), an integer field a JSON integer only ("2", 2.0,
1.5 and true are errors: bool is an int in Python, so lax pydantic would take
it), a number field a JSON number (integers too: `temperature: 1`; not "0.5",
not true, not NaN/Infinity, which Python's json module reads), a string field a
JSON string (no 5 -> "5"). Sizes that each decode step pays for are bounded:
see the MAX_* limits below (also in the README's Serving section).

Responses are built as plain dicts in server.serving: their shape is fixed by
the OpenAI API and dicts keep the hot streaming path cheap.
"""
import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)


# Request limits. OpenAI allows 4 stop strings and 300 logit_bias entries;
# vLLM bounds neither. Every decode step of every sequence scans all stop
# strings (and holds back up to the longest one's length), so 16 of at most
# 1,024 characters each: 4x OpenAI's count, and a measured worst case of ~2 ms
# per step per sequence. stop_token_ids are a set lookup per step, so a generous
# 256 (all of a model's special tokens). Token ids are bounded to int32 (the
# vocabulary check in server.serving then names the real limit), seeds to int64
# (what torch.Generator takes; the n samples use seed, seed+1, ...), top_k to
# int32 (a larger k than the vocabulary means "all tokens" anyway).
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_TOKEN_ID = 2**31 - 1
MIN_SEED, MAX_SEED = -2**63, 2**63 - 1
# Each prompt of a completions batch (times n) is its own engine request and
# the queue limit (--max-queue) is checked per HTTP request: bound the fan-out.
MAX_PROMPTS_X_N = 256
# OpenAI's bound on /v1/embeddings inputs (clients batch up to it: LangChain sends 1,000).
MAX_EMBEDDING_INPUTS = 2048
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")      # a logit_bias key: a token id in ASCII digits
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def has_lone_surrogate(body: bytes, obj: Any) -> bool:
    """Whether the parsed JSON holds a string with an unpaired UTF-16 surrogate
    ("\\ud800"): json.loads takes it, but it is not text, and tokenizers fail on it.
    Cheap unless the body has a surrogate escape at all (a valid pair, e.g. an
    escaped emoji, becomes one code point and passes)."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _Body(BaseModel):
    # strict: no coercion between JSON types (see the module docstring); JSON
    # integers are still numbers. allow_inf_nan=False: NaN/Infinity are not JSON.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str                                # data:image/...;base64,..., http(s)://, file:// (server/media.py)
    detail: Literal["auto", "low", "high"] | None = None     # accepted; the model's processor sizes images


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL
    _image: Any = PrivateAttr(default=None)   # its pixels, decoded and preprocessed (server.media.load_images)


class OtherPart(_Body):
    """A content part of another kind (input_audio, ...): rejected with a clear message."""
    model_config = ConfigDict(extra="allow")
    type: str


_PART_NEEDS = {"text": "a string `text`", "image_url": "an object `image_url` with a string `url`"}


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")   # name, tool_calls, tool_call_id, ... go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart | OtherPart] | None = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.content, list):
            for part in self.content:
                if isinstance(part, OtherPart) and part.type in _PART_NEEDS:
                    raise ValueError(f"a {part.type} content part needs {_PART_NEEDS[part.type]}")
                if isinstance(part, OtherPart):
                    raise ValueError(f"content part type {part.type!r} is not supported (text and image_url)")
                if isinstance(part, ImagePart) and self.role != "user":
                    raise ValueError(f"images are taken in user messages, not {self.role!r} ones")
        # Extra fields go to the chat template as they are: those templates read get their
        # JSON types checked (tool_calls: 5 would otherwise fail in the server, a 500).
        extra = self.model_extra or {}
        for key, kind, what in (("name", str, "a string"), ("tool_call_id", str, "a string"),
                                ("tool_calls", list, "a list of objects")):
            v = extra.get(key)
            if v is not None and (not isinstance(v, kind) or
                                  kind is list and not all(isinstance(c, dict) for c in v)):
                raise ValueError(f"`{key}` must be {what}")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content

    def images(self) -> list["ImagePart"]:
        return [p for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def to_template(self, parts: bool = False) -> dict[str, Any]:
        """The message as a chat template reads it: content a string (an
        assistant turn that only calls tools has content null: templates
        expect a string there), or with parts a list of text parts (vLLM's
        --chat-template-content-format openai). A message with images is
        its parts as given, each image {"type": "image"} (what HF templates read)."""
        text = self.text() or ""
        if self.images():
            d = {"role": self.role, "content": _template_parts(self.content)}
            d.update(self.model_extra or {})
            return d
        d = {"role": self.role, "content": ([{"type": "text", "text": text}] if text else []) if parts else text}
        d.update(self.model_extra or {})
        return d


def _template_parts(content: list) -> list[dict]:
    return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in content]


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = list[TokenId]


def _keep_tokens(v: int) -> int:
    if v == 0:
        raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
    return v


# vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: the context).
KeepTokens = Annotated[int, Field(ge=-1), AfterValidator(_keep_tokens)]

# A JSON schema, regex, choice list or grammar is compiled by the engine; its
# size bounds the compile work one request can ask for.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


class JsonSchemaFormat(_Body):
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self):
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar)) if v is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(given) or 'none'}")
        if len(json.dumps(self.json_)) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"a JSON schema may have at most {MAX_GRAMMAR_CHARS} characters")
        return self


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class _SamplingFields(_Body):
    """Fields common to chat and completions (OpenAI's plus vLLM's extensions)."""
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    speculative: bool = True        # false: this request never drafts (speculative decoding)
    priority: int = 0               # vLLM's: lower is scheduled first (--scheduling-policy priority)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)   # vLLM's: prefix-cache isolation
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    min_tokens: int = Field(0, ge=0)
    truncate_prompt_tokens: KeepTokens | None = None
    allowed_token_ids: TokenIds | None = Field(None, min_length=1)    # vLLM's: sample only among these
    bad_words: list[str] | None = Field(None, max_length=1024)     # vLLM's: words never generated
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:{id}"
    use_beam_search: bool = False   # vLLM's: `n` beams, ranked by their logprob (engine/beam_search.py)
    length_penalty: float = 1.0     # vLLM's: beams' scores divide by their length ** length_penalty
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's names for structured_outputs before v0.11; clients still send them.
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None    # accepted: llguidance compiles every kind here

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v):
        if v is not None and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(v)}")
        for k, b in (v or {}).items():
            # Not int(k): that takes " 5", "+5", "5_0" and non-ASCII digits.
            if not _TOKEN_ID_KEY.fullmatch(k):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        for s in stops:
            if s == "":
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(s)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v):
        if v is not None and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        legacy = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if v is not None}
        if legacy:
            if self.structured_outputs is not None:
                raise ValueError("give either structured_outputs or guided_*, not both")
            if len(legacy) > 1:
                raise ValueError(f"give one of guided_json, guided_regex, guided_choice, guided_grammar; got "
                                 f"{', '.join('guided_' + k for k in legacy)}")
            try:
                self.structured_outputs = StructuredOutputs.model_validate(legacy)
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                raise ValueError(f"guided_{'.'.join(map(str, err['loc']))}: "
                                 f"{err['msg'].removeprefix('Value error, ')}") from None
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("give either response_format or structured_outputs, not both")
        return self


class Prediction(_Body):
    """OpenAI's predicted output (`prediction`): text the answer will largely repeat."""
    type: Literal["content"]
    content: str | list[dict[str, Any]]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    prediction: Prediction | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)      # capped by --max-logprobs (serving.sampling_params)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None    # vLLM's: this request's jinja template (--trust-request-chat-template)
    # vLLM's: retrieved documents for templates that lay them out (Command R, Granite), each
    # a {"title": ..., "text": ...} mapping of strings.
    documents: list[dict[str, str]] | None = Field(None, max_length=256)
    # OpenAI's values plus DeepSeek-V4's "max"; reaches the chat template as a kwarg (as vLLM)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self):
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if choice not in (None, "none", "auto") and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("a forced tool_choice cannot be combined with response_format or structured_outputs")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | TokenIds | list[TokenIds]


def prompt_list(p: Prompt) -> list[str | list[int]]:
    """A Prompt as its list of prompts (a text or a token-id list each)."""
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)            # both capped by --max-logprobs (serving.sampling_params)
    prompt_logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None       # fill-in-the-middle: the text after the gap (model_zoo/fim.py)
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix is not None and self.echo:
            raise ValueError("suffix (fill-in-the-middle) cannot be used with echo")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("token-id prompts must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo")
        if len(self.prompts()) * self.n > MAX_PROMPTS_X_N:
            raise ValueError(f"prompts x n may be at most {MAX_PROMPTS_X_N}, got {len(self.prompts())} x {self.n}")
        return self

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False
    # llama.cpp's spelling: content, add_special, with_pieces ([{"id", "piece"}] for tokens)
    content: str | None = None
    add_special: bool | None = None
    with_pieces: bool = False

    @model_validator(mode="after")
    def _one_of(self):
        if sum(x is not None for x in (self.prompt, self.messages, self.content)) != 1:
            raise ValueError("give exactly one of prompt or messages")
        if self.content is not None:
            self.prompt = self.content
            if self.add_special_tokens is None:
                self.add_special_tokens = bool(self.add_special)    # llama.cpp's default: none
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's)."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's; its lora_int_id is accepted and not needed)."""
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def _checked_inputs(v: Prompt) -> Prompt:
    """An embedding or classification request's `input`: 1..MAX_EMBEDDING_INPUTS non-empty prompts."""
    inputs = prompt_list(v)
    if not inputs:
        raise ValueError("input must not be empty")
    if any(not p for p in inputs):
        raise ValueError("input must not contain empty strings or token lists")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"input may hold at most {MAX_EMBEDDING_INPUTS} items, got {len(inputs)}")
    return v


class EmbeddingRequest(_Body):
    """POST /v1/embeddings: OpenAI's fields, plus vLLM's extras, and vLLM's
    chat form: `messages` instead of `input`, rendered by the chat template
    (without the generation prompt unless asked) and embedded as one input."""
    model: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    input: Prompt | None = Field(None, validate_default=True)       # (checked after messages: one of the two)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: KeepTokens | None = None
    normalize: bool | None = None                             # None: the model's pooling says
    add_special_tokens: bool = True
    priority: int = 0

    @model_validator(mode="after")
    def _check_chat_form(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @field_validator("input")
    @classmethod
    def _check_input(cls, v, info):
        if (v is None) == (info.data.get("messages") is None):
            raise ValueError("give exactly one of input or messages (vLLM's chat form)")
        return v if v is None else _checked_inputs(v)

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): the pooler's output per input, `task` "embed"
    (the model's embedding) or "classify" (a classifier's label probabilities)."""
    task: Literal["embed", "classify"] | None = None       # None: classify for a classifier, else embed


class ClassificationRequest(_Body):
    """POST /classify (vLLM's): a token classifier's label probabilities per input."""
    model: str | None = None
    input: Prompt
    truncate_prompt_tokens: KeepTokens | None = None
    priority: int = 0
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, v):
        return _checked_inputs(v)

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)


class ScoreRequest(_Body):
    """POST /v1/score (vLLM's): text_1 against each of text_2, or pairwise."""
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: KeepTokens | None = None
    priority: int = 0

    @model_validator(mode="after")
    def _pairs(self):
        one, two = self.texts()
        if not one or not two or not all(one) or not all(two):
            raise ValueError("text_1 and text_2 must be non-empty strings or lists of them")
        if len(one) > 1 and len(one) != len(two):
            raise ValueError(f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or as many "
                             f"as text_2")
        if len(two) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"text_2 may hold at most {MAX_EMBEDDING_INPUTS} texts, got {len(two)}")
        return self

    def texts(self) -> tuple[list[str], list[str]]:
        as_list = lambda t: [t] if isinstance(t, str) else list(t)      # noqa: E731
        return as_list(self.text_1), as_list(self.text_2)


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    """POST /v1/rerank (vLLM's, in Jina's and Cohere's shape)."""
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    top_n: int | None = Field(None, ge=0)       # 0 or None: all
    return_documents: bool = True
    truncate_prompt_tokens: KeepTokens | None = None
    priority: int = 0

    @model_validator(mode="after")
    def _texts(self):
        if not all(self.texts()):
            raise ValueError("documents must not be empty")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


# --------------------------------------------------------------------------
# /v1/responses (OpenAI's Responses API; server/responses.py turns it into a chat request)
# --------------------------------------------------------------------------
class ResponsesTool(_Body):
    """A function tool, flat as the Responses API writes it."""
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Body):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


# vLLM's sampling extensions a Responses or Messages request may carry: passed to the chat
# request as they are, which validates them.
SAMPLING_EXTRAS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
                    "stop", "stop_token_ids", "logit_bias", "ignore_eos", "min_tokens", "priority",
                    "speculative", "skip_special_tokens", "chat_template_kwargs", "cache_salt")


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.background and not self.store:
            raise ValueError("background responses are kept to be read: background needs store true")
        if self.text and self.text.format and self.text.format.type == "json_schema" \
                and self.text.format.schema_ is None:
            raise ValueError("text.format type json_schema needs a schema")
        return self


# --------------------------------------------------------------------------
# /v1/messages (Anthropic's Messages API; server/messages_api.py turns it into a chat request)
# --------------------------------------------------------------------------
class AnthropicTool(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type not in (None, "custom"):
            raise ValueError(f"server tools (type {self.type!r}) are not supported: give custom tools")
        return self


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice type "tool" needs a name')
        return self


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class MessagesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


# --------------------------------------------------------------------------
# llama.cpp's native API (/completion, /infill): its names and defaults.
# --------------------------------------------------------------------------
MixedPrompt = str | list[TokenId | str]     # text, token ids, or both in one list (llama.cpp's "mixed")
MAX_PROMPT_MEDIA = 64


class MediaPrompt(_Body):
    """llama.cpp's multimodal prompt: its media marker (<__media__>, or
    $LLAMA_MEDIA_MARKER) once per image of multimodal_data (base64 or data: URLs)."""
    prompt_string: str
    multimodal_data: list[str] = Field(default_factory=list, max_length=MAX_PROMPT_MEDIA)


MAX_INPUT_EXTRA = 1024


class InputExtra(_Body):
    """/infill's input_extra chunk: another file of the project."""
    text: str = ""
    filename: str = "tmp"


# llama.cpp samplers this server does not have: a request that turns one on is a 400, not ignored.
_LLAMA_UNSUPPORTED = (("typical_p", 1.0), ("mirostat", 0), ("dry_multiplier", 0.0), ("xtc_probability", 0.0),
                      ("dynatemp_range", 0.0), ("post_sampling_probs", False))


class LlamaCompletionRequest(_Body):
    """llama.cpp's POST /completion (its server README). Accepted with no
    effect here: cache_prompt (the prefix cache always serves), id_slot,
    samplers (the order is fixed), n_keep, min_keep, t_max_prompt_ms.
    repeat_last_n is accepted, but the penalties see the whole context
    (vLLM's rule; llama.cpp's last 64 tokens)."""
    prompt: MixedPrompt | MediaPrompt | list[MixedPrompt | MediaPrompt]
    model: str | None = None            # a LoRA adapter's name selects it; other names are ignored (llama.cpp)
    n_predict: int | None = Field(None, ge=-1)      # -1: up to the context
    max_tokens: int | None = Field(None, ge=-1)     # llama.cpp's alias of n_predict
    temperature: float = 0.8
    top_k: int = 40                     # <= 0: off
    top_p: float = Field(0.95, ge=0, le=1)
    min_p: float = Field(0.05, ge=0, le=1)
    repeat_penalty: float = Field(1.0, gt=0)
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    typical_p: float = 1.0
    mirostat: int = 0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    dynatemp_range: float = 0.0
    seed: int = Field(-1, ge=MIN_SEED, le=MAX_SEED)     # -1: random
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    n_probs: int = Field(0, ge=0)
    post_sampling_probs: bool = False
    # [[token id or text, bias or false], ...] or {"id or text": bias or false}; false: never
    logit_bias: list[list[TokenId | str | float | bool]] | dict[str, float | bool] | None = None
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)    # GBNF
    json_schema: dict[str, Any] | None = None
    stream: bool = False
    return_tokens: bool = False
    response_fields: list[str] | None = None
    t_max_predict_ms: int = Field(0, ge=0)      # stop after this long generating, once a line has ended
    n_indent: int = Field(0, ge=0)              # stop at a line indented less (code completion)
    timings_per_token: bool = False
    lora: list[Any] | None = None
    needs_prompt: ClassVar[bool] = True

    @model_validator(mode="after")
    def _check_llama(self):
        for name, neutral in _LLAMA_UNSUPPORTED:
            if getattr(self, name) != neutral:
                raise ValueError(f"{name} {getattr(self, name)!r} is not supported by this server "
                                 f"(only {neutral!r})")
        if self.lora:
            raise ValueError("lora: per-request adapter scales are not supported; load an adapter "
                             "(/v1/load_lora_adapter) and name it in `model`")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give either grammar or json_schema, not both")
        if self.needs_prompt and (not self.prompt or not all(self.prompts())):
            raise ValueError("prompt must not be empty")
        if len(self.prompts()) > MAX_PROMPTS_X_N:
            raise ValueError(f"at most {MAX_PROMPTS_X_N} prompts are allowed, got {len(self.prompts())}")
        for pair in self.logit_bias if isinstance(self.logit_bias, list) else ():
            if len(pair) != 2 or not isinstance(pair[0], (int, str)) or isinstance(pair[0], bool) \
                    or isinstance(pair[1], str):
                raise ValueError("logit_bias pairs must be [token id or text, bias or false]")
        return self

    def limit(self) -> int:
        """n_predict (or max_tokens); -1: up to the context."""
        return next((v for v in (self.n_predict, self.max_tokens) if v is not None), -1)

    def prompts(self) -> list[MixedPrompt | MediaPrompt]:
        """One prompt (text, ids, mixed: a list with an id in it, or with media) or several."""
        p = self.prompt
        if isinstance(p, (str, MediaPrompt)) or any(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class InfillRequest(LlamaCompletionRequest):
    """llama.cpp's POST /infill: the text before and after the gap, other
    files of the project, and `prompt`, the text just before the gap (after
    input_prefix); see model_zoo/fim.infill_prompt."""
    prompt: MixedPrompt = ""
    input_prefix: MixedPrompt
    input_suffix: MixedPrompt
    input_extra: list[InputExtra] = Field(default_factory=list, max_length=MAX_INPUT_EXTRA)
    needs_prompt: ClassVar[bool] = False

    def prompts(self) -> list[MixedPrompt]:
        return [self.prompt]
