"""Per-request pooling (embeddings), in the shape vLLM users know: a request
with PoolingParams runs its prompt through the model and returns one vector
pooled from the final hidden states (after the model's last norm) instead of
generating tokens, or a classifier's label probabilities at the last
position: some tokens' (classify_token_ids: yes/no rerankers) or a
sequence-classification head's (score_head).

The pool is accumulated chunk by chunk as chunked prefill computes the prompt
(ModelRunner.prepare asks `rows` which positions a chunk adds), so a prompt
of any length up to the context pools in the same steps as other requests.
"""
from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")


class PoolingError(ValueError):
    """An invalid pooling value; the message names the field."""


@dataclass
class PoolingParams:
    pooling_type: str = "last"       # last: the final token's state (decoder embedding models); mean; cls: the first
    normalize: bool = True           # to unit length (cosine similarity = dot product)
    dimensions: int | None = None    # keep the first d (Matryoshka embeddings; normalized after the cut)
    # A token classifier (a yes/no reranker): the result is the softmax of the
    # last position's logits of these tokens, not a hidden state.
    classify_token_ids: tuple[int, ...] | None = None
    # A sequence classifier: its score head's labels at the last position,
    # sigmoid for one label, else softmax (vLLM's activations).
    score_head: bool = False

    def __post_init__(self):
        if not isinstance(self.pooling_type, str):
            raise PoolingError(f"pooling_type must be a string, got {self.pooling_type!r}")
        self.pooling_type = self.pooling_type.lower()
        if self.pooling_type not in POOLING_TYPES:
            raise PoolingError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise PoolingError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise PoolingError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if (self.classify_token_ids is not None or self.score_head) and self.pooling_type != "last":
            raise PoolingError("a classifier reads the last position: pooling_type must be last")

    @property
    def head(self) -> str | None:
        """What the runner computes for the pooled row instead of its state:
        "logits" (the LM head) or "score" (a classifier's head)."""
        return "logits" if self.classify_token_ids is not None else "score" if self.score_head else None

    @property
    def uses_every_position(self) -> bool:
        """Whether the pool reads positions before the last: then a prefix-cache
        hit, whose positions are not computed again, cannot be used."""
        return self.pooling_type != "last"

    def rows(self, start: int, n: int, num_prompt: int) -> tuple[int, int] | None:
        """The positions [lo, hi) of the chunk [start, start + n) whose states the
        pool adds up (None: none)."""
        end = min(start + n, num_prompt)
        if self.pooling_type == "mean":
            return (start, end) if end > start else None
        if self.pooling_type == "last":
            return (num_prompt - 1, num_prompt) if start < num_prompt <= start + n else None
        return (0, 1) if start == 0 else None

    def finish(self, total, num_prompt: int) -> list[float]:
        """The embedding from the sum of the pooled rows' states (a tensor);
        a classifier's probabilities from the last position's logits."""
        import torch     # here: the protocol layer imports this module
        v = total.float()
        if self.classify_token_ids is not None:
            return torch.softmax(v[list(self.classify_token_ids)], 0).tolist()
        if self.score_head:
            return (torch.sigmoid(v) if len(v) == 1 else torch.softmax(v, 0)).tolist()
        if self.pooling_type == "mean":
            v = v / num_prompt
        if self.dimensions is not None:
            v = v[:self.dimensions]          # (checked against the model's width at admission)
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()


def pair_token_ids(tokenizer, text_1: str, text_2: str) -> list[int]:
    """A token classifier's input for a pair (/v1/score, /v1/rerank): text_1's
    tokens, then text_2's with no special tokens between (how vLLM pairs texts
    for decoder rerankers, whose prompt format is in the texts)."""
    return tokenizer.encode(text_1) + tokenizer.encode(text_2, add_special_tokens=False)
