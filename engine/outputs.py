"""What the engine hands back per request."""
from dataclasses import dataclass, field

# One position's logprobs: {token_id: logprob}, the chosen token first, then
# the top-k alternatives in descending order (a token may appear in both).
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprobs] | None = None          # one per generated token
    finish_reason: str | None = None                # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None            # the stop string or stop token id that matched; "error": why


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprobs | None] | None = None   # first entry None (no context), as vLLM
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)     # arrival/first_token/finish times, queue time
    embedding: list[float] | None = None            # a pooling request's vector (engine/pooling_params.py)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape: out.outputs.embedding)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]          # one per label (ModelInfo.classifier_labels)


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt (vLLM's shape: out.outputs.probs)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair (vLLM's shape: out.outputs.score)."""
    request_id: str
    prompt_token_ids: list[int]         # the pair's (a classifier's input), or text_2's (embeddings)
    outputs: ScoringOutput
    finished: bool = True
