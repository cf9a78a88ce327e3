"""How many tokens to draft each round: a model ranks the draft lengths, measurement decides
whether to draft at all.

- **Acceptance** is estimated by draft position, as P(accept i | accepted i - 1), an average
  over recent verified rounds that leans on a per-algorithm prior. Where proposals are known
  before the round (NGRAM's lookups), it is kept per class of proposal (the matched suffix's
  length): a one-token match in open text is rarely kept, a four-token match in copied text
  nearly always.
- **Round cost** is ``round_cost.RoundCost``: whole rounds timed at start-up, every pass a round
  runs included. With acceptance it ranks the draft lengths by expected tokens per second.
- **The guard**: the policy measures how fast rounds commit tokens, as the time plain rounds at
  the warm-up's speed would need for those tokens over the time taken: its plain rounds at any
  batch size together (load slows them all alike), its drafting rounds per batch-size bucket (1,
  2-3, 4-7, ...). Once both are measured, drafting happens in a bucket only if it measured
  faster there; the model alone decides only until then. So a wrong model can cost a few
  rounds, never a run: drafting at a measured loss stops.
- **Probes** keep both measurements current at a bounded cost: a plain round after every
  ``probe_every`` rounds without one (rounds where nobody drafts come free, and count), and, in
  a bucket where drafting is off, a drafting round at most every ``probe_every`` rounds and at
  most ``probe_budget`` of the time, by what the last one cost over a plain round.

The fixed policy drafts all it can for every request: K tokens, or a lookup's whole proposal;
both honour a request's own cap (``speculative: false`` is a cap of 0). Nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..args import FIXED, MODES
from .algorithms import ALGORITHMS
from .round_cost import RoundCost



class Acceptance:
    """Conditional acceptance by draft position, P(position i is kept | all before it were): a
    decayed average of verified rounds. Each position leans on the rate over all positions
    (drafts whose first tokens are kept are expected to keep later ones, before any has been
    verified that far), and that on ``prior``, each worth ``prior_weight`` rounds."""

    def __init__(self, positions: int, prior: float, prior_weight: float = 2.0, decay: float = 0.95):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.hits = np.zeros(positions)
        self.seen = np.zeros(positions)

    def rates(self) -> np.ndarray:
        w = self.prior_weight
        overall = (w * self.prior + self.hits.sum()) / (w + self.seen.sum())
        return (w * overall + self.hits) / (w + self.seen)

    def gains(self) -> np.ndarray:
        """Expected extra tokens from the 1st..K-th draft token: prod_{j<=i} a_j."""
        return np.cumprod(self.rates())

    def observe(self, proposed: np.ndarray, accepted: np.ndarray) -> None:
        """Verified proposals, one per request: positions before ``accepted`` were kept, the next
        one (if proposed) rejected, and later ones were never judged."""
        pos = np.arange(len(self.hits))[None, :]
        judged = pos < np.minimum(proposed, accepted + 1)[:, None]
        kept = judged & (pos < accepted[:, None])
        count = judged.sum(0)
        if not count.any():
            return
        self.seen = self.decay ** count * self.seen + judged.sum(0)
        self.hits = self.decay ** count * self.hits + kept.sum(0)


class MeasuredSpeed:
    """How fast recent rounds of one kind committed tokens: the seconds plain rounds at the
    warm-up's speed would need for their tokens, over the seconds they took. Older rounds count
    less by how many rounds ago they ran (up to ``stale`` rounds), so a probe after a long pause
    outweighs what was measured before it. Load slows both kinds alike, so their ratio is what
    drafting buys now."""

    def __init__(self, decay: float = 0.8, stale: int = 8):
        self.decay, self.stale = decay, stale
        self.saved = self.took = 0.0
        self.rounds = 0  # rounds measured, in all

    def add(self, plain_seconds: float, seconds: float, age: int = 1) -> None:
        """A round of this kind, ``age`` rounds of its bucket after the one before it."""
        keep = self.decay ** min(max(age, 1), self.stale)
        self.saved = keep * self.saved + plain_seconds
        self.took = keep * self.took + seconds
        self.rounds += 1

    @property
    def speed(self) -> float:
        return self.saved / self.took if self.took > 0 else 0.0


@dataclass
class Bucket:
    """What the guard knows of drafting rounds of one batch-size range."""

    drafting: MeasuredSpeed = field(default_factory=MeasuredSpeed)
    since_drafting: int = 0  # rounds of this bucket since its last drafting one
    seconds_since_drafting: float = 0.0
    drafting_extra: float = 0.0  # what the last drafting round took over a plain one, in seconds


def bucket_of(requests: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: the bucket's smallest size."""
    return 1 << (max(requests, 1).bit_length() - 1)


