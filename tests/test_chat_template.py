"""render_chat against transformers' apply_chat_template(..., tokenize=False),
for the real models' templates and for a template that exercises every
extension transformers gives templates."""

from __future__ import annotations

import pytest

from fixtures_models import hf_tokenizer
from model_zoo.chat_template import GEMMA3_CHAT_TEMPLATE, ChatTemplateError, render_chat
from model_zoo.resolve import open_model

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system-user": [SYSTEM, {"role": "user", "content": "Name a prime number."}],
    "multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. What do you need?"},
        {"role": "user", "content": "  A haiku about\nthe sea, please.  "},
    ],
    "unicode": [{"role": "user", "content": "Traduis « bonjour » en 中文 🤖\n\n<b>bold</b> & \"quotes\""}],
    "none-keys": [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "hello", "tool_calls": None},
        {"role": "user", "content": "bye"},
    ],
}
CONTINUE = {
    "plain": [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}],
    "trailing-space": [{"role": "user", "content": "Finish:"}, {"role": "assistant", "content": "The answer is "}],
    "with-system": [SYSTEM, {"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Once upon"}],
}


@pytest.fixture(scope="module")
def hf():
    """transformers' renderer: any tokenizer renders any template passed as chat_template=."""
    return hf_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def templates():
    smol = open_model("smollm2-135m")
    return {
        "smollm2": (smol.chat_template, smol.tokenizer.bos_token, smol.tokenizer.eos_token),
        "gemma3": (GEMMA3_CHAT_TEMPLATE, "<bos>", "<eos>"),
    }


def reference(hf, template, messages, bos, eos, **kwargs):
    return hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, bos_token=bos, eos_token=eos, **kwargs
    )


def test_smollm2_template_is_the_gguf_one(hf, templates):
    assert templates["smollm2"][0] == hf.chat_template
    assert "<|im_start|>" in hf.chat_template


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_equals_transformers(hf, templates, model, conversation, add_generation_prompt):
    template, bos, eos = templates[model]
    messages = CONVERSATIONS[conversation]
    ours = render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)
    assert ours == reference(hf, template, messages, bos, eos, add_generation_prompt=add_generation_prompt)
    assert ours.endswith(("<|im_start|>assistant\n", "<start_of_turn>model\n")) == add_generation_prompt


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("conversation", sorted(CONTINUE))
def test_continue_final_message_equals_transformers(hf, templates, model, conversation):
    template, bos, eos = templates[model]
    messages = CONTINUE[conversation]
    # continue_final_message implies no generation prompt, even at render_chat's default True
    ours = render_chat(template, messages, continue_final_message=True, bos_token=bos, eos_token=eos)
    theirs = reference(hf, template, messages, bos, eos, continue_final_message=True, add_generation_prompt=False)
    assert ours == theirs
    assert ours.rstrip().endswith(messages[-1]["content"].rstrip())
    assert not ours.endswith(("<|im_end|>\n", "<end_of_turn>\n"))


