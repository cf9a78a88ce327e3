"""The algorithm registry: every served algorithm declared once, agreeing with the planner's rules."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from specdecode_worker.contract import EAGLE_ALGORITHMS, SERVED_ALGORITHMS  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.engine.speculation.algorithms import ALGORITHMS, Drafter, algorithm  # noqa: E402
from specdecode_worker.planner.plan import FEATURE_HIDDENS  # noqa: E402


def test_every_served_algorithm_is_declared_once():
    assert sorted(ALGORITHMS) == sorted(SERVED_ALGORITHMS)
    assert all(name == a.name for name, a in ALGORITHMS.items())


def test_the_target_features_a_drafter_reads_are_the_ones_the_planner_prices():
    read = {name: a.feature_layers for name, a in ALGORITHMS.items() if a.reads_target_features}
    assert read == FEATURE_HIDDENS == {"EAGLE": 1, "EAGLE3": 3, "MTP": 1}


def test_the_draft_folder_rules():
    needs = sorted(n for n, a in ALGORITHMS.items() if a.needs_draft_folder)
    takes = sorted(n for n, a in ALGORITHMS.items() if a.takes_draft_folder)
    assert needs == sorted(["STANDALONE", *EAGLE_ALGORITHMS])
    assert takes == sorted(["STANDALONE", "MTP", *EAGLE_ALGORITHMS])
    assert [n for n, a in ALGORITHMS.items() if not a.drafts] == ["NONE"]
    assert algorithm("NGRAM").drafter is Drafter.LOOKUP and algorithm("NGRAM").draft_name is None


def test_an_unknown_algorithm_is_refused_with_the_served_ones():
    with pytest.raises(InputError, match=r"--algorithm MEDUSA: this engine serves NONE, STANDALONE, NGRAM"):
        algorithm("MEDUSA")
