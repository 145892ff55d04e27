"""Beam search, vLLM's way: each step runs every live beam as a one-token
request asking for the top 2 x beam_width logprobs (prefix caching makes
the beams' shared tokens free), and the step's candidates, each beam
extended by each of its top tokens, are ranked by cumulative logprob. A
candidate ending in EOS (or a stop token id) is complete; the best
beam_width of the others go on. At the end (max_tokens, or no live beam,
or no live beam that could still rank above the complete ones: the rule of
transformers' early_stopping=False) the best beam_width of all are returned,
ranked by cum_logprob / generated_length ** length_penalty (transformers'
score, the EOS counted; vLLM counts the prompt's length too and not the
EOS).

`BeamSearch` is the search's state, driven by LLM.beam_search (offline) and
AsyncLLM.beam_search (the server: `use_beam_search` with `n` beams).
"""
from dataclasses import dataclass, field

from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0        # accepted for vLLM's signature: the ranking reads the raw logprobs
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise InvalidRequest(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1 for beam search, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """vLLM's: tokens are the prompt's then the generated ones; logprobs one
    dict per generated token (the chosen one and the step's top ones)."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def check_width(params: BeamSearchParams, max_logprobs: int) -> None:
    """A step asks for 2 x beam_width logprobs: within the engine's max_logprobs (-1: no cap)."""
    if 0 <= max_logprobs < 2 * params.beam_width:
        raise InvalidRequest(f"beam width {params.beam_width} needs the top {2 * params.beam_width} logprobs per "
                             f"step, more than --max-logprobs {max_logprobs} allows")


class BeamSearch:
    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, stop_ids: set[int]):
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.stop_ids = set() if params.ignore_eos else set(stop_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.complete: list[BeamSearchSequence] = []
        self.steps = 0
        self.aborted = False

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0, logprobs=2 * self.params.beam_width, ignore_eos=True)

    def score(self, beam: BeamSearchSequence) -> float:
        n = len(beam.tokens) - self.num_prompt_tokens      # (an ending EOS counts, as in transformers)
        return beam.cum_logprob / n ** self.params.length_penalty

    @property
    def done(self) -> bool:
        k = self.params.beam_width
        if not self.live or self.steps >= self.params.max_tokens:
            return True
        if len(self.complete) < k:
            return False
        worst_kept = sorted(map(self.score, self.complete), reverse=True)[k - 1]
        return max(map(self.score, self.live)) <= worst_kept

    def advance(self, logprobs: list[dict[int, float]]) -> None:
        """One step: logprobs[i] is live beam i's next-token dict (top 2k)."""
        k = self.params.beam_width
        candidates = []
        for beam, lps in zip(self.live, logprobs):
            for tok, lp in lps.items():
                new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lps], beam.cum_logprob + lp)
                if tok in self.stop_ids:
                    new.finish_reason, new.stop_reason = "stop", tok
                    self.complete.append(new)
                else:
                    candidates.append(new)
        self.live = sorted(candidates, key=lambda b: b.cum_logprob, reverse=True)[:k]
        self.complete = sorted(self.complete, key=self.score, reverse=True)[:k]
        self.steps += 1

    def output(self, tokenizer, skip_special_tokens: bool = True) -> BeamSearchOutput:
        """The best beam_width beams, best first, with their text."""
        for b in self.live:
            b.finish_reason = "abort" if self.aborted else "length"
        best = sorted(self.complete + self.live, key=self.score, reverse=True)[:self.params.beam_width]
        for b in best:
            out = b.tokens[self.num_prompt_tokens:]
            if b.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                out = out[:-1]
            b.text = tokenizer.decode(out, skip_special_tokens=skip_special_tokens) if tokenizer is not None else None
        return BeamSearchOutput(best)
