"""Structured outputs: OpenAI's ``response_format`` as a grammar over the target's vocabulary.

Grammars come from llguidance: JSON schemas compile to a grammar in microseconds, token masks cost
tens of microseconds to a few milliseconds, and a matcher copies cheaply, which speculation needs
(``engine.grammar``). It is one dependency-free wheel, so it pins no torch or transformers version.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import llguidance
import llguidance.hf

from ..engine.grammar import TokenGrammar
from ..errors import InputError

FORMATS = "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'schema': {...}}}"


def grammar_source(response_format: Any) -> str | None:
    """The llguidance grammar a ``response_format`` asks for; None for plain text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                       "json_schema"):
        raise InputError(f"'response_format' must be {FORMATS}, got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise InputError("'response_format.json_schema' must be an object with a 'schema' (a JSON schema "
                             "object) and a 'name'")
        schema = spec.get("schema", {})
    try:
        # Compact output: no whitespace beyond what the schema asks for, as OpenAI answers.
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as exc:
        raise InputError(f"'response_format' holds a JSON schema this server cannot use: {exc}") from None


class _TokenBytes:
    """Each token's own text, for tokenizers llguidance cannot read directly (word-level ones);
    text is tokenized by longest match over those bytes, so it splits as the grammar sees tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        specials = set(tokenizer.all_special_ids)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(t for t in specials if t < vocab_size)
        # llguidance's convention: a special token's bytes are 0xFF and its name, so no text matches it.
        self.tokens = [b"\xff" + tokenizer.convert_ids_to_tokens(i).encode() if i in specials
                       else tokenizer.decode([i]).encode() if i < len(tokenizer) else b"\xff<unused>"
                       for i in range(vocab_size)]
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens))) if t and not t.startswith(b"\xff")}
        self._longest = max(map(len, self._ids), default=0)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if data[at:end] in self._ids:
                    out.append(self._ids[data[at:end]])
                    at = end
                    break
            else:
                return out  # bytes no token spells
        return out


@cache
def _grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError:
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size)),
                                      n_vocab=vocab_size)


def token_grammar(tokenizer: Any, vocab_size: int, source: str) -> TokenGrammar:
    """A fresh grammar (one per request: it holds the request's state). An InputError when the
    grammar is invalid or this vocabulary cannot begin an output that matches it."""
    if tokenizer is None:
        raise InputError("'response_format' needs the model's tokenizer; this model has none")
    lltok = _grammar_tokenizer(tokenizer, vocab_size)
    problem = llguidance.LLMatcher.validate_grammar(source, lltok)
    if problem:
        raise InputError(f"'response_format': {problem}")
    grammar = TokenGrammar(llguidance.LLMatcher(lltok, source), vocab_size, source)
    first = grammar.mask()  # a vocabulary that cannot spell the start leaves the matcher in error
    if grammar.matcher.is_error() or not first.any():
        raise InputError("'response_format': no token of this model's vocabulary can begin such an output")
    return grammar

