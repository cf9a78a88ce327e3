"""A request's text as its tokens arrive, in time proportional to the new tokens.

Decoding the whole output again on every update costs O(length) per update, O(length^2) per
request, on the server's event loop. Only a window is decoded instead: from the first token of
the last piece already sent (``prefix``) to the end. The same window's start is decoded without
the new tokens, so whatever a tokenizer does at the start of a decode (a SentencePiece word's
leading space dropped) happens to both, and the difference is exactly the new text. A window
that ends inside a multi-byte character (byte-level or byte-fallback tokens) decodes to U+FFFD
and waits for the rest.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    """``push(tokens)`` returns the text those tokens add (possibly empty while a character is
    incomplete); the pieces join to what decoding every token at once gives."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: the first token of the last piece sent
        self.read = 0  # tokens whose text has been sent

    def push(self, tokens: list[int]) -> str:
        self.ids.extend(tokens)
        if self.tokenizer is None:
            return ""
        sent = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(sent) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(sent) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""
