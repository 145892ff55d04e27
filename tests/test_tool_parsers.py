"""server.tool_parsers: recorded outputs of each format through parse() and
stream() (cut every way), and the grammars enforced with llguidance on the
SmolLM2 tokenizer."""
import json
import random

import pytest

from server.tool_parsers import (
    PARSERS, ToolCallDelta, ToolParser, default_parser,
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "book",
        "parameters": {"type": "object", "properties": {
            "guest": {"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]},
            "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["guest"]}}},
    {"type": "function", "function": {"name": "ping"}},   # no parameters: any object
]

DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def h(name, args, key="arguments"):
    return "<tool_call>\n" + json.dumps({"name": name, key: args}, ensure_ascii=False) + "\n</tool_call>"


def ds(name, args):
    return (f"{DS_CB}function{DS_SEP}{name}\n```json\n"
            + json.dumps(args, ensure_ascii=False) + f"\n```{DS_CE}")


DSML = "｜DSML｜"
V4_B, V4_E = f"<{DSML}tool_calls>\n", f"</{DSML}tool_calls>"


def dsml(name, args):
    """One invoke as DeepSeek-V4 writes it: strings raw (string="true"), other values JSON."""
    params = "".join(f'<{DSML}parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
                     f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{DSML}parameter>\n"
                     for k, v in args.items())
    return f'<{DSML}invoke name="{name}">\n{params}</{DSML}invoke>\n'


def qc(name, args):
    """One call as Qwen3-Coder writes it: a <tool_call> block, values as text (JSON for non-strings)."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                     "</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


W = {"city": "Paris", "unit": "celsius"}
UNI = {"city": "Zürich", "note": "東京 ☀️ \"quoted\" \\ back"}
NESTED = {"guest": {"name": "Ann", "age": 3}, "tags": ["a", {"deep": [1, 2.5, None, True, {"x": "}"}]}]}
CODE = {"code": "if (a) { return \"}\"; } // </tool_call"}

# (parser, text, content, [(name, arguments)]): well-formed outputs.
GOOD = [
    ("hermes", h("get_weather", W), None, [("get_weather", W)]),
    ("hermes", h("get_weather", W) + "\n" + h("book", NESTED), None,
     [("get_weather", W), ("book", NESTED)]),
    ("hermes", "Let me check.\n\n" + h("get_weather", W), "Let me check.\n\n", [("get_weather", W)]),
    ("hermes", "\n\n" + h("get_weather", UNI) + "\n", None, [("get_weather", UNI)]),
    ("hermes", h("book", NESTED) + "\n\n" + h("ping", {}) + "\nDone.", "\nDone.",
     [("book", NESTED), ("ping", {})]),
    ("hermes", h("not_a_tool", CODE), None, [("not_a_tool", CODE)]),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}, "name": "ping"}\n</tool_call>', None,
     [("ping", {"a": 1})]),
    ("hermes", '<tool_call>{"name":"ping","parameters":{"a":[1,2]}}</tool_call>', None,
     [("ping", {"a": [1, 2]})]),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    ("hermes", h("ping", {}) + "\n<tool_call>\nnot json\n</tool_call>",
     "\n<tool_call>\nnot json\n</tool_call>", [("ping", {})]),   # a failed call is content, with its separator
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": W}), None, [("get_weather", W)]),
    ("llama3_json", "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": UNI}, ensure_ascii=False),
     None, [("get_weather", UNI)]),
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": W}) + "; "
     + json.dumps({"name": "book", "arguments": NESTED}), None, [("get_weather", W), ("book", NESTED)]),
    ("llama3_json", '\n {"name": "ping", "parameters": {"code": "{[\\"}"}}', None,
     [("ping", {"code": '{["}'})]),
    ("llama3_json", '{"name": "ping", "parameters": {}} and then text', " and then text", [("ping", {})]),
    ("llama3_json", "The weather in Paris is {mild}.", "The weather in Paris is {mild}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("deepseek_v3", DS_B + ds("get_weather", W) + DS_E, None, [("get_weather", W)]),
    ("deepseek_v3", "I'll look.\n" + DS_B + ds("get_weather", UNI) + "\n" + ds("book", NESTED) + DS_E,
     "I'll look.\n", [("get_weather", UNI), ("book", NESTED)]),
    ("deepseek_v3", DS_B + f'{DS_CB}ping{DS_SEP}{{"a": 1}}{DS_CE}' + DS_E + "\nAfter.", "\nAfter.",
     [("ping", {"a": 1})]),
    ("deepseek_v3", "Plain <｜tool answer.", "Plain <｜tool answer.", []),
    ("deepseek_v4", V4_B + dsml("get_weather", W) + V4_E, None, [("get_weather", W)]),
    ("deepseek_v4", "I'll look.\n\n" + V4_B + dsml("get_weather", UNI) + dsml("book", NESTED) + V4_E + "\nDone.",
     "I'll look.\n\n\nDone.", [("get_weather", UNI), ("book", NESTED)]),
    ("deepseek_v4", V4_B + dsml("ping", CODE) + dsml("ping", {"s": "a\n<b>\n", "n": None}) + V4_E, None,
     [("ping", CODE), ("ping", {"s": "a\n<b>\n", "n": None})]),
    ("deepseek_v4", f"<{DSML}function_calls>\n" + dsml("ping", {}) + f"</{DSML}function_calls>", None,
     [("ping", {})]),                                                   # V3.2's block
    ("deepseek_v4", f"Plain <{DSML}tool text.", f"Plain <{DSML}tool text.", []),
    ("deepseek_v32", f"<{DSML}function_calls>\n" + dsml("get_weather", W) + f"</{DSML}function_calls>", None,
     [("get_weather", W)]),
    ("qwen3_coder", qc("get_weather", W), None, [("get_weather", W)]),
    ("qwen3_coder", "I'll look.\n" + qc("get_weather", UNI) + "\n" + qc("book", NESTED) + "\nDone.",
     "I'll look.\n\nDone.", [("get_weather", UNI), ("book", NESTED)]),
    ("qwen3_coder", qc("ping", CODE) + qc("ping", {"s": "a\n<b>\n", "n": "null"}), None,
     [("ping", CODE), ("ping", {"s": "a\n<b>\n", "n": None})]),      # schema-less values stay text, null aside
    ("qwen3_coder", qc("get_weather", {"city": "Oslo", "days": "4"}) + qc("get_weather", {"days": "four"}), None,
     [("get_weather", {"city": "Oslo", "days": 4}), ("get_weather", {"days": "four"})]),   # typed by the schema
    ("qwen3_coder", h("get_weather", W), h("get_weather", W), []),       # Hermes JSON is not this format
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', None, [("get_weather", W)]),
    ("pythonic", "[get_weather(city='Zürich', days=3), book(guest={'name': 'Ann', 'age': 3}, "
     "tags=['a', {'deep': [1, 2.5, None, True, {'x': '}'}]}]), ping()]\n", None,
     [("get_weather", {"city": "Zürich", "days": 3}), ("book", NESTED), ("ping", {})]),
    ("pythonic", '[ping(x=-1.5, y=(1, 2), z=null, s="a)b]c", t=false)]', None,
     [("ping", {"x": -1.5, "y": [1, 2], "z": None, "s": "a)b]c", "t": False})]),
    ("pythonic", "Sure, [1] is a citation.", "Sure, [1] is a citation.", []),
    ("pythonic", "[Note](http://example.com)", "[Note](http://example.com)", []),
]

# (parser, text): malformed call text -> all content, no call, never an exception.
BAD = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),   # unclosed
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argum'),                                   # truncated
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
    ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": }}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"name": "get_weather", "parameters": [1]}'),
    ("deepseek_v3", DS_B + f"{DS_CB}function{DS_SEP}get_weather\n```json\n{{\"city\": }}\n```{DS_CE}" + DS_E),
    ("deepseek_v3", DS_B + f"{DS_CB}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}"),
    ("deepseek_v3", DS_B + f"{DS_CB}function{DS_SEP}get_we"),
    ("deepseek_v4", V4_B + f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="days" string="false">'
     f"three</{DSML}parameter>\n</{DSML}invoke>\n" + V4_E),           # not JSON
    ("deepseek_v4", V4_B + f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Par'),
    ("deepseek_v4", V4_B + f'<{DSML}invoke name="get_weather">\nstray text\n</{DSML}invoke>\n' + V4_E),
    ("deepseek_v4", V4_B + f'<{DSML}invoke name="">\n</{DSML}invoke>\n' + V4_E),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nstray\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    ("pythonic", "[get_weather(1)]"),
    ("pythonic", '[get_weather(city="Paris"'),
    ("pythonic", '[get_weather(city=open("x"))]'),
    ("pythonic", "[get_weather(**kw)]"),
    ("pythonic", "[get_weather(x=1e999)]"),
]


def chunkings(text):
    yield [text]
    yield list(text)
    for seed in range(3):
        rng, out, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            out.append(text[i:i + n])
            i += n
        yield out


def run_stream(parser: ToolParser, pieces):
    s = parser.stream()
    content, deltas = "", []
    for p in pieces:
        c, d = s.feed(p)
        content += c
        deltas += d
    c, d = s.finish()
    return content + c, deltas + d


def assemble(deltas: list[ToolCallDelta]):
    calls = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.id.startswith("call_") and d.name, d   # id and name come first
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None, d
        calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("fmt,text,content,calls", GOOD)
def test_parse_recorded(fmt, text, content, calls):
    got_content, got = PARSERS[fmt](TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for c in got:
        assert c.id.startswith("call_") and len(c.id) == 29
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("fmt,text,content,calls", GOOD)
def test_stream_reassembles_to_parse(fmt, text, content, calls):
    parser = PARSERS[fmt](TOOLS)
    p_content, p_calls = parser.parse(text)
    for pieces in chunkings(text):
        got_content, deltas = run_stream(parser, pieces)
        assert got_content == (p_content or ""), pieces
        got = assemble(deltas)
        assert [(n, json.loads(a)) for _, n, a in got] == [(c.name, json.loads(c.arguments)) for c in p_calls]
        if len(pieces) == 1:           # whole calls in one delta: exactly ToolCall.arguments
            assert [a for _, _, a in got] == [c.arguments for c in p_calls]


@pytest.mark.parametrize("fmt,text", BAD)
def test_malformed_is_content(fmt, text):
    parser = PARSERS[fmt](TOOLS)
    content, calls = parser.parse(text)
    assert calls == [] and content == text
    for pieces in chunkings(text):
        got_content, deltas = run_stream(parser, pieces)
        if not deltas:                 # nothing sent as a call: all of it is content
            assert got_content == text
        if fmt == "pythonic":          # commits only complete, valid calls
            assert not deltas and got_content == text


def test_stream_holds_back_markers_and_streams_arguments():
    s = PARSERS["hermes"](TOOLS).stream()
    assert s.feed("Hi <b>x</b> <tool") == ("Hi <b>x</b> ", [])
    assert s.feed("_ca") == ("", [])
    c, d = s.feed('ll>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert c == "" and d[0].name == "get_weather" and d[0].id.startswith("call_")
    assert d[1] == ToolCallDelta(0, arguments='{"city": "Pa')
    assert s.feed('ris"}}\n</tool_') == ("", [ToolCallDelta(0, arguments='ris"}')])
    assert s.feed("call>\n") == ("", [])
    assert s.feed("Bye") == ("\nBye", [])   # the segment's held "\n" goes with it
    assert s.finish() == ("", [])

    s = PARSERS["deepseek_v3"](TOOLS).stream()
    c, d = s.feed("ok" + DS_B + DS_CB + "function" + DS_SEP + 'ping\n```json\n{"a": [1, "}"')
    assert c == "ok" and [x.name for x in d] == ["ping", None] and d[1].arguments == '{"a": [1, "}"'
    assert s.feed("]}\n``")[1] == [ToolCallDelta(0, arguments="]}")]
    assert s.feed("`" + DS_CE[:3]) == ("", [])
    assert s.feed(DS_CE[3:] + DS_E) == ("", [])
    assert s.finish() == ("", [])

    s = PARSERS["llama3_json"](TOOLS).stream()
    assert s.feed(" ") == ("", [])
    assert s.feed("<|python") == ("", [])
    c, d = s.feed('_tag|>{"name": "ping", "parameters": {"q": 1')
    assert [x.name for x in d] == ["ping", None] and d[1].arguments == '{"q": 1'
    assert s.feed("}}")[1] == [ToolCallDelta(0, arguments="}")]

    s = PARSERS["pythonic"](TOOLS).stream()
    assert s.feed('[ping(a="x)"') == ("", [])
    c, d = s.feed("), get_weather(city='P')")
    assert [(x.index, x.name, x.arguments) for x in d] == [(0, "ping", '{"a": "x)"}'), (1, "get_weather", '{"city": "P"}')]


def test_fuzz_never_raises():
    # Recorded outputs, cut and spliced at random: near-misses of every format.
    atoms = ["<tool_call>", "</tool_call>", "\n", "{", "}", "[", "]", '"', "\\", ", ", ": ", "; ",
             "<|python_tag|>", DS_B, DS_E, DS_CB, DS_CE, DS_SEP, "```", "(", ")", "=", "'", "<tool", "<｜tool▁",
             V4_B, V4_E, f"<{DSML}invoke", f"</{DSML}parameter>", ' string="false">']
    rng = random.Random(7)
    cases = [(f, t) for f, t, *_ in GOOD + BAD]
    stats = {"calls": 0, "none": 0}              # of the text's own format
    for _ in range(2000):
        own, text = rng.choice(cases)
        for _ in range(rng.randint(0, 2)):
            i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
            op = rng.randrange(4)
            text = (text[:i] if op == 0 else text[:i] + text[j:] if op == 1
                    else text[:i] + rng.choice(atoms) + text[i:] if op == 2 else text[:j] + text[i:])
        for fmt, cls in PARSERS.items():
            parser = cls(TOOLS)
            content, calls = parser.parse(text)
            assert content is None or content.strip()
            for c in calls:
                assert isinstance(json.loads(c.arguments), dict) and c.name
            if fmt == own:
                stats["calls" if calls else "none"] += 1
            n = rng.randint(1, 5)
            s_content, deltas = run_stream(parser, [text[k:k + n] for k in range(0, len(text), n)])
            assemble(deltas)
            if not deltas:
                assert s_content == (content or "") and not calls
    assert stats["calls"] > 300 and stats["none"] > 1000, stats  # not vacuous


def test_tools_input_is_tolerant():
    p = PARSERS["hermes"]([{"type": "function", "function": {"name": "a"}}, {"type": "x"}, "junk",
                           {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}])
    assert list(p.tools) == ["a"] and p.tools["a"] == {"type": "object"}
    with pytest.raises(ValueError):
        p.grammar("nope", False)
    with pytest.raises(ValueError):
        PARSERS["hermes"]([]).grammar(None, False)


def test_registry_and_default_parser():
    assert set(PARSERS) == {"hermes", "llama3_json", "deepseek_v3", "deepseek_v4", "deepseek_v32", "qwen3_coder",
                            "pythonic"}
    assert PARSERS["deepseek_v3"].skip_special_tokens is False and PARSERS["deepseek_v4"].skip_special_tokens is False
    assert PARSERS["hermes"].skip_special_tokens is True
    smol = "{{'<|im_start|>' + message['role'] + '\\n'}}"
    assert default_parser("llama", smol) == "hermes"                 # SmolLM2
    assert default_parser("llama", "<|start_header_id|>") == "llama3_json"
    assert default_parser("llama", "{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_parser("llama", None) == "llama3_json"
    assert default_parser("qwen2", None) == "hermes"
    assert default_parser("qwen3", "x <tool_call> y") == "hermes"
    assert default_parser("gemma3", None) == "pythonic"
    assert default_parser("gemma3_text", "<start_of_turn>") == "pythonic"
    assert default_parser("deepseek_v3", None) == "deepseek_v3"
    assert default_parser("deepseek_v4", None) == "deepseek_v4"
    assert default_parser("deepseek_v32", None) == "deepseek_v32"
    assert default_parser(None, f"x <{DSML}tool_calls> y") == "deepseek_v4"
    assert default_parser("deepseek_v3", f"x <{DSML}function_calls> y") == "deepseek_v32"
    assert default_parser(None, "...<｜tool▁calls▁begin｜>...") == "deepseek_v3"
    coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + '>' }}"
    assert default_parser("qwen3_moe", coder) == "qwen3_coder"      # Qwen3-Coder's template
    assert default_parser("mistral", "[INST]") is None
    assert default_parser(None, None) is None


# --- grammars, enforced by llguidance on the SmolLM2 tokenizer -----------------

@pytest.fixture(scope="module")
def tk():
    llguidance = pytest.importorskip("llguidance")
    from model_zoo.resolve import open_model
    m = open_model("smollm2-135m", weights=False)
    llt = llguidance.LLTokenizer(m.tokenizer.backend.to_str(), eos_token=m.eos_token_ids)
    return llguidance, llt, m.tokenizer


def compile_grammar(tk, lark):
    llg, llt, _ = tk
    g = llg.grammar_from("lark", lark)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(g, llt)
    assert not is_error and messages == [], messages
    return g


def accepts(tk, grammar, text) -> bool:
    llg, llt, tok = tk
    m = llg.LLMatcher(llt, grammar, log_level=0)
    ok = m.consume_tokens(tok.encode(text, add_special_tokens=False))
    return ok and not m.is_error() and m.is_accepting()


def py_call(name, args):
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


GW = {"city": "Paris", "unit": "celsius", "days": 3}
BK = {"guest": {"name": "Zoë", "age": 30}, "tags": ["x", "y"]}
# format -> (call writer, joiner of parallel calls, whole-output wrapper)
WRITE = {
    "hermes": (h, "\n", lambda s: s),
    "llama3_json": (lambda n, a: json.dumps({"name": n, "parameters": a}, ensure_ascii=False), "; ", lambda s: s),
    "deepseek_v3": (ds, "\n", lambda s: DS_B + s + DS_E),
    "deepseek_v4": (dsml, "", lambda s: V4_B + s + V4_E),
    "deepseek_v32": (dsml, "", lambda s: f"<{DSML}function_calls>\n" + s + f"</{DSML}function_calls>"),
    "pythonic": (py_call, ", ", lambda s: "[" + s + "]"),
    "qwen3_coder": (qc, "\n", lambda s: s),
}
# argument sets that break get_weather's schema (pythonic checks types, enums, required and
# repeated keywords and their order, not ranges)
VIOLATIONS = {
    "json": [{"city": "Paris", "unit": "kelvin"}, {"city": "Paris", "days": 9}, {"city": 5},
             {"unit": "celsius"}],
    "pythonic": [{"city": "Paris", "unit": "kelvin"}, {"city": 5}, {"city": "Paris", "days": "3"},
                 {"city": "Paris", "extra": 1}, {"unit": "celsius"}, {"unit": "celsius", "city": "Paris"}],
}


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_enforces_calls(tk, fmt):
    parser = PARSERS[fmt](TOOLS)
    call, join, wrap = WRITE[fmt]
    one = wrap(call("get_weather", GW))
    two = wrap(join.join([call("book", BK), call("get_weather", {"city": "Oslo"}), call("ping", {})]))
    for choice in (None, "get_weather"):
        for parallel in (False, True):
            g = compile_grammar(tk, parser.grammar(choice, parallel))
            assert accepts(tk, g, one)
            assert accepts(tk, g, two) == (parallel and choice is None)
            assert not accepts(tk, g, wrap(call("get_wether", GW)))        # not a tool
            assert not accepts(tk, g, "The weather in Paris is sunny.")    # prose
            # (qwen3_coder's values are text: a string "5" is a string)
            for bad in VIOLATIONS["pythonic" if fmt == "pythonic" else "json"]:
                if fmt == "qwen3_coder" and bad == {"city": 5}:
                    continue
                assert not accepts(tk, g, wrap(call("get_weather", bad))), bad
    g = compile_grammar(tk, parser.grammar("book", False))
    assert accepts(tk, g, wrap(call("book", BK)))
    assert not accepts(tk, g, one)                                         # another tool than the named one
    assert not accepts(tk, g, wrap(call("book", {"guest": {"name": 5}})))  # nested property type
    # what the grammar lets through parses back into the calls
    content, calls = parser.parse(two)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("book", BK), ("get_weather", {"city": "Oslo"}),
                                                                 ("ping", {})]


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_grammar_schema_refs_and_odd_values(tk, fmt):
    # $defs of a tool's parameters are hoisted to the %json root, where "#/$defs/..." points
    tools = [{"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                         "mode": {"enum": ["it's", 'say "hi"', 2, None]}},
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}]
    parser = PARSERS[fmt](tools)
    call, _, wrap = WRITE[fmt]
    g = compile_grammar(tk, parser.grammar(None, False))
    for mode in ("it's", 'say "hi"', 2, None):
        assert accepts(tk, g, wrap(call("put", {"p": {"x": 1}, "mode": mode}))), mode
    assert not accepts(tk, g, wrap(call("put", {"mode": "its"})))
    if fmt != "pythonic":                     # pythonic leaves $ref'd values free-form
        assert not accepts(tk, g, wrap(call("put", {"p": {"x": "1"}})))


def test_grammar_stops_after_the_call(tk):
    llg, llt, tok = tk
    g = compile_grammar(tk, PARSERS["hermes"](TOOLS).grammar(None, False))
    m = llg.LLMatcher(llt, g, log_level=0)
    assert m.consume_tokens(tok.encode(h("ping", {"a": [1, "b"]}), add_special_tokens=False))
    assert m.is_accepting() and m.is_stopped()
    assert not m.consume_tokens(tok.encode("\n", add_special_tokens=False))


def test_deepseek_marker_tokens_grammar_text():
    g = PARSERS["deepseek_v3"](TOOLS).grammar("ping", True, marker_tokens=True)
    assert g.startswith(f"start: {DS_B} call") and f'"\\n```" {DS_CE}' in g
    assert f'"{DS_B}"' not in g


def test_pythonic_grammar_takes_each_keyword_once(tk):
    g = compile_grammar(tk, PARSERS["pythonic"](TOOLS).grammar("get_weather", False))
    assert accepts(tk, g, '[get_weather(city="Paris", days=3)]')               # optional unit left out
    assert not accepts(tk, g, '[get_weather(city="Paris", city="Paris")]')     # repeated keyword
    assert not accepts(tk, g, "[get_weather()]")                               # required city missing


def test_dsml_grammar_raw_text_only_where_a_string_may_go(tk):
    g = compile_grammar(tk, PARSERS["deepseek_v4"](TOOLS).grammar("get_weather", False))

    def invoke(*params):
        return V4_B + f'<{DSML}invoke name="get_weather">\n' + "".join(
            f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>\n' for k, s, v in params) \
            + f"</{DSML}invoke>\n" + V4_E
    assert accepts(tk, g, invoke(("city", "true", "Rio de\nJaneiro <2>"), ("days", "false", "3")))
    assert accepts(tk, g, invoke(("city", "false", '"Rio"')))              # a JSON string is a string too
    assert not accepts(tk, g, invoke(("city", "true", "Rio"), ("days", "true", "3")))    # raw integer
    assert not accepts(tk, g, invoke(("city", "true", "Rio"), ("unit", "true", "kelvin")))
    assert accepts(tk, g, invoke(("city", "true", "Rio"), ("unit", "true", "celsius")))
    only_ints = [{"type": "function", "function": {"name": "n", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}}]
    g = compile_grammar(tk, PARSERS["deepseek_v4"](only_ints).grammar(None, False))    # no unused raw rule
    assert accepts(tk, g, V4_B + dsml("n", {"k": 4}) + V4_E)
    content, calls = PARSERS["deepseek_v4"](TOOLS).parse(invoke(("city", "true", "Rio de\nJaneiro <2>"),
                                                                ("days", "false", "3")))
    assert content is None and json.loads(calls[0].arguments) == {"city": "Rio de\nJaneiro <2>", "days": 3}


def test_qwen3_coder_values_follow_the_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"$ref": "#/$defs/P"}, "on": {"type": "boolean"}, "x": {"type": "number"},
        "s": {"type": "string"}, "o": {"type": ["object", "null"]}},
        "$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}}]
    text = qc("f", {"p": {"a": 1}, "on": "True", "x": "2.5", "s": "42", "o": "null"})
    _, calls = PARSERS["qwen3_coder"](tools).parse(text)
    assert json.loads(calls[0].arguments) == {"p": {"a": 1}, "on": True, "x": 2.5, "s": "42", "o": None}
