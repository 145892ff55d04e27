"""Per-request pooling (embeddings), in the shape vLLM users know: a request
with PoolingParams runs its prompt through the model and returns one vector
pooled from the final hidden states (after the model's last norm) instead of
generating tokens.

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
        """The embedding from the sum of the pooled rows' states (a tensor)."""
        import torch     # here: the protocol layer imports this module
        v = total.float()
        if self.pooling_type == "mean":
            v = v / num_prompt
        if self.dimensions is not None:
            v = v[:self.dimensions]          # (checked against the model's width at admission)
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()