def test_gemma3_template_facts():
    messages = CONVERSATIONS["multi-turn"]
    text = render_chat(GEMMA3_CHAT_TEMPLATE, messages, bos_token="<bos>")
    # BOS written by the template (so encode with add_special_tokens=False), system folded into the
    # first user turn, the assistant called "model", content trimmed
    assert text.startswith("<bos><start_of_turn>user\nYou are a terse assistant.")
    assert "<start_of_turn>model\nHello. What do you need?<end_of_turn>\n" in text
    assert "A haiku about\nthe sea, please.<end_of_turn>" in text
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(GEMMA3_CHAT_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


FEATURES = """\
{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'skip' %}{% continue %}{% endif -%}
  {%- if m.role == 'stop' %}{% break %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  [{{ m.role }}|{{ m.content if m.content is string else m.content | tojson }}]
  {%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
  {%- if m.thinking is defined %}(t:{{ m.thinking }}){% endif %}
{%- endfor %}
n={{ ns.count }} bos={{ bos_token }} eos={{ eos_token }} missing=[{{ unk_token }}]
{%- if tools %} tools={{ tools | tojson }} indented={{ tools[0] | tojson(indent=2) }}{% endif %}
{%- if documents %} docs={{ documents | length }}{% endif %}
{%- if custom_flag is defined %} flag={{ custom_flag }}{% endif %}
{{ dict(a=1) | tojson }} {{ {'z': 'é', 'a': '<&>'} | tojson(sort_keys=true) }}
{%- if add_generation_prompt %}<gen>{% endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_template_extensions_equal_transformers(hf):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "skip", "content": "ignored"},
        {"role": "user", "content": [{"type": "text", "text": "multi\u00e9"}]},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "after stop"},
    ]
    kwargs = dict(tools=TOOLS, documents=[{"title": "t", "text": "d"}], custom_flag=True)
    for agp in (True, False):
        ours = render_chat(FEATURES, messages, add_generation_prompt=agp, bos_token="<s>", eos_token="</s>", **kwargs)
        theirs = hf.apply_chat_template(messages, chat_template=FEATURES, tokenize=False, add_generation_prompt=agp,
                                        bos_token="<s>", eos_token="</s>", unk_token="", **kwargs)
        assert ours == theirs
    assert "Météo <now>" in ours and "<think>because</think>" in ours and "n=3" in ours


def test_strftime_now():
    from datetime import datetime

    year = datetime.now().strftime("%Y")
    assert render_chat("{{ strftime_now('%Y') }}", [{"role": "user", "content": "x"}]) in (year, str(int(year) + 1))


@pytest.mark.parametrize(
    "template, messages, match",
    [
        ("{% for m in messages %}{{ m.content }", [{"role": "user", "content": "x"}], "compile"),
        ("{{ raise_exception('bad role: ' + messages[0].role) }}", [{"role": "tool", "content": "x"}],
         "bad role: tool"),
        ("{% set ns = namespace(_hidden=1) %}", [{"role": "user", "content": "x"}], "underscore"),
        ("{{ messages[3].content }}", [{"role": "user", "content": "x"}], "render"),
        ("{{ x }}", [], "empty"),
        ("", [{"role": "user", "content": "x"}], "no chat template"),
    ],
)
def test_template_errors_are_clear_value_errors(template, messages, match):
    with pytest.raises(ValueError, match=match) as err:
        render_chat(template, messages)
    assert isinstance(err.value, ChatTemplateError)


def test_continue_final_message_needs_a_template_that_reads_content():
    with pytest.raises(ChatTemplateError, match="never reads"):
        render_chat("{{ messages | length }}", [{"role": "assistant", "content": "x"}], continue_final_message=True)


def test_messages_are_not_mutated():
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One"}]
    render_chat(GEMMA3_CHAT_TEMPLATE, messages, continue_final_message=True, bos_token="<bos>")
    assert messages == [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One"}]


def test_gemma3_tool_template():
    """The gemma3 fallback (GGUFs without a template) renders exactly as
    google's template when there are no tools, and writes tools, calls
    (pythonic) and results (user turns) when there are."""
    from model_zoo.chat_template import FALLBACK_TEMPLATES, GEMMA3_TOOL_CHAT_TEMPLATE as T
    assert FALLBACK_TEMPLATES["gemma3"] == T
    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "hello"}, {"role": "user", "content": " bye "}]]
    for c in convs:
        for agp in (True, False):
            assert render_chat(T, c, add_generation_prompt=agp, bos_token="<bos>") == \
                render_chat(GEMMA3_CHAT_TEMPLATE, c, add_generation_prompt=agp, bos_token="<bos>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {"role": "tool", "tool_call_id": "b", "content": "noon"}]
    text = render_chat(T, chat, add_generation_prompt=True, bos_token="<bos>", tools=tools)
    assert '{"name": "get_weather", "parameters"' in text.split("weather?")[0]
    assert '<start_of_turn>model\n[get_weather(city="Paris"), get_time()]<end_of_turn>\n' in text
    assert "<start_of_turn>user\nResult of the call: sunny\nResult of the call: noon<end_of_turn>\n" \
           "<start_of_turn>model\n" in text
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat(T, chat[:1] + chat[2:], bos_token="<bos>")
