"""Tool calls out of a model's text: vLLM's `--tool-call-parser` formats.

Each parser reads one model family's tool-call format in three ways:

- `parse(text)`: a whole output -> (content, calls), for non-streaming replies;
- `stream()`: an incremental reader for one streamed choice, fed text deltas,
  giving content deltas and OpenAI `delta.tool_calls[]` entries;
- `grammar(choice, parallel)`: a Lark grammar (llguidance's dialect) that forces
  the output to be valid calls, for tool_choice="required" or a named function.

`parse` runs the same state machine as `stream` (in a "whole" mode that only
commits a call once its text is complete and valid), so the two agree on what
is content and what is a call. Malformed call text is never an error: it stays
in the content. Content rule, for both: the text outside calls is kept verbatim,
except that a whitespace-only run between/around calls vanishes (the newlines
that separate calls are not content); None when nothing is left.

Streaming sends a call's name as soon as it is known and then its arguments as
the model writes them (the model's raw JSON text, which json.loads to the same
object as ToolCall.arguments). A call whose whole text is already there when
its name could be read (e.g. all of it in one delta) is sent as one delta with
ToolCall.arguments' exact text. If a call turns out malformed after its name
was sent, it cannot be taken back: it stays a call (its arguments as written so
far); only a call of which nothing was sent falls back to content. pythonic
sends each call whole once its closing ")" arrives, so it always agrees with
parse.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ToolCall:
    id: str          # "call_" + 24 random hex digits
    name: str
    arguments: str   # JSON text of the arguments object


@dataclass
class ToolCallDelta:
    """One OpenAI streaming delta.tool_calls[] entry."""
    index: int                  # position of the call in this choice
    id: str | None = None       # set on the call's first delta only
    name: str | None = None     # set on the call's first delta only
    arguments: str = ""         # a piece of the arguments JSON text


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _dumps(obj) -> str:
    # ensure_ascii=False: arguments keep their unicode as the model wrote it.
    return json.dumps(obj, ensure_ascii=False)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def _load_json(text: str):
    """json.loads that rejects NaN/Infinity (Python's json accepts them) and
    never raises: None for anything that is not JSON."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return None


def _call_from_obj(obj, arg_keys: tuple[str, ...]) -> tuple[str, dict] | None:
    """(name, arguments) of a {"name": ..., "<arg key>": {...}} object, or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = next((obj[k] for k in arg_keys if k in obj), None)
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        return None
    return name.strip(), args


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of a marker
    (held back: "<tool" may become "<tool_call>")."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(position, marker) of the earliest marker in text, (-1, "") if none."""
    found = (-1, "")
    for m in markers:
        i = text.find(m)
        if i >= 0 and (found[0] < 0 or i < found[0]):
            found = (i, m)
    return found


class _BracketScan:
    """Incremental bracket depth of JSON text fed piece by piece, aware of
    strings and escapes: finds where an object ends without re-reading what
    came before (O(n) per call). _PyScan: the same over Python source."""
    OUT = re.compile(r'["{}\[\]]')                 # what matters outside a string
    IN = {'"': re.compile(r'["\\]')}              # ... inside one, by its quote

    def __init__(self, depth: int = 0):
        self.depth, self.quote, self.esc = depth, "", False

    def feed(self, text: str, pos: int = 0) -> int:
        """Scan text[pos:]; index just past the bracket that brings the depth
        back to 0, or -1 if it is not in this text."""
        n = len(text)
        while pos < n:
            if self.esc:
                self.esc, pos = False, pos + 1
                continue
            m = (self.IN[self.quote] if self.quote else self.OUT).search(text, pos)
            if m is None:
                return -1
            ch, pos = m.group(), m.end()
            if self.quote:
                if ch == "\\":
                    self.esc = True
                else:
                    self.quote = ""
            elif ch in self.IN:
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return pos
        return -1


class ToolStream(ABC):
    """Incremental tool-call reader for one choice: feed() deltas, finish() once.

    Subclasses implement _step(final): consume self._buf as far as it can be
    decided, reporting through _content/_open_call/_args/_close_call/_whole_call.
    """

    def __init__(self, whole: bool = False):
        self._whole = whole          # parse(): commit calls only once complete and valid
        self._buf = ""               # text received, not yet decided
        self._out: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._ws = ""                # whitespace held while the content segment has no text yet
        self._live = False           # the current content segment has non-whitespace text
        self._index = 0              # index of the next (or current) call
        self._done = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._done or not delta:
            return self._take()
        self._buf += delta
        self._step(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if not self._done:
            self._step(final=True)
            self._done = True
            self._ws = ""            # a whitespace-only last segment vanishes
        return self._take()

    @abstractmethod
    def _step(self, final: bool) -> None: ...

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        out, deltas = "".join(self._out), self._deltas
        self._out, self._deltas = [], []
        return out, deltas

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._live:
            self._out.append(text)
        elif text.strip():
            self._out.append(self._ws + text)
            self._ws, self._live = "", True
        else:
            self._ws += text

    def _end_segment(self) -> None:
        # A call starts: whitespace held since the last call is a separator.
        self._ws, self._live = "", False

    def _open_call(self, name: str) -> None:
        self._end_segment()
        self._deltas.append(ToolCallDelta(self._index, _call_id(), name))

    def _args(self, piece: str) -> None:
        if piece:
            self._deltas.append(ToolCallDelta(self._index, arguments=piece))

    def _close_call(self) -> None:
        self._index += 1

    def _stream_args(self, final: bool) -> bool:
        """State "args": stream the arguments JSON until it closes, then state
        "tail". True: the caller's loop goes on."""
        buf = self._buf
        end = self._scan.feed(buf)
        piece = buf if end < 0 else buf[:end]
        self._args(piece)
        self._buf = buf[len(piece):]
        if end < 0:
            if final:
                self._close_call()
            return False
        self._state = "tail"
        return True

    def _skip_tail(self, close: str, after: str, final: bool) -> bool:
        """State "tail": drop text up to the call's closing marker, then state
        `after`. True: the caller's loop goes on."""
        buf = self._buf
        j = buf.find(close)
        if j >= 0:
            self._buf, self._state = buf[j + len(close):], after
            self._close_call()
            return True
        if final:
            self._buf = ""
            self._close_call()
        else:
            self._buf = buf[len(buf) - _partial_suffix(buf, (close,)):]
        return False

    def _whole_call(self, name: str, args: dict) -> None:
        self._end_segment()
        self._deltas.append(ToolCallDelta(self._index, _call_id(), name, _dumps(args)))
        self._index += 1


def _assemble(content: str, deltas: list[ToolCallDelta]) -> tuple[str | None, list[ToolCall]]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or _call_id(), d.name or "", "")
        calls[d.index].arguments += d.arguments
    return (content or None), [calls[i] for i in sorted(calls)]


# --- grammars -----------------------------------------------------------------

# JSON spelled as json.dumps writes it (", " and ": ", no other whitespace):
# what the model is forced to write is then, string escapes aside, the text of
# ToolCall.arguments, and a small model cannot loop on whitespace. lenient: schema keywords llguidance does not
# implement are ignored instead of failing the whole request.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                 "key_separator": ": ", "lenient": True}


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _params(schema) -> dict:
    """A tool's "parameters" as an object schema (a missing one: any object)."""
    p = dict(schema) if isinstance(schema, dict) else {}
    p.setdefault("type", "object")
    return p


def _split_root(params: dict) -> tuple[dict, dict]:
    """(root, params) for a %json schema that embeds `params`: its
    $defs/definitions move to the root, where its "#/$defs/..." refs point,
    and the root carries the compile options."""
    params = dict(params)
    root = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    root["x-guidance"] = _JSON_OPTIONS
    return root, params


def _properties(params: dict) -> tuple[dict, list[tuple[str, dict]], set]:
    """(%json root, [(key, schema)], required keys) of a tool's parameters, for
    the formats whose grammar writes each parameter on its own (DSML, Qwen3-Coder)."""
    root, params = _split_root(params)
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    return root, [(k, v if isinstance(v, dict) else {}) for k, v in props.items()], set(params.get("required") or ())


def _json_call_rule(name: str, params: dict, args_key: str) -> str:
    root, params = _split_root(params)
    root.update({"type": "object",
                 "properties": {"name": {"const": name}, args_key: params},
                 "required": ["name", args_key], "additionalProperties": False})
    return "%json " + json.dumps(root, ensure_ascii=False)


class ToolParser(ABC):
    name: ClassVar[str]                          # registry name (vLLM's)
    skip_special_tokens: ClassVar[bool] = True   # False: the format's markers are special tokens

    def __init__(self, tools: list[dict] | None):
        # name -> parameters schema; first of duplicate names wins, malformed entries skipped
        self.tools: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
                self.tools.setdefault(fn["name"], _params(fn.get("parameters")))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        s = self._stream(whole=True)
        c1, d1 = s.feed(text)
        c2, d2 = s.finish()
        return _assemble(c1 + c2, d1 + d2)

    def stream(self) -> ToolStream:
        return self._stream(whole=False)

    @abstractmethod
    def _stream(self, whole: bool) -> ToolStream: ...

    @abstractmethod
    def grammar(self, choice: str | None, parallel: bool) -> str:
        """Lark grammar: exactly one call (or, parallel, one or more) of any tool
        (choice None) or of the named one, arguments valid against its schema.
        Raises ValueError when there is no tool to call / choice is not a tool."""

    def _chosen(self, choice: str | None) -> list[tuple[str, dict]]:
        if choice is not None:
            if choice not in self.tools:
                raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
            return [(choice, self.tools[choice])]
        if not self.tools:
            raise ValueError("tool_choice requires a call but no function tools were given")
        return list(self.tools.items())


# --- hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> -----

_NAME_STR = r'"(?:[^"\\]|\\.)*"'


class _HermesStream(ToolStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(' + _NAME_STR + r')\s*,\s*"arguments"\s*:\s*(?=\{)')

    def __init__(self, whole: bool):
        super().__init__(whole)
        self._state = "text"
        self._from = 0       # where to look for CLOSE next (not re-searching the region)

    def _step(self, final: bool) -> None:
        O, C = self.OPEN, self.CLOSE
        while True:
            buf = self._buf
            if self._state == "text":
                i = buf.find(O)
                if i < 0:
                    keep = 0 if final else _partial_suffix(buf, (O,))
                    self._content(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._content(buf[:i])
                self._buf, self._state, self._from = buf[i:], "head", len(O)
            elif self._state == "head":          # self._buf starts with OPEN
                j = buf.find(C, self._from)
                if j >= 0:                       # the whole call is here: validate it
                    end = j + len(C)
                    call = _call_from_obj(_load_json(buf[len(O):j]), ("arguments", "parameters"))
                    if call:
                        self._whole_call(*call)
                    else:
                        self._content(buf[:end])
                    self._buf, self._state = buf[end:], "text"
                    continue
                self._from = max(len(O), len(buf) - len(C) + 1)
                m = None if self._whole else self.HEAD.match(buf, len(O))
                name = _load_json(m.group(1)) if m else None
                if isinstance(name, str) and name.strip():
                    self._open_call(name.strip())
                    self._buf, self._state, self._scan = buf[m.end():], "args", _BracketScan()
                    continue
                if final:                        # unclosed: content
                    self._content(buf)
                    self._buf = ""
                return
            elif self._state == "args":
                if not self._stream_args(final):
                    return
            elif not self._skip_tail(C, "text", final):    # "tail": skip to CLOSE ("}\n" before it)
                return


class HermesToolParser(ToolParser):
    """Qwen2/2.5/3, Hermes, SmolLM2: <tool_call>\\n{"name": "fn", "arguments": {...}}\\n</tool_call>,
    several one after another. Also takes "parameters" for "arguments"."""
    name = "hermes"

    def _stream(self, whole: bool) -> ToolStream:
        return _HermesStream(whole)

    def grammar(self, choice: str | None, parallel: bool) -> str:
        tools = self._chosen(choice)
        lines = ['start: call ("\\n" call)*' if parallel else "start: call",
                 'call: "<tool_call>\\n" fn "\\n</tool_call>"',
                 "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        lines += [f"fn_{i}: " + _json_call_rule(n, p, "arguments") for i, (n, p) in enumerate(tools)]
        return "\n".join(lines) + "\n"


# --- llama3_json: {"name": ..., "parameters": {...}}; {...} -------------------

class _Llama3Stream(ToolStream):
    TAG = "<|python_tag|>"
    HEAD = re.compile(r'(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*(' + _NAME_STR
                      + r')\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')

    def __init__(self, whole: bool):
        super().__init__(whole)
        self._state = "start"
        self._pending = ""   # separator text ("; ") before a call: content if no call follows

    def _step(self, final: bool) -> None:
        T = self.TAG
        while True:
            buf = self._buf
            if self._state in ("start", "sep"):
                # A call only where the output starts (or right after a call, past an optional ";").
                rest = buf.lstrip()
                if self._state == "sep" and rest.startswith(";"):
                    rest = rest[1:].lstrip()
                lead = buf[:len(buf) - len(rest)]
                if rest.startswith("{") or rest.startswith(T):
                    if self._state == "start":
                        self._content(lead)          # held whitespace; vanishes if a call follows
                    else:
                        self._pending = lead
                    self._buf, self._state = rest, "head"
                    self._scan, self._scanned = _BracketScan(), 0
                    continue
                if not final and (not rest or T.startswith(rest)):
                    return                           # undecided yet
                self._state = "plain"
            elif self._state == "plain":             # no (more) calls: the rest is content
                self._content(buf)
                self._buf = ""
                return
            elif self._state == "head":              # self._buf starts with "{" or the tag
                end = self._scan.feed(buf, self._scanned)
                self._scanned = len(buf)
                if end >= 0:                         # the whole object is here: validate it
                    text = buf[:end]
                    body = text[len(T):] if text.startswith(T) else text
                    call = _call_from_obj(_load_json(body), ("parameters", "arguments"))
                    if call:
                        self._whole_call(*call)
                        self._state = "sep"
                    else:
                        self._content(self._pending + text)
                        self._state = "plain"
                    self._pending, self._buf = "", buf[end:]
                    continue
                m = None if self._whole else self.HEAD.match(buf)
                name = _load_json(m.group(1)) if m else None
                if isinstance(name, str) and name.strip():
                    self._open_call(name.strip())
                    self._pending = ""
                    self._buf, self._state, self._scan = buf[m.end():], "args", _BracketScan()
                    continue
                if final:                            # unclosed object: content
                    self._content(self._pending + buf)
                    self._buf = ""
                return
            elif self._state == "args":
                end = self._scan.feed(buf)
                piece = buf if end < 0 else buf[:end]
                self._args(piece)
                self._buf = buf[len(piece):]
                if end < 0:
                    if final:
                        self._close_call()
                    return
                self._state, self._scan = "tail", _BracketScan(depth=1)
            else:                                    # "tail": up to the outer object's "}"
                end = self._scan.feed(buf)
                if end < 0:
                    self._buf = ""
                    if final:
                        self._close_call()
                    return
                self._buf, self._state = buf[end:], "sep"
                self._close_call()


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON calls: the output is {"name": "fn", "parameters": {...}}
    (or "arguments"), optionally after <|python_tag|>, several separated by "; ".
    Only read as calls when the output starts with "{" or the tag; text after
    the last call (or after one that does not parse) is content."""
    name = "llama3_json"

    def _stream(self, whole: bool) -> ToolStream:
        return _Llama3Stream(whole)

    def grammar(self, choice: str | None, parallel: bool) -> str:
        # No <|python_tag|>: it is a special token in Llama's tokenizer (a quoted
        # literal would spell it in text bytes); the output starts at "{".
        tools = self._chosen(choice)
        lines = ['start: fn ("; " fn)*' if parallel else "start: fn",
                 "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        lines += [f"fn_{i}: " + _json_call_rule(n, p, "parameters") for i, (n, p) in enumerate(tools)]
        return "\n".join(lines) + "\n"


# --- deepseek_v3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}
#     \n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class _DeepSeekStream(ToolStream):
    # V3: begin function<sep>NAME\n```json\n{...}\n``` end; V3.1: begin NAME<sep>{...} end.
    HEAD_V3 = re.compile(re.escape(DS_CALL_BEGIN) + r"\s*function\s*" + re.escape(DS_SEP)
                         + r"([^\n`<]+?)[ \t]*\n\s*```(?:json)?[ \t]*\n?\s*(?=\{)")
    HEAD_V31 = re.compile(re.escape(DS_CALL_BEGIN) + r"\s*([^\n<]+?)\s*" + re.escape(DS_SEP) + r"\s*(?=\{)")
    WHOLE_V3 = re.compile(r"\s*function\s*" + re.escape(DS_SEP)
                          + r"([^\n`<]+?)[ \t]*\n\s*```(?:json)?[ \t]*\n?(.*?)```\s*", re.S)
    WHOLE_V31 = re.compile(r"\s*([^\n<]+?)\s*" + re.escape(DS_SEP) + r"(.*)", re.S)

    def __init__(self, whole: bool):
        super().__init__(whole)
        self._state = "text"
        self._pending = ""   # block markers/whitespace before a call: content if it fails
        self._block_ok = False   # a call of this block was read: its end marker is dropped

    def _whole_region(self, inner: str) -> tuple[str, dict] | None:
        m = self.WHOLE_V3.fullmatch(inner) or self.WHOLE_V31.fullmatch(inner)
        if not m or not m.group(1).strip():
            return None
        args = _load_json(m.group(2).strip())
        return (m.group(1).strip(), args) if isinstance(args, dict) else None

    def _step(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "text":
                i, mk = _first_marker(buf, (DS_CALLS_BEGIN, DS_CALL_BEGIN))
                if i < 0:
                    keep = 0 if final else _partial_suffix(buf, (DS_CALLS_BEGIN, DS_CALL_BEGIN))
                    self._content(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._content(buf[:i])
                self._block_ok = False
                if mk == DS_CALLS_BEGIN:
                    self._pending, self._buf, self._state = mk, buf[i + len(mk):], "block"
                else:                                # a call without the block marker
                    self._pending, self._buf, self._state = "", buf[i:], "head"
            elif self._state == "block":             # between calls, inside the block
                rest = buf.lstrip()
                lead = buf[:len(buf) - len(rest)]
                if rest.startswith(DS_CALL_BEGIN):
                    self._pending += lead
                    self._buf, self._state = rest, "head"
                elif rest.startswith(DS_CALLS_END):  # block closes: markers of a read block are dropped
                    if not self._block_ok:
                        self._content(self._pending + lead + DS_CALLS_END)
                    self._pending, self._buf, self._state = "", rest[len(DS_CALLS_END):], "text"
                elif not final and (not rest or DS_CALL_BEGIN.startswith(rest)
                                    or DS_CALLS_END.startswith(rest)):
                    return
                else:                                # anything else ends the block
                    self._content(self._pending)
                    self._pending, self._state = "", "text"
            elif self._state == "head":              # self._buf starts with DS_CALL_BEGIN
                j = buf.find(DS_CALL_END, len(DS_CALL_BEGIN))
                if j >= 0:                           # the whole call is here: validate it
                    end = j + len(DS_CALL_END)
                    call = self._whole_region(buf[len(DS_CALL_BEGIN):j])
                    if call:
                        self._whole_call(*call)
                        self._block_ok = True
                    else:
                        self._content(self._pending + buf[:end])
                    self._pending, self._buf, self._state = "", buf[end:], "block"
                    continue
                m = None if self._whole else (self.HEAD_V3.match(buf) or self.HEAD_V31.match(buf))
                if m and m.group(1).strip():
                    self._open_call(m.group(1).strip())
                    self._pending, self._block_ok = "", True
                    self._buf, self._state, self._scan = buf[m.end():], "args", _BracketScan()
                    continue
                if final:
                    self._content(self._pending + buf)
                    self._pending, self._buf = "", ""
                return
            elif self._state == "args":
                if not self._stream_args(final):
                    return
            elif not self._skip_tail(DS_CALL_END, "block", final):   # "tail": skip "\n```" to the call's end
                return


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 (and V3.1's `NAME<sep>{...}` variant when reading). The
    markers are special tokens: detokenize with skip_special_tokens=False so
    they reach the parser."""
    name = "deepseek_v3"
    skip_special_tokens = False

    def _stream(self, whole: bool) -> ToolStream:
        return _DeepSeekStream(whole)

    def grammar(self, choice: str | None, parallel: bool, *, marker_tokens: bool = False) -> str:
        """marker_tokens=True writes the markers as special tokens (<｜...｜>, as
        a real DeepSeek tokenizer has them); the default quoted literals match
        them as text, for tokenizers that lack them."""
        tools = self._chosen(choice)
        mk = (lambda s: s) if marker_tokens else _lark_str
        call_head = (f'{mk(DS_CALL_BEGIN)} "function" {mk(DS_SEP)}' if marker_tokens
                     else _lark_str(DS_CALL_BEGIN + "function" + DS_SEP))
        lines = [f"start: {mk(DS_CALLS_BEGIN)} "
                 + ('call ("\\n" call)*' if parallel else "call") + f" {mk(DS_CALLS_END)}",
                 f'call: {call_head} fn "\\n```" {mk(DS_CALL_END)}',
                 "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, (n, p) in enumerate(tools):
            root, params = _split_root(p)
            root.update(params)                  # the arguments object is the root here
            lines.append(f"fn_{i}: {_lark_str(n + chr(10) + '```json' + chr(10))} args_{i}")
            lines.append(f"args_{i}: %json " + json.dumps(root, ensure_ascii=False))
        return "\n".join(lines) + "\n"


# --- deepseek_v4 / deepseek_v32: DSML blocks ---------------------------------
# <｜DSML｜tool_calls>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="K" string="true">raw
# text</｜DSML｜parameter>\n...</｜DSML｜invoke>\n</｜DSML｜tool_calls> (V3.2: function_calls). A
# parameter's value is its raw text with string="true", JSON with string="false".

DSML = "｜DSML｜"
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
DSML_PARAM_END = f"</{DSML}parameter>"
_DSML_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]+)"\s*>(.*?)</{DSML}invoke>', re.S)
_DSML_PARAM = re.compile(rf'\s*<{DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>',
                         re.S)


def _dsml_call(region: str) -> tuple[str, dict] | None:
    """(name, arguments) of one whole invoke element, or None when malformed."""
    m = _DSML_INVOKE.fullmatch(region)
    if not m or not m.group(1).strip():
        return None
    args, pos, body = {}, 0, m.group(2)
    for p in _DSML_PARAM.finditer(body):
        if p.start() != pos:
            return None
        if p.group(2) == "true":
            args[p.group(1)] = p.group(3)
        else:
            v = _load_json(p.group(3))
            if v is None and p.group(3).strip() != "null":
                return None
            args[p.group(1)] = v
        pos = p.end()
    return (m.group(1).strip(), args) if not body[pos:].strip() else None


class _ElementStream(ToolStream):
    """Blocks of call elements (DSML's <｜DSML｜tool_calls> of invokes, Qwen3-Coder's
    <tool_call> of <function=...>): each call is sent whole once its element
    closes (as pythonic does). read(element) -> (name, arguments) or None."""

    def __init__(self, whole: bool, opens: tuple[str, ...], element: str, element_end: str,
                 read: Callable[[str], tuple[str, dict] | None]):
        super().__init__(whole)
        self._opens, self._element, self._element_end, self._read = opens, element, element_end, read
        self._state, self._close = "text", ""
        self._pending = ""       # the block's open marker and what followed: content if no call is read
        self._block_ok = False

    def _step(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "text":
                i, mk = _first_marker(buf, self._opens)
                if i < 0:
                    keep = 0 if final else _partial_suffix(buf, self._opens)
                    self._content(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._content(buf[:i])
                self._close = "</" + mk[1:]
                self._pending, self._buf, self._state, self._block_ok = mk, buf[i + len(mk):], "block", False
                continue
            rest = buf.lstrip()
            lead = buf[:len(buf) - len(rest)]
            if rest.startswith(self._element):
                j = rest.find(self._element_end)
                if j < 0:
                    if final:
                        self._content(self._pending + buf)
                        self._pending, self._buf = "", ""
                    return
                end = j + len(self._element_end)
                call = self._read(rest[:end])
                if call:
                    self._whole_call(*call)
                    self._block_ok, self._pending = True, ""
                else:
                    self._content(self._pending + lead + rest[:end])
                    self._pending = ""
                self._buf = rest[end:]
            elif rest.startswith(self._close):       # the block closes: a read block's markers are dropped
                if not self._block_ok:
                    self._content(self._pending + lead + self._close)
                self._pending, self._buf, self._state = "", rest[len(self._close):], "text"
            elif not final and (not rest or self._element.startswith(rest) or self._close.startswith(rest)):
                return
            else:                                    # anything else ends the block
                self._content(self._pending)
                self._pending, self._state = "", "text"


def _may_be_string(schema: dict) -> bool:
    t = schema.get("type")
    if "enum" in schema:
        return any(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    return t is None or t == "string" or (isinstance(t, list) and "string" in t)


def _text_value(schema: dict, end: str, raw: str) -> str | None:
    """The grammar alternative of a parameter value written as text, when the
    schema lets it be a string: its enum's strings (each followed by `end`) as
    literals, else the `raw` text rule; None when it cannot be a string."""
    if not _may_be_string(schema):
        return None
    lits = [_lark_str(v + end) for v in schema.get("enum", []) if isinstance(v, str)]
    return f"({' | '.join(lits)})" if lits else raw


def _deref(schema: dict, root: dict) -> dict:
    """A property's schema with a local "#/$defs/X" (or definitions) $ref followed."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        node = root
        for part in ref[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            return node
    return schema


def _only_string(schema: dict) -> bool:
    if "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    return schema.get("type") == "string"


class DeepSeekV4ToolParser(ToolParser):
    """DeepSeek-V4's DSML tool calls (<｜DSML｜tool_calls>); reads V3.2's
    <｜DSML｜function_calls> blocks too. Its markers are special tokens."""
    name = "deepseek_v4"
    skip_special_tokens = False
    block = "tool_calls"                 # what the grammar writes

    def _stream(self, whole: bool) -> ToolStream:
        return _ElementStream(whole, tuple(f"<{DSML}{b}>" for b in ("tool_calls", "function_calls")),
                              DSML_INVOKE, DSML_INVOKE_END, _dsml_call)

    def grammar(self, choice: str | None, parallel: bool) -> str:
        """One invoke per call, parameters in the schema's order (required ones
        always, the others optional); a value that may be a string as raw text
        (string="true"; an enum's strings as literals), any value as JSON
        valid against its schema (string="false")."""
        tools = self._chosen(choice)
        end = _lark_str(DSML_PARAM_END)
        lines = [f"start: {_lark_str(f'<{DSML}{self.block}>' + chr(10))} " + ("call+" if parallel else "call")
                 + f" {_lark_str(f'</{DSML}{self.block}>')}",
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, (n, p) in enumerate(tools):
            root, props, required = _properties(p)
            body = []
            for j, (k, schema) in enumerate(props):
                js = json.dumps(dict(root, **schema), ensure_ascii=False)
                alts = [f"{_dsml_param(json.dumps(k), False)} %json {js} {end}"]
                text = _text_value(schema, DSML_PARAM_END, "raw")
                if text:
                    alts.insert(0, f"{_dsml_param(json.dumps(k), True)} {text}")
                lines.append(f"p_{i}_{j}: ({' | '.join(alts)}) " + r'"\n"')
                body.append(f"p_{i}_{j}" + ("" if k in required else "?"))
            if not props:                        # free-form: any parameters, raw or JSON
                name = r'/"[^"]+"/'
                lines.append(f"p_{i}_any: ({_dsml_param(name, True)} raw | {_dsml_param(name, False)} %json {{}} "
                             f"{end}) " + r'"\n"')
                body.append(f"p_{i}_any*")
            lines.append(f"fn_{i}: {_lark_str(f'<{DSML}invoke name=' + json.dumps(n) + '>' + chr(10))} "
                         f"{' '.join(body)} {_lark_str(DSML_INVOKE_END + chr(10))}")
        if any(" raw" in line for line in lines):   # (an unused rule is a grammar warning)
            lines.append(f"raw[stop={end}]: /(?s:.*)/")
        return "\n".join(lines) + "\n"


def _dsml_param(name: str, string: bool) -> str:
    """Lark for a parameter's open tag; name: a quoted-name literal's text (json.dumps of
    the name) or a regex (/.../) for any name."""
    tail = _lark_str(f' string="{str(string).lower()}">')
    if name.startswith("/"):
        return f"{_lark_str(f'<{DSML}parameter name=')} {name} {tail}"
    return f"{_lark_str(f'<{DSML}parameter name=' + name)} {tail}"


class DeepSeekV32ToolParser(DeepSeekV4ToolParser):
    """DeepSeek-V3.2's DSML (<｜DSML｜function_calls>)."""
    name = "deepseek_v32"
    block = "function_calls"


# --- qwen3_coder: <tool_call>\n<function=f>\n<parameter=k>\nvalue\n</parameter>\n</function>\n</tool_call>

QC_FUNCTION, QC_FUNCTION_END, QC_PARAM_END = "<function=", "</function>", "</parameter>"
_QC_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_QC_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _qc_value(text: str, schema: dict | None):
    """A parameter's raw text -> its value, by the property's schema type, as
    vLLM's qwen3_coder parser converts it: "null" is None; strings (and
    properties without a schema) stay text; other types are read as JSON
    (booleans in Python's spelling too); what does not read stays text."""
    if text.strip().lower() == "null":
        return None
    t = (schema or {}).get("type")
    types = set(t) if isinstance(t, list) else {t}
    if schema is None or types & {"string", None} and not types - {"string", None, "null"}:
        return text
    v = _load_json(text.strip())
    if v is None and "boolean" in types and text.strip() in ("True", "False"):
        v = text.strip() == "True"
    return text if v is None else v


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML-like calls: <tool_call> blocks of <function=NAME>
    elements whose <parameter=KEY> values are raw text (one newline around
    each value is part of the format), typed by the tool's schema."""
    name = "qwen3_coder"

    def _read(self, element: str) -> tuple[str, dict] | None:
        m = _QC_FUNCTION.fullmatch(element)
        if not m or not m.group(1).strip():
            return None
        name = m.group(1).strip()
        params = self.tools.get(name, {})
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        args, pos, body = {}, 0, m.group(2)
        for p in _QC_PARAM.finditer(body):
            if p.start() != pos:
                return None
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = p.group(1).strip()
            schema = props.get(key)
            args[key] = _qc_value(value, _deref(schema, params) if isinstance(schema, dict) else None)
            pos = p.end()
        return (name, args) if not body[pos:].strip() else None

    def _stream(self, whole: bool) -> ToolStream:
        return _ElementStream(whole, ("<tool_call>",), QC_FUNCTION, QC_FUNCTION_END, self._read)

    def grammar(self, choice: str | None, parallel: bool) -> str:
        """One <tool_call> block per call; parameters in the schema's order
        (required ones always, the others optional); a value that may be a
        string as raw text (an enum's strings as literals), any value as JSON
        valid against its schema."""
        tools = self._chosen(choice)
        end = _lark_str("\n" + QC_PARAM_END)
        block = _lark_str("<tool_call>\n") + " call " + _lark_str("</tool_call>")
        lines = [f"start: {block}" + (f" ({_lark_str(chr(10))} {block})*" if parallel else ""),
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, (n, p) in enumerate(tools):
            root, props, required = _properties(p)
            body = []
            for j, (k, schema) in enumerate(props):
                js = json.dumps(dict(root, **schema), ensure_ascii=False)
                # text where a string may go (an enum's strings as literals), JSON where another value may
                kind = _deref(schema, root)
                alts = [] if _only_string(kind) else [f"%json {js} {end}"]
                text = _text_value(kind, "\n" + QC_PARAM_END, "qraw")
                if text:
                    alts.insert(0, text)
                lines.append(f"p_{i}_{j}: {_lark_str(f'<parameter={k}>' + chr(10))} ({' | '.join(alts)}) "
                             + r'"\n"')
                body.append(f"p_{i}_{j}" + ("" if k in required else "?"))
            if not props:                        # free-form: any parameters, as text
                lines.append(f'p_{i}_any: "<parameter=" /[^>\\n]+/ ">\\n" qraw "\\n"')
                body.append(f"p_{i}_any*")
            lines.append(f"fn_{i}: {_lark_str(f'<function={n}>' + chr(10))} {' '.join(body)} "
                         f"{_lark_str(QC_FUNCTION_END + chr(10))}")
        if any("qraw" in line for line in lines):   # (an unused rule is a grammar warning)
            lines.append(f"qraw[stop={end}]: /(?s:.*)/")
        return "\n".join(lines) + "\n"


# --- pythonic: [get_weather(city="Paris", days=3), other(x=1)] ---------------

_PY_NAMES = {"True": True, "False": False, "None": None,
             "true": True, "false": False, "null": None}   # JSON spellings too


def _py_literal(node: ast.AST):
    """A Python literal (str/int/float/bool/None/list/tuple/dict) as JSON data;
    ValueError for anything else. Never evaluates code."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_py_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("dict keys must be strings")
            out[k.value] = _py_literal(v)
        return out
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    raise ValueError(f"not a literal: {type(node).__name__}")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _py_call(text: str) -> tuple[str, dict] | None:
    """`name(k=literal, ...)` -> (name, arguments) or None (no positional args, no **)."""
    try:
        with warnings.catch_warnings():     # odd model text ("3x") is not worth a SyntaxWarning on stderr
            warnings.simplefilter("ignore", SyntaxWarning)
            node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or _dotted(node.func) is None:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            args[kw.arg] = _py_literal(kw.value)
        json.dumps(args, allow_nan=False)          # inf/nan (1e999) are not JSON
        return _dotted(node.func), args
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class _PyScan(_BracketScan):
    """Bracket depth of Python source, skipping '...'/"..." strings (triple
    quotes are not special-cased: ast checks the result)."""
    OUT = re.compile(r"[\"'()\[\]{}]")
    IN = {'"': re.compile(r'["\\]'), "'": re.compile(r"['\\]")}


class _PythonicStream(ToolStream):
    NAME_OPEN = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
    NAME_PART = re.compile(r"\s*(?:[A-Za-z_][\w.]*\s*)?")
    AFTER = re.compile(r"\s*([,\]])")

    def __init__(self, whole: bool):
        super().__init__(whole)      # pythonic commits each call once complete either way
        self._state = "start"
        self._raw = ""               # list text since the last committed call: content on failure
        self._call = ""              # text of the call being read

    def _fail(self) -> None:
        self._content(self._raw + self._buf)
        self._raw, self._buf, self._state = "", "", "plain"

    def _step(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "start":               # calls only when the output starts with "["
                rest = buf.lstrip()
                if not rest:
                    if final:
                        self._content(buf)
                        self._buf = ""
                    return
                if rest[0] == "[":
                    self._content(buf[:len(buf) - len(rest)])
                    self._raw, self._buf, self._state = "[", rest[1:], "name"
                else:
                    self._state = "plain"
            elif self._state == "plain":
                self._content(buf)
                self._buf = ""
                return
            elif self._state == "name":
                m = self.NAME_OPEN.match(buf)
                if m:
                    self._call = m.group(1) + "("
                    self._raw += buf[:m.end()]
                    self._buf, self._state, self._scan = buf[m.end():], "args", _PyScan(1)
                    continue
                if not final and self.NAME_PART.fullmatch(buf):
                    return
                return self._fail()
            elif self._state == "args":
                end = self._scan.feed(buf)
                piece = buf if end < 0 else buf[:end]
                self._call += piece
                self._raw += piece
                self._buf = buf[len(piece):]
                if end < 0:
                    return self._fail() if final else None
                call = _py_call(self._call)
                if call is None:
                    return self._fail()
                self._whole_call(*call)
                self._raw, self._state = "", "after"
            else:                                    # "after": ", next(...)" or "]"
                m = self.AFTER.match(buf)
                if m:
                    self._raw += buf[:m.end()]
                    self._buf = buf[m.end():]
                    if m.group(1) == ",":
                        self._state = "name"
                    else:
                        self._raw, self._state = "", "plain"
                    continue
                if not final and not buf.strip():
                    return
                return self._fail()


# Python-literal values for the pythonic grammar (strings in either quote style).
_PY_GRAMMAR_COMMON = r"""
py_value: PY_STR | PY_NUM | PY_BOOL | "None" | py_list | py_dict
py_list: "[" (py_value (", " py_value)*)? "]"
py_dict: "{" (PY_STR ": " py_value (", " PY_STR ": " py_value)*)? "}"
PY_STR: /"([^"\\\n]|\\.)*"/ | /'([^'\\\n]|\\.)*'/
PY_INT: /-?(0|[1-9][0-9]*)/
PY_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
PY_BOOL: "True" | "False"
"""


def _py_const(v) -> str | None:
    """Lark alternatives spelling one JSON constant as a Python literal."""
    if isinstance(v, str):
        return " | ".join(dict.fromkeys(_lark_str(s) for s in (json.dumps(v, ensure_ascii=False), repr(v))))
    if isinstance(v, bool) or v is None:
        return _lark_str(repr(v))
    if isinstance(v, (int, float)):
        return _lark_str(repr(v))
    return None


class _PyRules:
    """Lark rules for Python-literal values typed by a JSON schema: type, enum/const,
    array items, object properties; other keywords (ranges, lengths, required,
    patterns) are not enforced."""

    def __init__(self):
        self.rules: list[str] = []

    def value(self, schema, depth: int = 0) -> str:
        if not isinstance(schema, dict) or depth > 6:
            return "py_value"
        for key in ("enum", "const"):
            if key in schema:
                vals = schema[key] if key == "enum" else [schema[key]]
                alts = [_py_const(v) for v in vals] if isinstance(vals, list) else [None]
                if alts and None not in alts:
                    return "(" + " | ".join(alts) + ")"
                return "py_value"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return "(" + " | ".join(self.value(s, depth + 1) for s in schema[key]) + ")"
        t = schema.get("type")
        if isinstance(t, list) and t:
            return "(" + " | ".join(self.value({**schema, "type": x}, depth + 1) for x in t) + ")"
        simple = {"string": "PY_STR", "integer": "PY_INT", "number": "PY_NUM",
                  "boolean": "PY_BOOL", "null": '"None"'}
        if t in simple:
            return simple[t]
        if t == "array":
            item = self.value(schema.get("items"), depth + 1)
            return self._rule(f'"[" ({item} (", " {item})*)? "]"')
        if t == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
            kv = " | ".join(f'({_py_const(k)}) ": " {self.value(s, depth + 1)}'
                            for k, s in schema["properties"].items())
            kv = self._rule(kv)
            return self._rule(f'"{{" ({kv} (", " {kv})*)? "}}"')
        if t == "object":
            return "py_dict"
        return "py_value"

    def _rule(self, body: str) -> str:
        name = f"pv_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name


def _ordered_kwargs(rule: str, name: str, props: dict, required: set, pr) -> list[str]:
    """Lark rules for name(k1=v1, k2=v2, ...): the properties in schema order,
    each at most once, required ones present (a small model otherwise repeats
    one keyword until max_tokens). Rule {rule}_a{j}_{f}: the arguments from
    property j on, f = 0 before the first one written (no ", " yet), 1 after."""
    keys = list(props)
    out = [f'{rule}: {_lark_str(name + "(")} {rule}_a0_0 ")"']
    for j, k in enumerate(keys):
        kv = f"{_lark_str(k + '=')} {pr.value(props[k])}"
        for f in (0, 1):
            sep = '", " ' if f else ""
            alts = [f"{sep}{kv} {rule}_a{j + 1}_1"]
            if k not in required:
                alts.append(f"{rule}_a{j + 1}_{f}")
            out.append(f"{rule}_a{j}_{f}: " + " | ".join(alts))
    out += [f'{rule}_a{len(keys)}_0: ""', f'{rule}_a{len(keys)}_1: ""']
    return out


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Gemma 3 recipes: [get_weather(city="Paris", days=3), other(x=1)],
    keyword arguments with Python literal values (read with ast, never eval'd;
    true/false/null are taken too). Calls only when the output starts with "[";
    text after the list, or from a call that does not parse, is content."""
    name = "pythonic"

    def _stream(self, whole: bool) -> ToolStream:
        return _PythonicStream(whole)

    def grammar(self, choice: str | None, parallel: bool) -> str:
        """Enforces: "[" call (", " call)* "]" (one call unless parallel), names
        from the allowed tools, keyword names from each tool's properties, each
        value a Python literal of the property's JSON type (enum/const values,
        array items, nested object properties too), each keyword at most once
        and in the schema's order, required ones present. Not enforced:
        numeric ranges, string lengths or patterns. Fixed spelling: "=" with
        no spaces, ", " between items."""
        tools = self._chosen(choice)
        pr = _PyRules()
        lines = ['start: "[" fn (", " fn)* "]"' if parallel else 'start: "[" fn "]"',
                 "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, (n, p) in enumerate(tools):
            props = p.get("properties") if isinstance(p.get("properties"), dict) else {}
            if props:
                lines += _ordered_kwargs(f"fn_{i}", n, props, set(p.get("required") or ()), pr)
            elif p.get("additionalProperties") is False:
                lines.append(f'fn_{i}: {_lark_str(n + "(")} ")"')
            else:                               # free-form object: any keyword=literal
                lines.append(f'fn_{i}: {_lark_str(n + "(")} (py_kw (", " py_kw)*)? ")"')
        lines.append(r"py_kw: /[A-Za-z_][A-Za-z0-9_]*=/ py_value")
        return "\n".join(lines + pr.rules) + "\n" + _PY_GRAMMAR_COMMON


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser, DeepSeekV4ToolParser,
                        DeepSeekV32ToolParser, Qwen3CoderToolParser, PythonicToolParser)
}
# vLLM's other names for the same formats (a vLLM command line's --tool-call-parser).
ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder"}


def default_parser(model_type: str | None, chat_template: str | None) -> str | None:
    """The parser name for a model, from markers in its chat template first (they
    show the format it was trained on), then its HF config model_type; None if
    unknown (the caller uses hermes)."""
    t = chat_template or ""
    if DSML in t:
        return "deepseek_v4" if f"{DSML}tool_calls" in t else "deepseek_v32"
    if DS_CALLS_BEGIN in t or DS_CALL_BEGIN in t:
        return "deepseek_v3"
    if "<function=" in t and "<parameter=" in t:   # Qwen3-Coder (its calls sit in <tool_call> too)
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t:
        return "llama3_json"
    mt = (model_type or "").lower()
    if mt in ("deepseek_v4", "deepseek_v32"):   # DSML (V3.2 has model_type deepseek_v32)
        return mt
    if mt.startswith("deepseek_v"):           # deepseek_v3
        return "deepseek_v3"
    if mt.startswith("qwen"):                  # qwen2, qwen2_moe, qwen3, qwen3_moe
        return "hermes"
    if mt.startswith("gemma3"):                # gemma3, gemma3_text
        return "pythonic"
    if mt == "llama":
        # SmolLM2 and other ChatML llamas write Hermes-style calls; Meta's use JSON.
        return "hermes" if "<|im_start|>" in t else "llama3_json"
    if "<|im_start|>" in t:
        return "hermes"
    return None
