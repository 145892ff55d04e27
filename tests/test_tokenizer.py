"""Our tokenizer against transformers' for the same source: built from each real
GGUF (byte-level BPE for SmolLM2, sentencepiece-style BPE for Gemma 3) and
from a tokenizer.json directory."""

from __future__ import annotations

import json
import random

import pytest

from fixtures_models import REAL_MODELS, corpus, gguf_path, hf_tokenizer
from model_zoo.resolve import open_model
from model_zoo.tokenizer import Tokenizer, generate_merges, load_tokenizer_config


@pytest.fixture(scope="module", params=REAL_MODELS)
def pair(request):
    name = request.param
    return name, open_model(name).tokenizer, hf_tokenizer(name)


def test_backend_is_built_like_transformers(pair):
    """Same normalizer, pre-tokenizer, post-processor, decoder, BPE model (vocab, merges, flags), added tokens."""
    _, ours, theirs = pair
    a, b = json.loads(ours.backend.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model"):
        assert a[part] == b[part], part
    key = lambda t: t["id"]  # noqa: E731
    assert sorted(a["added_tokens"], key=key) == sorted(b["added_tokens"], key=key)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(pair, add_special_tokens):
    _, ours, theirs = pair
    texts = corpus()
    for text in texts:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == theirs.encode(
            text, add_special_tokens=add_special_tokens
        ), repr(text[:80])
    assert ours.encode_batch(list(texts[:10]), add_special_tokens) == [
        theirs.encode(t, add_special_tokens=add_special_tokens) for t in texts[:10]
    ]


def test_bos_is_added_as_the_file_says(pair):
    name, ours, _ = pair
    ids = ours.encode("hi")
    if name == "gemma3-270m":  # tokenizer.ggml.add_bos_token = true
        assert ids[0] == ours.bos_token_id == 2 and ours.encode("hi", add_special_tokens=False) == ids[1:]
    else:  # SmolLM2: add_bos_token = false
        assert name == "smollm2-135m"
        assert ours.bos_token_id not in ids and ours.encode("hi", add_special_tokens=False) == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers(pair, skip_special_tokens):
    _, ours, theirs = pair
    sequences = [theirs.encode(text) for text in corpus()]
    rng = random.Random(0)
    vocab = len(theirs)
    special = sorted(ours.all_special_ids)
    for _ in range(200):  # random ids: split UTF-8 sequences, byte-fallback tokens, specials in the middle
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        seq.insert(rng.randrange(len(seq) + 1), rng.choice(special))
        sequences.append(seq)
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == theirs.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


def test_round_trip_of_plain_text(pair):
    _, ours, _ = pair
    for text in ["Hello, world!", "中文 and emoji 🤖", "line\n\n  indented\ttab", "First Citizen:\nSpeak."]:
        assert ours.decode(ours.encode(text)) == text


def test_tokens_and_special_attributes_equal_transformers(pair):
    _, ours, theirs = pair
    ids = theirs.encode(corpus()[12] + corpus()[17])
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token",
                 "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.vocab_size == len(theirs)
    # ours lists every special (control) token -- what decode(skip_special_tokens=True) drops --
    # which includes transformers' named ones
    assert set(theirs.all_special_ids) <= ours.all_special_ids
    for idx in sorted(ours.all_special_ids)[:50]:
        assert theirs.decode([idx], skip_special_tokens=True) == ""
        assert theirs.decode([idx], skip_special_tokens=False) != ""


def test_special_tokens_are_matched_whole(pair):
    name, ours, _ = pair
    marker = "<|im_start|>" if name == "smollm2-135m" else "<start_of_turn>"
    idx = ours.convert_tokens_to_ids(marker)
    assert idx is not None and idx in ours.all_special_ids
    assert ours.encode(f"a{marker}b", add_special_tokens=False).count(idx) == 1


# ------------------------------------------------------------- tokenizer.json


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smol-tokenizer")
    hf_tokenizer("smollm2-135m").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("variant", ["as-saved", "config-add-bos", "no-post-processor"])
def test_from_file_equals_transformers(saved_dir, tmp_path, variant):
    """transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists; so must we."""
    from transformers import AutoTokenizer

    folder = saved_dir
    if variant != "as-saved":
        folder = tmp_path / variant
        folder.mkdir()
        for f in saved_dir.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["add_bos_token"] = True
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        if variant == "no-post-processor":
            tok = json.loads((folder / "tokenizer.json").read_text())
            tok["post_processor"] = None
            (folder / "tokenizer.json").write_text(json.dumps(tok))
    theirs = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_file(folder / "tokenizer.json", load_tokenizer_config(folder))
    for text in corpus():
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, repr(text[:80])
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)
    assert ours.bos_token_id == 1 and ours.encode("x")[0] != ours.bos_token_id


def test_from_file_without_config_has_no_named_specials(saved_dir):
    ours = Tokenizer.from_file(saved_dir / "tokenizer.json")
    assert ours.bos_token is None and ours.eos_token_id is None
    assert ours.encode("Hello world") == [19556, 905]


# -------------------------------------------------------------------- merges


def test_generate_merges_matches_transformers():
    from transformers.tokenization_utils_base import generate_merges as reference

    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "aa", "aaa"])}
    assert generate_merges(vocab) == reference(vocab)
    scores = {t: -i for t, i in vocab.items()}
    assert generate_merges(vocab, scores) == reference(vocab, scores)


def test_gguf_tokenizer_rejects_unknown_model():
    from model_zoo.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"],
                             "general.architecture": "bert"})
    assert gguf_path("smollm2-135m").exists()


# ------------------------------------------------------- tiny synthetic GGUFs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_gguf_tokenizer_equals_transformers(tmp_path, kind):
    """The two builders the real files do not cover: a bare byte-level vocab, and llama-style
    sentencepiece (Metaspace, byte fallback, merges rebuilt from scores)."""
    import gguf
    from transformers import AutoTokenizer

    from fixtures_models import write_tiny_gguf

    path = tmp_path / f"tiny-{kind}.gguf"
    write_tiny_gguf(path, tokenizer=kind)
    ours = Tokenizer.from_gguf(gguf.GGUFReader(path))  # a reader works as well as a metadata dict
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    a, b = json.loads(ours.backend.to_str()), json.loads(theirs.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model"):
        assert a[part] == b[part], part
    texts = ["hello world", " hello  world ", "abc ab a", "héllo wörld 🤖", "<s>hello</s>", "x\ny z!", ""]
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add) == theirs.encode(text, add_special_tokens=add), (text, add)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, False) == theirs.decode(ids, skip_special_tokens=False)
    if kind == "llama":
        assert ours.encode("hello")[0] == ours.bos_token_id == 1  # llama default: add BOS
        assert "<0xC3>" in ours.convert_ids_to_tokens(ours.encode("é"))  # byte fallback
