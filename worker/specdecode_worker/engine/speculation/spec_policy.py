"""How many tokens to draft: per step, and per request where the algorithm allows.

The adaptive policy picks each request's draft length k in 0..K that maximises the batch's
expected goodput, sum_r (1 + v_r E[accepted_r | k_r]) / step_time(round shape):
- acceptance is estimated by draft position, as the conditional rate P(accept i | accepted
  i - 1), per algorithm and per request. The algorithm's is a forgetting Beta estimate whose
  positions lean on its rate over all positions, and that on a fixed per-algorithm prior
  (``Acceptance``). Where the proposals are known before the round (NGRAM's lookups,
  ``speculative.Lookup``), acceptance is also learnt per class of proposal (the matched suffix's
  length), and a request leans on its proposal's class instead of the algorithm: a one-token
  match in open text is rarely kept, a four-token match in a copied passage nearly always. Where
  the drafts cost a pass, a free lookup of the request's own context classes its round the same
  way (``ngram_index.ContextGuesses``), and each class learns the draft's acceptance from the
  rounds that drafted in it: a draft model too keeps a copied passage's tokens far more often
  than open text's, and a request is then read by the text it is at, not by the requests before
  it. A request's own estimate is its parent's (its class's, or the algorithm's) times a factor,
  its kept tokens over what its parents expected it to keep, so that a request that kept a long
  match as long matches are kept is not expected to keep its next short one (``RequestEstimates``: every
  request is a row of arrays, so a round costs a few numpy operations whatever the batch);
- E[accepted | k] = sum_{i<=k} prod_{j<=i} a_j, so the gain of the i-th draft token of a request
  is prod_{j<=i} a_j and never grows with i: for a given verify width the best choice takes the
  largest gains, and the policy tries every width (and every draft depth) and keeps the best ratio;
- v_r, what a token drafted for request r is worth as a share of an average token of the round:
  1 while requests wait for a place (one that finishes early lets the next in) or for a request
  that no other outlasts; less for one the others outlast in a draining batch, whose early finish
  saves only its own place in the rounds it leaves (``_token_values``);
- step_time is ``step_cost.StepCost``: a linear model of the round's shape, seeded by the warm-up
  and refitted online over recent rounds, with machine load cancelled, and a measured curve of
  plain rounds by batch size for what a request's place in a round costs. A round prices the
  tokens it verifies: an EAGLE tree's round verifies every node of every request's tree (N + 1
  rows each) whatever k the policy picks, so k only chooses which nodes may be accepted.
A request about to draft after rounds without drafting (or for the first time) first has its
draft model cache the tokens committed since (``StepCost.catch_up``); that once-off cost is spread
over the rounds the request has left and added to any round that turns it on. A new request
expects at least its algorithm's fixed prior, however earlier requests did (where there are no
classes to go by), and if that does not get it drafting it drafts once anyway (its first probe,
at the length that costs least net of what it is expected to give, if a failed probe would cost
at most ``first_probe_budget`` of its time without drafting), so that one that copies from its
prompt is found out in its first rounds; where rounds are classed, only in a class that drafted
rounds have yet to teach. Where drafts cost a pass, the free lookup's first token is also scored
as a guess at the request's next token (``score_guesses``): a request whose guesses come true
copies, and its failed probe is priced at the odds its guesses give.
A request drafting nothing gets no new observation, so now and then the requests held at k = 0
by their estimates draft one token each, together, spaced so that probing costs at most
``probe_budget`` of the time: that is how speculation comes back once acceptance does. Proposals
known before the round need neither probe: one not drafted is scored against the token the round
committed (``score``), which is what verifying its first token would have told, for nothing (a
draft model's guesses are not its proposals, so its classed rounds keep both probes). A lookup
that found nothing to propose (NGRAM) is no evidence either way: no token was verified, so asking
cost nothing, and it says nothing of how often a match is accepted (counting it as a rejection
would scale a request's gains by how often it matches while its cost, priced per verified token,
stays whole). Where lookups come before the round, such a request's cap is 0 for it (its first
probe waits for its first match); where they do not, a first probe that found nothing comes again.

The fixed policy drafts all it can for every request: K tokens, or a lookup's whole proposal
(today's behaviour); both honour a request's own cap (``speculative: false`` is a cap of 0).
Nothing here needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .algorithms import ALGORITHMS
from .step_cost import StepCost

ADAPTIVE, FIXED = "adaptive", "fixed"
MODES = (ADAPTIVE, FIXED)

# First-position acceptance to expect before anything is measured (later positions alike).


class Acceptance:
    """Conditional acceptance by draft position, pooled over many requests (an algorithm's, or a
    class of proposals'): forgetting Beta estimates, shrunk toward a fixed prior in two levels, so
    that evidence counts at once: a position's rate leans on the rate over all positions (proposals
    that kept their first drafts are expected to keep later ones, before any has drafted that
    far), and that rate on the prior."""

    def __init__(self, positions: int, prior: float, prior_weight: float = 1.0, decay: float = 0.8,
                 position_weight: float = 1.0):
        self.prior, self.prior_weight, self.decay, self.position_weight = prior, prior_weight, decay, position_weight
        self.hits = [0.0] * positions
        self.seen = [0.0] * positions

    def overall(self) -> float:
        """Acceptance over all positions, leaning on the prior."""
        return (self.prior_weight * self.prior + sum(self.hits)) / (self.prior_weight + sum(self.seen))

    def rates(self) -> list[float]:
        """P(the draft token at position i (0-based) is accepted | all before it were), by position."""
        overall = self.overall()
        return [(self.position_weight * overall + h) / (self.position_weight + n) for h, n in zip(self.hits, self.seen)]

    def observe(self, proposed: int, accepted: int) -> None:
        """One verified round: positions before ``accepted`` were kept, the next one was rejected."""
        for i in range(min(proposed, accepted + 1, len(self.hits))):
            self.seen[i] = self.decay * self.seen[i] + 1
            self.hits[i] = self.decay * self.hits[i] + (1.0 if i < accepted else 0.0)

    def observe_many(self, proposed: np.ndarray, accepted: np.ndarray) -> None:
        """Several verified rounds at once, as ``observe`` on each in turn (their order kept)."""
        counted = np.arange(len(self.hits))[None, :] < np.minimum(proposed, accepted + 1)[:, None]  # [n, K]
        if not counted.any():
            return
        kept = counted & (np.arange(len(self.hits))[None, :] < accepted[:, None])
        later = counted[::-1].cumsum(0)[::-1] - 1  # counted rounds after this one, per position
        weight = np.where(counted, self.decay ** later, 0.0)
        keep = self.decay ** counted.sum(0)
        self.seen = (keep * np.array(self.seen) + weight.sum(0)).tolist()
        self.hits = (keep * np.array(self.hits) + (weight * kept).sum(0)).tolist()

    def gains(self, k: int) -> list[float]:
        """Expected extra tokens from the 1st..k-th draft token: prod_{j<=i} a_j."""
        out, p = [], 1.0
        for a in self.rates()[:k]:
            p *= a
            out.append(p)
        return out


def lifted(parent_rates: np.ndarray, parent_overall: np.ndarray, floor: float) -> np.ndarray:
    """[requests, positions]: each parent's rates, raised in proportion where its overall rate is
    below ``floor`` (a new request expects at least its algorithm's prior), at most 1."""
    lift = np.maximum(parent_overall, floor) / np.maximum(parent_overall, 1e-9)
    return np.minimum(parent_rates * lift[:, None], 1.0)


class RequestEstimates:
    """Every request's acceptance, relative to what it was expected to accept, as rows of arrays,
    so that a round's estimates cost a few array operations, whatever the batch.

    A request's proposals lean on a parent that can change from round to round (the algorithm's
    estimate, or the class of this round's proposal), so its own evidence is read against what
    its parent predicted for each token it had verified: a request is its parent's rates times a
    factor, its kept tokens over the tokens its parents expected it to keep, shrunk toward 1 (a
    gamma prior worth ``prior_weight`` expected tokens), with a factor per position on top
    (``position_weight``). A request that kept a long match's tokens as often as long matches are
    kept has a factor of 1, and its next short match is priced as short matches are; one that kept
    more than its proposals promised is priced above its parents wherever it goes, and one that
    kept less, below."""

    def __init__(self, positions: int, prior_weight: float = 1.0, decay: float = 0.8, position_weight: float = 1.0):
        self.positions = positions
        self.prior_weight, self.decay, self.position_weight = prior_weight, decay, position_weight
        self.hits = np.zeros((8, positions))  # decayed tokens kept, by position
        self.seen = np.zeros((8, positions))  # decayed tokens verified (a position judged)
        self.expected = np.zeros((8, positions))  # decayed sum of the parent's rate for each judged position
        self.pace = np.ones(8)  # tokens a round, recently (a moving average; 1 for a new request)
        self._row: dict[int, int] = {}
        self._free = list(range(7, -1, -1))

    def rows(self, rids: list[int]) -> np.ndarray:
        """Each request's row; a new request gets a fresh one (no evidence yet)."""
        for rid in rids:
            if rid not in self._row:
                if not self._free:
                    size = len(self.hits)
                    for name in ("hits", "seen", "expected"):
                        table = getattr(self, name)
                        setattr(self, name, np.vstack([table, np.zeros_like(table)]))
                    self.pace = np.concatenate([self.pace, np.ones(size)])
                    self._free = list(range(2 * size - 1, size - 1, -1))
                row = self._row[rid] = self._free.pop()
                self.hits[row] = self.seen[row] = self.expected[row] = 0.0
                self.pace[row] = 1.0
        return np.fromiter((self._row[rid] for rid in rids), dtype=np.int64, count=len(rids))

    def rates(self, rows: np.ndarray, parent_rates: np.ndarray, parent_overall: np.ndarray,
              floor: float = 0.0) -> np.ndarray:
        """[requests, positions]: P(request i keeps the draft token at each position | it kept
        those before), where its parent's rates are ``parent_rates[i]`` by position and
        ``parent_overall[i]`` over all (floored at ``floor``)."""
        hits, expected = self.hits[rows], self.expected[rows]
        factor = (self.prior_weight + hits.sum(1)) / (self.prior_weight + expected.sum(1))
        by_position = (self.position_weight + hits) / (self.position_weight + factor[:, None] * expected)
        return np.minimum(lifted(parent_rates, parent_overall, floor) * factor[:, None] * by_position, 1.0)

    def gains(self, rows: np.ndarray, caps: np.ndarray, parent_rates: np.ndarray, parent_overall: np.ndarray,
              floor: float = 0.0) -> np.ndarray:
        """[requests, positions]: the expected extra tokens of each draft position, 0 past the cap."""
        g = np.cumprod(self.rates(rows, parent_rates, parent_overall, floor), axis=1)
        return np.where(np.arange(self.positions)[None, :] < caps[:, None], g, 0.0)

    def observe(self, rows: np.ndarray, proposed: np.ndarray, accepted: np.ndarray, predicted: np.ndarray) -> None:
        """Verified rounds: ``predicted[i]``, request i's parent's (lifted) rates by position when
        its proposal was made, what each judged position counts as expected."""
        pos = np.arange(self.positions)[None, :]
        counted = pos < np.minimum(proposed, accepted + 1)[:, None]
        kept = (pos < accepted[:, None]).astype(float)
        for name, value in (("seen", 1.0), ("hits", kept), ("expected", predicted)):
            table = getattr(self, name)
            table[rows] = np.where(counted, self.decay * table[rows] + value, table[rows])

    def advance(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """A round committed ``tokens[i]`` tokens for request i (its accepted drafts and one more)."""
        self.pace[rows] = self.decay * self.pace[rows] + (1.0 - self.decay) * tokens

    def observed(self, rows: np.ndarray) -> np.ndarray:
        """Whether each request has had a draft token verified (a first position judged)."""
        return self.seen[rows, 0] > 0

    def forget(self, rid: int) -> None:
        row = self._row.pop(rid, None)
        if row is not None:
            self._free.append(row)


@dataclass
class SpecPolicy:
    """Draft lengths for a batch; ``record`` feeds back what each round measured."""

    mode: str
    algorithm: str
    max_draft: int  # K, the engine's --num-draft-tokens
    cost: StepCost
    per_request: bool = True  # False: one k for the whole batch
    choices: tuple[int, ...] | None = None  # the k a uniform batch may take (None: 0..K)
    verified_per_request: int | None = None  # draft tokens each request verifies in a drafting round (None: its k)
    classes: int = 0  # classes of rounds known before them (``Lookup.classes``, ``ContextGuesses``; 0: none)
    classes_scored: bool = True  # whether a classed round not drafted is scored (NGRAM's proposals are known)
    probe_every: int = 8  # the fewest rounds between two probes
    probe_budget: float = 0.02  # the share of round time that probing may cost
    first_probe_budget: float = 0.05  # the most a failed first probe may cost, as a share of the request's plain time
    guess_prior: float = 2.0  # free guesses counted as failed before any is scored (``_failure_odds``)
    trace: list | None = None  # a list to append each round's choice, prediction and measurement to
    prior: float = field(init=False)  # the algorithm's first-position acceptance before any evidence
    algorithm_acceptance: Acceptance = field(init=False)
    class_acceptance: list[Acceptance] = field(init=False)
    requests: RequestEstimates = field(init=False)
    guesses: dict[int, list[int]] = field(init=False, default_factory=dict)  # rid -> [kept, scored] free guesses
    _since_probe: int = field(init=False, default=0)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown speculation policy {self.mode!r}; use one of {', '.join(MODES)}")
        self.prior = ALGORITHMS[self.algorithm].prior
        self.algorithm_acceptance = Acceptance(self.max_draft, self.prior, prior_weight=2.0, decay=0.95)
        self.class_acceptance = [Acceptance(self.max_draft, self.prior, prior_weight=2.0, decay=0.95)
                                 for _ in range(self.classes)]
        self.requests = RequestEstimates(self.max_draft)

    def acceptance(self, rid: int) -> list[float]:
        """Request ``rid``'s acceptance by draft position, as the policy now estimates it (leaning
        on the algorithm's estimate, whatever the class of its next proposal)."""
        return self.requests.rates(self.requests.rows([rid]), *self._parents(1, None))[0].tolist()

    def _parents(self, n: int, classes: list[int] | None) -> tuple[np.ndarray, np.ndarray, float]:
        """What each of ``n`` requests' estimates leans on: rates by position [n, K], overall
        rates [n], and the least overall rate taken from them. Where the round's proposals have
        classes, a request leans on its proposal's class; otherwise on the algorithm's estimate,
        floored at the algorithm's prior: a new request expects at least the prior, however badly
        earlier requests did, so that one that copies from its prompt is tried within its first
        rounds. Classes need no floor: what earlier requests taught of a class is what a new
        proposal of that class is worth (a copied passage matches long suffixes, whose class keeps
        its own, high, estimate, however often short matches failed)."""
        if classes is not None and self.class_acceptance:
            by_class = {c: (self.class_acceptance[c].rates(), self.class_acceptance[c].overall()) for c in set(classes)}
            return (np.array([by_class[c][0] for c in classes]), np.array([by_class[c][1] for c in classes]), 0.0)
        return (np.tile(self.algorithm_acceptance.rates(), (n, 1)), np.full(n, self.algorithm_acceptance.overall()),
                self.prior)

    def draft_lengths(self, rids: list[int], caps: list[int], catch_up: list[int] | None = None,
                      remaining: list[int] | None = None, waiting: int = 0,
                      classes: list[int] | None = None) -> list[int]:
        """k per request; ``caps[i]`` is request i's own limit (0: no speculation). ``catch_up[i]``:
        committed tokens request i's draft model must cache before it drafts again (None: none);
        ``remaining[i]``: the most tokens request i has left to generate (None: unknown, many);
        ``waiting``: requests queued for a place in the batch; ``classes[i]``: the class of
        request i's proposal this round, where it is known before the round (``Lookup``)."""
        caps = [max(0, min(c, self.max_draft)) for c in caps]
        if self.mode == FIXED or self.max_draft == 0 or not rids:
            return caps
        self._since_probe += 1
        cap = np.array(caps, dtype=np.int64)
        rows = self.requests.rows(rids)
        gains = self.requests.gains(rows, cap, *self._parents(len(rids), classes))
        if not self.per_request:
            return self._uniform(gains, caps)
        value = self._token_values(gains, remaining, waiting, rows)
        weighted = gains * value[:, None]
        entry = self._entry_costs(gains, catch_up, remaining)
        # Taking the largest gains first ignores what turning a request on costs: so also try the
        # batch with the requests that would have to catch up left out.
        candidates = [weighted]
        if entry.any():
            candidates.append(np.where(entry[:, None] > 0, 0.0, weighted))
        n = len(rids)
        best, best_rate = np.zeros(n, dtype=np.int64), n / self.cost(n, 0)
        for depth in self._depths_that_may_pay(weighted, entry, best_rate, int(cap.max())):
            for candidate in candidates:
                ks, rate = self._best_for_depth(candidate, depth, entry)
                if rate > best_rate:
                    best, best_rate = ks, rate
        if classes is not None and self.classes_scored:  # proposals known before the round are scored anyway
            return best.tolist()
        catch_up_seconds = (np.array([self.cost.catch_up(t) for t in catch_up]) if catch_up
                            else np.zeros(len(rids)))
        new = ~self.requests.observed(rows) & self._untaught(classes)
        best = self._first_probe(new, cap, best, catch_up_seconds, weighted, remaining, rids)
        return self._probe(cap, best, catch_up_seconds, value).tolist()

    def _depths_that_may_pay(self, gains: np.ndarray, entry: np.ndarray, plain_rate: float, deepest: int) -> list[int]:
        """The draft depths at which some round could beat the plain one. At depth d, every token
        expected from the first d positions of every request, for the price of the cheapest round
        of that depth (d passes, one verify token, the least catch-up of a request that may draft),
        bounds the rate any choice reaches; where acceptance is low that settles the round
        without trying each width."""
        n = len(gains)
        may_draft = gains[:, 0] > 0
        if not may_draft.any():
            return []
        least_entry = float(entry[may_draft].min())
        expected = n + np.cumsum(gains.sum(0))  # by depth 1..K
        out = []
        for depth in range(1, deepest + 1):
            base, switch, per_token, per_pass, per_pass_request = self.cost.round_terms(n, depth)
            cheapest = base + switch + per_pass + per_token * self._verified(n, 1) + per_pass_request + least_entry
            if expected[depth - 1] / max(cheapest, 1e-9) > plain_rate:
                out.append(depth)
        return out

    def _token_values(self, gains: np.ndarray, remaining: list[int] | None, waiting: int,
                      rows: np.ndarray) -> np.ndarray:
        """What a token drafted for each request is worth, as a share of an average token of the
        round. With requests waiting, or with one request, every token is worth as much: a request
        that finishes early lets the next one in, or ends the batch. Otherwise the batch drains,
        and lasts as long as its slowest request: a request that the others outlast saves, by
        finishing early, only its own share of the rounds it leaves (the plain round of n requests
        against one without the requests that leave early: on a CPU, little between 2 and 4
        requests, much between 1 and 2); only the rounds it would run past every other request
        count in full. Which requests leave early is read from the pace each has kept (its recent
        tokens a round) as well as from this round's proposals: an open request with one long
        match this round is not on course to finish early, and where a round of 1 request costs
        far less than one of 2, counting it would price the batch as if it would drop to 1."""
        n = len(gains)
        if waiting or remaining is None or n < 2:
            return np.ones(n)
        slow = np.array(remaining, dtype=float)  # rounds left if it never drafts
        fast = slow / (1.0 + gains.sum(1))  # rounds left drafting its cap at its estimate
        top = np.argsort(-fast)[:2]
        others = np.where(np.arange(n) == top[0], fast[top[1]], fast[top[0]])  # the longest of the others
        tail = np.clip(slow - others, 0.0, None) / np.maximum(slow - fast, 1e-9)
        tail = np.where(slow - fast > 1e-9, np.minimum(tail, 1.0), 1.0)
        # The requests that leave early: those that could (tail < 0.5) and are on their way at the
        # pace they have kept; at least one, the request whose drafting is priced.
        going = slow / self.requests.pace[rows]  # rounds left at the pace it has kept
        leaving = max(1, int(((tail < 0.5) & (going < 0.5 * going.max())).sum()))
        marginal = (self.cost.plain(n) - self.cost.plain(n - leaving)) / leaving
        share = min(1.0, max(0.0, marginal / (self.cost.plain(n) / n)))
        return tail + (1.0 - tail) * share

    def _untaught(self, classes: list[int] | None) -> np.ndarray | bool:
        """Whether each round's class has yet to be taught by drafted rounds (less evidence than its
        prior's weight); without classes, every round is (the algorithm's estimate is no guide to
        a new request's text)."""
        if classes is None:
            return True
        return np.array([self.class_acceptance[c].seen[0] < self.class_acceptance[c].prior_weight for c in classes])

    def _first_probe(self, new: np.ndarray, caps: np.ndarray, ks: np.ndarray, catch_up: np.ndarray,
                     gains: np.ndarray, remaining: list[int] | None, rids: list[int]) -> np.ndarray:
        """New requests the estimates hold at k = 0 draft once, together, early in their life: a
        request that copies from its prompt is then found out within its first rounds, whatever
        earlier requests did. ``new``: the requests that may need it, those with no proposal
        verified yet whose round's class (where rounds are classed) drafted rounds have yet to
        teach: a taught class says what the probe would find. They draft the length whose round
        costs least net of the tokens it is expected to give (its verify tokens, the switch, its
        draft passes and the draft caches it must build, against the expected tokens at the value
        of an average token of the round), and only if what it costs should nothing be accepted,
        at the odds of that (``_failure_odds``: 1, or less for a request whose free guesses came true), is
        at most ``first_probe_budget`` of their time without drafting: a probe that fails then
        costs them at most that share, by expectation. If all new requests together are over it,
        those with better odds are tried alone. A probe whose lookup found nothing cost nothing,
        and the request is still new. Proposals known before the round skip it: one that is not
        drafted is scored anyway (``score``), so a new request has its first evidence after its
        first round, at no cost."""
        fresh = (ks == 0) & (caps > 0) & new
        if not fresh.any():
            return ks
        odds = self._failure_odds(rids)
        n = len(ks)
        now = self._cost_of(ks)
        for group in self._probe_groups(fresh, odds):
            best, best_net = ks, None
            for k in range(1, int(caps[group].max()) + 1):
                probed = np.where(group, np.minimum(caps, k), ks)
                expected = gains[group, :k].sum()
                net = self._cost_of(probed) - now + catch_up[group].sum() - expected * now / n
                if best_net is None or net < best_net:
                    best, best_net = probed, net
            # What it costs if nobody accepts: the round's extra time and the draft catch-up, against
            # the new requests' plain rounds to go (each a request's share of a plain round).
            failed = (self._cost_of(best) - now + catch_up[group].sum()) * float(odds[group].max())
            left = np.inf if remaining is None else float(np.array(remaining, dtype=float)[group].sum())
            if failed <= self.first_probe_budget * left * now / n:
                return best
        return ks

    @staticmethod
    def _probe_groups(fresh: np.ndarray, odds: np.ndarray) -> list[np.ndarray]:
        """Every new request; then, where their odds differ, those with the better half of the
        odds; then those with the best."""
        groups = [fresh]
        levels = np.unique(odds[fresh])
        for level in (levels[(len(levels) - 1) // 2], levels[0]):
            group = fresh & (odds <= level)
            if not any((group == g).all() for g in groups):
                groups.append(group)
        return groups

    def _cost_of(self, ks: np.ndarray) -> float:
        m = int(ks.sum())
        return self.cost(len(ks), int(self._verified(len(ks), m)), int(ks.max()) if m else 0, int((ks > 0).sum()))

    def _verified(self, requests: int, drafts: int | np.ndarray) -> int | np.ndarray:
        """Draft tokens a round verifies when its requests draft ``drafts`` in all: those, or, where
        every request verifies a fixed number once any drafts (a tree), that number each."""
        if self.verified_per_request is None:
            return drafts
        return np.where(np.asarray(drafts) > 0, requests * self.verified_per_request, 0)

    def _entry_costs(self, gains: np.ndarray, catch_up: list[int] | None,
                     remaining: list[int] | None) -> np.ndarray:
        """Seconds per round that drafting costs request i on top of the round's shape: its draft's
        catch-up, paid once, spread over the rounds it can still draft in (its tokens left over the
        tokens a round gives it at its estimate). A long prompt with few tokens to go thus stays
        undrafted, and one with many to go pays for its catch-up."""
        if catch_up is None:
            return np.zeros(len(gains))
        left = np.full(len(gains), np.inf) if remaining is None else np.array(remaining, dtype=float)
        rounds = np.where(np.isinf(left), 1e9, np.maximum(1.0, left / (1.0 + gains.sum(1))))
        seconds = np.array([self.cost.catch_up(t) if t else 0.0 for t in catch_up])
        return seconds / rounds

    def _best_for_depth(self, gains: np.ndarray, depth: int, entry: np.ndarray) -> tuple[np.ndarray, float]:
        """Largest gains first, every verify width tried: the best ks with at most ``depth`` drafts each."""
        n = len(gains)
        plain_rate = n / self.cost(n, 0)
        g = gains[:, :depth]
        request, position = np.nonzero(g > 0)
        if not len(request):
            return np.zeros(n, dtype=np.int64), plain_rate
        g = g[request, position]
        order = np.lexsort((position, entry[request], -g))
        g, request, position = g[order], request[order], position[order]
        base, switch, per_token, per_pass, per_pass_request = self.cost.round_terms(n, depth)
        starts = position == 0  # a request's gains never grow with position: its first comes first
        m = np.arange(1, len(g) + 1)
        seconds = (base + switch + per_pass + per_token * self._verified(n, m) + per_pass_request * np.cumsum(starts)
                   + np.cumsum(np.where(starts, entry[request], 0.0)))
        rate = (n + np.cumsum(g)) / np.maximum(seconds, 1e-9)
        best = int(np.argmax(rate))
        if rate[best] <= plain_rate:
            return np.zeros(n, dtype=np.int64), plain_rate
        return np.bincount(request[: best + 1], minlength=n), float(rate[best])

    def _uniform(self, gains: np.ndarray, caps: list[int]) -> list[int]:
        n = len(gains)
        cap = np.array(caps)
        options = self.choices if self.choices is not None else range(self.max_draft + 1)
        best_k, best_rate = 0, None
        for k in options:
            expected = n + gains[:, :k].sum()
            drafts = int(np.minimum(k, cap).sum())
            rate = expected / self.cost(n, int(self._verified(n, drafts)), k if drafts else 0, n if drafts else 0)
            if best_rate is None or rate > best_rate:
                best_k, best_rate = k, rate
        return [min(best_k, c) for c in caps]

    def _probe(self, caps: np.ndarray, ks: np.ndarray, catch_up: np.ndarray, value: np.ndarray) -> np.ndarray:
        """Requests held at k = 0 by their estimates draft one token each, all in the same round:
        that is how speculation comes back once acceptance does, and the round's switch to the
        verify path is paid once for all of them. A probe round costs extra time (on a CPU a
        verify round can cost twice a plain one), so probes are spaced to spend at most
        ``probe_budget`` of the time: at least ``probe_every`` rounds apart, and further where a
        probe round costs more. A request held back by its tokens' worth, not its acceptance
        (the others outlast it), is not probed: its estimate is not what holds it."""
        idle = (ks == 0) & (caps > 0) & (value >= 1.0)
        if not idle.any() or self._since_probe < self.probe_every:
            return ks
        now = self._cost_of(ks)
        probed = np.where(idle, 1, ks)
        # A probe round pays in full for the catch-up of the draft caches it turns on.
        extra = (self._cost_of(probed) + catch_up[idle].sum()) / now - 1
        if self._since_probe * self.probe_budget < extra:
            return ks
        self._since_probe = 0
        return probed

    def record(self, rids: list[int], ks: list[int], proposed: list[int], accepted: list[int], seconds: float,
               classes: list[int] | None = None, caught_up: int = 0) -> None:
        """A finished round: acceptance per request, algorithm and proposal class, and the measured
        step time. A request that was asked for drafts and found none (an n-gram lookup that
        matched nothing) is not observed: nothing of it was verified. ``caught_up``: committed
        tokens the round's draft model cached before it drafted; their time is the catch-up's,
        priced on its own, so the round's shape is fitted to what is left."""
        p, a = np.array(proposed, dtype=np.int64), np.array(accepted, dtype=np.int64)
        rows = self.requests.rows(rids)
        drafted = p > 0
        if drafted.any():
            self._observe(rows[drafted], p[drafted], a[drafted],
                          None if classes is None else np.array(classes)[drafted])
        if self.mode == FIXED:
            return
        self.requests.advance(rows, 1.0 + a)
        shape = (len(rids), int(self._verified(len(rids), int(p.sum()))), int(p.max(initial=0)), int((p > 0).sum()))
        # A catch-up priced above what the round took leaves half the round: never a negative time.
        seconds = max(seconds - self.cost.catch_up(caught_up), 0.5 * seconds) if caught_up else seconds
        if self.trace is not None:
            self.trace.append({"requests": shape[0], "ks": list(ks), "proposed": list(proposed),
                               "accepted": list(accepted), "predicted": self.cost(*shape), "seconds": seconds})
        self.cost.record(*shape, seconds)

    def score(self, rids: list[int], kept: list[bool], classes: list[int] | None = None) -> None:
        """Proposals known before a round that were not drafted, each scored against the token the
        round committed for its request: ``kept[i]``, whether it was the proposal's first token. For
        a lookup's proposal (a point mass) that is what verifying its first token would have said:
        greedy, the same token; sampling, a token drawn from the same distribution, kept with the
        same probability. First-position evidence for the request, its class and the algorithm,
        every round, without a verify pass; later positions are learnt from drafted rounds."""
        if rids:
            self._observe(self.requests.rows(rids), np.ones(len(rids), dtype=np.int64), np.array(kept, dtype=np.int64),
                          None if classes is None else np.array(classes))

    def score_guesses(self, rids: list[int], kept: list[bool]) -> None:
        """Free guesses at requests' next tokens (a lookup of each one's own context, where the
        drafts cost a pass), each scored against the token the round committed; only a new
        request's count (one with no proposal verified yet). They are not the draft's proposals,
        so they do not enter the acceptance estimates; they say how likely a first probe is to
        fail: a request that copies from its context has its guesses come true, and its draft's
        proposals too (copied text is what any draft predicts best)."""
        if not rids:
            return
        new = ~self.requests.observed(self.requests.rows(rids))
        for rid, k in zip(np.array(rids)[new].tolist(), np.array(kept)[new].tolist()):
            counts = self.guesses.setdefault(rid, [0, 0])
            counts[0] += bool(k)
            counts[1] += 1

    def _failure_odds(self, rids: list[int]) -> np.ndarray:
        """The odds that a request's first probe is rejected: 1 less its guesses' kept share, with
        ``guess_prior`` guesses counted as failed (1 for a request with no guesses). A probe that
        fails costs a short request several percent (on a CPU, its prompt's catch-up), so a few
        lucky guesses in open text must not be enough: 2 kept of 2 leave even odds."""
        counts = np.array([self.guesses.get(r, (0, 0)) for r in rids], dtype=float).reshape(len(rids), 2)
        return 1.0 - counts[:, 0] / (counts[:, 1] + self.guess_prior)

    def _observe(self, rows: np.ndarray, proposed: np.ndarray, accepted: np.ndarray,
                 classes: np.ndarray | None) -> None:
        """Verified (or scored) proposals as evidence for their requests' rows, the algorithm and their classes."""
        predicted = lifted(*self._parents(len(rows), None if classes is None else classes.tolist()))
        self.requests.observe(rows, proposed, accepted, predicted)
        self.algorithm_acceptance.observe_many(proposed, accepted)
        if classes is not None and self.class_acceptance:
            for c in np.unique(classes):
                self.class_acceptance[c].observe_many(proposed[classes == c], accepted[classes == c])

    def forget(self, rid: int) -> None:
        self.requests.forget(rid)
        self.guesses.pop(rid, None)
