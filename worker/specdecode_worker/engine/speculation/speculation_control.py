"""Speculation control: what each round drafts, and what the round teaches, behind two calls.

``plan_round`` gathers what is known before a round (NGRAM's lookups, which cost no pass) and asks
the policy for each request's draft length. ``observe`` gives the policy the round's acceptance and
time, and scores the lookups the round did not draft against the tokens it committed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request import Request
from .round_cost import RoundCost
from .spec_policy import FIXED, SpecPolicy
from .rounds import Lookup, RoundResult, Speculator
from .step_timing import time_rounds


@dataclass(frozen=True)
class RoundPlan:
    rids: list[int]
    draft_lengths: list[int]
    lookup: Lookup | None  # the proposals, where known before the round


class SpeculationController:
    def __init__(self, policy: SpecPolicy, speculator: Speculator):
        self.policy, self.speculator = policy, speculator

    def plan_round(self, reqs: list[Request]) -> RoundPlan:
        caps = [self._draft_cap(r) for r in reqs]
        lookup = self.speculator.look_ahead(reqs, caps)
        classes = None
        if lookup is not None:
            caps = [min(c, len(p)) for c, p in zip(caps, lookup.proposals)]
            classes = lookup.classes
        rids = [r.rid for r in reqs]
        return RoundPlan(rids, self.policy.draft_lengths(rids, caps, classes=classes), lookup)

    def observe(self, plan: RoundPlan, results: list[RoundResult], seconds: float) -> None:
        lookup = plan.lookup
        self.policy.record(plan.rids, plan.draft_lengths, [x.proposed for x in results],
                           [x.accepted for x in results], seconds, classes=lookup.classes if lookup else None)
        if lookup is not None:  # each proposal not drafted, against the token committed instead
            undrafted = [i for i, (k, p) in enumerate(zip(plan.draft_lengths, lookup.proposals)) if k == 0 and p]
            self.policy.score([lookup.proposals[i][0] == results[i].tokens[0] for i in undrafted],
                              [lookup.classes[i] for i in undrafted])

    def _draft_cap(self, r: Request) -> int:
        if not r.speculative:
            return 0
        k = self.policy.max_draft
        return k if r.max_draft_tokens is None else min(k, r.max_draft_tokens)


def build_controller(mode: str, algorithm: str, k: int, speculator: Speculator,
                     cost: RoundCost | None) -> SpeculationController:
    policy = SpecPolicy(mode, algorithm, k, cost, classes=speculator.draft_classes)
    return SpeculationController(policy, speculator)


def measure_round_cost(mode: str, k: int, speculator: Speculator, batch: int, context_len: int,
                       chunk_tokens: int) -> RoundCost | None:
    """The adaptive policy's round-cost model, from rounds timed on this device. None where the
    fixed policy needs none, or under tensor parallelism, where a rank cannot run rounds alone:
    the policy then drafts K until measurement says otherwise."""
    if mode == FIXED or k == 0 or speculator.target.tp.size > 1:
        return None
    return time_rounds(speculator, batch, context_len, chunk_tokens)
