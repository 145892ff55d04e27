"""Request state inside the engine core."""
import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.lora import LoRARequest
from engine.multimodal import MultiModalItem, cache_token_ids
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    """What a client sends to the engine core: one sequence (n is fanned out
    by the client into n requests)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0             # --scheduling-policy priority: lower runs first (vLLM's meaning)
    pooling: PoolingParams | None = None   # an embedding: the prompt's pooled states, no tokens (max_tokens 0)
    cache_salt: str | None = None # vLLM's: only requests with the same salt share prefix-cache blocks
    lora: LoRARequest | None = None   # the adapter it runs with (engine/lora.py)
    mm_items: list[MultiModalItem] = field(default_factory=list)   # its images, in prompt order


class Request:
    def __init__(self, er: EngineRequest, max_model_len: int):
        self.request_id = er.request_id
        self.params = er.params
        self.prompt_token_ids = list(er.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.token_ids = list(er.prompt_token_ids)    # prompt + generated
        self.mm_items = er.mm_items
        # What the prefix cache hashes: token_ids itself, or with images a copy
        # whose placeholders name the image (engine/multimodal.py).
        self.cache_token_ids = cache_token_ids(self.token_ids, self.mm_items) if self.mm_items else self.token_ids
        self.eos_token_ids = set() if er.params.ignore_eos else set(er.eos_token_ids)
        self.stop_token_ids = set(er.params.stop_token_ids)
        self.arrival_time = er.arrival_time
        self.priority = er.priority
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1                  # prefix-cache hit at first schedule
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        mt = er.params.max_tokens
        room = max_model_len - self.num_prompt_tokens
        self.max_tokens = room if mt is None else min(mt, room)
        # A seeded request draws from its own generator, made on the logits'
        # device at its first sample (generator_for).
        self.seed: int | None = er.params.seed
        self.generator: torch.Generator | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_on_token = False     # the last token is the eos / stop token that ended it
        # Prompt logprobs are computed chunk by chunk and sent once complete.
        self.prompt_logprobs: list | None = [None] if er.params.prompt_logprobs is not None else None
        # Embeddings: the sum of the pooled rows' states so far (ModelRunner.collect).
        self.pooling = er.pooling
        # Prefix-cache blocks are shared within one salt and one adapter.
        self.cache_salt = er.cache_salt if er.lora is None else (er.cache_salt, "lora", er.lora.lora_int_id)
        self.lora = er.lora
        self.lora_slot = 0          # its adapter's slot while running (LoRAManager.acquire)
        self.pooled: torch.Tensor | None = None
        # Grammar-constrained requests: set by the engine core (structured_output.GrammarState).
        self.grammar = None
        # bad_words as token sequences: set by the engine core (engine/bad_words.py).
        self.bad_words_ids: list[list[int]] = []
        allowed = er.params.allowed_token_ids       # (an array once, not per step)
        self.allowed_ids = None if allowed is None else np.asarray(allowed, dtype=np.int64)
        # Draft tokens the next step verifies (speculative decoding); never in token_ids.
        self.spec_token_ids: list[int] = []
        # A predicted output (OpenAI's `prediction`): drafts come from it first;
        # how many of its drafted tokens were accepted / rejected.
        pred = er.params.prediction_token_ids
        self.prediction = np.asarray(pred, dtype=np.int64) if pred else None
        self.spec_from_prediction = False       # the drafts now in spec_token_ids came from it
        self.prediction_accepted = self.prediction_rejected = 0
        # Tokens sampled by a step still in flight (asynchronous scheduling):
        # the next step is scheduled as if they were here.
        self.num_placeholders = 0
        # token_ids as int64 numpy: a buffer whose first _arr_len entries
        # mirror token_ids (extended by what was appended since it was read).
        self._arr = np.empty(0, np.int64)
        self._arr_len = 0
        self._prompt_distinct: np.ndarray | None = None

    @property
    def token_array(self) -> np.ndarray:
        """token_ids as int64 numpy (a view, valid until the next append or
        truncate): copies only the tokens appended since the last call, so
        penalties and n-gram lookups read a long context without converting
        it each step."""
        n, k = len(self.token_ids), self._arr_len
        if n > k:
            if n > len(self._arr):
                grown = np.empty(max(n, 2 * len(self._arr), 64), np.int64)
                grown[:k] = self._arr[:k]
                self._arr = grown
            self._arr[k:n] = self.token_ids[k:]
            self._arr_len = n
        return self._arr[:n]

    @property
    def output_array(self) -> np.ndarray:
        """The output's ids as int64 numpy (a view of token_array)."""
        return self.token_array[self.num_prompt_tokens:]

    @property
    def prompt_distinct(self) -> np.ndarray:
        """The prompt's distinct ids, once: what a repetition penalty touches
        in it (text repeats itself: 8K tokens of English hold ~1.7K distinct
        ids, 32K ~3.8K, with SmolLM2's tokenizer)."""
        if self._prompt_distinct is None:
            self._prompt_distinct = np.unique(self.token_array[:self.num_prompt_tokens])
        return self._prompt_distinct

    def truncate(self, num_tokens: int) -> None:
        """Keep the first num_tokens tokens (the grammar follows)."""
        del self.token_ids[num_tokens:]
        if self.cache_token_ids is not self.token_ids:
            del self.cache_token_ids[num_tokens:]
        self._arr_len = min(self._arr_len, num_tokens)
        if self.grammar is not None:
            self.grammar.rollback(self.token_ids, self.num_output_tokens)

    @property
    def reuses_prefix(self) -> bool:
        """Whether a prefix-cache hit may skip computing the prompt's first
        positions: not when their logprobs or their states are wanted."""
        return self.params.prompt_logprobs is None and not (self.pooling and self.pooling.uses_every_position)

    def needs_own_tokens(self) -> bool:
        """Whether sampling its next token reads its previous tokens on the
        host (penalties over them, a grammar's state, bad words of several
        tokens): then a step's sampling waits for the tokens of the step
        before. (min_tokens needs only their count, placeholders included.)"""
        p = self.params
        return (p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)
                or self.grammar is not None or any(len(s) > 1 for s in self.bad_words_ids))

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """This request's generator on `device` (None when unseeded), seeded
        from the request's seed when first asked for; on CPU its stream is
        torch.Generator().manual_seed(seed)'s."""
        if self.seed is None:
            return None
        g = self.generator
        if g is None or g.device != device:
            g = self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return g

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append(self, token: int) -> None:
        """Add a sampled token; sets finish_reason when it ends the request."""
        self.token_ids.append(token)
        if self.cache_token_ids is not self.token_ids:
            self.cache_token_ids.append(token)
        n = self.num_output_tokens
        if self.grammar is not None and self.grammar.accept(self.token_ids, n):
            # The grammar is complete (or, never expected, rejected the token).
            self.finish_reason = "stop"
            self.stopped_on_token = token in self.eos_token_ids or token in self.stop_token_ids
            return
        if n >= self.params.min_tokens:
            if token in self.eos_token_ids:
                self.finish_reason, self.stopped_on_token = "stop", True
            elif token in self.stop_token_ids:
                self.finish_reason, self.stop_reason, self.stopped_on_token = "stop", token, True
        if self.finish_reason is None and n >= self.max_tokens:
            self.finish_reason = "length"
