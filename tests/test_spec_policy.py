"""The speculation policy on its own: acceptance estimates, the cost model and the draft lengths it picks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdecode_worker.engine.speculation.spec_policy import Acceptance, RequestEstimates, SpecPolicy
from specdecode_worker.engine.speculation.step_cost import StepCost


def overhead_bound() -> StepCost:
    """A round costs 1 + 0.1 per token: extra tokens are cheap, as on a GPU at low load."""
    return StepCost.linear(plain=(1.0, 0.1), per_draft_token=0.1)


def half_a_step_per_token() -> StepCost:
    """Each verify token costs half a plain step: a draft token pays when kept over half the time."""
    return StepCost.linear(plain=(0.5, 0.5), per_draft_token=0.5)


def weight_bound() -> StepCost:
    """Reading the weights (1.0) dominates a step and is shared by the batch; each token adds 0.02
    and each verify token 0.2: a kept draft token pays at batch 1, not at 16."""
    return StepCost.linear(plain=(1.0, 0.02), per_draft_token=0.2)


def run(policy: SpecPolicy, rids: list[int], rounds: int, accept) -> list[list[int]]:
    """``rounds`` rounds where request r accepts ``accept(r, k)`` of its k drafts; the ks chosen."""
    chosen = []
    for _ in range(rounds):
        ks = policy.draft_lengths(rids, [policy.max_draft] * len(rids))
        accepted = [accept(rid, k) for rid, k in zip(rids, ks)]
        policy.record(rids, ks, ks, accepted, policy.cost(len(rids), sum(ks)))
        chosen.append(ks)
    return chosen


def test_acceptance_counts_positions_up_to_the_first_rejection():
    est = Acceptance(4, prior=0.5, prior_weight=2.0, decay=1.0, position_weight=1.0)
    est.observe(proposed=4, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 never judged
    # Over all positions: 2 kept of 3 judged, on a prior of 0.5 worth 2 -> 3/5; each position
    # leans on that with weight 1: (0.6 + 1) / 2, (0.6 + 1) / 2, (0.6 + 0) / 2, and 0.6 unjudged.
    assert est.overall() == pytest.approx(0.6)
    assert est.rates() == pytest.approx([0.8, 0.8, 0.3, 0.6])
    assert est.gains(3) == pytest.approx([0.8, 0.64, 0.192])


def test_a_request_with_evidence_grows_its_estimate_at_once():
    """One round that kept 4 of 4, where its parent expected half of each, lifts every position of
    that request, the undrafted ones too, above the parent's; a rejection at position 1 pulls its
    estimate below."""
    est = RequestEstimates(4)
    rows = est.rows([1, 2])
    half = np.full((2, 4), 0.5)
    est.observe(rows, np.array([4, 1]), np.array([4, 0]), half)
    copying, other = est.rates(rows, half, np.array([0.5, 0.5]))
    # Copying: kept 4 where 2 were expected -> factor (1 + 4) / (1 + 2); per position (1 + 1) / (1 + 5/3 * 0.5).
    assert copying == pytest.approx([0.5 * 5 / 3 * 2 / (1 + 5 / 6)] * 4)
    assert min(copying) > 0.7 > 0.5 > max(other)


def test_speculation_turns_off_when_acceptance_collapses_and_returns_when_it_comes_back():
    policy = SpecPolicy("adaptive", "NGRAM", 4, half_a_step_per_token(), probe_every=8, probe_budget=1.0)
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


def cpu_like() -> StepCost:
    """A verify round costs about twice a plain one (the switch), as on a CPU: a draft token must be
    kept well over half the time to pay."""
    return StepCost.linear(plain=(1.0, 0.1), per_draft_token=0.1, switch=(1.0, 0.0))


def test_a_new_copying_request_drafts_at_once_after_earlier_requests_collapsed_acceptance():
    """Earlier requests rejected everything, so the algorithm's estimate is far below what pays.
    A new request still drafts in its first round (its first probe, at the length whose round
    costs least net of what it is expected to give: here one token): one that copies drafts its
    full cap from then on, one that does not is back at 0 within a few rounds and stays there."""
    policy = SpecPolicy("adaptive", "NGRAM", 4, cpu_like(), probe_every=1000)
    run(policy, [1, 2, 3, 4], 20, lambda rid, k: 0)
    for rid in (1, 2, 3, 4):
        policy.forget(rid)
    assert policy.algorithm_acceptance.overall() < 0.2

    def rounds(rid, n, accept):
        chosen = []
        for _ in range(n):
            ks = policy.draft_lengths([rid], [4], remaining=[32])
            policy.record([rid], ks, ks, [accept(k) for k in ks], policy.cost(1, sum(ks)))
            chosen.append(ks[0])
        return chosen

    copying = rounds(10, 6, lambda k: k)
    assert copying[0] >= 1 and copying[1:] == [4] * 5, copying
    other = rounds(11, 8, lambda k: 0)
    assert other[0] >= 1 and other[-4:] == [0] * 4, other
    # With 2 tokens to go the first probe is not worth its budget of the request's rounds.
    collapsed = SpecPolicy("adaptive", "NGRAM", 4, cpu_like(), probe_every=1000)
    run(collapsed, [1], 20, lambda rid, k: 0)
    assert collapsed.draft_lengths([12], [4], remaining=[2]) == [0]
    assert collapsed.draft_lengths([13], [4], remaining=[32]) != [0]


def test_catching_the_draft_up_is_charged_to_the_request_that_resumes():
    """A draft model caching 1000 committed tokens (0.01 a token, ten plain steps) before a
    request's first draft does not pay for a request with 4 tokens left; it does for one with
    4000 left, and no catch-up drafts even with 4 left. A request already drafting pays nothing."""
    cost = StepCost.linear(plain=(1.0, 0.02), per_draft_token=0.1, draft_pass=(0.1, 0.0), catch_up_per_token=0.01)

    def first_choice(catch_up, remaining):
        policy = SpecPolicy("adaptive", "STANDALONE", 4, cost, probe_every=1000)
        return policy.draft_lengths([1], [4], catch_up=[catch_up], remaining=[remaining])[0]

    assert first_choice(1000, 4) == 0
    assert first_choice(1000, 4000) > 0
    assert first_choice(0, 4) > 0
    # In a batch, only the request that must catch up is held back.
    policy = SpecPolicy("adaptive", "STANDALONE", 4, cost, probe_every=1000)
    ks = policy.draft_lengths([1, 2], [4, 4], catch_up=[1000, 0], remaining=[4, 4])
    assert ks[0] == 0 and ks[1] > 0, ks


def test_a_catch_up_is_priced_by_what_its_tokens_add_to_a_draft_pass():
    """A draft pass of w tokens costs 0.03 + 0.002 w (the CPU's int8 draft, about): the catch-up
    rides in the first proposal pass, so a token of it costs 0.002, not a 32-token pass's 0.0029
    a token; a pass timed no dearer for its width prices nothing."""
    from specdecode_worker.engine.speculation.step_timing import catch_up_seconds

    def pass_seconds(w):
        return 0.03 + 0.002 * w

    assert catch_up_seconds(pass_seconds(1), pass_seconds(32), 32) == pytest.approx(0.002)
    assert pass_seconds(1) + 86 * catch_up_seconds(pass_seconds(1), pass_seconds(32), 32) == pytest.approx(
        pass_seconds(87))
    assert catch_up_seconds(0.05, 0.04, 32) == 0.0


def test_probes_count_the_catch_up_of_the_requests_they_turn_on():
    """A probe round costs 0.8 more than a plain one of 1.8: at a budget of 10% probes come every
    5 rounds. When it must also cache 10 tokens in each of 8 draft models (0.8 more), every 9."""
    cost = StepCost.linear((1.0, 0.1), 0.1, catch_up_per_token=0.01)
    rids = list(range(8))

    def probe_rounds(catch_up):
        policy = SpecPolicy("adaptive", "STANDALONE", 4, cost, probe_every=1, probe_budget=0.1)
        chosen = []
        for _ in range(40):
            ks = policy.draft_lengths(rids, [4] * 8, catch_up=[catch_up] * 8, remaining=[8] * 8)
            policy.record(rids, ks, ks, [0] * 8, cost(8, sum(ks)))
            chosen.append(ks)
        return [i for i, ks in enumerate(chosen) if any(ks)][2:]  # past the new requests' first tries

    cheap, dear = probe_rounds(0), probe_rounds(10)
    assert {b - a for a, b in zip(cheap, cheap[1:])} == {5}, cheap
    assert {b - a for a, b in zip(dear, dear[1:])} == {9}, dear


def test_load_backs_speculation_off_when_verify_tokens_are_paid_for():
    """Acceptance about 0.5 per token pays at batch 1 (the weights are read anyway) but not at 16."""
    def accept(_rid, k):
        return min(k, 1)  # the first draft usually kept, the rest rejected: about 0.5 per position

    alone = SpecPolicy("adaptive", "STANDALONE", 4, weight_bound())
    assert run(alone, [1], 20, accept)[-1][0] >= 1
    busy = SpecPolicy("adaptive", "STANDALONE", 4, weight_bound())
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


def test_probes_of_idle_requests_share_one_round():
    """Held at 0, every request probes in the same round: the batch pays the switch to the verify
    path once per ``probe_every`` rounds, not once per request."""
    policy = SpecPolicy("adaptive", "NGRAM", 4, StepCost.linear((1.0, 0.1), 0.1, switch=(5.0, 0.0)), probe_every=4,
                        probe_budget=1.0)
    chosen = run(policy, list(range(8)), 16, lambda rid, k: 0)
    drafting = [i for i, ks in enumerate(chosen) if any(ks)]
    assert drafting == [0, 3, 7, 11, 15], chosen  # round 0: the new requests' first probe
    assert len(set(chosen[0])) == 1 and chosen[0][0] >= 1
    assert all(ks == [1] * 8 for ks in (chosen[i] for i in drafting[1:]))


def test_probes_spend_at_most_their_budget_of_the_time():
    """A probe round costs 3.22 plain rounds more (7.6 against 1.8: the switch to the verify path is
    dear); at a budget of 10% the probes come every 33 rounds, not every 4."""
    cost = StepCost.linear((1.0, 0.1), 0.1, switch=(5.0, 0.0))
    policy = SpecPolicy("adaptive", "NGRAM", 4, cost, probe_every=4, probe_budget=0.1)
    chosen = run(policy, list(range(8)), 70, lambda rid, k: 0)
    assert [i for i, ks in enumerate(chosen) if any(ks)] == [0, 32, 65], chosen  # 0: their first probe


def test_switching_to_the_verify_path_has_its_own_price():
    """With a verify path that costs as much as the rest of the step, one draft token kept 90% of
    the time does not pay for one request in a batch of 8, and all eight drafting 4 do."""
    cost = StepCost.linear(plain=(1.0, 0.1), per_draft_token=0.02, switch=(1.8, 0.0))
    policy = SpecPolicy("adaptive", "NGRAM", 4, cost, probe_every=1000)
    ks = run(policy, list(range(8)), 30, lambda rid, k: k if rid == 0 else 0)[-1]
    assert ks == [0] * 8
    ks = run(SpecPolicy("adaptive", "NGRAM", 4, cost, probe_budget=1.0), list(range(8)), 30, lambda rid, k: k)[-1]
    assert ks == [4] * 8


def test_cost_model_seeded_by_warm_up_points_recovers_their_terms():
    true = (0.06, 0.01, 0.002, 0.005, 0.004)  # base, per request, switch, switch per request, per token
    points = {(n, m): sum(c * x for c, x in zip(true, (1, n, m > 0, (m > 0) * n, m)))
              for n, m in ((1, 0), (16, 0), (1, 4), (16, 16), (16, 64))}
    model = StepCost(points)
    assert list(model.coefficients().values())[:5] == pytest.approx(true, rel=1e-3)
    assert model(8, 0) == pytest.approx(0.06 + 0.08)
    assert model(8, 8) == pytest.approx(0.06 + 0.08 + 0.002 + 0.04 + 0.032)


def test_cost_model_cancels_load_and_ignores_interrupted_rounds():
    """Seeded on a quiet machine, run three times slower with one round in seven interrupted (x6):
    the predicted ratio of a verify round to a plain one stays the machine's."""
    model = StepCost.linear(plain=(0.06, 0.01), per_draft_token=0.004, switch=(0.0, 0.005), learn=True)
    ratio = model(8, 32) / model(8, 0)
    shapes = [(8, 0), (8, 32), (4, 0), (4, 16), (8, 8)] * 13
    for i, (n, m) in enumerate(shapes):
        seconds = 3 * model.__class__.linear((0.06, 0.01), 0.004, (0.0, 0.005))(n, m)
        model.record(n, m, 0, 0, seconds * (6 if i % 7 == 3 else 1))
    assert model.load == pytest.approx(3, rel=0.05)
    assert model(8, 32) / model(8, 0) == pytest.approx(ratio, rel=0.05)


def test_one_slow_round_among_few_drafting_rounds_does_not_make_drafting_look_dear():
    """The warm-up priced a round of 4 drafts at 0.29; two such rounds took 0.22-0.23, and a third
    was slowed to 0.68 by other work. The fit follows the two, where a fit that set aside only
    rounds over twice its own prediction kept the third (0.35: drafting 4 tokens kept 99% of the
    time no longer beat a 0.07 plain round)."""
    model = StepCost.linear(plain=(0.065, 0.005), per_draft_token=0.005, switch=(0.02, 0.0), draft_pass=(0.045, 0.0),
                            learn=True)
    plain = [(1, 0, 0, 0, 0.07)]
    for r in plain * 3 + [(1, 4, 4, 1, 0.23), (1, 4, 4, 1, 0.22), (1, 4, 4, 1, 0.68)] + plain * 10:
        model.record(*r)
    assert model(1, 4, 4, 1) == pytest.approx(0.225, rel=0.1)
    assert model(1, 0) == pytest.approx(0.07, rel=0.02)


def test_a_refit_whose_rounds_all_lie_close_to_it_is_fitted_once():
    """Reweighting changes nothing when every round is within the Huber margin of the fit, so the
    refit stops after one fit instead of three; with a slowed round among them, it refits."""
    model = StepCost.linear(plain=(0.065, 0.005), per_draft_token=0.005, switch=(0.02, 0.0), draft_pass=(0.045, 0.0),
                            learn=True)
    model.refit_every = 10**6  # refits only when the test asks
    fits = []
    fit = model._fit
    model._fit = lambda rows, terms: fits.append(1) or fit(rows, terms)
    for r in [(1, 0, 0, 0, 0.07)] * 3 + [(1, 4, 4, 1, 0.23), (1, 4, 4, 1, 0.22)]:
        model.record(*r)
    model.refit()
    assert len(fits) == 1
    model.record(1, 4, 4, 1, 0.68)
    fits.clear()
    model.refit()
    assert len(fits) > 1
    assert model(1, 4, 4, 1) == pytest.approx(0.225, rel=0.1)


def test_a_round_is_the_plain_curve_plus_what_drafting_adds():
    """On a CPU a plain round of 2 requests costs far more than one of 1 (0.11 against 0.07) and
    little less than one of 4. A round's plain part is the curve's, so drafting terms learnt on
    rounds of 1 request price a round of 2 on top of what a plain round of 2 took, not on a linear
    term that put it at 0.08."""
    curve = {1: 0.07, 2: 0.11, 4: 0.125, 8: 0.16, 16: 0.2}
    target = {(1, 0): 0.07, (16, 0): 0.2, (1, 4): 0.112, (16, 16): 0.278, (16, 64): 0.422}
    model = StepCost(target, {1: 0.04, 16: 0.115}, plain=curve, learn=True)
    for _ in range(6):
        model.record(1, 4, 4, 1, 0.23)
        model.record(1, 0, 0, 0, 0.07)
        model.record(2, 0, 0, 0, 0.11)
    assert model(2, 0) == pytest.approx(0.11) and model.plain(2) == pytest.approx(0.11)
    assert model(1, 4, 4, 1) == pytest.approx(0.23, rel=0.05)
    base, switch, per_token, per_pass, per_request = model.round_terms(2, 4)
    assert base == pytest.approx(0.11)
    assert model(2, 8, 4, 2) == pytest.approx(base + switch + 8 * per_token + per_pass + 2 * per_request)
    # What a second drafting request adds: its switch share, its 4 verify tokens, its draft rows.
    _, switch_one, _, _, _ = model.round_terms(1, 4)
    assert model(2, 8, 4, 2) - model(2, 0) == pytest.approx(
        model(1, 4, 4, 1) - model(1, 0) + (switch - switch_one) + 4 * per_token + per_request)


def test_cost_model_learns_a_cheaper_verify_path_from_measured_rounds():
    """The warm-up priced each verify token at a whole plain step per request; the rounds say
    tokens are nearly free at today's load (which is twice the warm-up's): the fit follows them."""
    seeded = StepCost.linear(plain=(0.05, 0.01), per_draft_token=0.01, learn=True)
    true = StepCost.linear(plain=(0.10, 0.02), per_draft_token=0.002)
    for n, m in [(8, 0), (8, 8), (8, 32), (2, 0), (2, 8)] * 13:
        seeded.record(n, m, 0, 0, true(n, m))
    assert seeded.coefficients()["per_draft_token"] == pytest.approx(0.002, rel=0.25)
    assert seeded(8, 32) / seeded(8, 0) == pytest.approx(true(8, 32) / true(8, 0), rel=0.05)


def test_cost_model_keeps_drafting_terms_non_negative():
    """Noise that makes verify rounds look faster than plain ones never makes drafting look free of charge or better."""
    model = StepCost({(1, 0): 0.10, (16, 0): 0.30, (1, 4): 0.09, (16, 16): 0.29, (16, 64): 0.28})
    terms = model.coefficients()
    assert all(terms[t] >= 0 for t in ("switch", "switch_per_request", "per_draft_token"))
    assert model(16, 64) >= model(16, 0) - 1e-12


def test_round_terms_add_up_to_the_model():
    model = StepCost.linear(plain=(0.06, 0.01), per_draft_token=0.004, switch=(0.002, 0.005), draft_pass=(0.01, 0.003))
    base, switch, per_token, per_pass, per_request = model.round_terms(8, 3)
    assert base + switch + per_token * 20 + per_pass + per_request * 6 == pytest.approx(model(8, 20, 3, 6))


class OneRequest:
    """One request's estimate as ``RequestEstimates`` describes it, position by position in plain
    Python: an independent reference for the batched rows."""

    def __init__(self, positions: int, decay: float = 0.8):
        self.decay = decay
        self.hits, self.seen, self.expected = [0.0] * positions, [0.0] * positions, [0.0] * positions

    def observe(self, proposed: int, accepted: int, predicted: list[float]) -> None:
        for i in range(min(proposed, accepted + 1, len(self.hits))):
            self.seen[i] = self.decay * self.seen[i] + 1
            self.hits[i] = self.decay * self.hits[i] + (i < accepted)
            self.expected[i] = self.decay * self.expected[i] + predicted[i]

    def rates(self, parent: list[float]) -> list[float]:
        factor = (1 + sum(self.hits)) / (1 + sum(self.expected))
        return [min(1.0, a * factor * (1 + h) / (1 + factor * e)) for a, h, e in zip(parent, self.hits, self.expected)]


def floored(algorithm: Acceptance, floor: float) -> list[float]:
    """The algorithm's rates, raised in proportion where its overall rate is below ``floor``."""
    lift = max(algorithm.overall(), floor) / algorithm.overall()
    return [min(1.0, a * lift) for a in algorithm.rates()]


def test_the_batched_estimates_are_the_per_request_estimates():
    """The policy keeps every request's estimate as rows of arrays; they must equal each request's
    estimate computed on its own (parent: the algorithm's, floored at its prior), round after
    round, and the algorithm's batched update must equal its updates one by one."""
    rng = random.Random(3)
    policy = SpecPolicy("adaptive", "STANDALONE", 4, overhead_bound())
    algorithm = Acceptance(4, 0.7, prior_weight=2.0, decay=0.95)
    own = {rid: OneRequest(4) for rid in range(6)}
    for _ in range(30):
        rids = rng.sample(range(6), rng.randrange(1, 7))
        proposed = [rng.randrange(0, 5) for _ in rids]
        accepted = [rng.randrange(0, p + 1) for p in proposed]
        policy.record(rids, proposed, proposed, accepted, 1.0)
        predicted = floored(algorithm, 0.7)
        for rid, p, a in zip(rids, proposed, accepted):
            if p:
                own[rid].observe(p, a, predicted)
                algorithm.observe(p, a)
        assert policy.algorithm_acceptance.rates() == pytest.approx(algorithm.rates(), abs=1e-12)
        for rid in range(6):
            assert policy.acceptance(rid) == pytest.approx(own[rid].rates(floored(algorithm, 0.7)), abs=1e-12)


def test_a_request_the_others_outlast_drafts_only_if_leaving_early_saves_time():
    """No request waits, so the batch lasts as long as its slowest requests. Two copy and two open
    requests, 32 tokens each: the copying ones would finish in a few rounds and the batch would
    still run its 32. Where a plain round of 2 requests costs what one of 4 does (the weights set
    it, as on a CPU), their drafting buys nothing and they do not draft; where every request adds
    its share, or where requests wait for their place (an early finish lets the next one in), they do."""
    def copy_two(plain_curve, waiting):
        # The warm-up's verify passes cost what they add to its plain passes of the same batch.
        one, four = plain_curve[1], plain_curve[4]
        cost = StepCost({(1, 0): one, (4, 0): four, (1, 4): one + 0.4, (4, 4): four + 0.3, (4, 16): four + 0.6},
                        plain=plain_curve, learn=False)
        policy = SpecPolicy("adaptive", "NGRAM", 4, cost, probe_every=1000)
        rids = [0, 1, 2, 3]
        for left in range(32, 20, -1):
            ks = policy.draft_lengths(rids, [4] * 4, remaining=[left] * 4, waiting=waiting)
            policy.record(rids, ks, ks, [k if rid % 2 == 0 else 0 for rid, k in zip(rids, ks)], 1.0)
        return ks

    flat = {1: 1.0, 2: 1.3, 4: 1.3}
    assert copy_two(flat, waiting=0) == [0, 0, 0, 0]
    assert copy_two(flat, waiting=3) == [4, 0, 4, 0]
    assert copy_two({1: 0.4, 2: 0.7, 4: 1.3}, waiting=0) == [4, 0, 4, 0]


def test_the_plain_round_follows_the_measured_curve():
    cost = StepCost({(1, 0): 0.06, (16, 0): 0.16, (1, 4): 0.09, (16, 16): 0.2, (16, 64): 0.4},
                    plain={1: 0.06, 2: 0.09, 4: 0.09, 8: 0.11, 16: 0.16}, learn=False)
    assert cost.plain(3) == pytest.approx(0.09) and cost.plain(12) == pytest.approx(0.135)
    assert cost.plain(16) == pytest.approx(0.16) and cost.plain(32) > 0.16


def test_a_warm_up_curve_that_falls_is_pooled():
    """Timed while something else had the machine, the warm-up found 2 requests cheaper than 1:
    a pass over more rows never costs less, so the two are pooled (and the rest kept)."""
    cost = StepCost({(1, 0): 0.127, (16, 0): 0.32, (1, 4): 0.2, (16, 16): 0.4, (16, 64): 0.6},
                    plain={1: 0.127, 2: 0.115, 4: 0.196, 16: 0.32}, learn=False)
    assert cost.plain(1) == pytest.approx(0.121) and cost.plain(2) == pytest.approx(0.121)
    assert cost.plain(4) == pytest.approx(0.196)


def test_measured_plain_rounds_replace_the_warm_up_point_of_their_batch_size():
    """The warm-up says 1 and 2 requests cost the same (0.1); the worker then measures plain
    rounds of 1 request at 0.06 and of 2 at 0.1: from the third at a size, their median is the
    curve's point there, so a request's place in a round of 2 is worth 0.04, not nothing."""
    cost = StepCost({(1, 0): 0.1, (16, 0): 0.2, (1, 4): 0.15, (16, 16): 0.3, (16, 64): 0.5},
                    plain={1: 0.1, 2: 0.1, 16: 0.2}, refit_every=1)
    for seconds in (0.06, 0.07, 0.05):
        cost.record(1, 0, 0, 0, seconds)
    for _ in range(3):
        cost.record(2, 0, 0, 0, 0.1)
    assert cost.plain(1) == pytest.approx(0.06) and cost.plain(2) == pytest.approx(0.1)
    assert cost.plain(2) - cost.plain(1) == pytest.approx(0.04)


def test_a_lookup_that_finds_nothing_is_no_evidence():
    """Asked for 4 drafts, an n-gram lookup that matches nothing verifies no token: it leaves the
    request's estimate and the algorithm's as they were, while a rejected proposal lowers them."""
    policy = SpecPolicy("adaptive", "NGRAM", 4, overhead_bound())
    before = policy.acceptance(1)
    for _ in range(3):
        policy.record([1, 2], [4, 0], [0, 0], [0, 0], 1.0)
    assert policy.acceptance(1) == pytest.approx(before)
    assert policy.acceptance(2) == pytest.approx(before)
    policy.record([1, 2], [4, 0], [4, 0], [0, 0], 1.0)
    assert policy.acceptance(1)[0] < before[0] / 2 and policy.acceptance(2)[0] < before[0]


def test_a_first_probe_that_found_nothing_comes_again():
    """A new request whose first probe matched nothing has told nothing about itself: it is probed
    again in the next round (a lookup that finds nothing costs nothing), until a probe verifies a
    token; after that it drafts by its estimate (a rejection here: no more drafting)."""
    cost = StepCost.linear(plain=(1.0, 0.0), per_draft_token=0.8)  # drafting at the prior does not pay
    policy = SpecPolicy("adaptive", "NGRAM", 4, cost, probe_every=1000)
    probes = []
    for found in (0, 0, 1, 0):
        k = policy.draft_lengths([1], [4], remaining=[100])[0]
        probes.append(k)
        policy.record([1], [k], [min(k, found)], [0], 1.0)
    assert probes[:3] == [1, 1, 1] and probes[3] == 0


def test_a_failed_first_probe_costs_at_most_its_share_of_the_request():
    """A STANDALONE request must first cache its prompt in the draft (0.01 a token here) before it
    can draft: a first probe that is then rejected costs that catch-up and the probe round's extra
    time. With 5% allowed, it is tried when that is at most 5% of the request's plain rounds to go.
    A verify token costs 0.8 of a plain round, so drafting at the prior of 0.7 does not pay: only
    the probe drafts, one token (the length that costs least net of the 0.7 token it may give)."""
    cost = StepCost.linear(plain=(1.0, 0.0), per_draft_token=0.8, catch_up_per_token=0.01)

    def first(catch_up, remaining):
        policy = SpecPolicy("adaptive", "STANDALONE", 4, cost, probe_every=1000)
        return policy.draft_lengths([1], [4], catch_up=[catch_up], remaining=[remaining])[0]

    assert first(100, 37) == 1 and first(100, 35) == 0  # 0.8 + 1.0 against 1.85 and 1.75
    assert first(0, 17) == 1 and first(0, 15) == 0  # 0.8 against 0.85 and 0.75


def test_guesses_that_come_true_price_a_first_probe_at_their_odds():
    """A round costs 1 a request and each verify token 0.8: drafting pays only for a request that
    keeps nearly every draft. A first probe whose catch-up and verify token (1.8) are over its
    share of the request (5% of 30 plain rounds, 1.5) is not tried blind; a request whose free
    guesses came true 4 times in 4 fails it at odds of 1/3 (two guesses of prior weight counted
    as failed), 0.6, and is probed. 2 in 2 leave even odds, 0.9: under a 1.5 bound, over one of
    0.75 (a budget of 2.5%), where 4 in 4 still pass. Guesses that failed leave the odds at 1.
    Beside a request with no guesses, the one with kept guesses is probed alone."""
    cost = StepCost.linear(plain=(0.0, 1.0), per_draft_token=0.8, catch_up_per_token=0.01)

    def first(guesses, budget=0.05):
        policy = SpecPolicy("adaptive", "STANDALONE", 4, cost, probe_every=1000, first_probe_budget=budget)
        for rid, kept in guesses.items():
            policy.score_guesses([rid] * len(kept), kept)
        rids = sorted(set(guesses) | {1})
        return policy.draft_lengths(rids, [4] * len(rids), catch_up=[100] * len(rids), remaining=[30] * len(rids))

    assert first({}) == [0]
    assert first({1: [True] * 4}) == [1] and first({1: [True] * 2}) == [1]
    assert first({1: [True] * 2}, budget=0.025) == [0] and first({1: [True] * 4}, budget=0.025) == [1]
    assert first({1: [False] * 4}) == [0]
    assert first({1: [True] * 4, 2: []}) == [1, 0]


def test_only_new_requests_guesses_count_and_forget_drops_them():
    policy = SpecPolicy("adaptive", "STANDALONE", 4, overhead_bound(), probe_every=1000)
    policy.record([1], [2], [2], [1], 1.0)  # a verified proposal: request 1 is no longer new
    policy.score_guesses([1, 2], [True, True])
    assert policy.guesses == {2: [1, 1]}
    policy.forget(2)
    assert policy.guesses == {}


def draft_model_cost() -> StepCost:
    """A draft pass costs a quarter of a plain round and the switch to verifying 0.3: a round of 4
    drafts pays only where nearly all are kept."""
    return StepCost.linear(plain=(1.0, 0.1), per_draft_token=0.1, switch=(0.3, 0.0), draft_pass=(0.25, 0.0))


def test_a_draft_models_round_is_priced_by_its_guess_class():
    """Earlier copying requests rejected their first drafted round, where the context's lookup
    matched one token (class 1), and then kept 4 of 4 where it matched four (class 4). A new
    copying request has just rejected its first round too. Priced by class, that rejection was
    what class 1 promised: at class 4 it drafts all 4, and another new request at class 1 is not
    drafted. Priced by the algorithm's estimate (no classes), the same rejection sinks the
    copying request below what pays, and the estimate the copy requests left makes the other new
    request draft all 4 at once, whatever its text."""
    def policy(classes: int) -> SpecPolicy:
        p = SpecPolicy("adaptive", "STANDALONE", 4, draft_model_cost(), probe_every=1000, first_probe_budget=0.0,
                       classes=classes, classes_scored=False)
        for rid in range(10):
            p.record([rid], [4], [4], [0], 1.0, classes=[1] if classes else None)
            for _ in range(6):
                p.record([rid], [4], [4], [4], 1.0, classes=[4] if classes else None)
            p.forget(rid)
        p.record([20], [4], [4], [0], 1.0, classes=[1] if classes else None)
        return p

    by_class = policy(5)
    assert by_class.draft_lengths([20], [4], remaining=[28], classes=[4]) == [4]
    assert by_class.draft_lengths([21], [4], remaining=[28], classes=[1]) == [0]
    by_algorithm = policy(0)
    assert by_algorithm.draft_lengths([20], [4], remaining=[28]) == [0]
    assert by_algorithm.draft_lengths([21], [4], remaining=[28]) == [4]


def test_unscored_classes_keep_the_probes_until_drafted_rounds_teach_them():
    """A draft model's classes come from guesses, not from its proposals, so a round it did not
    draft says nothing of them. Class 1 has been taught by rejected rounds: a new request in it
    is not probed first, since its class says what the probe would find; a new request in class
    3, which no round has taught, gets its first probe. A request the policy has observed still
    gets the spaced one-token probes. Where the classed proposals are scored (NGRAM), neither
    probe comes. A verify token costs 0.8 of a plain round: drafting at the prior (0.7) does not pay."""
    def policy(scored: bool) -> SpecPolicy:
        p = SpecPolicy("adaptive", "STANDALONE", 4, StepCost.linear(plain=(1.0, 0.0), per_draft_token=0.8),
                       probe_every=4, probe_budget=1.0, classes=5, classes_scored=scored)
        for rid in range(10):
            p.record([rid], [4], [4], [0], 1.0, classes=[1])
            p.forget(rid)
        return p

    assert policy(False).draft_lengths([20], [4], remaining=[32], classes=[3]) == [1]
    assert policy(False).draft_lengths([20], [4], remaining=[32], classes=[1]) == [0]
    assert policy(True).draft_lengths([20], [4], remaining=[32], classes=[3]) == [0]
    for scored, probes in ((False, True), (True, False)):
        p = policy(scored)
        p.record([30], [1], [1], [0], 1.0, classes=[1])  # observed: no first probe
        ks = [p.draft_lengths([30], [4], remaining=[32], classes=[1])[0] for _ in range(8)]
        assert (1 in ks) is probes and set(ks) <= {0, 1}, ks


@pytest.mark.parametrize("per_token,chain,tree", [(0.1, [2] * 4, [4] * 4), (0.15, [1] * 4, [0] * 4)])
def test_a_tree_round_is_priced_by_every_node_it_verifies(per_token, chain, tree):
    """A tree verifies all N = 4 nodes of every request once any drafts, whatever k: four requests
    at acceptance 0.7 (gains 0.7, 0.49, 0.343, 0.24) in a round costing 1 + per_token per verified
    token. At 0.1 the chain stops at 2 each ((4 + 4.76) / 1.8 beats (4 + 6.13) / 2.2), while the
    tree's 16 nodes cost 1 + 1.6 whatever k, so each lets all 4 count: (4 + 7.09) / 2.6 = 4.27 per
    second against 4 plain. At 0.15 the chain still drafts ((4 + 2.8) / 1.6 = 4.25), while the
    tree's round would give (4 + 7.09) / 3.4 = 3.26: plain."""
    ks = {}
    for name, verified in (("chain", None), ("tree", 4)):
        policy = SpecPolicy("adaptive", "EAGLE", 4, StepCost.linear(plain=(1.0, 0.0), per_draft_token=per_token),
                            verified_per_request=verified)
        ks[name] = policy.draft_lengths([1, 2, 3, 4], [4] * 4, remaining=[10] * 4, waiting=1)
    assert ks == {"chain": chain, "tree": tree}


def test_a_tree_round_is_recorded_with_every_node_it_verified():
    """One request drafting one token of a 4-node tree in a batch of three: the cost model learns
    from a round that verified 3 x 4 draft tokens, not 1."""
    trace: list = []
    cost = StepCost.linear(plain=(1.0, 0.0), per_draft_token=0.1)
    policy = SpecPolicy("adaptive", "EAGLE", 4, cost, verified_per_request=4, trace=trace)
    policy.record([1, 2, 3], [1, 0, 0], [1, 0, 0], [1, 0, 0], 2.2)
    policy.record([1, 2, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0], 1.0)  # a plain round verifies nothing
    assert [t["predicted"] for t in trace] == pytest.approx([1.0 + 0.1 * 12, 1.0], rel=1e-4)


def test_a_proposal_is_priced_by_its_class_not_by_the_prior_floor():
    """Short n-gram matches (class 1) were all rejected, one long match (class 4) was kept whole:
    a new request's class-1 proposal is not drafted, its class-4 one is, at full length (with
    requests waiting, so that the tokens of each are worth as much). Without
    classes the same history leaves a new request at the algorithm's prior (the floor), drafting
    its short matches too: the rejected verify rounds that made open prompts pay for NGRAM."""
    def policy(classes: int) -> SpecPolicy:
        p = SpecPolicy("adaptive", "NGRAM", 4, overhead_bound(), probe_every=1000, first_probe_budget=0.0,
                       classes=classes)
        for rid in range(10):
            p.record([rid], [4], [4], [0], 1.0, classes=[1])
            p.forget(rid)
        p.record([10], [4], [4], [4], 1.0, classes=[4])
        p.forget(10)
        return p

    assert policy(5).draft_lengths([20, 21], [4, 4], remaining=[32, 32], waiting=1, classes=[1, 4]) == [0, 4]
    assert policy(5).class_acceptance[1].overall() < 0.15 < 0.8 < policy(5).class_acceptance[4].overall()
    assert policy(0).algorithm_acceptance.overall() < 0.5
    assert policy(0).draft_lengths([20], [4], remaining=[32], classes=[1])[0] > 0  # no classes: the floor


def test_the_depth_bound_never_rules_out_a_round_that_beats_plain():
    """The policy skips the draft depths whose bound (every expected token at the cheapest round
    of that depth) cannot beat a plain round: on random batches, every depth whose best round
    does beat it is kept."""
    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(300):
        cost = StepCost.linear(plain=(1.0, rng.uniform(0, 0.2)), per_draft_token=rng.uniform(0, 0.5),
                               switch=(rng.uniform(0, 1), rng.uniform(0, 0.1)),
                               draft_pass=(rng.uniform(0, 0.5), rng.uniform(0, 0.1)))
        policy = SpecPolicy("adaptive", "STANDALONE", 4, cost)
        n = int(rng.integers(1, 9))
        gains = np.cumprod(rng.uniform(0, 1, (n, 4)), axis=1) * (rng.uniform(size=(n, 1)) < 0.8)
        entry = rng.uniform(0, 0.3, n) * (rng.uniform(size=n) < 0.5)
        plain_rate = n / cost(n, 0)
        kept = policy._depths_that_may_pay(gains, entry, plain_rate, 4)
        for depth in range(1, 5):
            if policy._best_for_depth(gains, depth, entry)[1] > plain_rate:
                assert depth in kept, (trial, depth)


def test_a_new_request_with_a_classed_proposal_gets_no_blind_first_probe():
    """Short n-gram matches (class 1) were all rejected. A new request whose proposal is a short
    match is not probed: its class says what the probe would find. Without classes the same
    request is probed once (its estimate leans on the algorithm's, which earlier requests could
    have dragged down whatever the new request copies)."""
    def policy(classes: int) -> SpecPolicy:
        p = SpecPolicy("adaptive", "NGRAM", 4, cpu_like(), probe_every=1000, classes=classes)
        for rid in range(10):
            p.record([rid], [4], [4], [0], 1.0, classes=[1] if classes else None)
            p.forget(rid)
        return p

    assert policy(5).draft_lengths([20], [4], remaining=[32], classes=[1]) == [0]
    assert policy(0).draft_lengths([20], [4], remaining=[32])[0] > 0


def test_scored_proposals_bring_drafting_back_without_probes():
    """Long matches (class 4) were all rejected, so two new requests start at k = 0. Their
    proposals are scored against the committed token each round they are not drafted: request 20's
    keep matching and it drafts again within a few rounds; request 21's never do and it is never
    drafted, not even by a probe (due every round here, at no limit on its cost)."""
    p = SpecPolicy("adaptive", "NGRAM", 4, overhead_bound(), classes=5, probe_every=1, probe_budget=1.0)
    for rid in range(10):
        p.record([rid], [4], [4], [0], 1.0, classes=[4])
        p.forget(rid)
    chosen = []
    for _ in range(8):
        ks = p.draft_lengths([20, 21], [4, 4], remaining=[32, 32], waiting=1, classes=[4, 4])
        chosen.append(ks)
        p.record([20, 21], ks, ks, [k if rid == 20 else 0 for rid, k in zip([20, 21], ks)], 1.0, classes=[4, 4])
        undrafted = [rid for rid, k in zip([20, 21], ks) if k == 0]
        p.score(undrafted, [rid == 20 for rid in undrafted], [4] * len(undrafted))
    assert chosen[0] == [0, 0]
    assert all(ks[1] == 0 for ks in chosen), chosen
    assert chosen[-1][0] == 4, chosen


def test_a_kept_long_match_does_not_make_a_request_draft_its_short_ones():
    """Short matches (class 1) are rarely kept, long ones (class 2) mostly: a request whose first,
    long, match kept 2 of 4 has done about what its class promised, which says nothing good of its
    next, short, match. Read against what its proposal's class predicted, its evidence leaves the
    short match at class 1's rate, and it is not drafted; its next long match is."""
    p = SpecPolicy("adaptive", "NGRAM", 4, half_a_step_per_token(), probe_every=1000, classes=5)
    for rid in range(20):
        p.record([rid], [4], [4], [0 if rid % 10 else 1], 1.0, classes=[1])  # class 1: 1 kept in 10
        p.record([rid], [4], [4], [2 if rid % 2 else 4], 1.0, classes=[2])  # class 2: mostly kept
        p.forget(rid)
    assert p.class_acceptance[1].overall() < 0.2 and p.class_acceptance[2].overall() > 0.7
    p.record([50], [4], [4], [2], 1.0, classes=[2])
    assert p.draft_lengths([50], [4], remaining=[32], waiting=1, classes=[1]) == [0]
    assert p.draft_lengths([50], [4], remaining=[32], waiting=1, classes=[2])[0] > 0


def test_a_request_with_one_long_match_is_not_counted_as_leaving_the_batch_early():
    """A draining batch of two copying requests and two open ones, on a CPU-like curve: a plain
    round of 1 request costs far less than one of 2, one of 2 what one of 4 does. The copying
    requests would finish early, but the batch would then run with the 2 open ones, at the price
    of 4: their drafting saves nothing, and they do not draft. One open request has a long match
    this round; that does not put it on course to finish early (it has kept 1 token a round so
    far), so the batch is not priced as if it would drop to 1 request. With one open request
    beside it, a copying request's early finish does save: the batch drops to 1."""
    curve = {1: 0.065, 2: 0.112, 4: 0.116}
    cost = StepCost({(1, 0): 0.0706, (4, 0): 0.1144, (1, 4): 0.1082, (4, 4): 0.152, (4, 16): 0.1748},
                    plain=curve, learn=False)
    policy = SpecPolicy("adaptive", "NGRAM", 4, cost, probe_every=1000, classes=5)
    for rid in range(100, 120):  # earlier requests kept every long match
        policy.record([rid], [4], [4], [4], 0.15, classes=[4 if rid % 2 else 2])
        policy.forget(rid)
    # requests 0 and 2 copy (a 4-token match), 1 has a 2-token match, 3 none
    assert policy.draft_lengths([0, 1, 2, 3], [4, 4, 4, 0], remaining=[31] * 4, classes=[4, 2, 4, 0]) == [0] * 4
    assert policy.draft_lengths([0, 3], [4, 0], remaining=[31, 31], classes=[4, 0]) == [4, 0]


def test_request_rows_grow_together_and_keep_their_evidence():
    """Past the rows it starts with, every table doubles alike, and a request's evidence stays its own."""
    est = RequestEstimates(4)
    first = est.rows([0])
    est.observe(first, np.array([4]), np.array([4]), np.full((1, 4), 0.5))
    before = est.rates(first, np.full((1, 4), 0.5), np.array([0.5]))
    rows = est.rows(list(range(1, 20)))
    assert len(set(rows.tolist()) | {int(first[0])}) == 20
    assert est.hits.shape == est.seen.shape == est.expected.shape and len(est.pace) == len(est.hits) >= 20
    assert est.rates(est.rows([0]), np.full((1, 4), 0.5), np.array([0.5])) == pytest.approx(before)
    assert est.rates(rows, np.full((19, 4), 0.5), np.full(19, 0.5)) == pytest.approx(np.full((19, 4), 0.5))


def test_a_round_is_fitted_without_the_catch_up_it_ran():
    """A round in which a draft cached 100 committed tokens first (1.0 s at 0.01 a token) is
    recorded for its shape without them: the catch-up is priced on its own. A catch-up priced
    above what the round took leaves half the round, never a negative time."""
    cost = StepCost.linear(plain=(1.0, 0.0), per_draft_token=0.1, catch_up_per_token=0.01)
    policy = SpecPolicy("adaptive", "STANDALONE", 4, cost, trace=[])
    policy.record([1], [2], [2], [2], 3.0, caught_up=100)
    policy.record([1], [2], [2], [2], 1.2, caught_up=100)
    policy.record([1], [2], [2], [2], 1.2)
    assert [t["seconds"] for t in policy.trace] == pytest.approx([2.0, 0.6, 1.2])
