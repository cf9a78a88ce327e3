"""How many tokens to draft: per step, and per request where the algorithm allows.

The adaptive policy picks each request's draft length k in 0..K that maximises the batch's
expected goodput, sum_r E[accepted_r + 1 | k_r] / step_time(verify tokens, draft steps):
- acceptance is estimated by draft position, as the conditional rate P(accept i | accepted
  i - 1), per request and per algorithm: a Beta estimate with forgetting; a request's estimate
  leans on the algorithm's at each position, and the algorithm's on a fixed per-algorithm prior
  at position 1 and on the position before at later ones;
- E[accepted | k] = sum_{i<=k} prod_{j<=i} a_j, so the gain of the i-th draft token of a request
  is prod_{j<=i} a_j and never grows with i: for a given verify width the best choice takes the
  largest gains, and the policy tries every width (and every draft depth) and keeps the best ratio;
- step_time is a cost model over total verify tokens plus draft steps, seeded by a warm-up
  measurement and refined online from measured rounds.
A request drafting nothing gets no new observation, so every ``probe_every`` rounds at k = 0 it
drafts one token: that is how speculation comes back once acceptance does.

The fixed policy drafts K tokens for every request (today's behaviour); both honour a request's
own cap (``speculative: false`` is a cap of 0). Nothing here needs torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ADAPTIVE, FIXED = "adaptive", "fixed"
MODES = (ADAPTIVE, FIXED)

# First-position acceptance to expect before anything is measured (later positions alike).
ALGORITHM_PRIORS = {"NGRAM": 0.5, "STANDALONE": 0.7, "EAGLE": 0.7, "EAGLE3": 0.75, "MTP": 0.75}


class Acceptance:
    """Conditional acceptance by draft position, a forgetting Beta estimate over a prior."""

    def __init__(self, positions: int, prior: "Acceptance | float", prior_weight: float = 1.0, decay: float = 0.8):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.hits = [0.0] * positions
        self.seen = [0.0] * positions

    def rates(self) -> list[float]:
        """P(the draft token at position i (0-based) is accepted | all before it were), by position.

        A request's estimate leans on the algorithm's, position by position (what earlier
        requests showed). The algorithm's leans on its fixed prior at position 0 and on the
        position before at later ones, so a position never drafted yet is expected to do as its
        predecessor does (the draft length can grow one position at a time as acceptance shows)."""
        pooled = self.prior.rates() if isinstance(self.prior, Acceptance) else None
        out = []
        for i in range(len(self.hits)):
            if pooled is not None:
                prior = pooled[i]
            else:
                prior = out[-1] if i else self.prior
            out.append((self.prior_weight * prior + self.hits[i]) / (self.prior_weight + self.seen[i]))
        return out

    def rate(self, i: int) -> float:
        return self.rates()[i]

    def observe(self, proposed: int, accepted: int) -> None:
        """One verified round: positions before ``accepted`` were kept, the next one was rejected."""
        for i in range(min(proposed, accepted + 1, len(self.hits))):
            self.seen[i] = self.decay * self.seen[i] + 1
            self.hits[i] = self.decay * self.hits[i] + (1.0 if i < accepted else 0.0)

    def gains(self, k: int) -> list[float]:
        """Expected extra tokens from the 1st..k-th draft token: prod_{j<=i} a_j."""
        out, p = [], 1.0
        for a in self.rates()[:k]:
            p *= a
            out.append(p)
        return out


class CostCurve:
    """Seconds as a piecewise-linear function of a token count, refined toward measurements."""

    def __init__(self, points: dict[int, float], rate: float = 0.2):
        self.xs = sorted(points)
        self.ys = [points[x] for x in self.xs]
        self.rate = rate

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * max(x, 1) / max(xs[0], 1)
        j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        slope = max((y1 - y0) / (x1 - x0), 0.0)
        return max(y0 + slope * (x - x0), 1e-9)

    def update(self, x: float, seconds: float) -> None:
        """Move the two points around ``x`` toward a measured ``seconds`` (EWMA, by proximity)."""
        xs = self.xs
        err = seconds - self(x)
        if len(xs) == 1:
            self.ys[0] += self.rate * err
            return
        j = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        w1 = min(max((x - xs[j - 1]) / (xs[j] - xs[j - 1]), 0.0), 1.0)
        step = self.rate * err / ((1 - w1) ** 2 + w1**2)  # moves the prediction at x by rate x err
        self.ys[j - 1] = max(self.ys[j - 1] + (1 - w1) * step, 1e-9)
        self.ys[j] = max(self.ys[j] + w1 * step, 1e-9)


@dataclass
class StepCost:
    """One round's time: the target's pass over all verify tokens, plus the draft's steps
    (each a pass over one token per drafting request; zero for NGRAM)."""

    target: CostCurve
    draft: CostCurve | None = None

    def __call__(self, verify_tokens: int, draft_steps: int, drafting: int) -> float:
        draft = self.draft(drafting) * draft_steps if self.draft is not None and draft_steps else 0.0
        return self.target(verify_tokens) + draft


@dataclass
class SpecPolicy:
    """Draft lengths for a batch; ``record`` feeds back what each round measured."""

    mode: str
    algorithm: str
    max_draft: int  # K, the engine's --num-draft-tokens
    cost: StepCost
    per_request: bool = True  # False: one k for the whole batch
    choices: tuple[int, ...] | None = None  # the k a uniform batch may take (None: 0..K)
    probe_every: int = 8
    algorithm_acceptance: Acceptance = field(init=False)
    _requests: dict[int, Acceptance] = field(init=False, default_factory=dict)
    _idle_rounds: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown speculation policy {self.mode!r}; use one of {', '.join(MODES)}")
        prior = ALGORITHM_PRIORS.get(self.algorithm, 0.5)
        self.algorithm_acceptance = Acceptance(self.max_draft, prior, prior_weight=2.0, decay=0.95)

    def acceptance(self, rid: int) -> Acceptance:
        if rid not in self._requests:
            self._requests[rid] = Acceptance(self.max_draft, self.algorithm_acceptance)
        return self._requests[rid]

    def draft_lengths(self, rids: list[int], caps: list[int]) -> list[int]:
        """k per request; ``caps[i]`` is request i's own limit (0: no speculation)."""
        caps = [max(0, min(c, self.max_draft)) for c in caps]
        if self.mode == FIXED or self.max_draft == 0:
            return caps
        if not self.per_request:
            return self._uniform(rids, caps)
        best, best_rate = [0] * len(rids), None
        for depth in range(self.max_draft + 1):
            ks, rate = self._best_for_depth(rids, [min(c, depth) for c in caps], depth)
            if best_rate is None or rate > best_rate:
                best, best_rate = ks, rate
        return self._probe(rids, caps, best)

    def _best_for_depth(self, rids, caps, depth) -> tuple[list[int], float]:
        """Largest gains first, every verify width tried: the best ks with at most ``depth`` drafts each."""
        gains = sorted(((g, i, pos) for i, rid in enumerate(rids)
                        for pos, g in enumerate(self.acceptance(rid).gains(caps[i]))), key=lambda t: (-t[0], t[2]))
        n = len(rids)
        tokens, best_m, best_rate, drafting = float(n), 0, n / self.cost(n, 0, 0), set()
        for m, (g, i, _) in enumerate(gains, start=1):
            tokens += g
            drafting.add(i)
            rate = tokens / self.cost(n + m, depth, len(drafting))
            if rate > best_rate:
                best_m, best_rate = m, rate
        ks = [0] * n
        for _, i, _ in gains[:best_m]:
            ks[i] += 1
        return ks, best_rate

    def _uniform(self, rids, caps) -> list[int]:
        n = len(rids)
        options = self.choices if self.choices is not None else range(self.max_draft + 1)
        best_k, best_rate = 0, None
        for k in options:
            expected = sum(1 + sum(self.acceptance(rid).gains(min(k, c))) for rid, c in zip(rids, caps))
            rate = expected / self.cost(sum(1 + min(k, c) for c in caps), k, n if k else 0)
            if best_rate is None or rate > best_rate:
                best_k, best_rate = k, rate
        return [min(best_k, c) for c in caps]

    def _probe(self, rids, caps, ks) -> list[int]:
        """A request held at k = 0 by its estimate drafts one token now and then, to notice recovery."""
        for i, rid in enumerate(rids):
            if ks[i] or not caps[i]:
                self._idle_rounds.pop(rid, None)
                continue
            idle = self._idle_rounds.get(rid, 0) + 1
            if idle >= self.probe_every:
                ks[i], idle = 1, 0
            self._idle_rounds[rid] = idle
        return ks

    def record(self, rids: list[int], ks: list[int], proposed: list[int], accepted: list[int], seconds: float,
               draft_seconds: float = 0.0) -> None:
        """A finished round: acceptance per request and algorithm, and the measured step time."""
        for rid, p, a in zip(rids, proposed, accepted):
            if p:
                self.acceptance(rid).observe(p, a)
                self.algorithm_acceptance.observe(p, a)
        depth = max(ks, default=0)
        drafting = sum(1 for k in ks if k)
        if depth and self.cost.draft is not None and draft_seconds > 0:
            self.cost.draft.update(drafting, draft_seconds / depth)
        self.cost.target.update(len(rids) + sum(proposed), max(seconds - draft_seconds, 1e-9))

    def forget(self, rid: int) -> None:
        self._requests.pop(rid, None)
        self._idle_rounds.pop(rid, None)
