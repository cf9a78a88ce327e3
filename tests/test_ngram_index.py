"""The incremental n-gram index against the scan it replaces, over growing random token lists."""

from __future__ import annotations

import random

import pytest

from specdecode_worker.engine.speculation.ngram_index import ContextGuesses, NgramIndex
from specdecode_worker.engine.speculation.speculative import ngram_match


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


def test_context_guesses_class_by_the_lookup_and_skip_requests_that_may_not_draft():
    """A request's guess and class are the lookup's first token and matched length, as the scan
    gives them; one whose cap is 0 is not looked up (no guess, class 0) and keeps no index."""

    class Req:
        def __init__(self, rid, ids):
            self.rid, self.all_ids = rid, ids

    copying, held = Req(1, [5, 6, 7, 8, 5, 6, 7]), Req(2, [5, 6, 7, 8, 5, 6, 7])
    guesses = ContextGuesses(4)
    proposal, n = ngram_match(copying.all_ids, 1, 4)
    assert guesses.guess([copying, held], [4, 0]) == ([proposal[0], None], [n, 0])
    assert n == 3 and proposal == [8]
    assert set(guesses._indexes._indexes) == {1}
