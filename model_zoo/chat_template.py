"""Chat template rendering, the way transformers' `apply_chat_template(...,
tokenize=False)` renders it (utils/chat_template_utils.py): the same sandboxed
jinja2 environment, globals and filters, None-valued message keys dropped,
reasoning fields aliased, and the continue_final_message cut.

The rendered prompt already holds whatever BOS the template writes (Gemma's
writes `<bos>`), so encode it with `add_special_tokens=False`, as
transformers' apply_chat_template(tokenize=True) does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Pieces of Gemma 3's chat template, shared by google's and the tool variant.
_GEMMA3_HEAD = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
)

_GEMMA3_CONTENT = (
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
)

_GEMMA3_TAIL = (
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

# The template google/gemma-3-*-it ship in tokenizer_config.json (it writes
# {{ bos_token }} itself and calls the assistant "model"). The gemma3 GGUF we
# bundle carries no tokenizer.chat_template: the loader falls back to the
# tool variant below.
GEMMA3_CHAT_TEMPLATE = _GEMMA3_HEAD + (
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
) + _GEMMA3_CONTENT + (
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
) + _GEMMA3_TAIL


# GEMMA3_CHAT_TEMPLATE with tools (Gemma 3 has no tool format of its own; this
# is the pythonic one of vLLM's Gemma 3 tool example): the tools and how to call
# them go into the first user turn, an assistant's tool_calls are written
# [name(k=v, ...)], and tool results are user turns (consecutive ones share a
# turn). Without tools or tool messages it renders exactly as google's template.
GEMMA3_TOOL_CHAT_TEMPLATE = _GEMMA3_HEAD + (
    "{%- if tools -%}\n"
    "    {%- set tns = namespace(text='') -%}\n"
    "    {%- for tool in tools -%}\n"
    "        {%- set tns.text = tns.text + (tool['function'] if tool['function'] is defined else tool) | tojson + '\n' -%}\n"
    "    {%- endfor -%}\n"
    "    {%- set first_user_prefix = first_user_prefix + 'You can call these functions:\n' + tns.text"
    "        + '\nTo call functions, answer with only a list of calls in Python syntax: '\n"
    "        + '[func_name1(param1=value1, param2=value2), func_name2(param=value)]\n\n' -%}\n"
    "{%- endif -%}\n"
    "{%- set ns = namespace(turn=0) -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- set after_tool = message['role'] == 'tool' and not loop.first and loop.previtem['role'] == 'tool' -%}\n"
    "    {%- set before_tool = message['role'] == 'tool' and not loop.last and loop.nextitem['role'] == 'tool' -%}\n"
    "    {%- if not after_tool -%}\n"
    "        {%- if (message['role'] in ['user', 'tool']) != (ns.turn % 2 == 0) -%}\n"
    "            {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "        {%- endif -%}\n"
    "        {%- set ns.turn = ns.turn + 1 -%}\n"
    "        {%- if (message['role'] == 'assistant') -%}\n"
    "            {%- set role = \"model\" -%}\n"
    "        {%- elif (message['role'] == 'tool') -%}\n"
    "            {%- set role = \"user\" -%}\n"
    "        {%- else -%}\n"
    "            {%- set role = message['role'] -%}\n"
    "        {%- endif -%}\n"
    "        {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if message['role'] == 'tool' -%}\n"
    "        {{ 'Result of ' + (message['name'] ~ ' ' if message['name'] is defined else '') + 'the call: ' }}\n"
    "    {%- endif -%}\n"
) + _GEMMA3_CONTENT + (
    "    {%- if message['tool_calls'] is defined and message['tool_calls'] -%}\n"
    "        {{ '[' }}\n"
    "        {%- for call in message['tool_calls'] -%}\n"
    "            {%- set fn = call['function'] if call['function'] is defined else call -%}\n"
    "            {{ fn['name'] + '(' }}\n"
    "            {%- for k, v in (fn['arguments'] if fn['arguments'] is mapping else {}).items() -%}\n"
    "                {{ k + '=' + v | tojson }}{{ ', ' if not loop.last else '' }}\n"
    "            {%- endfor -%}\n"
    "            {{ ')' }}{{ ', ' if not loop.last else '' }}\n"
    "        {%- endfor -%}\n"
    "        {{ ']' }}\n"
    "    {%- endif -%}\n"
    "    {%- if before_tool -%}\n"
    "        {{ '\n' }}\n"
    "    {%- else -%}\n"
    "        {{ '<end_of_turn>\n' }}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
) + _GEMMA3_TAIL


def builtin_template(name: str) -> str:
    """A template this package ships in model_zoo/chat_templates/ (by file stem)."""
    return (Path(__file__).with_name("chat_templates") / f"{name}.jinja").read_text(encoding="utf-8")


# Fallbacks by GGUF architecture or HF model_type, for checkpoints that carry
# no template. DeepSeek-V4 publishes its format as a Python encoder only.
FALLBACK_TEMPLATES = {"gemma3": GEMMA3_TOOL_CHAT_TEMPLATE, "deepseek_v4": builtin_template("deepseek_v4")}

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes; transformers' does not, and exposes these options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict` without attribute access to the real type (sandbox hygiene, as transformers)
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # namespaces reject underscore names so templates cannot reach CPython internals
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training
    # masks; for rendering it is a no-op, but templates that use it must parse.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _plain(value: Any) -> Any:
    """Plain JSON-ish data only: rich objects never reach the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy / torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _parse_arguments(message: dict) -> dict:
    # Templates expect tool-call arguments as a mapping (vLLM parses the
    # OpenAI-style JSON string before rendering, for the server and LLM.chat).
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        out.append(call)
    return {**message, "tool_calls": out}


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # Templates read reasoning as `reasoning_content` (or gpt-oss's `thinking`);
    # fill both from whichever name the caller used.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with `template`; template problems raise ChatTemplateError (a ValueError).

    continue_final_message leaves the final message open (no end-of-turn) so
    the model continues it; it implies add_generation_prompt=False.
    Extra kwargs (documents, enable_thinking, unk_token, ...) reach the template.
    """
    if not template:
        raise ChatTemplateError("no chat template: this model has none and none was given")
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if continue_final_message:
        add_generation_prompt = False
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")

    compiled = compile_template(template)
    chat = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {message!r}")
        # None-valued keys dropped: OpenAI clients send content=None / tool_calls=None
        chat.append(_parse_arguments({k: v for k, v in message.items() if v is not None}))
    chat = _alias_reasoning(chat)

    # special tokens the template may read; absent ones stay undefined (render
    # as ""), not the string "None"
    specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    template_kwargs = _plain({**specials, **kwargs})
    documents = template_kwargs.pop("documents", None)

    final_text = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = chat[-1].get(field)
        if final_text is None:
            raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}"')
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_text]
        if not any(f in template for f in fields):
            raise ChatTemplateError(f'continue_final_message is set to "{field}" but the chat template never reads it')
        if isinstance(final_text, (list, tuple)):
            for block in reversed(final_text):
                if "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatTemplateError("continue_final_message is set but the final message has no text block")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG

    try:
        rendered = compiled.render(
            messages=chat,
            tools=_plain(tools),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
    except (TypeError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError(
                "continue_final_message is set but the chat template drops part of the final message"
            )
        loc = rendered.rindex(tag)
        if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:loc]
        else:  # the template trimmed trailing space after the message
            rendered = rendered[:loc].rstrip()
    return rendered
