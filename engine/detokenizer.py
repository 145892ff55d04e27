"""Incremental detokenization: text grows token by token without splitting
a UTF-8 character across tokens (byte-level BPE and byte-fallback pieces
decode to U+FFFD until their character is complete)."""

# A few prompt tokens give the decoder the context it needs (e.g. the
# SentencePiece leading space of the first output token).
_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly completed text."""
        if self.tokenizer is None:
            return ""
        self.ids.extend(token_ids)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""
