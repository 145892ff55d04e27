"""Client-side request state: incremental text, stop strings, n-way fan-in.

Runs in the caller's process (the API server or the offline LLM), so the
engine core never detokenizes. A stop string found in the text finishes the
request here and tells the caller which core requests to abort."""
import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCoreOutput
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer
    out: CompletionOutput
    hold: str = ""              # text held back: it may be the start of a stop string


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(c.out.finish_reason is not None for c in self.children.values())

    def output(self) -> RequestOutput:
        outs = []
        for c in sorted(self.children.values(), key=lambda c: c.index):
            o = c.out
            outs.append(CompletionOutput(o.index, list(o.token_ids), o.text,
                                         list(o.logprobs) if o.logprobs is not None else None,
                                         o.finish_reason, o.stop_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.prompt_logprobs, self.finished, self.num_cached_tokens,
                             dict(self.metrics), self.embedding)


def child_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def child_params(params: SamplingParams, i: int) -> SamplingParams:
    """Each of n samples gets its own seed so that they differ yet repeat."""
    if params.n == 1:
        return params
    d = dict(params.__dict__)
    d["n"] = 1
    if params.seed is not None:
        d["seed"] = params.seed + i
    return SamplingParams(**d)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float) -> list[str]:
        ids = child_ids(request_id, params.n)
        children = {
            cid: _Child(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                  params.skip_special_tokens),
                        CompletionOutput(i, logprobs=[] if params.logprobs is not None else None))
            for i, cid in enumerate(ids)}
        self.parents[request_id] = ParentState(request_id, prompt, prompt_token_ids, params, children,
                                               metrics={"arrival_time": arrival_time})
        for cid in ids:
            self.child_to_parent[cid] = request_id
        return ids

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Forget a parent, ending it: its output with every unfinished child
        marked "abort", and those children's ids (for the core to abort)."""
        p = self.parents.get(request_id)
        if p is None:
            return None, []
        unfinished = []
        for cid, c in p.children.items():
            if c.out.finish_reason is None:
                unfinished.append(cid)
                c.out.finish_reason = "abort"
                c.out.text += c.hold
                c.hold = ""
        p.metrics["finished_time"] = time.monotonic()
        final = p.output()
        self.remove(request_id)
        return final, unfinished

    def remove(self, request_id: str) -> list[str]:
        """Forget a parent; returns its unfinished child ids (to abort)."""
        p = self.parents.pop(request_id, None)
        if p is None:
            return []
        for cid in p.children:
            self.child_to_parent.pop(cid, None)
        return [cid for cid, c in p.children.items() if c.out.finish_reason is None]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply core outputs; returns updated parents' outputs and child ids
        the core must abort (stopped by a stop string)."""
        now = time.monotonic()
        touched: dict[str, ParentState] = {}
        to_abort = []
        for eo in outputs:
            pid = self.child_to_parent.get(eo.request_id)
            if pid is None:
                continue
            p = self.parents[pid]
            c = p.children[eo.request_id]
            m = p.metrics
            if eo.first_scheduled_time is not None:
                m.setdefault("first_scheduled_time", eo.first_scheduled_time)
                p.num_cached_tokens = max(p.num_cached_tokens, eo.num_cached_tokens)
            if eo.prompt_logprobs is not None and p.prompt_logprobs is None:
                p.prompt_logprobs = eo.prompt_logprobs
            if eo.embedding is not None:
                p.embedding = eo.embedding
            if eo.prediction is not None:       # (each choice's, at its end)
                for key, n in zip(("accepted_prediction_tokens", "rejected_prediction_tokens"), eo.prediction):
                    m[key] = m.get(key, 0) + n
            if eo.new_token_ids:
                m.setdefault("first_token_time", now)
                m["last_token_time"] = now
            self._append(p, c, eo)
            if c.out.finish_reason is None and eo.finish_reason is not None:
                c.out.finish_reason, c.out.stop_reason = eo.finish_reason, eo.stop_reason
                c.out.text += c.hold
                c.hold = ""
            elif c.out.finish_reason is not None and eo.finish_reason is None:
                to_abort.append(eo.request_id)       # stopped here by a stop string
            touched[pid] = p
        results = []
        for pid, p in touched.items():
            if p.finished:
                p.metrics["finished_time"] = now
                self.remove(pid)
            results.append(p.output())
        return results, to_abort

    def _append(self, p: ParentState, c: _Child, eo: EngineCoreOutput) -> None:
        # The eos / stop token that ended the request stays in token_ids but is
        # not text (as vLLM), unless include_stop_str_in_output: with special
        # tokens kept (a DSML tool parser), it would end the content otherwise.
        ids = eo.new_token_ids
        shown = ids[:-1] if eo.stopped_on_token and not p.params.include_stop_str_in_output else ids
        if not p.params.stop:
            if c.out.finish_reason is None:
                c.out.token_ids.extend(ids)
                if c.out.logprobs is not None and eo.new_logprobs:
                    c.out.logprobs.extend(eo.new_logprobs)
                c.out.text += c.detok.add(shown)
            return
        # Token by token: a stop string ends the output at the token that
        # completes it, however many tokens a step brought (speculative decoding).
        for i, tok in enumerate(ids):
            if c.out.finish_reason is not None:
                return
            c.out.token_ids.append(tok)
            if c.out.logprobs is not None and eo.new_logprobs:
                c.out.logprobs.append(eo.new_logprobs[i])
            if i < len(shown):
                self._stop_strings(p, c, c.detok.add([tok]))

    @staticmethod
    def _stop_strings(p: ParentState, c: _Child, delta: str) -> None:
        stops = p.params.stop
        # Search the held-back tail plus the new text for a complete stop string.
        buf = c.hold + delta
        best = None
        for s in stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            c.out.text += buf[:i + len(s)] if p.params.include_stop_str_in_output else buf[:i]
            c.hold = ""
            c.out.finish_reason, c.out.stop_reason = "stop", s
            return
        # Hold back the longest tail that could start a stop string.
        keep = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        c.out.text += buf[:len(buf) - keep]
        c.hold = buf[len(buf) - keep:]
