"""A round-cost model with known terms, as if the warm-up had timed rounds that cost exactly that."""

from __future__ import annotations

from specdecode_worker.engine.speculation.round_cost import RoundCost

SIZES = (1, 2, 4, 8, 16, 64)


def linear_cost(k: int, plain: float = 1.0, per_request: float = 0.0, per_draft_token: float = 0.0,
                per_pass: float = 0.0, fixed: float = 0.0) -> RoundCost:
    """Rounds of up to ``k`` drafts: a plain round takes ``plain + per_request * b``; a drafting
    round adds ``fixed``, ``per_pass`` per draft step and ``per_draft_token`` per verified token."""
    p = {b: plain + per_request * b for b in SIZES}
    drafting = {(b, d): p[b] + fixed + per_pass * d + per_draft_token * b * d for b in SIZES for d in range(1, k + 1)}
    one = {b: p[b] + fixed + per_pass * k + per_draft_token * k for b in SIZES}
    return RoundCost(p, drafting, one)
