"""Grammar-constrained decoding: a per-request token mask, built on llguidance.

llguidance was picked over xgrammar and outlines-core by measurement
(tests/bench/structured_output.py, results in tests/bench/results/): both
llguidance and xgrammar mask a SmolLM2 step in tens of microseconds, but
llguidance has no dependencies (xgrammar pulls an unpinned triton and
tvm-ffi), reads the tokenizer.json as is (no vocabulary-type guessing),
embeds JSON schemas in Lark grammars (tool calls) and rolls back (speculative
decoding).

Flow: the server turns a request's `response_format` / `structured_outputs`
/ forced tool choice into `StructuredOutputsParams` and validates it
(`GrammarCompiler.check`: a 400 naming the problem). The engine core
compiles it once per distinct grammar (LRU of pristine matchers; each
request gets a copy) and hangs a `GrammarState` on the request. Each step
the sampler asks `fill_bitmask` for the rows that are constrained, applies
the bits to those rows' logits only, and every token the request accepts
advances its matcher (`Request.append`); a rollback rolls it back.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class StructuredOutputError(ValueError):
    """An invalid or unsupported schema / grammar; the message names the problem."""


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one constraint kind is set.
    `start_after`: token ids that open the constrained part (a reasoning
    model's `</think>`): the mask applies only after the output contains them."""
    json: str | dict | None = None           # a JSON schema (text or dict)
    json_object: bool = False                 # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                # Lark (llguidance's dialect) or GBNF / EBNF
    start_after: tuple[int, ...] = ()

    def __post_init__(self):
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise StructuredOutputError(
                f"give exactly one of json, json_object, regex, choice, grammar; got {kinds or 'none'}")
        self.start_after = tuple(self.start_after)

    def to_llguidance(self) -> str:
        """The llguidance grammar (a JSON text) for this constraint."""
        import llguidance
        try:
            if self.json is not None:
                return llguidance.grammar_from("json_schema", _compact(self.json))
            if self.json_object:
                return llguidance.grammar_from("json_schema", _compact({"type": "object"}))
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                if not self.choice or not all(isinstance(c, str) for c in self.choice):
                    raise StructuredOutputError("choice must be a non-empty list of strings")
                return llguidance.grammar_from("choice", self.choice)
            return llguidance.grammar_from("grammar", self.grammar)
        except StructuredOutputError:
            raise
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(f"invalid {self.kind}: {e}") from None

    @property
    def kind(self) -> str:
        if self.json is not None:
            return "json schema"
        return "json_object" if self.json_object else "regex" if self.regex is not None else \
            "choice" if self.choice is not None else "grammar"


# JSON is written as json.dumps writes it (", " and ": ", no other whitespace):
# with free whitespace a small model can spend its whole budget on newlines.
# A schema's own "x-guidance" options win.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: str | dict | bool) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise StructuredOutputError(f"invalid json schema: {e}") from None
    if schema is True:
        schema = {}
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}}
    return json.dumps(schema)


class GrammarCompiler:
    """Compiles constraints against one tokenizer; caches one pristine matcher
    per distinct grammar and hands out copies. Thread-safe (the server checks
    requests from its event loop and worker threads)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        self._json, self._vocab, self._eos = tokenizer_json, int(vocab_size), list(eos_token_ids)
        self._tok = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> "GrammarCompiler":
        # The mask spans the model's logits, which may be wider than the tokenizer.
        return cls(tokenizer.backend.to_str(), max(vocab_size, len(tokenizer)), eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def tokenizer(self):
        if self._tok is None:                  # ~0.3 s: built at the first constrained request
            import llguidance
            with self._lock:
                if self._tok is None:
                    self._tok = llguidance.LLTokenizer(self._json, n_vocab=self._vocab,
                                                       eos_token=self._eos or None)
        return self._tok

    def check(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar for `params`; StructuredOutputError when it
        does not compile (the message is llguidance's, naming what is wrong or
        unsupported)."""
        grammar = params.to_llguidance()
        self.matcher(grammar, params.kind)
        return grammar

    def matcher(self, grammar: str, kind: str = "grammar"):
        """A fresh matcher at the grammar's start (kind names the constraint in errors)."""
        import llguidance
        with self._lock:
            m = self._cache.get(grammar)
            if m is not None:
                self._cache.move_to_end(grammar)
                return m.deep_copy()
        m = llguidance.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise StructuredOutputError(f"invalid {kind}: {_clean(m.get_error())}")
        with self._lock:
            self._cache[grammar] = m
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return m.deep_copy()


