"""How many tokens to draft: per step, and per request where the algorithm allows.

The adaptive policy picks each request's draft length k in 0..K that maximises the batch's
expected goodput, sum_r E[accepted_r + 1 | k_r] / step_time(round shape):
- acceptance is estimated by draft position, as the conditional rate P(accept i | accepted
  i - 1), per request and per algorithm: forgetting Beta estimates; a position's rate leans on
  the estimate's rate over all positions, a request's overall rate on the algorithm's, and the
  algorithm's on a fixed per-algorithm prior (see ``Acceptance``);
- E[accepted | k] = sum_{i<=k} prod_{j<=i} a_j, so the gain of the i-th draft token of a request
  is prod_{j<=i} a_j and never grows with i: for a given verify width the best choice takes the
  largest gains, and the policy tries every width (and every draft depth) and keeps the best ratio;
- step_time is ``step_cost.StepCost``: a linear model of the round's shape, seeded by the warm-up
  and refitted online over recent rounds, with machine load cancelled.
A request about to draft after rounds without drafting (or for the first time) first has its
draft model cache the tokens committed since (``StepCost.catch_up``); that once-off cost is spread
over the rounds the request has left and added to any round that turns it on. A new request
expects at least its algorithm's fixed prior, however earlier requests did, so that one that copies
from its prompt drafts within its first rounds, and its own evidence soon overrules that.
A request drafting nothing gets no new observation, so now and then the requests held at k = 0
draft one token each, together, spaced so that probing costs at most ``probe_budget`` of the time:
that is how speculation comes back once acceptance does.

The fixed policy drafts K tokens for every request (today's behaviour); both honour a request's
own cap (``speculative: false`` is a cap of 0). Nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .step_cost import StepCost

ADAPTIVE, FIXED = "adaptive", "fixed"
MODES = (ADAPTIVE, FIXED)

# First-position acceptance to expect before anything is measured (later positions alike).
ALGORITHM_PRIORS = {"NGRAM": 0.5, "STANDALONE": 0.7, "EAGLE": 0.7, "EAGLE3": 0.75, "MTP": 0.75}


class Acceptance:
    """Conditional acceptance by draft position: forgetting Beta estimates, shrunk toward a parent.

    Two levels of pooling, so that evidence counts at once: a position's rate leans on this
    estimate's rate over all positions (a request that kept its first drafts is expected to keep
    later ones too, before it has drafted that far), and that overall rate leans on the parent's
    (the algorithm's estimate for a request; the algorithm's fixed prior for the algorithm)."""

    def __init__(self, positions: int, prior: "Acceptance | float", prior_weight: float = 1.0, decay: float = 0.8,
                 position_weight: float = 1.0, floor: float = 0.0):
        """``floor``: the least overall rate taken from the parent. A new request expects at least
        its algorithm's fixed prior, however badly earlier requests did, so that one that copies
        from its prompt is tried within its first rounds; its own evidence soon outweighs that."""
        self.prior, self.prior_weight, self.decay, self.position_weight = prior, prior_weight, decay, position_weight
        self.floor = floor
        self.hits = [0.0] * positions
        self.seen = [0.0] * positions

    def overall(self) -> float:
        """Acceptance over all positions, leaning on the parent's."""
        parent = self.prior.overall() if isinstance(self.prior, Acceptance) else self.prior
        return (self.prior_weight * max(parent, self.floor) + sum(self.hits)) / (self.prior_weight + sum(self.seen))

    def rates(self, parent: tuple[list[float], float] | None = None) -> list[float]:
        """P(the draft token at position i (0-based) is accepted | all before it were), by position.
        ``parent``: the parent's (rates(), overall()) when the caller has them already."""
        if parent is None and isinstance(self.prior, Acceptance):
            parent = self.prior.rates(), self.prior.overall()
        if parent is None:
            overall = (self.prior_weight * self.prior + sum(self.hits)) / (self.prior_weight + sum(self.seen))
        else:
            parent_overall = max(parent[1], self.floor)
            overall = (self.prior_weight * parent_overall + sum(self.hits)) / (self.prior_weight + sum(self.seen))
        out = []
        for i in range(len(self.hits)):
            # A request's own overall rate, with the algorithm's profile over positions on top of it.
            centre = overall if parent is None else overall * parent[0][i] / max(parent[1], 1e-9)
            centre = min(centre, 1.0)
            out.append((self.position_weight * centre + self.hits[i]) / (self.position_weight + self.seen[i]))
        return out

    def rate(self, i: int) -> float:
        return self.rates()[i]

    def observe(self, proposed: int, accepted: int) -> None:
        """One verified round: positions before ``accepted`` were kept, the next one was rejected."""
        for i in range(min(proposed, accepted + 1, len(self.hits))):
            self.seen[i] = self.decay * self.seen[i] + 1
            self.hits[i] = self.decay * self.hits[i] + (1.0 if i < accepted else 0.0)

    def gains(self, k: int, parent: tuple[list[float], float] | None = None) -> list[float]:
        """Expected extra tokens from the 1st..k-th draft token: prod_{j<=i} a_j."""
        out, p = [], 1.0
        for a in self.rates(parent)[:k]:
            p *= a
            out.append(p)
        return out


