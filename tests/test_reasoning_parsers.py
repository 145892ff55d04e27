"""server.reasoning_parsers: split() on recorded outputs, stream() giving the
same parts however the text is cut, and thinking_in_prompt."""
import random

import pytest

from server.reasoning_parsers import PARSERS

# (parser, output, reasoning_content, content)
CASES = [
    # Qwen3 thinking: it writes <think> itself
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\n4.", "\nThe user wants 2+2.\n", "\n\n4."),
    ("qwen3", "\n<think>x</think>y", "x", "y"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", None, "\n\nHello!"),           # empty thinking
    ("qwen3", "<think>\nStill thinking when cut", "\nStill thinking when cut", None),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),               # only the first end splits
    ("qwen3", "<think>a</think>\n\n", "a", None),                             # blank answer
    # Qwen3 non-thinking (enable_thinking=False): no markers, all content
    ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),
    ("qwen3", "  <thin air", None, "  <thin air"),
    ("qwen3", "a <think> b </think> c", None, "a <think> b </think> c"),      # not at the start
    ("qwen3", "", None, None),
    ("qwen3", " \n ", None, None),
    # DeepSeek-R1 / V3.1 / V4: <think> is in the prompt, the output starts inside it
    ("deepseek_r1", "Let me see: 6*7.\n</think>\n\n42", "Let me see: 6*7.\n", "\n\n42"),
    ("deepseek_r1", "<think>\nhmm\n</think>42", "\nhmm\n", "42"),
    ("deepseek_r1", "Thinking, then cut at max_tokens", "Thinking, then cut at max_tokens", None),
    ("deepseek_r1", "</think>Direct answer.", None, "Direct answer."),
    ("deepseek_r1", "思考中…\n</think>\n\n答案：東京 ☀️", "思考中…\n", "\n\n答案：東京 ☀️"),
    ("deepseek_r1", "<thinking is fun</think>x", "<thinking is fun", "x"),
    ("deepseek_r1", "a</think", "a</think", None),                            # a cut end marker is text
    ("deepseek_v3", "plan: call the tool\n</think>\n\n<｜tool▁calls▁begin｜>", "plan: call the tool\n",
     "\n\n<｜tool▁calls▁begin｜>"),
    ("deepseek_v3", "", None, None),
]


def chunkings(text):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):                  # every single cut
        yield [text[:i], text[i:]]
    for seed in range(5):
        rng, out, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            out.append(text[i:i + n])
            i += n
        yield out


def run(stream, pieces):
    reasoning = content = ""
    for p in pieces:
        r, c = stream.feed(p)
        reasoning += r
        content += c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_split(name, text, reasoning, content):
    assert PARSERS[name]().split(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_stream_matches_split_for_any_cut(name, text, reasoning, content):
    parser = PARSERS[name]()
    for pieces in chunkings(text):
        assert run(parser.stream(), pieces) == (reasoning or "", content or ""), pieces


def test_stream_sends_as_it_goes_and_holds_markers():
    s = PARSERS["qwen3"]().stream()
    assert s.feed("<thi") == ("", "")                # may be <think>
    assert s.feed("nk>\nSo") == ("\nSo", "")
    assert s.feed(" far</thi") == (" far", "")       # "</thi" held back
    assert s.feed("nk>\n\n") == ("", "")             # blank content so far is held
    assert s.feed("Yes") == ("", "\n\nYes")
    assert s.finish() == ("", "")
    s = PARSERS["qwen3"]().stream()
    assert s.feed("Hi") == ("", "Hi")                # no <think>: content at once
    s = PARSERS["deepseek_r1"]().stream()
    assert s.feed("Hm") == ("Hm", "")                # reasoning at once
    assert s.feed("<") == ("", "")
    assert s.feed("b") == ("<b", "")


def test_thinking_false_is_all_content():
    for name in PARSERS:
        p = PARSERS[name]()
        text = "Answer</think> with <think> markers"
        assert p.split(text, thinking=False) == (None, text)
        assert run(p.stream(thinking=False), list(text)) == ("", text)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_thinking_in_prompt(name):
    p = PARSERS[name]()
    # Qwen3 enable_thinking=False renders a closed, empty block at the end
    assert not p.thinking_in_prompt("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert p.thinking_in_prompt("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # DeepSeek-R1 / V3.1 thinking: the prompt opens the block
    assert p.thinking_in_prompt("<｜User｜>hi<｜Assistant｜><think>\n")
    # DeepSeek-V3.1 non-thinking: the prompt closes it with no <think> before
    assert not p.thinking_in_prompt("<｜User｜>hi<｜Assistant｜></think>")
    # a closed block of an earlier turn does not count
    assert p.thinking_in_prompt("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n")
    assert p.thinking_in_prompt("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not p.thinking_in_prompt("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think></think>")
    assert p.thinking_in_prompt("")


def test_registry():
    assert set(PARSERS) == {"qwen3", "deepseek_r1", "deepseek_v3"}
    for name, cls in PARSERS.items():
        assert cls.name == name and cls.start == "<think>" and cls.end == "</think>"
