"""The engine's counters: tokens, speculation, scheduling and start-up, as /metrics reads them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .request import Request
from .speculation.rounds import RoundResult


@dataclass
class Stats:
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, positions the prefix cache served (not prefilled)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_rounds: int = 0
    finished_requests: int = 0
    retracted_requests: int = 0  # retractions under KV pressure (work recomputed later)
    accept_lengths: Counter[int] = field(default_factory=Counter)  # accepted drafts per request-round -> count
    draft_lengths: Counter[int] = field(default_factory=Counter)  # draft length chosen per request-round -> count
    decode_steps: int = 0
    steps_without_speculation: int = 0  # decode steps where no request drafted
    proposed_by_position: Counter[int] = field(default_factory=Counter)  # draft position (1-based) -> verified
    accepted_by_position: Counter[int] = field(default_factory=Counter)  # draft position (1-based) -> accepted
    decode_tokens: int = 0  # tokens the decode rounds produced (goodput's numerator)
    decode_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def count_round(self, ks: list[int], results: list[RoundResult], seconds: float) -> None:
        """One decode round over a batch: ``ks`` the draft lengths chosen, ``results`` per request."""
        self.decode_steps += 1
        self.steps_without_speculation += not any(x.proposed for x in results)
        self.draft_lengths.update(ks)
        self.decode_tokens += sum(len(x.tokens) for x in results)
        self.decode_seconds += seconds
        for x in results:
            self.proposed_by_position.update(range(1, x.proposed + 1))
            self.accepted_by_position.update(range(1, x.accepted + 1))

    def count_verified(self, r: Request, result: RoundResult, kept: int) -> None:
        """One request's verified round, on the request and in the totals; ``kept``: how many of
        the round's tokens the request's output took (fewer at EOS or max_tokens)."""
        r.proposed_draft_tokens += result.proposed
        r.accepted_draft_tokens += result.accepted
        r.kept_draft_tokens += min(result.accepted, kept)
        r.verify_rounds += 1
        self.proposed_tokens += result.proposed
        self.accepted_tokens += result.accepted
        self.verify_rounds += 1
        self.accept_lengths[result.accepted] += 1
