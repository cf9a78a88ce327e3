"""The speculation policy's cost model: seconds of one decode round, from the round's shape.

A round of ``requests`` requests verifying ``drafts`` draft tokens in all, after ``depth`` draft
passes over ``drafting`` requests each, costs

    plain(requests)                           the plain curve (below)
  + switching to the verify path, if drafts   e + d * requests
  + the verify tokens                         c * drafts
  + the draft passes                          depth * (f + g * drafting)

A request that resumes drafting also pays, once, for the committed tokens its draft model must
cache first (``catch_up``: its whole prompt when it has never drafted); the policy spreads that
over the rounds the request has left.

The switch term is there because a round in which nobody drafts runs the cheaper decode path
(one token per request: batched decode attention, a CUDA graph on a GPU) and any draft token moves
the whole batch onto the verify path.

``plain(n)`` is a plain round of n requests from the warm-up's plain passes at several batch
sizes (interpolated, at today's load), not a linear term: on a CPU a pass of 2 to 4 rows costs
what one of 4 does (the weights, not the rows, set its time), and a pass of 1 far less. Measured
plain rounds refine it: at a batch size with a few recent plain rounds, their median replaces the
warm-up's point; and the curve is made non-decreasing (pooling neighbours that contradict that),
since a pass over more rows never costs less: a warm-up timed while something else had the
machine may say otherwise. The curve also says what a request still running costs the rounds
it is in (the policy's token values).

The drafting terms (e, d, c, f, g) are seeded by the warm-up's timed passes, less the plain curve
at their batch sizes, and refined online by a robust least-squares fit over the last ``window``
rounds, each less the plain round of its batch size. Machine load scales every step time by a
common factor, and the policy's choice only depends on ratios of step times at the same moment;
so the warm-up points enter the fit as pseudo-rounds rescaled by the current load factor (the
median of measured over seeded time in the window, the seed being a linear model of the warm-up
points). Load thus cancels, and whatever the recent rounds do not pin down (the cost of drafting
while nobody drafts, say) keeps the warm-up's shape.
The fit is numpy over the window's rows; nothing here needs torch.
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

FEATURES = ("base", "per_request", "switch", "switch_per_request", "per_draft_token", "draft_pass",
            "draft_pass_per_request")
# The terms a round pays only for drafting: a fit may not make them negative (drafting never saves time).
_MARGINAL = range(2, len(FEATURES))


# The robust refit: a round more than this far from the fit, relatively, counts in proportion less,
# and the fit is redone with the new weights, at most this many fits in all (fewer once the weights stop changing).
_HUBER, _ROBUST_FITS = 0.25, 3
_MARGINAL_MASK = np.array([i in _MARGINAL for i in range(len(FEATURES))])


def features(requests: int, drafts: int, depth: int = 0, drafting: int = 0) -> tuple[float, ...]:
    switch = 1.0 if drafts else 0.0
    return (1.0, float(requests), switch, switch * requests, float(drafts), float(depth), float(depth * drafting))


class StepCost:
    """Seconds of one round; ``record`` refines the model with what a round measured."""

    def __init__(self, target: dict[tuple[int, int], float], draft: dict[int, float] | None = None,
                 window: int = 64, prior_weight: float = 0.5, refit_every: int = 4, learn: bool = True,
                 catch_up_per_token: float = 0.0, plain: dict[int, float] | None = None):
        """``target``: seconds of a target pass by (requests, draft tokens verified in all);
        ``draft``: seconds of one draft pass by the number of requests in it (None: no draft model,
        the draft terms stay zero); ``catch_up_per_token``: seconds per committed token a draft
        model caches when a request resumes drafting (see ``catch_up``); ``plain``: seconds of a
        plain pass by batch size (None: the target's plain points)."""
        self.catch_up_per_token = catch_up_per_token
        self.prior = [(features(n, m), s) for (n, m), s in target.items()]
        self.prior += [((0.0,) * 5 + (1.0, float(j)), s) for j, s in (draft or {}).items()]
        self.terms = list(range(len(FEATURES) if draft else 5))
        self._marginal_terms = [i for i in self.terms if i in _MARGINAL]
        self.prior_weight, self.refit_every, self.learn = prior_weight, refit_every, learn
        self.rounds: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        # The whole linear model over the warm-up's points: what load is measured against.
        self.seed = self._fit([(x, s, 1.0 / max(s, 1e-12) ** 2) for x, s in self.prior], self.terms)
        curve = plain if plain else {n: s for (n, m), s in target.items() if m == 0}
        self._warm_plain = {float(n): s for n, s in curve.items()}  # seconds at the warm-up's load
        self._measured_plain: dict[int, deque[float]] = {}  # recent plain rounds by batch size
        self.load = 1.0  # measured / seeded prediction, over the window
        self._set_plain_curve()
        self.coef = self._fit_marginal(np.empty((0, len(FEATURES))), np.empty(0), np.empty(0))
        self._since_fit = 0

    @classmethod
    def linear(cls, plain: tuple[float, float], per_draft_token: float, switch: tuple[float, float] = (0.0, 0.0),
               draft_pass: tuple[float, float] = (0.0, 0.0), learn: bool = False,
               catch_up_per_token: float = 0.0) -> "StepCost":
        """The model with the given terms (see the module doc), as if the warm-up had measured them."""
        coef = (*plain, *switch, per_draft_token, *draft_pass)
        target = {(n, m): _dot(coef, features(n, m)) for n, m in ((1, 0), (16, 0), (1, 4), (16, 16), (16, 64))}
        draft = {j: draft_pass[0] + draft_pass[1] * j for j in (1, 16)} if any(draft_pass) else None
        return cls(target, draft, learn=learn, catch_up_per_token=catch_up_per_token,
                   plain={n: plain[0] + plain[1] * n for n in (1, 16)})

    def __call__(self, requests: int, drafts: int, depth: int = 0, drafting: int = 0) -> float:
        marginal = _dot(self.coef[2:], features(requests, drafts, depth, drafting)[2:])
        return max(self.plain(requests) + marginal, 1e-9)

    def catch_up(self, tokens: int) -> float:
        """Seconds the draft spends caching ``tokens`` committed tokens of one request, at today's
        load: paid once, by the round in which that request resumes drafting."""
        return self.catch_up_per_token * tokens * self.load

    def plain(self, requests: float) -> float:
        """Seconds of a plain round of ``requests`` requests at today's load: the plain curve (the
        warm-up's passes, refined by measured plain rounds) interpolated; beyond the widest, the
        linear model's slope; below the narrowest (or with a single point), in proportion to it."""
        seconds = self._plain_by_size.get(requests)  # every round prices its batch size, many times
        if seconds is None:
            seconds = self._plain_by_size[requests] = float(self._plain_of(np.asarray(requests, dtype=float)))
        return seconds

    def _plain_of(self, requests: np.ndarray) -> np.ndarray:
        """``plain`` for an array of batch sizes."""
        n, s = self._plain_n, self._plain_s
        base, per_request = self.seed[0] * self.load, self.seed[1] * self.load  # the linear plain term
        if not len(n):
            return base + per_request * requests
        out = np.interp(requests, n, s)
        if len(n) > 1:
            out = np.where(requests > n[-1], s[-1] + per_request * (requests - n[-1]), out)
        return np.where((requests < n[0]) | (len(n) == 1), s[0] * requests / n[0], out)

    def round_terms(self, requests: int, depth: int) -> tuple[float, float, float, float, float]:
        """For rounds of ``requests`` requests and ``depth`` draft passes that draft at all: the
        plain step, the switch, seconds per draft token, per round of passes, and per drafting request
        (what the policy adds up for every width it tries, without building features each time)."""
        c = self.coef
        return (self.plain(requests), c[2] + c[3] * requests, c[4], depth * c[5], depth * c[6])

    def coefficients(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coef))

    def record(self, requests: int, drafts: int, depth: int, drafting: int, seconds: float) -> None:
        if not self.learn or seconds <= 0:
            return
        self.rounds.append((features(requests, drafts, depth, drafting), seconds))
        if not drafts:
            self._measured_plain.setdefault(requests, deque(maxlen=8)).append(seconds)
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        """Today's load (the median of measured over seeded times in the window), the plain curve
        at that load, then the drafting terms (see ``_fit_marginal``)."""
        self._since_fit = 0
        if not self.rounds:
            return
        x = np.array([r[0] for r in self.rounds])
        y = np.array([r[1] for r in self.rounds])
        seeded = np.maximum(x @ np.array(self.seed), 1e-12)
        self.load = float(np.median(y / seeded))
        self._set_plain_curve()
        self.coef = self._fit_marginal(x, y, 1.0 / (seeded * self.load) ** 2)

    def _set_plain_curve(self) -> None:
        self._plain_n, self._plain_s = self._plain_curve()
        self._plain_by_size: dict[float, float] = {}

    def _fit_marginal(self, x: np.ndarray, y: np.ndarray, relative: np.ndarray) -> list[float]:
        """The terms a round pays for drafting, fitted to what each round (and each warm-up point,
        at today's load) took beyond the plain round of its batch size on the plain curve: least
        squares in relative error (``relative``: 1 / the round's seeded time squared). The plain
        part is the curve's, not a linear term's: on a CPU a plain round of 2 requests costs far
        more than one of 1 and little less than one of 4, so a linear plain term fitted on rounds
        of 1 put a round of 2 a quarter below what it took, and the drafting that paid at 2
        requests (10 tokens in 3.2 plain rounds' time) looked as if it did not.
        Other work on the machine only ever adds time, so the fit is robust to it: a round over
        twice the fit's prediction is set aside, and one more than ``_HUBER`` off counts in
        proportion less (Huber weights, the fit redone a few times). Set aside only against a
        first fit it had dragged up, one round slowed threefold among the three drafting rounds of
        a window stayed, priced 4 drafts 20% too dear, and a policy that then stops drafting
        measures no round that would correct it."""
        px = np.array([p[0] for p in self.prior])
        py = np.array([p[1] for p in self.prior]) * self.load
        pw = self.prior_weight / np.maximum(py, 1e-12) ** 2
        plain = self._plain_of(np.concatenate([px[:, 1], x[:, 1]]))
        xs, ys = np.vstack([px, x]), np.concatenate([py, y])
        trust = np.ones(len(y))
        for _ in range(_ROBUST_FITS):
            coef = self._fit((xs, ys - plain, np.concatenate([pw, relative * trust])), self._marginal_terms)
            predicted = plain[len(py):] + x @ np.array(coef)
            over = y / np.maximum(predicted, 1e-12) - 1.0
            weights = np.where(over > 1.0, 0.0, np.minimum(1.0, _HUBER / np.maximum(np.abs(over), 1e-12)))
            if np.array_equal(weights, trust):  # the same weights give the same fit: usually every round is close
                break
            trust = weights
        coef[0], coef[1] = self.seed[0] * self.load, self.seed[1] * self.load  # reported: the linear plain term
        return coef

    def _plain_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """Plain-round seconds by batch size at today's load: the warm-up's points rescaled, a
        batch size's own recent plain rounds (their median, from 3 on) in place of its point, made
        non-decreasing by pooling adjacent points that fall (a pass over more rows never costs
        less)."""
        points = {n: s * self.load for n, s in self._warm_plain.items()}
        points.update({float(n): statistics.median(v) for n, v in self._measured_plain.items() if len(v) >= 3})
        sizes = sorted(points)
        return np.array(sizes, dtype=float), np.array(non_decreasing([points[n] for n in sizes]))

    @staticmethod
    def _fit(rows, terms: list[int]) -> list[float]:
        """Weighted least squares over ``terms`` (the others zero); the marginal terms are held at
        zero or above (dropped and refitted while one comes out negative). ``rows``: (x, y, w)
        triples, or the arrays X [rows, features], y and w."""
        if isinstance(rows, list):
            rows = (np.array([r[0] for r in rows], dtype=float), np.array([r[1] for r in rows], dtype=float),
                    np.array([r[2] for r in rows], dtype=float))
        x, y, w = rows
        free = list(terms)
        while True:
            coef = _solve_normal(x, y, w, free, ridge=1e-6)
            negative = [i for i in free if _MARGINAL_MASK[i] and coef[i] < 0]
            if not negative:
                return coef
            free = [i for i in free if i not in negative]


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def _solve_normal(x: np.ndarray, y: np.ndarray, w: np.ndarray, free: list[int], ridge: float) -> list[float]:
    """Coefficients over the ``free`` features (the others zero) minimising sum w (x.c - y)^2,
    with a ridge relative to each feature's scale so unexcited features stay at zero."""
    xs = x[:, free]
    a = (xs * w[:, None]).T @ xs
    rhs = (xs * w[:, None]).T @ y
    a[np.diag_indices_from(a)] += ridge * (np.diag(a) + 1.0)
    sol = np.linalg.solve(a, rhs)  # the ridge makes a positive definite
    coef = [0.0] * len(FEATURES)
    for i, v in zip(free, sol):
        coef[i] = float(v)
    return coef