@dataclass
class SpecPolicy:
    """Draft lengths for a batch; ``record`` feeds back what each round measured."""

    mode: str
    algorithm: str
    max_draft: int  # K, the engine's --num-draft-tokens
    cost: RoundCost | None  # None: nothing timed (tensor parallelism): draft K, measurement decides
    classes: int = 0  # classes of proposals known before the round (``Lookup.classes``; 0: none)
    probe_every: int = 32  # the fewest rounds between two probes of one kind
    probe_budget: float = 0.02  # the most time drafting probes may take beyond plain rounds, as a share
    least_rounds: int = 3  # rounds of each kind measured before a verdict counts
    probes: int = field(init=False, default=0)  # rounds run to measure, not because they were best
    plain: MeasuredSpeed = field(init=False, default_factory=MeasuredSpeed)  # every batch size's plain rounds
    since_plain: int = field(init=False, default=0)  # rounds since the last plain one
    buckets: dict[int, Bucket] = field(init=False, default_factory=dict)
    acceptance: list[Acceptance] = field(init=False)  # by class (one where proposals have none)
    _probing: bool = field(init=False, default=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown speculation policy {self.mode!r}; use one of {', '.join(MODES)}")
        prior = ALGORITHMS[self.algorithm].prior
        self.acceptance = [Acceptance(max(self.max_draft, 1), prior) for _ in range(max(self.classes, 1))]

    # ---- the choice ---------------------------------------------------------------------------
    def draft_lengths(self, rids: list[int], caps: list[int], classes: list[int] | None = None) -> list[int]:
        """k per request; ``caps[i]`` is request i's own limit (0: no speculation; a lookup's
        proposal length); ``classes[i]``: the class of request i's proposal, where known."""
        caps = [max(0, min(c, self.max_draft)) for c in caps]
        self._probing = False
        if self.mode == FIXED or not any(caps):
            return caps
        n = len(caps)
        bucket = self.buckets.setdefault(bucket_of(n), Bucket())
        gains = self._gains(caps, classes)
        best = self._best(gains, caps, classes is not None)
        verdict = self._verdict(bucket)
        draft = verdict if verdict is not None else any(best)  # measurement first, the model until then
        probe = self._plain_probe_due() if draft else self._drafting_probe_due(bucket)
        self._probing = probe
        if draft == probe:  # not drafting, or a plain probe
            return [0] * n
        return best if any(best) else self._best(gains, caps, classes is not None, must_draft=True)

    def _gains(self, caps: list[int], classes: list[int] | None) -> np.ndarray:
        """[requests, K]: the expected extra tokens of each draft position, 0 past the cap."""
        by_class = np.array([a.gains() for a in self.acceptance])
        rows = by_class[np.minimum(classes, len(by_class) - 1) if classes is not None else np.zeros(len(caps), int)]
        return np.where(np.arange(rows.shape[1])[None, :] < np.array(caps)[:, None], rows, 0.0)

    def _best(self, gains: np.ndarray, caps: list[int], per_request: bool, must_draft: bool = False) -> list[int]:
        """The lengths the model expects most tokens per second from. Without a timed model, all
        that may be drafted. Where proposals differ (a lookup's classes), any request's tokens may be
        taken, the likeliest first; otherwise every request drafts one k (within its cap)."""
        n, cap = len(caps), np.array(caps)
        if self.cost is None:
            return caps
        best, best_rate = np.zeros(n, dtype=np.int64), (-1.0 if must_draft else n / self.cost.plain(n))
        for depth in range(1, int(cap.max()) + 1):
            if per_request:
                g = gains[:, :depth]
                request, position = np.nonzero(g > 0)
                order = np.lexsort((position, -g[request, position]))  # a request's gains fall with position
                request, tokens = request[order], np.cumsum(g[request, position][order])
                verified = np.arange(1, len(tokens) + 1)
            else:
                ks = np.minimum(cap, depth)
                request, tokens, verified = None, np.array([gains[:, :depth].sum()]), np.array([ks.sum()])
            if not len(tokens):
                continue
            rate = (n + tokens) / self.cost.round(n, verified, depth)
            i = int(np.argmax(rate))
            if rate[i] > best_rate:
                best_rate = rate[i]
                best = np.bincount(request[: i + 1], minlength=n) if per_request else np.minimum(cap, depth)
        return best.tolist()

    def _verdict(self, bucket: Bucket) -> bool | None:
        """Whether drafting measured faster than plain rounds (None: not both measured yet)."""
        if self.plain.rounds < self.least_rounds or bucket.drafting.rounds < self.least_rounds:
            return None
        return bucket.drafting.speed > self.plain.speed

    def _plain_probe_due(self) -> bool:
        """A plain round, while drafting: the first few soon, then one every ``probe_every``."""
        return self.since_plain >= (2 if self.plain.rounds < self.least_rounds else self.probe_every)

    def _drafting_probe_due(self, bucket: Bucket) -> bool:
        """A drafting round, while drafting is off: spaced by rounds and by what one costs."""
        return (bucket.since_drafting >= self.probe_every
                and bucket.seconds_since_drafting * self.probe_budget >= bucket.drafting_extra)

    # ---- what a round measured ----------------------------------------------------------------
    def record(self, rids: list[int], ks: list[int], proposed: list[int], accepted: list[int], seconds: float,
               classes: list[int] | None = None) -> None:
        """A finished round: acceptance by class, and its speed in its bucket. A request that was
        asked for drafts and found none (an n-gram lookup that matched nothing) verified nothing
        and is not observed."""
        p, a = np.array(proposed, dtype=np.int64), np.array(accepted, dtype=np.int64)
        self._observe(p, a, classes)
        if self.mode == FIXED:
            return
        self.probes += self._probing
        self._probing = False
        n = len(rids)
        bucket = self.buckets.setdefault(bucket_of(n), Bucket())
        # Without timed rounds (tensor parallelism), plain rounds count as equally long at any batch size.
        plain = self.cost.plain(n) if self.cost is not None else 1.0
        tokens = n + int(a.sum())
        self.since_plain += 1
        bucket.since_drafting += 1
        if p.any():
            bucket.drafting.add(plain * tokens / n, seconds, bucket.since_drafting)
            # A plain round now takes its warm-up time over the plain rounds' measured speed.
            plain_now = plain / self.plain.speed if self.plain.speed else plain
            bucket.drafting_extra = max(0.0, seconds - plain_now)
            bucket.since_drafting, bucket.seconds_since_drafting = 0, 0.0
        else:
            self.plain.add(plain, seconds, self.since_plain)
            self.since_plain = 0
            bucket.seconds_since_drafting += seconds

    def score(self, kept: list[bool], classes: list[int]) -> None:
        """Proposals known before a round that were not drafted, each scored against the token the
        round committed (``kept[i]``: whether it was the proposal's first token). For a lookup's
        proposal that is what verifying its first token would have said: first-position evidence
        for its class, without a verify pass."""
        if kept:
            self._observe(np.ones(len(kept), dtype=np.int64), np.array(kept, dtype=np.int64), classes)

    def _observe(self, proposed: np.ndarray, accepted: np.ndarray, classes: list[int] | None) -> None:
        judged = proposed > 0
        if not judged.any():
            return
        if classes is None or len(self.acceptance) == 1:
            self.acceptance[0].observe(proposed[judged], accepted[judged])
            return
        c = np.array(classes)
        for value in np.unique(c[judged]):
            mine = judged & (c == value)
            self.acceptance[min(int(value), len(self.acceptance) - 1)].observe(proposed[mine], accepted[mine])

    def speedups(self) -> dict[str, float]:
        """Drafting's measured speed over plain rounds', by batch-size bucket ('4-7'), where both ran."""
        if not self.plain.rounds or not self.plain.speed:
            return {}
        return {(str(low) if low == 1 else f"{low}-{2 * low - 1}"): bucket.drafting.speed / self.plain.speed
                for low, bucket in sorted(self.buckets.items()) if bucket.drafting.rounds}

    def forget(self, rid: int) -> None:
        """A request finished (nothing is kept per request)."""
