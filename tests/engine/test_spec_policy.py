"""The adaptive speculation policy against simulated rounds: a model ranks the draft lengths, and
measured speed decides whether to draft. Each simulated round takes what a step-time source says
(the truth), while the policy's model may say otherwise."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdecode_worker.engine.speculation.round_cost import RoundCost
from specdecode_worker.engine.speculation.spec_policy import Acceptance, SpecPolicy, bucket_of

from tests import policy_helpers

K = 4


def linear_cost(**terms) -> RoundCost:
    return policy_helpers.linear_cost(K, **terms)


def simulate(policy: SpecPolicy, rounds: int, *, requests: int, acceptance: float, draft_cost: float,
             seed: int = 0) -> list[list[int]]:
    """``rounds`` rounds of ``requests`` requests: a plain round takes 1 s; a drafting round takes
    ``draft_cost`` s, each draft token accepted with ``acceptance`` until the first rejection.
    Returns the draft lengths of every round."""
    rng = random.Random(seed)
    rids, chosen = list(range(requests)), []
    for _ in range(rounds):
        ks = policy.draft_lengths(rids, [K] * requests)
        accepted = []
        for k in ks:
            n = 0
            while n < k and rng.random() < acceptance:
                n += 1
            accepted.append(n)
        policy.record(rids, ks, ks, accepted, draft_cost if any(ks) else 1.0)
        chosen.append(ks)
    return chosen


def drafting_share(rounds: list[list[int]]) -> float:
    return sum(1 for ks in rounds if any(ks)) / len(rounds)


def test_drafting_at_a_measured_loss_stops_and_comes_back_when_the_cost_falls():
    """The model says drafting is free (it is not): rounds that draft cost 4x a plain one and keep
    half their tokens. Within a bounded number of rounds the policy stops drafting, and then
    drafts only as probes, within their budget of the time; when drafting gets cheap, it drafts
    again within a bounded number of rounds."""
    policy = SpecPolicy("adaptive", "STANDALONE", K, linear_cost(plain=1.0, per_draft_token=0.0))
    first = simulate(policy, 20, requests=1, acceptance=0.5, draft_cost=4.0)
    assert any(first[0]), "the model alone decides before anything is measured"
    settled = simulate(policy, 1000, requests=1, acceptance=0.5, draft_cost=4.0, seed=1)
    probes = [ks for ks in settled if any(ks)]
    # Each probe costs 3 s over a plain round: the budget (2% of the time) allows one per 150 rounds.
    assert len(probes) <= 1000 * policy.probe_budget / 3 + 1
    assert policy.speedups()["1"] < 1.0
    back = simulate(policy, 400, requests=1, acceptance=0.5, draft_cost=1.1, seed=2)
    since = next(i for i in range(len(back)) if drafting_share(back[i:]) > 0.9)
    assert since < 300
    assert policy.speedups()["1"] > 1.0
    assert policy.probes > 0


def test_a_correct_model_never_drafts_at_a_loss_even_before_measuring():
    """The model prices a drafting round at what it costs (4 plain ones) and acceptance at its
    prior: no round drafts but the rate-limited probes."""
    policy = SpecPolicy("adaptive", "STANDALONE", K, linear_cost(plain=1.0, fixed=3.0))
    rounds = simulate(policy, 500, requests=4, acceptance=0.5, draft_cost=4.0)
    assert drafting_share(rounds) <= 0.02


def test_a_cheap_accepted_draft_drafts_almost_every_round():
    """Drafting costs 10% more than a plain round and is nearly always accepted: the policy drafts
    K, with plain probes at most one round in ``probe_every`` after the first few."""
    policy = SpecPolicy("adaptive", "NGRAM", K, linear_cost(plain=1.0, fixed=0.1))
    rounds = simulate(policy, 500, requests=4, acceptance=0.95, draft_cost=1.1)
    assert drafting_share(rounds[20:]) >= 1 - 1 / policy.probe_every - 0.01
    assert all(ks == [K] * 4 for ks in rounds[20:] if any(ks))
    assert policy.speedups()["4-7"] > 2.0


def test_buckets_are_judged_apart():
    """Drafting pays at 1 request and loses at 8: each batch-size bucket keeps its own verdict."""
    policy = SpecPolicy("adaptive", "STANDALONE", K, None)  # no model: draft K until measured otherwise
    simulate(policy, 200, requests=1, acceptance=0.9, draft_cost=1.2)
    late = simulate(policy, 300, requests=8, acceptance=0.9, draft_cost=6.0)
    assert drafting_share(late[-150:]) < 0.03
    assert drafting_share(simulate(policy, 100, requests=1, acceptance=0.9, draft_cost=1.2)) > 0.9
    assert set(policy.speedups()) == {"1", "8-15"}


def test_plain_rounds_measured_at_one_batch_size_serve_every_bucket():
    """Plain speed is measured relative to the warm-up's plain rounds, so once it is known a new
    batch size drafts from its first round, with no plain probes of its own before the next
    periodic one."""
    policy = SpecPolicy("adaptive", "NGRAM", K, linear_cost(plain=1.0, fixed=0.1))
    simulate(policy, 40, requests=1, acceptance=0.95, draft_cost=1.1)
    probes = policy.probes
    late = simulate(policy, 20, requests=4, acceptance=0.95, draft_cost=1.1)
    assert any(late[0]) and sum(not any(ks) for ks in late) == policy.probes - probes <= 1  # the periodic one


def test_bucket_of_groups_batch_sizes_by_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 4, 4, 8, 8, 16]


def test_the_model_picks_the_length_that_maximises_tokens_per_second():
    """First-position acceptance 0.9 then 0.5 at every later one; each draft token costs 0.3 of a
    plain round: k = 1 gives 1.9 / 1.3 = 1.46, k = 2 gives 2.35 / 1.6 = 1.47, k = 3 gives
    2.575 / 1.9 = 1.36: the policy picks 2."""
    policy = SpecPolicy("adaptive", "STANDALONE", K, linear_cost(plain=1.0, per_draft_token=0.3))
    policy.acceptance[0].hits[:] = [0.9e6, 0.5e6, 0.5e6, 0.5e6]
    policy.acceptance[0].seen[:] = 1e6
    assert policy.draft_lengths([1], [K]) == [2]


def test_lookups_draft_the_classes_that_pay_and_leave_the_others():
    """Per-request choice where proposals are known: a class that keeps its tokens drafts, one
    that never does is left at 0 (its verify tokens would cost more than they give)."""
    policy = SpecPolicy("adaptive", "NGRAM", K, linear_cost(plain=1.0, per_draft_token=0.1), classes=K + 1)
    for _ in range(30):
        policy.score([True, False], [4, 1])
    assert policy.draft_lengths([1, 2], [K, K], classes=[4, 1]) == [K, 0]


def test_undrafted_lookups_teach_their_class_for_free():
    """A class held at 0 by a poor prior starts drafting once scored lookups show it is kept."""
    policy = SpecPolicy("adaptive", "NGRAM", K, linear_cost(plain=1.0, per_draft_token=0.4), classes=K + 1)
    policy.acceptance[3].prior = 0.05
    assert policy.draft_lengths([1], [K], classes=[3]) == [0]
    for _ in range(40):
        policy.score([True], [3])
    assert policy.draft_lengths([1], [K], classes=[3])[0] > 0


def test_acceptance_counts_positions_up_to_the_first_rejection():
    a = Acceptance(4, prior=0.5, prior_weight=1.0, decay=1.0)
    a.observe(np.array([4, 2]), np.array([1, 2]))
    # request 1: position 0 kept, 1 rejected, 2-3 never judged; request 2: 0 and 1 kept
    assert a.seen.tolist() == [2, 2, 0, 0] and a.hits.tolist() == [2, 1, 0, 0]
    overall = (0.5 + 3) / (1 + 4)  # every judged position, and the prior worth one
    assert a.rates().tolist() == pytest.approx([(overall + 2) / 3, (overall + 1) / 3, overall, overall])


def test_request_caps_hold_in_both_modes():
    for mode in ("fixed", "adaptive"):
        policy = SpecPolicy(mode, "NGRAM", K, linear_cost(plain=1.0), classes=K + 1)
        ks = policy.draft_lengths([1, 2, 3], [0, 2, 9], classes=[0, 4, 4])
        assert ks[0] == 0 and ks[1] <= 2 and ks[2] <= K
    assert SpecPolicy("fixed", "NGRAM", K, None).draft_lengths([1, 2, 3], [0, 2, 9]) == [0, 2, K]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown speculation policy"):
        SpecPolicy("sometimes", "NGRAM", K, None)


def test_timings_that_say_a_larger_round_costs_less_are_pooled():
    """A spike makes batch 2's plain round dearer than batch 4's, and k = 2 dearer than k = 3 at
    batch 1: each pair is pooled to its mean, so more requests or deeper drafts never cost less;
    timings already in order are kept."""
    plain = {1: 1.0, 2: 3.0, 4: 2.0}
    drafting = {(1, 1): 4.0, (1, 2): 6.0, (1, 3): 5.0, (2, 1): 5.0, (2, 2): 6.0, (2, 3): 7.0,
                (4, 1): 5.0, (4, 2): 6.0, (4, 3): 7.0}
    cost = RoundCost(plain, drafting, {1: 5.0, 2: 5.5, 4: 6.0})
    assert [cost.plain(b) for b in (1, 2, 4)] == [1.0, 2.5, 2.5]
    assert [cost.round(1, k, k) for k in (1, 2, 3)] == [4.0, 5.5, 5.5]
    assert [cost.round(4, 4 * k, k) for k in (1, 2, 3)] == [5.0, 6.0, 7.0]


def test_depths_between_the_timed_ones_are_interpolated():
    """Rounds are timed at k = 1 and K only: a round's passes and verify width grow in step with k."""
    plain = {1: 1.0, 4: 2.0}
    drafting = {(1, 1): 2.0, (1, 4): 5.0, (4, 1): 3.0, (4, 4): 9.0}
    cost = RoundCost(plain, drafting, {1: 5.0, 4: 4.0})
    assert [cost.round(1, k, k) for k in (1, 2, 3, 4)] == [2.0, 3.0, 4.0, 5.0]
    assert [cost.round(4, 4 * k, k) for k in (1, 2, 3, 4)] == [3.0, 5.0, 7.0, 9.0]
    assert cost.table()["draftingSeconds"] == {"1": [2.0, 3.0], "2": [3.0, 5.0], "3": [4.0, 7.0], "4": [5.0, 9.0]}


def test_a_round_between_timed_shapes_is_interpolated():
    """One drafter pays the fixed part; more drafters share the rest in proportion; batch sizes
    between timed ones are interpolated."""
    plain = {1: 1.0, 4: 2.0}
    drafting = {(b, k): plain[b] + k * b * 0.5 for b in plain for k in (1, 2)}
    one = {1: drafting[(1, 2)], 4: plain[4] + 1.0 + 0.5}  # one of 4 drafting 2: 1.5 above plain, of 4.0
    cost = RoundCost(plain, drafting, one)
    assert cost.plain(4) == 2.0 and cost.plain(2) == pytest.approx(1 + 1 / 3)
    assert cost.round(4, 8, 2) == pytest.approx(drafting[(4, 2)])  # every request drafts 2
    assert cost.round(4, 2, 2) == pytest.approx(one[4])  # one request drafts 2
    # two requests' worth of tokens: the fixed share (1.5 of 4.0) and a third of the rest
    assert cost.round(4, 4, 2) == pytest.approx(2.0 + 4.0 * (0.375 + 0.625 / 3))
    assert cost.round(1, 1, 1) == pytest.approx(1.5)