def _clean(msg: str) -> str:
    return " ".join(str(msg).split())


@dataclass
class GrammarState:
    """One request's position in its grammar."""
    matcher: object
    words: int                                # int32 words of its mask row (mask_words of the grammar's vocab)
    start_after: tuple[int, ...] = ()
    active: bool = True
    consumed: int = 0                         # output tokens the matcher has taken
    failed: str | None = field(default=None)

    @classmethod
    def start(cls, compiler: GrammarCompiler, params: StructuredOutputsParams) -> "GrammarState":
        m = compiler.matcher(params.to_llguidance(), params.kind)
        return cls(m, mask_words(compiler.vocab_size), params.start_after, active=not params.start_after)

    def accept(self, token_ids: list[int], num_output: int) -> bool:
        """Advance by the newest token (token_ids: prompt + output, num_output
        of them output). True when the grammar is complete (nothing more may
        follow) or rejected the token (`failed` says why)."""
        if not self.active:
            n = len(self.start_after)
            if num_output >= n and tuple(token_ids[-n:]) == self.start_after:
                self.active = True
            return False
        self.consumed += 1
        if not self.matcher.consume_token(token_ids[-1]):
            self.failed = _clean(self.matcher.get_error()) or f"token {token_ids[-1]} not allowed"
            return True
        return self.matcher.is_stopped()

    def fill_mask(self, row: np.ndarray, ahead: list[int] = ()) -> None:
        """Write the mask of the tokens allowed next into row (int32 words);
        with `ahead`, the mask after those tokens (drafts valid_drafts kept),
        leaving the matcher where it was."""
        if ahead:
            self.matcher.consume_tokens(list(ahead))
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, 4 * self.words)
        if ahead:
            self.matcher.rollback(len(ahead))

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar would take (0 while it waits
        for start_after: the drafts could cross the marker)."""
        return self.matcher.validate_tokens(drafts) if self.active and drafts else 0

    def ahead(self, drafts: list[int]) -> "GrammarAhead":
        return GrammarAhead(self, drafts)

    def rollback(self, token_ids: list[int], num_output: int) -> None:
        """The request was cut back to token_ids (num_output of them output):
        forget what the matcher took beyond them."""
        keep = num_output
        if self.start_after:
            after = _tokens_after(token_ids[len(token_ids) - num_output:], self.start_after)
            self.active, keep = after is not None, after or 0
        drop = self.consumed - keep
        if drop > 0:
            self.matcher.rollback(drop)
            self.consumed = keep


@dataclass
class GrammarAhead:
    """A grammar as it will be after some drafts (a verification row's mask)."""
    state: GrammarState
    drafts: list[int]

    @property
    def active(self) -> bool:
        return self.state.active

    @property
    def words(self) -> int:
        return self.state.words

    def fill_mask(self, row: np.ndarray) -> None:
        self.state.fill_mask(row, self.drafts)


def _tokens_after(ids: list[int], marker: tuple[int, ...]) -> int | None:
    """How many ids follow the first occurrence of marker; None when absent."""
    n = len(marker)
    for i in range(len(ids) - n + 1):
        if tuple(ids[i:i + n]) == marker:
            return len(ids) - i - n
    return None


def mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask (what llguidance fills, exactly)."""
    return (vocab_size + 31) // 32


def fill_bitmask(reqs) -> tuple[list[int], np.ndarray] | None:
    """(rows, int32 [len(rows), W]) bitmask of the tokens each constrained
    request of a batch may take next (bit t of word t // 32 is token t); None
    when none is constrained."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.active]
    if not rows:
        return None
    W = max(reqs[i].grammar.words for i in rows)
    # Rows an even count of words: the mask travels in the sampler's int64 upload.
    mask = np.zeros((len(rows), W + (W & 1)), dtype=np.int32)
    for j, i in enumerate(rows):
        reqs[i].grammar.fill_mask(mask[j])
    return rows, mask
