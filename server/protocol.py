"""Request bodies of the OpenAI-compatible API, as pydantic models.

Unknown fields are accepted and ignored (as vLLM does); wrong types or values
fail validation and become a 400 in OpenAI's error shape (see server.errors).
Responses are built as plain dicts in server.serving: their shape is fixed by
the OpenAI API and dicts keep the hot streaming path cheap.
"""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    """A non-text content part (image_url, input_audio, ...): rejected with a clear message."""
    model_config = ConfigDict(extra="allow")
    type: str


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")   # name, tool_calls, tool_call_id, ... go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.content, list):
            for part in self.content:
                if not isinstance(part, TextPart):
                    raise ValueError(f"content part type {part.type!r} is not supported (text only)")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content

    def to_template(self) -> dict[str, Any]:
        # An assistant turn that only calls tools has content null: templates
        # expect a string there.
        d = {"role": self.role, "content": self.text() or ""}
        d.update(self.model_extra or {})
        return d


NonNegInt = Annotated[int, Field(ge=0)]
TokenIds = list[NonNegInt]


class _SamplingFields(_Body):
    """Fields common to chat and completions (OpenAI's plus vLLM's extensions)."""
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v):
        for k, b in (v or {}).items():
            try:
                if int(k) < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if isinstance(v, list) and any(s == "" for s in v) or v == "":
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
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


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("token-id prompts must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only allowed with echo")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
