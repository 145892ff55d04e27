"""A thin tokenizer over the `tokenizers` library, built from a tokenizer.json or
from a GGUF file's `tokenizer.ggml.*` metadata.

The GGUF builders reproduce, fact for fact, what transformers'
`integrations/gguf/gguf_tokenizer_mapping.py` builds (normalizer,
pre-tokenizer, decoder, BPE flags, merges, added tokens, BOS/EOS
post-processor), so ids and text equal `AutoTokenizer.from_pretrained(dir,
gguf_file=...)`. tests/test_tokenizer.py checks the serialized result against
transformers' own, so a drift in either shows up there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

_SPECIAL_NAMES = ("bos", "eos", "unk", "pad")

# Pre-tokenizer splits by tokenizer.ggml.pre, as transformers maps them. A
# `pre` not listed (e.g. SmolLM2's "smollm", "default") keeps the builder's own
# pre-tokenizer (plain GPT-2 ByteLevel regex for byte-level vocabularies).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}

_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


class TokenizerError(ValueError):
    pass


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def generate_merges(vocab: dict[str, int], vocab_scores: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary (a GGUF sentencepiece vocab has none).

    Copied in behaviour from transformers' `tokenization_utils_base.generate_merges`:
    every split of a token into two in-vocab pieces, ordered by the token's
    score (descending when scores are given), ties by piece lengths; the sort
    is stable, so equal keys keep vocabulary order.
    """
    reverse = vocab_scores is not None
    scores = dict(vocab_scores) if reverse else vocab
    merges = []
    for merge, piece_score in scores.items():
        local = []
        for index in range(1, len(merge)):
            piece_l, piece_r = merge[:index], merge[index:]
            if piece_l in vocab and piece_r in vocab:
                local.append((piece_l, piece_r, piece_score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda val: (val[2], len(val[0]), len(val[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


class Tokenizer:
    def __init__(
        self,
        backend: _Backend,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
    ):
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id = self._id_or_none(bos_token)
        self.eos_token_id = self._id_or_none(eos_token)
        self.pad_token_id = self._id_or_none(pad_token)
        self.unk_token_id = self._id_or_none(unk_token)
        special = {tok.content for tok in backend.get_added_tokens_decoder().values() if tok.special}
        special.update(t for t in (bos_token, eos_token, pad_token, unk_token) if t is not None)
        self.all_special_tokens = special
        self.all_special_ids = {i for i in map(backend.token_to_id, special) if i is not None}

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend(self) -> _Backend:
        return self._tok

    @property
    def vocab_size(self) -> int:
        # len(tokenizer) in transformers: the model vocab plus any added token beyond it
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> list[str] | str | None:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> list[int | None] | int | None:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_file(cls, tokenizer_json_path: str | Path, tokenizer_config: dict | None = None) -> "Tokenizer":
        """tokenizer.json (+ the tokenizer_config.json dict) as transformers' TokenizersBackend reads them.

        The tokenizer.json pipeline is used as written. (transformers 5 rebuilds
        normalizer/pre-tokenizer/decoder for some `tokenizer_class` values, e.g.
        LlamaTokenizer; for the models those classes exist for, that rebuild
        reproduces the file.)
        """
        backend = _Backend.from_file(str(tokenizer_json_path))
        cfg = dict(tokenizer_config or {})
        named = {name: _token_text(cfg.get(f"{name}_token")) for name in _SPECIAL_NAMES}

        # Tokens tokenizer_config declares that tokenizer.json lacks, then the
        # named special tokens, are added the way transformers adds them.
        present = {tok.content for tok in backend.get_added_tokens_decoder().values()}
        extra = []
        for _, spec in sorted(((int(k), v) for k, v in (cfg.get("added_tokens_decoder") or {}).items())):
            content = _token_text(spec)
            if content and content not in present:
                extra.append(_added_token_from_config(spec))
                present.add(content)
        for token in named.values():
            if token is not None and token not in present:
                extra.append(AddedToken(token, special=True, normalized=False))
                present.add(token)
        if extra:
            backend.add_tokens(extra)

        # transformers 5 drops tokenizer_config's add_bos_token/add_eos_token
        # whenever a tokenizer.json exists: the file's post-processor decides,
        # and a file without one adds nothing.
        if backend.post_processor is None:
            _set_bos_eos_processor(backend, named["bos"], named["eos"], False, False)
        return cls(backend, named["bos"], named["eos"], named["pad"], named["unk"])

    @classmethod
    def from_gguf(cls, metadata: Any) -> "Tokenizer":
        """From GGUF metadata: a dict of key -> value, or a gguf.GGUFReader."""
        meta = metadata if isinstance(metadata, dict) else gguf_metadata(metadata)
        kind = meta.get("tokenizer.ggml.model")
        arch = meta.get("general.architecture")
        tokens = meta.get("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise TokenizerError("GGUF has no tokenizer.ggml.model/tokens metadata")
        token_type = list(meta.get("tokenizer.ggml.token_type") or [])

        if kind == "gpt2":
            backend, builder_specials = _byte_level(tokens, meta)
        elif kind == "llama" and arch in _GEMMA_ARCHS:
            backend, builder_specials = _gemma(tokens, meta)
        elif kind == "llama":
            backend, builder_specials = _sentencepiece(tokens, meta)
        else:
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} (architecture {arch!r}) is not supported; supported: gpt2, llama"
            )

        def token_of(key: str) -> str | None:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        named = {
            "bos": token_of("bos_token_id"),
            "eos": token_of("eos_token_id"),
            "unk": token_of("unknown_token_id"),
            "pad": token_of("padding_token_id"),
        }

        vocab = backend.get_vocab(with_added_tokens=False)
        # 1. The builder class's own default special tokens (e.g. GemmaTokenizer's
        #    <mask>), added as special -- only those the vocabulary has, so the
        #    vocab never grows past what the model's embedding covers.
        added = [AddedToken(t, special=True, normalized=False) for t in builder_specials if t in vocab]
        # 2. Control tokens as special, user-defined ones as plain added tokens
        #    (llama.cpp always matches both whole). In a byte-level vocab a
        #    "control" token spelled outside the byte alphabet is a llama.cpp
        #    mislabel and is skipped, as transformers does.
        spelled = set(bytes_to_unicode().values()) if kind == "gpt2" else None
        for token, ttype in zip(tokens, token_type):
            if ttype == _CONTROL and (spelled is None or set(token) <= spelled):
                added.append(AddedToken(token, special=True, normalized=False))
        user = [
            AddedToken(token, special=False, normalized=False)
            for token, ttype in zip(tokens, token_type)
            if ttype == _USER_DEFINED and token in vocab
        ]
        # 3. The named specials this file points at, if not already added.
        seen = {t.content for t in added} | {t.content for t in user}
        for token in named.values():
            if token is not None and token not in seen:
                added.append(AddedToken(token, special=True, normalized=False))
                seen.add(token)
        if added:
            backend.add_special_tokens(added)
        if user:
            backend.add_tokens(user)

        split = GGUF_PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
        if split is not None:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )

        # llama.cpp adds BOS to a sentencepiece vocab whose file does not say otherwise
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        _set_bos_eos_processor(backend, named["bos"], named["eos"], bool(add_bos), bool(add_eos))
        return cls(backend, named["bos"], named["eos"], named["pad"], named["unk"])


def _added_token_from_config(spec: Any) -> AddedToken:
    if isinstance(spec, dict):
        return AddedToken(
            spec["content"],
            single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", not spec.get("special", False)),
            special=spec.get("special", False),
        )
    return AddedToken(str(spec), special=True, normalized=False)


def _set_bos_eos_processor(backend: _Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """transformers' TokenizersBackend.update_post_processor."""
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = []
    if add_bos:
        special.append((bos, backend.token_to_id(bos)))
    if add_eos:
        special.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _merges(meta: dict, vocab: dict[str, int], vocab_scores: dict[str, float] | None) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        return [tuple(m.split(" ")) for m in merges]
    return generate_merges(vocab, vocab_scores)


def _byte_level(tokens: list[str], meta: dict) -> tuple[_Backend, list[str]]:
    """GPT-2 style byte-level BPE (transformers' GPT2Tokenizer)."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens llama.cpp stored as raw text (not in the byte alphabet) are respelled.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = _merges(meta, vocab, None)
    backend = _Backend(
        BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
            fuse_unk=False)
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend, ["<|endoftext|>"]  # GPT2Tokenizer's default unk/bos/eos


def _gemma(tokens: list[str], meta: dict) -> tuple[_Backend, list[str]]:
    """Gemma sentencepiece-as-BPE (transformers' GemmaTokenizer + its GGUF fixes).

    Whitespace-only tokens are stored as real spaces in the GGUF but looked up
    as U+2581 runs; and merges are rebuilt in file order (Gemma's scores do
    not follow its merge order).
    """
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(respelled)}
    positions = {t: -i for i, t in enumerate(respelled)}
    merges = _merges(meta, vocab, positions)
    backend = _Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None,
                           byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    return backend, ["<unk>", "<bos>", "<eos>", "<pad>", "<mask>"]


def _sentencepiece(tokens: list[str], meta: dict) -> tuple[_Backend, list[str]]:
    """Llama-style sentencepiece-as-BPE (transformers' LlamaTokenizer, legacy=False)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = meta.get("tokenizer.ggml.scores")
    vocab_scores = dict(zip(tokens, scores)) if scores is not None else None
    merges = _merges(meta, vocab, vocab_scores)
    backend = _Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return backend, ["<unk>", "<s>", "</s>"]


def gguf_metadata(reader: Any, skip: Iterable[str] = ()) -> dict:
    """A GGUFReader's key/value metadata as plain Python values (strings decoded, arrays as lists)."""
    skip = set(skip)
    out = {}
    for key, field in reader.fields.items():
        if key in skip or not field.types:
            continue
        out[key] = field.contents()
    return out


def load_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json merged over special_tokens_map.json (older repos keep bos/eos there)."""
    cfg: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if path.exists():
            cfg.update(json.loads(path.read_text(encoding="utf-8")))
    return cfg
