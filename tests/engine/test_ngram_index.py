"""The incremental n-gram index against the scan it replaces, over growing random token lists."""

from __future__ import annotations

import random

import pytest

from specdecode_worker.engine.speculation.ngram_index import NgramIndex
from specdecode_worker.engine.speculation.reference import ngram_match


@pytest.mark.parametrize("seed", range(4))
def test_the_index_answers_as_the_scan_while_tokens_are_committed(seed):
    """Small vocabularies make long repeated suffixes common; several tokens may be committed
    between two lookups (an accepted chain), or none (a lookup repeated in the same round)."""
    rng = random.Random(seed)
    for _ in range(60):
        vocab, max_n = rng.choice([2, 3, 5, 50]), rng.randint(1, 5)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        index = NgramIndex(max_n)
        for _ in range(50):
            k, min_n = rng.randint(0, 5), rng.randint(1, 3)
            assert index.match(tokens, k, min_n) == ngram_match(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)
            tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]


def test_tokens_that_do_not_extend_the_last_call_are_indexed_again():
    index = NgramIndex(2)
    assert index.match([1, 2, 3, 1, 2], k=1) == ([3], 2)
    assert index.match([1, 2], k=1) == ([], 0)  # shorter: nothing from the longer list survives
    assert index.match([1, 2, 1], k=2) == ([2, 1], 1)
