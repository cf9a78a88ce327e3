"""A request's grammar (structured outputs): which tokens its output may take next.

``TokenGrammar`` wraps a matcher with llguidance's interface (``validate_tokens``,
``consume_tokens``, ``deep_copy``, ``compute_logit_bias``, ``is_stopped``), built by the server from
a JSON schema; the engine only asks it for masks and tells it the tokens committed.

Under speculation a verify row scores the token after some of the round's proposals, so its mask is
the grammar's state after them: a copy of the matcher consumes the proposals and a mask is read at
each step, so the request's own matcher only ever holds committed tokens. (A copy rather than a
rollback: a matcher that reached the grammar's end does not roll back reliably.) A proposal the
grammar refuses is never consumed (a matcher that consumed one would stay in error): its own row
already masks it, so verification rejects it, and the rows after it are never read.
"""

from __future__ import annotations

from typing import Any

import torch


class TokenGrammar:
    def __init__(self, matcher: Any, vocab_size: int, source: str | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size  # the target's logits width; tokens past the tokenizer's are never allowed
        self.source = source  # the llguidance grammar it was built from: an engine process rebuilds it from this

    def mask(self) -> torch.Tensor:
        """``[V]`` bool: the tokens allowed after the committed output."""
        return self._mask_of(self.matcher)

    def mask_after(self, matcher: Any) -> torch.Tensor:
        """The mask of a copy of this grammar's matcher (one that follows a draft's proposals)."""
        return self._mask_of(matcher)

    def _mask_of(self, matcher: Any) -> torch.Tensor:
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) != 0
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        width = min(self.vocab_size, allowed.numel())
        out[:width] = allowed[:width]
        return out

    def masks_along(self, path: list[int]) -> torch.Tensor:
        """``[len(path) + 1, V]``: row j is the mask after ``path[:j]``; rows past the first token
        the grammar refuses allow everything (they are never read)."""
        rows = torch.ones(len(path) + 1, self.vocab_size, dtype=torch.bool)
        rows[0] = self.mask()
        ahead = self.matcher.deep_copy()
        for j in range(ahead.validate_tokens(path) if path else 0):
            ahead.consume_tokens([path[j]])
            rows[j + 1] = self._mask_of(ahead)
        return rows

    def tree_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """``[n, V]``: node x's row is the mask after the tokens on its path from the root (the
        root, node 0, is the last committed token: its path is empty)."""
        rows = torch.ones(len(tokens), self.vocab_size, dtype=torch.bool)
        for x in range(len(tokens)):
            path, y = [], x
            while y != 0:
                path.append(tokens[y])
                y = parents[y]
            path.reverse()
            if self.matcher.validate_tokens(path) < len(path):
                continue  # an ancestor's row masks this path's refused token: verification stops before it
            ahead = self.matcher.deep_copy()
            ahead.consume_tokens(path)
            rows[x] = self._mask_of(ahead)
        return rows

    def commit(self, tokens: list[int]) -> None:
        """The request's output grew by ``tokens`` (each allowed by a mask of this grammar)."""
        if tokens:
            self.matcher.consume_tokens(tokens)

    @property
    def complete(self) -> bool:
        """The output matches the whole grammar and no token may follow."""
        return self.matcher.is_stopped()
