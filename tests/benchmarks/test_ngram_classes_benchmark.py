"""benchmarks/ngram_classes.py: acceptance by matched-suffix length, checked on a hand-worked case."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.ngram_classes import class_rates  # noqa: E402


def test_class_rates_follow_the_lookup_a_round_would_make():
    # Position 0: the context ends in [1, 2], seen at the start, so the proposal is [3, 1, 2]
    # (class 2) and its first token is the answer's 3. Position 1: the context ends in [1, 2, 3],
    # seen at the start, so the proposal is [1, 2, 3] (class 3) and the answer's 9 rejects it.
    assert class_rates([[1, 2, 3, 1, 2]], [[3, 9]]) == {2: (1, 1.0, 1.0), 3: (1, 0.0, 0.0)}
    # Nothing repeats: no match at either position.
    assert class_rates([[5, 6]], [[7, 8]]) == {0: (2, 0.0, 0.0)}
