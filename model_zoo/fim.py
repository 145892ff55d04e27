"""Fill-in-the-middle prompts for code models: the text before and after a
gap, laid out with the model's own prefix / suffix / middle tokens (the
prefix-suffix-middle order those models train on), so that what it
generates is the middle. The tokens are found by name in the vocabulary,
the names the code model families use (llama.cpp's fallback when a GGUF
does not name them)."""

# (prefix, suffix, middle) token names, by family.
FIM_NAMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),     # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),           # StarCoder / StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),       # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),                             # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
)


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """The model's (prefix, suffix, middle) token ids, or None: no fill-in-the-middle."""
    lookup = getattr(tokenizer, "convert_tokens_to_ids", None)     # (a tokenizer without names has none)
    if lookup is None:
        return None
    for names in FIM_NAMES:
        ids = [lookup(n) for n in names]
        if None not in ids:
            return tuple(ids)
    return None


def fim_prompt(tokenizer, ids: tuple[int, int, int], prefix: str | list[int], suffix: str) -> list[int]:
    """[bos] <prefix> prefix <suffix> suffix <middle> (prefix: text or token ids)."""
    pre, suf, mid = ids
    bos = tokenizer.encode("", add_special_tokens=True)         # the tokenizer's own start, if any
    head = prefix if isinstance(prefix, list) else tokenizer.encode(prefix, add_special_tokens=False)
    return bos + [pre] + head + [suf] + tokenizer.encode(suffix, add_special_tokens=False) + [mid]
