"""Speculation control: what each round drafts, and what the round teaches, behind two calls.

``plan_round`` gathers what is known before a round (NGRAM's lookups, which cost no pass, or free
context guesses where drafts cost one; what each draft must catch up on) and asks the policy for
each request's draft length. ``observe`` gives the policy the round's acceptance and time, and
scores the proposals and guesses the round did not draft against the tokens it committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..request import Request
from .algorithms import Algorithm, Drafter
from .ngram_index import ContextGuesses
from .spec_policy import FIXED, SpecPolicy
from .speculative import Lookup, RoundResult, Speculator
from .step_cost import StepCost
from .step_timing import catch_up_seconds, draft_points, target_points


@dataclass(frozen=True)
class RoundPlan:
    rids: list[int]
    draft_lengths: list[int]
    lookup: Lookup | None  # the proposals, where known before the round
    classes: list[int] | None  # each proposal's (or guess's) class, where known
    guesses: list[int | None] | None  # free guesses of the next token (adaptive, drafts that cost a pass)
    catch_up: list[int] | None  # tokens each draft caches before it drafts (draft models only)


class SpeculationController:
    def __init__(self, policy: SpecPolicy, speculator: Speculator, guesses: ContextGuesses | None = None,
                 waiting: Callable[[], int] = lambda: 0):
        """``waiting``: requests queued for a place in the batch (a draft token is worth less then)."""
        self.policy, self.speculator, self.guesses, self.waiting = policy, speculator, guesses, waiting

    def plan_round(self, reqs: list[Request]) -> RoundPlan:
        caps = [self._draft_cap(r) for r in reqs]
        lookup = self.speculator.look_ahead(reqs, caps)
        classes = guesses = None
        if lookup is not None:
            caps = [min(c, len(p)) for c, p in zip(caps, lookup.proposals)]
            classes = lookup.classes
        elif self.guesses is not None:
            guesses, classes = self.guesses.guess(reqs, caps)
        catch_up = [self.speculator.catch_up_tokens(r) for r in reqs] if self.speculator.catches_up else None
        rids = [r.rid for r in reqs]
        ks = self.policy.draft_lengths(rids, caps, catch_up=catch_up,
                                       remaining=[r.params.max_tokens - len(r.output_ids) for r in reqs],
                                       waiting=self.waiting(), classes=classes)
        return RoundPlan(rids, ks, lookup, classes, guesses, catch_up)

    def observe(self, plan: RoundPlan, results: list[RoundResult], seconds: float) -> None:
        rids, ks = plan.rids, plan.draft_lengths
        caught_up = sum(t for t, k in zip(plan.catch_up, ks) if k) if plan.catch_up else 0
        self.policy.record(rids, ks, [x.proposed for x in results], [x.accepted for x in results], seconds,
                           classes=plan.classes, caught_up=caught_up)
        if plan.lookup is not None:  # each proposal not drafted, against the token committed instead
            lookup = plan.lookup
            undrafted = [i for i, (k, p) in enumerate(zip(ks, lookup.proposals)) if k == 0 and p]
            self.policy.score([rids[i] for i in undrafted],
                              [lookup.proposals[i][0] == results[i].tokens[0] for i in undrafted],
                              [lookup.classes[i] for i in undrafted])
        if plan.guesses is not None:  # each free guess of a request that drafted nothing
            scored = [i for i, (k, g) in enumerate(zip(ks, plan.guesses)) if k == 0 and g is not None]
            self.policy.score_guesses([rids[i] for i in scored],
                                      [plan.guesses[i] == results[i].tokens[0] for i in scored])

    def forget(self, rid: int) -> None:
        """A request finished: drop what was learned about it."""
        self.policy.forget(rid)
        if self.guesses is not None:
            self.guesses.release(rid)

    def _draft_cap(self, r: Request) -> int:
        if not r.speculative:
            return 0
        k = self.policy.max_draft
        return k if r.max_draft_tokens is None else min(k, r.max_draft_tokens)


def build_controller(mode: str, algorithm: str, k: int, speculator: Speculator, step_cost: StepCost,
                     ngram_max: int, waiting: Callable[[], int]) -> SpeculationController:
    """The policy over ``speculator``'s declared draft shapes. Where the drafts cost a pass, the
    adaptive policy classes rounds by free guesses instead of by the proposals (which NGRAM's
    lookups know before the round, and draft models do not)."""
    guessed = mode != FIXED and k > 0 and not speculator.draft_classes
    guesses = ContextGuesses(ngram_max) if guessed else None
    policy = SpecPolicy(mode, algorithm, k, step_cost, per_request=speculator.per_request_draft_lengths,
                        choices=speculator.draft_length_choices, verified_per_request=speculator.verified_per_request,
                        classes=guesses.classes if guessed else speculator.draft_classes, classes_scored=not guessed)
    return SpeculationController(policy, speculator, guesses, waiting)


def measure_step_cost(mode: str, method: Algorithm, k: int, speculator: Speculator, draft_runner, batch: int,
                      context_len: int, chunk_tokens: int, target_layers: int) -> StepCost:
    """The policy's round-cost model, measured on one device (a few passes at batch 1 and full,
    width 1, 2 and k + 1); with tensor parallelism the ranks cannot time passes alone, so a guess
    refined online seeds it. A fixed policy needs none."""
    if mode == FIXED or k == 0:
        return StepCost({(1, 0): 1.0}, learn=False)
    target_runner = speculator.target
    catch_up = 0.0  # seconds per token a draft model caches when a request resumes drafting
    curve = None  # plain rounds by batch size (None: the target's plain points)
    if target_runner.tp.size > 1:  # guess: verifying K per request at full batch doubles a plain step
        target = {(1, 0): 0.01, (batch, 0): 0.01, (1, k): 0.01 * (1 + 1 / batch),
                  (batch, batch): 0.01 * (1 + 1 / k), (batch, batch * k): 0.02}
    else:
        target, curve = target_points(target_runner, batch, k, context_len, speculator, chunk_tokens=chunk_tokens)
    plain = {1: target[(1, 0)], batch: target[(batch, 0)]}
    if method.drafter is Drafter.MODEL and draft_runner.tp.size > 1:
        # A sharded draft cannot be timed alone either: its decode cost scales with its weight bytes.
        share = draft_runner.weight_bytes / max(target_runner.weight_bytes, 1)
        draft = {j: s * share for j, s in plain.items()}
        catch_up = share * catch_up_seconds(target[(1, 0)], target[(1, k)], k + 1)
    elif method.drafter is Drafter.MODEL:
        draft, catch_up = draft_points(draft_runner, batch, context_len, chunk_tokens=chunk_tokens)
    elif not method.draft_name:  # a lookup: no pass
        draft = None
    else:  # an EAGLE head or NextN layer: one layer against the target's many
        layers = max(target_layers, 1)
        draft = {j: s / layers for j, s in plain.items()}
    return StepCost(target, draft, catch_up_per_token=catch_up, plain=curve)
