"""Seconds of one decode round by its shape, from whole rounds timed at start-up.

The warm-up (``step_timing.time_rounds``) runs real rounds through the speculator, so every pass
a round runs is in the time: a head's extend over the accepted tokens, each draft step (and a
STANDALONE draft's first one), the verify pass at its width, sampling and acceptance. It times, at
batch sizes 1, 2, 4, ... up to the largest:
- a plain round (nobody drafts);
- every request drafting 1, and K (the depths between are interpolated: a round's draft passes
  and verify width grow in step with k);
- one request drafting K, the others nothing (what drafting costs before it is shared).

A round where only some requests draft, or not all to the same depth, sits between those two:
its drafting time above the plain round is the one-request round's, plus the uniform round's
remainder in proportion to how many requests' worth of tokens it verifies. Between timed batch
sizes, times are interpolated. A round over more requests, or drafting deeper, never costs less:
timings that say otherwise (a spike on a shared machine, on a CPU often) are pooled with their
neighbours until they do not. The model only ranks draft lengths: whether drafting pays at all
is measured in serving (``spec_policy``). Nothing here needs torch.
"""

from __future__ import annotations

import numpy as np


class RoundCost:
    def __init__(self, plain: dict[int, float], drafting: dict[tuple[int, int], float], one: dict[int, float]):
        """``plain[b]``: seconds of a plain round of b requests; ``drafting[(b, k)]``: every one of
        b requests drafting k, for the depths timed (others are interpolated); ``one[b]``: one of b
        requests drafting the deepest k timed."""
        sizes = sorted(plain)
        self.sizes = np.array(sizes, dtype=float)
        timed = sorted({k for _, k in drafting})
        self.depth = timed[-1]
        # [depth 0..K, batch size]: plain rounds, then every request drafting k; monotone both ways
        by_depth = np.array([[drafting[(b, k)] for k in timed] for b in sizes])  # [batch size, timed depth]
        table = np.array([[plain[b] for b in sizes]] + [[np.interp(k, timed, row) for row in by_depth]
                                                         for k in range(1, self.depth + 1)])
        table = np.apply_along_axis(non_decreasing, 1, table)
        table = np.apply_along_axis(non_decreasing, 0, table)
        self._plain, self._drafting = table[0], {k: table[k] for k in range(1, self.depth + 1)}
        self._one = np.clip(non_decreasing(np.array([one[b] for b in sizes])), table[0], table[-1])

    def _at(self, values: np.ndarray, requests: float) -> float:
        return float(np.interp(requests, self.sizes, values))

    def plain(self, requests: int) -> float:
        return self._at(self._plain, requests)

    def round(self, requests: int, verified, depth: int):
        """Seconds of a round of ``requests`` requests verifying ``verified`` draft tokens in all
        (a number or an array of them), drafted at most ``depth`` deep."""
        depth = min(depth, self.depth)
        plain = self.plain(requests)
        every = max(self._at(self._drafting[depth], requests) - plain, 0.0)
        full = max(self._at(self._drafting[self.depth], requests) - plain, 1e-12)
        fixed = min(max(self._at(self._one, requests) - plain, 0.0) / full, 1.0)  # share one drafter pays
        drafters = np.clip(np.asarray(verified, dtype=float) / depth, 1.0, requests)
        shared = (drafters - 1.0) / (requests - 1.0) if requests > 1 else np.ones_like(drafters)
        return plain + every * (fixed + (1.0 - fixed) * shared)

    def table(self) -> dict:
        """The timed rounds, for /plan and the start-up log."""
        sizes = [int(b) for b in self.sizes]
        return {"batchSizes": sizes, "plainSeconds": self._plain.tolist(),
                "draftingSeconds": {str(k): v.tolist() for k, v in self._drafting.items()},
                "oneDrafterSeconds": self._one.tolist()}


def non_decreasing(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.array([total / count for total, count in blocks for _ in range(int(count))])
