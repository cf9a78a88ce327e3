"""The speculation policy on its own: acceptance estimates, the cost model and the draft lengths it picks."""

from __future__ import annotations

import pytest

from specdecode_worker.engine.spec_policy import Acceptance, CostCurve, SpecPolicy, StepCost


def overhead_bound(rate: float = 0.0) -> StepCost:
    """A round costs 1 + 0.1 per verify token: extra tokens are cheap, as on a GPU at low load."""
    return StepCost(CostCurve({1: 1.1, 100: 11.0}, rate=rate))


def half_a_step_per_token() -> StepCost:
    """Each verify token costs half a plain step: a draft token pays when kept over half the time."""
    return StepCost(CostCurve({1: 1.0, 101: 51.0}, rate=0.0))


def compute_bound() -> StepCost:
    """Free up to 8 tokens a pass, then linear: a batch of 16 pays for every draft token."""
    return StepCost(CostCurve({1: 1.0, 8: 1.0, 128: 16.0}, rate=0.0))


def run(policy: SpecPolicy, rids: list[int], rounds: int, accept) -> list[list[int]]:
    """``rounds`` rounds where request r accepts ``accept(r, k)`` of its k drafts; the ks chosen."""
    chosen = []
    for _ in range(rounds):
        ks = policy.draft_lengths(rids, [policy.max_draft] * len(rids))
        accepted = [accept(rid, k) for rid, k in zip(rids, ks)]
        policy.record(rids, ks, ks, accepted, 1.0)
        chosen.append(ks)
    return chosen


def test_acceptance_counts_positions_up_to_the_first_rejection():
    est = Acceptance(4, prior=0.5, prior_weight=2.0, decay=1.0)
    est.observe(proposed=4, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 never judged
    # Each position's prior is the rate before it; position 4, never judged, is position 3's rate.
    assert est.rates() == pytest.approx([2 / 3, 7 / 9, 14 / 27, 14 / 27])
    assert est.gains(3) == pytest.approx([2 / 3, 14 / 27, 14 / 27 * 14 / 27])


def test_cost_curve_interpolates_and_moves_toward_measurements():
    curve = CostCurve({1: 1.0, 9: 2.0}, rate=0.5)
    assert curve(5) == pytest.approx(1.5)
    curve.update(5, 2.5)  # 1.0 too fast, shared by both neighbours
    assert curve(5) == pytest.approx(2.0)


def test_speculation_turns_off_when_acceptance_collapses_and_returns_when_it_comes_back():
    policy = SpecPolicy("adaptive", "NGRAM", 4, half_a_step_per_token(), probe_every=8)
    good = run(policy, [1], 20, lambda rid, k: k)
    assert good[-1] == [4], good
    collapsed = run(policy, [1], 30, lambda rid, k: 0)
    assert collapsed[-1] == [0]
    first_off = next(i for i, ks in enumerate(collapsed) if ks == [0])
    assert first_off <= 6, collapsed
    # Held at 0, it still probes with one draft now and then, and nothing more.
    assert {ks[0] for ks in collapsed[first_off:]} <= {0, 1} and [1] in collapsed[first_off:]
    recovered = run(policy, [1], 40, lambda rid, k: k)
    assert recovered[-1] == [4], recovered


def test_load_backs_speculation_off_when_verify_tokens_are_paid_for():
    """Acceptance 0.6 per token pays at batch 1 (extra tokens free) but not at 16 (each costs a share)."""
    def accept(_rid, k):
        return min(k, 1)  # the first draft usually kept, the rest rejected: about 0.5 per position

    alone = SpecPolicy("adaptive", "STANDALONE", 4, compute_bound())
    assert run(alone, [1], 20, accept)[-1][0] >= 1
    busy = SpecPolicy("adaptive", "STANDALONE", 4, compute_bound())
    assert run(busy, list(range(16)), 20, accept)[-1] == [0] * 16


def test_requests_get_their_own_lengths_by_their_own_acceptance():
    policy = SpecPolicy("adaptive", "NGRAM", 4, overhead_bound(), probe_every=1000)
    ks = run(policy, [1, 2], 20, lambda rid, k: k if rid == 1 else 0)[-1]
    assert ks == [4, 0]


def test_uniform_algorithms_pick_one_length_from_their_choices():
    policy = SpecPolicy("adaptive", "EAGLE", 4, overhead_bound(), per_request=False, choices=(0, 4))
    assert run(policy, [1, 2], 10, lambda rid, k: k)[-1] == [4, 4]
    assert run(policy, [1, 2], 20, lambda rid, k: 0)[-1] == [0, 0]


def test_request_caps_hold_in_both_modes():
    for mode in ("fixed", "adaptive"):
        policy = SpecPolicy(mode, "NGRAM", 4, overhead_bound())
        ks = policy.draft_lengths([1, 2, 3], [0, 2, 9])
        assert ks[0] == 0 and ks[1] <= 2 and ks[2] <= 4
    assert SpecPolicy("fixed", "NGRAM", 4, overhead_bound()).draft_lengths([1, 2], [4, 4]) == [4, 4]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="adaptive, fixed"):
        SpecPolicy("sometimes", "NGRAM", 4, overhead_bound())
