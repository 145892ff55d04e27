"""Reasoning ("thinking") text out of a model's output: vLLM's `--reasoning-parser`.

A thinking model writes `<think>reasoning</think>answer`; the API returns the
reasoning as `reasoning_content` and the answer as `content`.

- qwen3: Qwen3 writes `<think>` itself when it thinks. An output that starts
  with `<think>` is reasoning up to `</think>`, content after it; any other
  output is all content (thinking disabled: enable_thinking=False renders the
  closed empty block in the prompt, and the model writes no markers).
- deepseek_r1 / deepseek_v3 (DeepSeek-V3.1/V4 thinking): the chat template puts
  `<think>` in the prompt, so the output starts inside the thinking: text
  before `</think>` is reasoning (a leading `<think>`, if written, is dropped),
  the rest content.

Output cut before `</think>` (max_tokens) is all reasoning in every parser: a
stream has sent it as reasoning already and cannot take it back, so `split`
says the same. When the prompt already closed the thinking (see
thinking_in_prompt), pass thinking=False: the whole output is content.

Both parts are kept as written (the "\\n\\n" after `</think>` stays in the
content), except that a part that is empty or only whitespace is None; a
stream holds whitespace at the start of a part until text follows, so what it
sends concatenates to exactly what `split` returns, however the text is cut.
"""
from __future__ import annotations

from abc import ABC
from typing import ClassVar


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """Incremental split for one choice: feed() deltas, then finish() once."""

    def __init__(self, parser: "ReasoningParser", thinking: bool = True):
        self._p = parser
        # "start": deciding whether the output opens with `start`;
        # "reason": inside the thinking; "content": after it (or no thinking).
        self._state = "start" if thinking else "content"
        self._buf = ""
        self._held = {"reason": "", "content": ""}    # leading whitespace of a part
        self._live = {"reason": False, "content": False}
        self._done = False

    def feed(self, delta: str) -> tuple[str, str]:
        if self._done:
            return "", ""
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        if self._done:
            return "", ""
        self._done = True
        return self._step(final=True)

    def _emit(self, out: dict, part: str, text: str) -> None:
        if not text:
            return
        if self._live[part]:
            out[part] += text
        elif text.strip():
            out[part] += self._held[part] + text
            self._held[part], self._live[part] = "", True
        else:
            self._held[part] += text                  # dropped if the part stays blank

    def _step(self, final: bool) -> tuple[str, str]:
        out = {"reason": "", "content": ""}
        p = self._p
        while True:
            buf = self._buf
            if self._state == "start":
                rest = buf.lstrip()
                if rest.startswith(p.start):          # drop leading whitespace + `start`
                    self._buf, self._state = rest[len(p.start):], "reason"
                elif not final and p.start.startswith(rest):
                    break                             # may still become `start`
                else:
                    self._state = "reason" if p.output_starts_thinking else "content"
            elif self._state == "reason":
                i = buf.find(p.end)
                if i >= 0:
                    self._emit(out, "reason", buf[:i])
                    self._buf, self._state = buf[i + len(p.end):], "content"
                    continue
                keep = 0 if final else _partial_suffix(buf, p.end)
                self._emit(out, "reason", buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            else:
                self._emit(out, "content", buf)
                self._buf = ""
                break
        return out["reason"], out["content"]


class ReasoningParser(ABC):
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # Whether output that does not open with `start` is inside the thinking.
    output_starts_thinking: ClassVar[bool] = True

    def split(self, text: str, *, thinking: bool = True) -> tuple[str | None, str | None]:
        """Whole output -> (reasoning_content, content); None for an empty part.
        thinking=False: the prompt closed the thinking, all is content."""
        s = self.stream(thinking=thinking)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self, *, thinking: bool = True) -> ReasoningStream:
        return ReasoningStream(self, thinking)

    def thinking_in_prompt(self, prompt_text: str) -> bool:
        """Whether the model is expected to think before answering this rendered
        prompt: False when the prompt's tail (after its last `start`, if any)
        already closes the thinking with `end` followed only by whitespace
        (Qwen3's enable_thinking=False renders "<think>\\n\\n</think>\\n\\n"),
        True otherwise."""
        i = prompt_text.rfind(self.start)
        tail = prompt_text[i + len(self.start):] if i >= 0 else prompt_text
        j = tail.rfind(self.end)
        return not (j >= 0 and not tail[j + len(self.end):].strip())


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    output_starts_thinking = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-V3.1 / V4 in thinking mode: as deepseek_r1. Their non-thinking
    prompt ends with `</think>` (thinking_in_prompt is False): pass thinking=False."""
    name = "deepseek_v3"


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser)
}