@dataclass
class SpecPolicy:
    """Draft lengths for a batch; ``record`` feeds back what each round measured."""

    mode: str
    algorithm: str
    max_draft: int  # K, the engine's --num-draft-tokens
    cost: StepCost
    per_request: bool = True  # False: one k for the whole batch
    choices: tuple[int, ...] | None = None  # the k a uniform batch may take (None: 0..K)
    probe_every: int = 8  # the fewest rounds between two probes
    probe_budget: float = 0.02  # the share of round time that probing may cost
    first_probe_budget: float = 0.1  # the share of a new request's expected rounds its first probe may cost
    trace: list | None = None  # a list to append each round's choice, prediction and measurement to
    algorithm_acceptance: Acceptance = field(init=False)
    _requests: dict[int, Acceptance] = field(init=False, default_factory=dict)
    _since_probe: int = field(init=False, default=0)
    _tried: set = field(init=False, default_factory=set)  # requests that have had their first probe

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown speculation policy {self.mode!r}; use one of {', '.join(MODES)}")
        prior = ALGORITHM_PRIORS.get(self.algorithm, 0.5)
        self.algorithm_acceptance = Acceptance(self.max_draft, prior, prior_weight=2.0, decay=0.95)

    def acceptance(self, rid: int) -> Acceptance:
        if rid not in self._requests:
            floor = ALGORITHM_PRIORS.get(self.algorithm, 0.5)
            self._requests[rid] = Acceptance(self.max_draft, self.algorithm_acceptance, floor=floor)
        return self._requests[rid]

    def draft_lengths(self, rids: list[int], caps: list[int], catch_up: list[int] | None = None,
                      remaining: list[int] | None = None) -> list[int]:
        """k per request; ``caps[i]`` is request i's own limit (0: no speculation). ``catch_up[i]``:
        committed tokens request i's draft model must cache before it drafts again (None: none);
        ``remaining[i]``: the most tokens request i has left to generate (None: unknown, many)."""
        caps = [max(0, min(c, self.max_draft)) for c in caps]
        if self.mode == FIXED or self.max_draft == 0:
            return caps
        self._since_probe += 1
        parent = self.algorithm_acceptance.rates(), self.algorithm_acceptance.overall()
        gains = [self.acceptance(rid).gains(c, parent) for rid, c in zip(rids, caps)]
        if not self.per_request:
            return self._uniform(gains, caps)
        entry = self._entry_costs(gains, catch_up, remaining)
        # Taking the largest gains first ignores what turning a request on costs: so also try the
        # batch with the requests that would have to catch up left out.
        candidates = [gains]
        if any(entry):
            candidates.append([[] if e else g for g, e in zip(gains, entry)])
        best, best_rate = [0] * len(rids), None
        for candidate in candidates:
            for depth in range(self.max_draft + 1):
                ks, rate = self._best_for_depth([g[:depth] for g in candidate], depth, entry)
                if best_rate is None or rate > best_rate:
                    best, best_rate = ks, rate
        catch_up_seconds = [self.cost.catch_up(t) for t in catch_up] if catch_up else None
        best = self._first_probe(rids, caps, best, catch_up_seconds, gains, remaining)
        return self._probe(caps, best, catch_up_seconds)

    def _first_probe(self, rids: list[int], caps: list[int], ks: list[int], catch_up: list[float] | None,
                     gains: list[list[float]], remaining: list[int] | None) -> list[int]:
        """New requests the estimates hold at k = 0 draft their full cap once, together, early in
        their life: a request that copies from its prompt is then found out within its first rounds,
        whatever earlier requests did. The probe round may cost (its verify tokens, the switch, the
        draft caches it must build) at most ``first_probe_budget`` of the new requests' expected rounds."""
        fresh = [i for i, (rid, k, c) in enumerate(zip(rids, ks, caps)) if not k and c and rid not in self._tried]
        if not fresh:
            return ks
        n, m = len(ks), sum(ks)
        depth, drafting = (max(ks) if m else 0), sum(1 for k in ks if k)
        probed = list(ks)
        for i in fresh:
            probed[i] = caps[i]
        now = self.cost(n, m, depth, drafting)
        extra = self.cost(n, sum(probed), max(probed), drafting + len(fresh)) - now
        extra += sum(catch_up[i] for i in fresh) if catch_up else 0.0
        left = [1e9 if remaining is None else max(1.0, remaining[i] / (1.0 + sum(gains[i]))) for i in fresh]
        if extra / now > self.first_probe_budget * sum(left) / len(left):
            return ks
        self._tried.update(rids[i] for i in fresh)
        return probed

    def _entry_costs(self, gains: list[list[float]], catch_up: list[int] | None,
                     remaining: list[int] | None) -> list[float]:
        """Seconds per round that drafting costs request i on top of the round's shape: its draft's
        catch-up, paid once, spread over the rounds it can still draft in (its tokens left over the
        tokens a round gives it at its estimate). A long prompt with few tokens to go thus stays
        undrafted, and one with many to go pays for its catch-up."""
        if catch_up is None:
            return [0.0] * len(gains)
        remaining = remaining or [None] * len(gains)
        out = []
        for g, tokens, left in zip(gains, catch_up, remaining):
            rounds = 1e9 if left is None else max(1.0, left / (1.0 + sum(g)))
            out.append(self.cost.catch_up(tokens) / rounds if tokens else 0.0)
        return out

    def _best_for_depth(self, gains: list[list[float]], depth: int,
                        entry: list[float] | None = None) -> tuple[list[int], float]:
        """Largest gains first, every verify width tried: the best ks with at most ``depth`` drafts each."""
        entry = entry or [0.0] * len(gains)
        order = sorted(((g, i, pos) for i, gs in enumerate(gains) for pos, g in enumerate(gs)),
                       key=lambda t: (-t[0], entry[t[1]], t[2]))
        n = len(gains)
        base, switch, per_token, per_pass, per_pass_request = self.cost.round_terms(n, depth)
        tokens, best_m, best_rate, drafting, entering = float(n), 0, n / self.cost(n, 0), set(), 0.0
        for m, (g, i, _) in enumerate(order, start=1):
            tokens += g
            if i not in drafting:
                drafting.add(i)
                entering += entry[i]
            seconds = base + switch + per_token * m + per_pass + per_pass_request * len(drafting) + entering
            rate = tokens / max(seconds, 1e-9)
            if rate > best_rate:
                best_m, best_rate = m, rate
        ks = [0] * n
        for _, i, _ in order[:best_m]:
            ks[i] += 1
        return ks, best_rate

    def _uniform(self, gains: list[list[float]], caps: list[int]) -> list[int]:
        n = len(gains)
        options = self.choices if self.choices is not None else range(self.max_draft + 1)
        best_k, best_rate = 0, None
        for k in options:
            expected = sum(1 + sum(g[:k]) for g in gains)
            drafts = sum(min(k, c) for c in caps)
            rate = expected / self.cost(n, drafts, k if drafts else 0, n if drafts else 0)
            if best_rate is None or rate > best_rate:
                best_k, best_rate = k, rate
        return [min(best_k, c) for c in caps]

    def _probe(self, caps: list[int], ks: list[int], catch_up: list[float] | None = None) -> list[int]:
        """Requests held at k = 0 by their estimates draft one token each, all in the same round:
        that is how speculation comes back once acceptance does, and the round's switch to the
        verify path is paid once for all of them. A probe round costs extra time (on a CPU a
        verify round can cost twice a plain one), so probes are spaced to spend at most
        ``probe_budget`` of the time: at least ``probe_every`` rounds apart, and further where a
        probe round costs more."""
        idle = [i for i, (k, c) in enumerate(zip(ks, caps)) if not k and c]
        if not idle or self._since_probe < self.probe_every:
            return ks
        n, m = len(ks), sum(ks)
        depth = max(ks) if m else 0
        drafting = sum(1 for k in ks if k)
        now = self.cost(n, m, depth, drafting)
        # A probe round pays in full for the catch-up of the draft caches it turns on.
        catching_up = sum(catch_up[i] for i in idle) if catch_up else 0.0
        extra = (self.cost(n, m + len(idle), max(depth, 1), drafting + len(idle)) + catching_up) / now - 1
        if self._since_probe * self.probe_budget < extra:
            return ks
        self._since_probe = 0
        return [k or int(c > 0) for k, c in zip(ks, caps)]

    def record(self, rids: list[int], ks: list[int], proposed: list[int], accepted: list[int], seconds: float) -> None:
        """A finished round: acceptance per request and algorithm, and the measured step time."""
        for rid, p, a in zip(rids, proposed, accepted):
            if p:
                self.acceptance(rid).observe(p, a)
                self.algorithm_acceptance.observe(p, a)
        if self.mode == FIXED:
            return
        shape = (len(rids), sum(proposed), max(proposed, default=0), sum(1 for p in proposed if p))
        if self.trace is not None:
            self.trace.append({"requests": shape[0], "ks": list(ks), "proposed": sum(proposed),
                               "accepted": sum(accepted), "predicted": self.cost(*shape), "seconds": seconds})
        self.cost.record(*shape, seconds)

    def forget(self, rid: int) -> None:
        self._requests.pop(rid, None)
        self._tried.discard(rid)
