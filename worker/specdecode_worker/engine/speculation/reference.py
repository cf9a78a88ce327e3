"""The n-gram lookup for one request, written plainly as a scan of its tokens: the reference whose
answers the serving index (``ngram_index.NgramIndex``) must give, and that tests and benchmarks
use to predict a round's proposals. Serving never calls it.
"""

from __future__ import annotations


def ngram_match(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> tuple[list[int], int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix,
    and that suffix's length (0: no suffix of ``min_n`` tokens or more occurs earlier)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k], n
    return [], 0


def ngram_propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    return ngram_match(tokens, k, max_n, min_n)[0]
