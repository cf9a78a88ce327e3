"""benchmarks/draft_confidence.py's within-round stop: what a chain keeps when it stops early."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.draft_confidence import Chain  # noqa: E402


def test_a_chain_stops_where_the_product_of_its_probabilities_falls_below_the_threshold():
    chain = Chain([0.9, 0.5, 0.9, 0.9], kept=3, match=4, committed=0.9)  # products 0.9, 0.45, 0.405, 0.3645
    assert chain.stopped(0.0) == (4, 4, 3)  # no stop: every pass made, every token verified
    assert chain.stopped(0.3) == (4, 4, 3)
    # Below 0.42 at the third token: its pass is made, the token dropped, 2 of the 3 kept remain.
    assert chain.stopped(0.42) == (3, 2, 2)
    assert chain.stopped(0.95) == (1, 0, 0)  # the first pass only: nothing verified


def test_a_stop_after_the_first_rejection_keeps_what_was_kept():
    assert Chain([0.8, 0.2, 0.9, 0.9], kept=1, match=2, committed=0.5).stopped(0.5) == (2, 1, 1)
