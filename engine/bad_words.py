"""vLLM's `bad_words`: words a request never generates.

Each word becomes the token sequences that spell it at the start of a text
and after a space (byte-level BPE tokenizers spell the two differently;
SentencePiece ones often alike). vLLM keeps the spaced spelling only when it
has as many tokens as the plain one, so a word like " Eldrador" (2 tokens
after a space, 3 without on SmolLM2) stays allowed mid-text there; here
every distinct spelling is banned. At each step a sequence's last token is
banned when the output so far ends with the rest of it: a one-token word is
never sampled, a longer one cannot be completed.
"""
import numpy as np

from engine.errors import InvalidRequest


def token_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    if tokenizer is None:
        raise InvalidRequest("bad_words needs the model's tokenizer (this model has none)")
    seqs: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequest(f"bad_words: {word!r} is no token of this model's vocabulary")
        seqs.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced != plain:
            seqs.append(spaced)
    return seqs


def banned_now(seqs: list[list[int]], output: np.ndarray) -> list[int]:
    """The tokens that would complete one of seqs after `output` (the tokens generated so far)."""
    n = len(output)
    banned = []
    for s in seqs:
        k = len(s) - 1
        if k == 0 or (k <= n and output[n - k:].tolist() == s[:-1]):
            banned.append(s[-1])
    return banned
