"""From a request's response_format / structured_outputs / tool_choice to the
engine's grammar constraint, and from a choice's text to OpenAI's message
fields (reasoning_content, content, tool_calls).

The engine compiles and enforces the grammar (engine/structured_output.py);
an invalid schema or grammar comes back from it as a 400 naming the problem.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.structured_output import StructuredOutputError, StructuredOutputsParams
from server.errors import APIError
from server.reasoning_parsers import PARSERS as REASONING_PARSERS, ReasoningParser
from server.tool_parsers import PARSERS as TOOL_PARSERS, ToolCallDelta, ToolParser


def constraint(req) -> dict | None:
    """The StructuredOutputsParams fields a request's response_format or
    structured_outputs asks for (chat and completions); None for free text."""
    so, rf = req.structured_outputs, req.response_format
    if so is not None:
        return dict(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                    json_object=bool(so.json_object))
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return dict(json_object=True)
    return dict(json=rf.json_schema.schema_)


def build(kw: dict | None, start_after: list[int] = ()) -> StructuredOutputsParams | None:
    if kw is None:
        return None
    try:
        return StructuredOutputsParams(**kw, start_after=tuple(start_after))
    except StructuredOutputError as e:
        raise APIError(400, str(e), param="structured_outputs") from None


@dataclass
class ChatTools:
    """What a chat request's tools, tool_choice and the server's parsers make
    of it: the forced-call grammar, and per choice the output parsing."""
    tool_parser: ToolParser | None        # None: tool calls are not parsed (no tools, or tool_choice none)
    reasoning: ReasoningParser | None
    forced: str | None                    # lark grammar for tool_choice required / named function
    thinking: bool = True                 # the output starts inside the thinking (from the prompt)
    parallel: bool = True                 # False (parallel_tool_calls): the first call only is kept

    @classmethod
    def for_request(cls, req, prompt_text: str, tool_parser_name: str | None,
                    reasoning_parser_name: str | None) -> "ChatTools":
        parser = None
        forced = None
        if req.tools and req.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            parser = TOOL_PARSERS[tool_parser_name or "hermes"](tools)
            choice = req.tool_choice
            # Markers that are special tokens are matched as tokens, not as their text.
            kw = {} if parser.skip_special_tokens else {"marker_tokens": True}
            if choice == "required":
                forced = parser.grammar(None, req.parallel_tool_calls, **kw)
            elif choice not in (None, "auto"):
                forced = parser.grammar(choice.function.name, req.parallel_tool_calls, **kw)
        reasoning = REASONING_PARSERS[reasoning_parser_name]() if reasoning_parser_name else None
        thinking = reasoning is not None and reasoning.thinking_in_prompt(prompt_text)
        return cls(parser, reasoning, forced, thinking, req.parallel_tool_calls)

    def constraint(self, req) -> dict | None:
        if self.forced is not None:
            return dict(grammar=self.forced)
        return constraint(req)

    def start_after(self, tokenizer) -> list[int]:
        """Token ids after which a constraint applies: the end of the thinking,
        when the model is expected to think first."""
        if not self.thinking:
            return []
        return tokenizer.encode(self.reasoning.end, add_special_tokens=False)

    @property
    def skip_special_tokens(self) -> bool:
        return self.tool_parser is None or self.tool_parser.skip_special_tokens

    def message(self, text: str) -> tuple[dict, bool]:
        """A finished choice's text -> (message fields, whether it calls tools)."""
        msg: dict = {"role": "assistant"}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, thinking=self.thinking)
            msg["reasoning_content"] = reasoning
        calls = []
        if self.tool_parser is not None and content:
            content, calls = self.tool_parser.parse(content)
            calls = calls if self.parallel else calls[:1]
        msg["content"] = content
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return msg, bool(calls)

    def stream(self) -> "ChatStream":
        return ChatStream(self)


class ChatStream:
    """One choice's streamed text -> OpenAI delta dicts (reasoning_content,
    content, tool_calls), holding back what may still become a marker."""

    def __init__(self, tools: ChatTools):
        self.r = tools.reasoning.stream(thinking=tools.thinking) if tools.reasoning is not None else None
        self.t = tools.tool_parser.stream() if tools.tool_parser is not None else None
        self.called = False
        self.max_index = None if tools.parallel else 0      # calls past it are dropped

    def feed(self, text: str, final: bool = False) -> list[dict]:
        reasoning, content = "", text
        if self.r is not None:
            reasoning, content = self.r.feed(text)
            if final:
                r2, c2 = self.r.finish()
                reasoning, content = reasoning + r2, content + c2
        calls: list[ToolCallDelta] = []
        if self.t is not None:
            content, calls = self.t.feed(content)
            if final:
                c2, k2 = self.t.finish()
                content, calls = content + c2, calls + k2
        deltas = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        if content:
            deltas.append({"content": content})
        for c in calls:
            if self.max_index is not None and c.index > self.max_index:
                continue
            self.called = True
            d = {"index": c.index, "function": {"arguments": c.arguments}}
            if c.id is not None:
                d = {"index": c.index, "id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
            deltas.append({"tool_calls": [d]})
        return deltas
