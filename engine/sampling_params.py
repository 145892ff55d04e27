"""Per-request sampling parameters, in the shape vLLM users know."""
import logging
from dataclasses import dataclass, field

from engine.structured_output import StructuredOutputsParams


class SamplingError(ValueError):
    """An invalid sampling value; the message names the field."""


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16          # None = up to the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None           # top-k alternatives per generated token (0 = only the chosen one)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None   # vLLM's: sample only among these
    bad_words: list[str] = field(default_factory=list)     # vLLM's: words never generated (engine/bad_words.py)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # grammar-constrained output
    speculative: bool = True              # False: never draft for this request (speculative decoding)
    # OpenAI's predicted output, as token ids: with n-gram speculative decoding
    # its tokens are the drafts (engine/speculative.py); the output is unchanged.
    prediction_token_ids: list[int] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise SamplingError(f"{name} {why}, got {getattr(self, name)!r}")
        if self.n < 1:
            bad("n", "must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", "must be >= 0")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not self.temperature >= 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be -1 (off), 0 (off) or positive")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        # (The engine caps both at its max_logprobs: engine_core.check_request.)
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be >= 0")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            bad("allowed_token_ids", "must be a non-empty list of token ids")
        if any(not w.strip() for w in self.bad_words):
            bad("bad_words", "must not contain empty words")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def log_sampling_defaults(defaults: dict) -> None:
    """The startup line saying which sampling settings requests get by default."""
    if defaults:
        logging.getLogger("tqserve.engine").info(
            "requests that leave them unset get the model's recommended sampling settings %s "
            "(--generation-config vllm: none)", ", ".join(f"{k}={v:g}" for k, v in defaults.items()))
