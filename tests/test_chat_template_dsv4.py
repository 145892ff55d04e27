"""DeepSeek-V4's chat template (model_zoo/chat_templates/deepseek_v4.jinja), the
fallback for V4 checkpoints, which publish their prompt format as a Python
encoder (encoding/encoding_dsv4.py) and ship no template.

The GOLDEN_* prompts are outputs of that encoder as published: the thinking-mode
one is its own test case 1 (encoding/tests/test_output_1.txt, quoted by ms-swift's
template tests), the chat-mode ones were produced with it over the same fixtures
(quoted by chat-bricks' tests), the last is the example in DeepSeek-V3.2's
README (the V4 encoder renders it the same). The rest checks the encoder's
rules (tool results merged and ordered by call, reasoning dropped before the
last user turn, the max-effort preamble) on conversations built for them."""
from __future__ import annotations

import json

import pytest

from model_zoo.chat_template import FALLBACK_TEMPLATES, builtin_template, render_chat
from server.tool_parsers import PARSERS, default_parser

V4 = builtin_template("deepseek_v4")
BOS, EOS, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a specific location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web for information",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Search query"},
            "num_results": {"type": "integer", "description": "Number of results to return"}},
            "required": ["query"]}}},
]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER = [
    SYSTEM,
    {"role": "user", "content": "What's the weather in Beijing?"},
    {"role": "assistant", "content": "",
     "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
     "tool_calls": [{"id": "call_001", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_001",
     "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}'},
    {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
     "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."},
]

TOOLS_SECTION = (
    "\n\n## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. '
    "For all other types (numbers, booleans, arrays, objects), "
    'pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), "
    "you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response."
    "\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Get the weather for a specific location", '
    '"parameters": {"type": "object", "properties": {"location": {"type": "string", '
    '"description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], '
    '"description": "Temperature unit"}}, "required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string", '
    '"description": "Search query"}, "num_results": {"type": "integer", '
    '"description": "Number of results to return"}}, "required": ["query"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
WEATHER_CALL = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
WEATHER_RESULT = '<tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result>'
WEATHER_ANSWER = "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."

GOLDEN_THINKING_TOOLS = (
    BOS + "You are a helpful assistant." + TOOLS_SECTION
    + U + "What's the weather in Beijing?" + A
    + "<think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>"
    + WEATHER_CALL + EOS
    + U + WEATHER_RESULT + A
    + "<think>Got the weather data. Let me format a nice response.</think>" + WEATHER_ANSWER + EOS
)
GOLDEN_CHAT_TOOLS = (
    BOS + "You are a helpful assistant." + TOOLS_SECTION
    + U + "What's the weather in Beijing?" + A + "</think>" + WEATHER_CALL + EOS
    + U + WEATHER_RESULT + A + "</think>" + WEATHER_ANSWER + EOS
)
BASIC = [SYSTEM, {"role": "user", "content": "Hello"},
         {"role": "assistant", "content": "Hi there! How can I help you?"},
         {"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."}]
GOLDEN_CHAT_BASIC = (
    BOS + "You are a helpful assistant."
    + U + "Hello" + A + "</think>Hi there! How can I help you?" + EOS
    + U + "What is the capital of France?" + A + "</think>The capital of France is Paris." + EOS
)
DROP = [{"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
        {"role": "user", "content": "1+1=?"}]
GOLDEN_DROP = BOS + U + "hello" + A + "</think>Hello! I am DeepSeek." + EOS + U + "1+1=?" + A + "<think>"


@pytest.mark.parametrize("messages,tools,kwargs,golden", [
    (WEATHER, TOOLS, {"thinking": True}, GOLDEN_THINKING_TOOLS),
    (WEATHER, TOOLS, {}, GOLDEN_CHAT_TOOLS),
    (BASIC, None, {}, GOLDEN_CHAT_BASIC),
    (DROP, None, {"thinking": True}, GOLDEN_DROP),
], ids=["thinking-tools", "chat-tools", "chat-basic", "thinking-drop"])
def test_published_prompts(messages, tools, kwargs, golden):
    assert render_chat(V4, messages, tools=tools, **kwargs) == golden


def test_thinking_switches():
    ask = [{"role": "user", "content": "hi"}]
    assert render_chat(V4, ask).endswith(A + "</think>")                      # chat mode by default
    assert render_chat(V4, ask, enable_thinking=True).endswith(A + "<think>")  # the kwarg Qwen3 users know
    assert render_chat(V4, ask, thinking=True, reasoning_effort="none").endswith(A + "</think>")
    assert render_chat(V4, ask, add_generation_prompt=False) == BOS + U + "hi"
    assert render_chat(V4, ask, thinking=True, reasoning_effort="high") == BOS + U + "hi" + A + "<think>"
    maxed = render_chat(V4, [SYSTEM] + ask, thinking=True, reasoning_effort="max")
    assert maxed.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert maxed.endswith("adversarial scenarios.\nExplicitly write out your entire deliberation process, "
                          "documenting every intermediate step, considered alternative, and rejected hypothesis "
                          "to ensure absolutely no assumption is left unchecked.\n\nYou are a helpful assistant."
                          + U + "hi" + A + "<think>")
    # the preamble is a thinking-mode thing only
    assert render_chat(V4, ask, reasoning_effort="max") == BOS + U + "hi" + A + "</think>"


def test_tool_results_join_one_user_turn_in_call_order():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "search", "arguments": {"query": q}}}
             for i, q in enumerate(["a", "b"])]
    messages = [{"role": "user", "content": "two searches"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "B"},     # answered out of order
                {"role": "tool", "tool_call_id": "c0", "content": "A"},
                {"role": "user", "content": "and summarise"}]
    out = render_chat(V4, messages, tools=TOOLS)
    assert out.endswith(EOS + U + "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand summarise"
                        + A + "</think>")
    assert out.count(U) == 2
    # both calls in one block, in the assistant's order
    block = out[out.index(U + "two searches"):]
    assert block.count("<｜DSML｜tool_calls>") == 1 and block.index('">a<') < block.index('">b<')


def test_reasoning_kept_with_tools_and_mid_turn():
    # With tools (an agent), reasoning stays in every turn, as the encoder does.
    followup = WEATHER + [{"role": "user", "content": "And tomorrow?"}]
    out = render_chat(V4, followup, tools=TOOLS, thinking=True)
    assert out == GOLDEN_THINKING_TOOLS + U + "And tomorrow?" + A + "<think>"
    # Without tools: dropped before the last user turn, unless the conversation ends mid-turn
    # (a tool result last, as vLLM's V4 path decides) or drop_thinking=False is asked for.
    no_tools = render_chat(V4, followup, thinking=True)
    assert "I should use the get_weather tool" not in no_tools and "Let me format" not in no_tools
    assert no_tools.endswith(WEATHER_ANSWER + EOS + U + "And tomorrow?" + A + "<think>")
    assert U + WEATHER_RESULT + A + "</think>" + WEATHER_ANSWER in no_tools
    kept = render_chat(V4, followup, thinking=True, drop_thinking=False)
    assert "I should use the get_weather tool.</think>" in kept and "Let me format a nice response.</think>" in kept
    mid = render_chat(V4, WEATHER[:4], thinking=True)
    assert mid.endswith("get_weather tool.</think>" + WEATHER_CALL + EOS + U + WEATHER_RESULT + A + "<think>")


def test_developer_turns():
    dev = {"role": "developer", "content": "Be brief."}
    msgs = [dev, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}]
    # a developer turn is a user turn; in thinking mode it is dropped with the old reasoning
    assert render_chat(V4, msgs) == (BOS + U + "Be brief." + U + "q1" + A + "</think>a1" + EOS + U + "q2" + A
                                     + "</think>")
    assert render_chat(V4, msgs, thinking=True) == (BOS + U + "q1" + A + "</think>a1" + EOS + U + "q2" + A
                                                    + "<think>")


def test_arguments_and_tools_without_system():
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "x", "type": "function", "function": {
                    "name": "search", "arguments": '{"query": "cats", "num_results": 5, "safe": true, '
                                                   '"tags": ["a", "ü"]}'}},
                {"id": "y", "type": "function", "function": {"name": "search", "arguments": "not json"}}]}]
    out = render_chat(V4, msgs, tools=TOOLS[1:])
    assert out.startswith(BOS + "\n\n## Tools\n\n")      # an empty system turn carries the tools
    assert ('<｜DSML｜invoke name="search">\n'
            '<｜DSML｜parameter name="query" string="true">cats</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="num_results" string="false">5</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="safe" string="false">true</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="tags" string="false">["a", "ü"]</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n'
            '<｜DSML｜invoke name="search">\n'
            '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS) in out


def test_the_dsml_parser_reads_back_what_the_template_writes():
    """The server's deepseek_v4 tool parser (the model's output side) parses the
    assistant text this template writes (its prompt side) back to the same calls."""
    args = {"location": "Beijing", "unit": "celsius", "days": 3, "opts": {"hourly": False}}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}},
                {"id": "b", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]}]
    out = render_chat(V4, msgs, tools=TOOLS)
    written = out[out.rindex(A + "</think>") + len(A + "</think>"):-len(EOS)]
    content, calls = PARSERS["deepseek_v4"](TOOLS).parse(written)
    assert content.strip() == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args), ("search", {"query": "x"})]


def test_continue_final_message():
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    assert render_chat(V4, msgs, continue_final_message=True) == BOS + U + "Count" + A + "</think>One, two,"


def test_is_the_fallback_for_v4_checkpoints(tmp_path):
    from model_zoo.resolve import open_model
    from tiny_models import save_tiny_deepseek_v4
    save_tiny_deepseek_v4(tmp_path)
    assert open_model(str(tmp_path)).chat_template == FALLBACK_TEMPLATES["deepseek_v4"] == V4
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")     # the checkpoint's own wins
    assert open_model(str(tmp_path)).chat_template == "{{ messages[0]['content'] }}"
    assert default_parser("deepseek_v4", V4) == "deepseek_v4"      # its DSML markers pick the parser
    with pytest.raises(ValueError, match="no role"):
        render_chat(V4, [{"role": "narrator", "content": "x"}])
