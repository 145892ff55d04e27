"""Fill-in-the-middle prompts for code models: the text before and after a
gap, laid out with the model's own prefix / suffix / middle tokens (the
prefix-suffix-middle order those models train on), so that what it
generates is the middle. The tokens are found by name in the vocabulary,
the names the code model families use (llama.cpp's fallback when a GGUF
does not name them).

`infill_prompt` is llama.cpp's /infill layout: other files of the project
(input_extra) before the gap, as the repo-level format of the models trained
on it (Qwen2.5-Coder, StarCoder2: repo name, then each file after a file
separator), and the prefix / suffix cut to fit a batch 3:1."""

# (prefix, suffix, middle) token names, by family.
FIM_NAMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),     # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),           # StarCoder / StarCoder2, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),       # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),                             # CodeLlama
    ("<PRE>", "<SUF>", "<MID>"),
)
# (repository, file separator) token names of the families trained on whole repositories.
REPO_NAMES = (
    ("<|repo_name|>", "<|file_sep|>"),                          # Qwen2.5-Coder, Qwen3-Coder
    ("<reponame>", "<file_sep>"),                               # StarCoder2
)
# llama.cpp's chunk separator where a model has no file separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


def _named(tokenizer, families) -> tuple[int, ...] | None:
    lookup = getattr(tokenizer, "convert_tokens_to_ids", None)     # (a tokenizer without names has none)
    if lookup is None:
        return None
    for names in families:
        ids = [lookup(n) for n in names]
        if None not in ids:
            return tuple(ids)
    return None


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """The model's (prefix, suffix, middle) token ids, or None: no fill-in-the-middle."""
    return _named(tokenizer, FIM_NAMES)


def repo_token_ids(tokenizer) -> tuple[int, int] | None:
    """The model's (repository name, file separator) token ids, or None."""
    return _named(tokenizer, REPO_NAMES)


def fim_prompt(tokenizer, ids: tuple[int, int, int], prefix: str | list[int], suffix: str) -> list[int]:
    """[bos] <prefix> prefix <suffix> suffix <middle> (prefix: text or token ids)."""
    pre, suf, mid = ids
    bos = tokenizer.encode("", add_special_tokens=True)         # the tokenizer's own start, if any
    head = prefix if isinstance(prefix, list) else tokenizer.encode(prefix, add_special_tokens=False)
    return bos + [pre] + head + [suf] + tokenizer.encode(suffix, add_special_tokens=False) + [mid]


def _ids(tokenizer, text: str | list[int]) -> list[int]:
    return list(text) if isinstance(text, list) else tokenizer.encode(text, add_special_tokens=False)


def infill_prompt(tokenizer, ids: tuple[int, int, int], prefix: str | list[int], suffix: str | list[int],
                  prompt: str | list[int] = "", extra: list[tuple[str, str]] = (), n_batch: int = 2048,
                  n_predict: int = 0, n_ctx: int = 4096) -> list[int]:
    """llama.cpp's /infill prompt: [bos] extra <prefix> prefix prompt <suffix>
    suffix <middle>. `prompt` is the text just before the gap (an editor's
    current line) after the prefix. The prefix keeps its last 3/4 of n_batch
    tokens, the suffix its first 1/4 less the prompt's; extra (filename, text)
    chunks keep their last tokens that leave room for the batch and twice
    n_predict in n_ctx. With repository tokens the chunks are files of
    `myproject`, each after a file separator, and the gap's file is `filename`
    (llama.cpp's placeholder names); otherwise snippet separators."""
    pre, suf, mid = ids
    repo = repo_token_ids(tokenizer)
    head, tail, line = _ids(tokenizer, prefix), _ids(tokenizer, suffix), _ids(tokenizer, prompt)
    context: list[int] = []
    if repo is not None:
        context += [repo[0]] + _ids(tokenizer, "myproject\n")
    for filename, text in extra:
        if repo is not None:
            context += [repo[1]] + _ids(tokenizer, filename + "\n")
        else:
            context += _ids(tokenizer, SNIPPET_SEPARATOR)
        context += _ids(tokenizer, text)
    if repo is not None:
        context += [repo[1]] + _ids(tokenizer, "filename\n")
    n_head = min(len(head), 3 * (n_batch // 4))
    n_tail = min(len(tail), max(0, n_batch // 4 - (2 + len(line))))
    n_context = min(max(0, n_ctx - n_batch - 2 * n_predict), len(context))
    bos = tokenizer.encode("", add_special_tokens=True)
    return (bos + context[len(context) - n_context:] + [pre] + head[len(head) - n_head:] + line
            + [suf] + tail[:n_tail] + [mid])
