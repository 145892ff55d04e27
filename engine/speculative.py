"""Speculative decoding: its configuration (vLLM's `speculative_config`) and
the proposers that draft tokens for the next step.

A proposer drafts up to k tokens per decoding request at the end of a step;
the next step runs them through the target model with the request's last
token (one mixed forward with everyone else's prefill and decode), the
sampler verifies them (engine/sampler.py: rejection sampling against a
one-hot draft distribution, since every proposer here drafts
deterministically) and the scheduler rolls the rejected positions' KV back.

Requests that speculate: running, decoding (their prompt fully computed),
SamplingParams.speculative true. A grammar keeps the drafts it would take
and masks each verification row as it will be after the drafts before it
(structured_output.GrammarAhead); while it waits for its start marker
(reasoning), nothing is drafted. When more than disable_by_batch_size
requests run, nobody drafts: a step's verification costs k + 1 tokens of
compute per request, which a large batch no longer has for free."""
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields

import numpy as np

from engine.engine_args import parse_json_object
from engine.request import Request

METHODS = ("ngram", "mtp", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None     # ngram: longest suffix matched
    prompt_lookup_min: int | None = None     # ngram: shortest suffix matched
    # No drafts while more requests than this run. Off by default: measured
    # (tests/bench/results/spec_decode*.md, SmolLM2 on a 2-core CPU), n-gram
    # drafts paid at every batch size up to the default max_num_seqs (1.85x
    # at 1, 1.37x at 8, 1.03x at 32, 1.48x at 64); a GPU's crossover is its own.
    disable_by_batch_size: int | None = None
    model: str | None = None                 # draft_model: the drafting model (engine/draft_model.py)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            # vLLM's defaults: either bound defaults to the other, both to 5.
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = lo or hi or 5, hi or lo or 5
            if not 1 <= lo <= hi:
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative method 'draft_model' takes the drafting model as 'model' (a directory, "
                             ".gguf file or packaged name); other methods take none")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the CLI's form) or an instance."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = parse_json_object(value)
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": "draft_model"}          # vLLM's: a model alone is a draft model
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)

    def to_dict(self) -> dict:
        return asdict(self)


class Proposer(ABC):
    """Drafts tokens for requests about to decode, at the end of each step."""

    @abstractmethod
    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Per request, at most max_drafts[i] tokens to follow req.token_ids
        (reqs may be empty: a proposer with state still sees every step)."""

    def retain(self, request_ids: set[str]) -> None:
        """Called each step with the running requests' ids: what a proposer
        keeps for any other request may go."""


class NgramProposer(Proposer):
    """Prompt lookup: the newest n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) are looked up in the request's own prompt + output;
    the tokens that followed their latest earlier occurrence are the draft.
    A request with a predicted output (OpenAI's `prediction`) also looks in
    it (follow), and its draft wins unless the prompt lookup matched more
    tokens."""

    def __init__(self, cfg: SpeculativeConfig):
        self.lo, self.hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for r, k in zip(reqs, max_drafts):
            p, m = self._follow(r.prediction, r.output_array, k) if k > 0 and r.prediction is not None else ([], 0)
            d, n = self._lookup(r.token_array, k) if k > 0 and m != float("inf") else ([], 0)
            r.spec_from_prediction = bool(p) and m >= n
            drafts.append(p if r.spec_from_prediction else d)
        return drafts

    def follow(self, prediction: np.ndarray, output: np.ndarray, k: int) -> list[int]:
        return self._follow(prediction, output, k)[0]

    def lookup(self, token_ids, k: int) -> list[int]:
        """token_ids: a request's prompt + output (int64 array or list)."""
        return self._lookup(token_ids, k)[0]

    def _follow(self, prediction: np.ndarray, output: np.ndarray, k: int) -> tuple[list[int], float]:
        """(draft, match length) from the prediction: while the output is its
        start, what comes next (matched in full: inf); else what follows the
        longest suffix of the output (prompt_lookup_max tokens down to two:
        one token is too weak a match after an edit) found in it, the
        occurrence ending nearest the output's length (an edited text stays
        roughly aligned with the original)."""
        m = len(output)
        if m <= len(prediction) and np.array_equal(prediction[:m], output):
            return prediction[m:m + k].tolist(), float("inf")
        for n in range(min(self.hi, m, len(prediction)), 1, -1):
            win = np.lib.stride_tricks.sliding_window_view(prediction, n)
            ends = np.flatnonzero((win == output[-n:]).all(axis=1)) + n
            if ends.size:
                end = int(ends[np.argmin(np.abs(ends - m))])
                return prediction[end:end + k].tolist(), n
        return [], 0

    def _lookup(self, token_ids, k: int) -> tuple[list[int], int]:
        ids = np.asarray(token_ids, dtype=np.int64)
        L = len(ids)
        if L <= self.lo:
            return [], 0
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            # Windows starting at 0 .. L - n - 1 (the suffix itself excluded).
            win = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)
            hit = np.flatnonzero((win == ids[L - n:]).all(axis=1))
            if hit.size:
                start = int(hit[-1]) + n
                return ids[start:start + k].tolist(), n
        return [], 0


def make_proposer(cfg: SpeculativeConfig, runner, draft=None, vocab_size: int = 0) -> Proposer:
    """draft: the worker's engine.draft_model.DraftModel (method draft_model)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if cfg.method == "draft_model":
        from engine.draft_model import DraftModelProposer
        return DraftModelProposer(draft, vocab_size)
    from engine.mtp_proposer import MtpProposer
    return MtpProposer(runner)
