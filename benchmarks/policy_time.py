"""The speculation policy's own time per round: choosing every request's draft length and taking
in what the round measured, on a synthetic batch (no model: the policy is numpy only).

Half of the requests accept everything they draft and half nothing; every 32 rounds a request
finishes and a new one takes its place, as under load. The cost model learns from the rounds
(a refit every 4), as in the engine. Printed: milliseconds per round (median of 3 runs of 300
rounds) for NGRAM (proposal classes known before the round, undrafted ones scored) and STANDALONE
(rounds classed by free guesses, first probes and probes), at 1, 16 and 64 requests.

Also printed: the worker's context lookup that classes a draft model's rounds
(``ContextGuesses``, NGRAM's index), per round at the same batch sizes over 8k-token contexts, and
the first lookup of such a context (the index of its prompt is built then).

Run:  python benchmarks/policy_time.py [--rounds 300] [--requests 1 16 64] [--context 8192]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))

from specdecode_worker.engine.speculation.ngram_index import ContextGuesses  # noqa: E402
from specdecode_worker.engine.speculation.spec_policy import SpecPolicy  # noqa: E402
from specdecode_worker.engine.speculation.step_cost import StepCost  # noqa: E402

K = 4


def cpu_like_cost() -> StepCost:
    """A verify round costs about twice a plain one, as on a CPU (the policy's hardest case: many
    widths are close)."""
    return StepCost.linear(plain=(0.06, 0.005), per_draft_token=0.005, switch=(0.05, 0.0),
                           draft_pass=(0.01, 0.001), learn=True, catch_up_per_token=0.001)


def time_rounds(algorithm: str, requests: int, rounds: int, seed: int = 0) -> float:
    """Seconds per round of choice and update."""
    rng = random.Random(seed)
    ngram = algorithm == "NGRAM"
    policy = SpecPolicy("adaptive", algorithm, K, cpu_like_cost(), classes=K + 1, classes_scored=ngram)
    rids = list(range(requests))
    left = {rid: rng.randrange(1, 33) for rid in rids}
    next_rid = requests
    spent = 0.0
    for _ in range(rounds):
        classes = [rng.randrange(K + 1) for _ in rids]
        caps = [K if not ngram or c else 0 for c in classes]
        start = time.perf_counter()
        ks = policy.draft_lengths(rids, caps, catch_up=None if ngram else [0] * len(rids),
                                  remaining=[left[r] for r in rids], waiting=1, classes=classes)
        accepted = [k if rid % 2 == 0 else 0 for rid, k in zip(rids, ks)]
        policy.record(rids, ks, ks, accepted, 0.06 + 0.005 * (len(rids) + sum(ks)), classes=classes)
        spent += time.perf_counter() - start
        for i, rid in enumerate(rids):  # a finished request gives its place to a new one
            left[rid] -= 1 + accepted[i]
            if left[rid] <= 0:
                policy.forget(rid)
                del left[rid]
                rids[i], left[next_rid] = next_rid, 32
                next_rid += 1
    return spent / rounds


class _Context:
    """A request as the lookup sees it: an id and its tokens."""

    def __init__(self, rid: int, tokens: list[int]):
        self.rid, self.all_ids = rid, tokens


def time_lookups(requests: int, rounds: int, context: int = 8192, seed: int = 0) -> tuple[float, float]:
    """Seconds of the first lookup of a ``context``-token request (its prompt indexed), and per
    round of looking every request up after each commits 1-5 tokens (text of 2,000 distinct tokens)."""
    rng = random.Random(seed)
    reqs = [_Context(i, [rng.randrange(2000) for _ in range(context)]) for i in range(requests)]
    guesses = ContextGuesses(4)
    start = time.perf_counter()
    guesses.guess(reqs[:1], [K])
    first = time.perf_counter() - start
    guesses.guess(reqs, [K] * requests)
    spent = 0.0
    for _ in range(rounds):
        for r in reqs:
            r.all_ids.extend(rng.randrange(2000) for _ in range(rng.randrange(1, 6)))
        start = time.perf_counter()
        guesses.guess(reqs, [K] * requests)
        spent += time.perf_counter() - start
    return first, spent / rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--requests", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=8192, help="tokens of each request's context for the lookups")
    args = ap.parse_args(argv)
    print("| algorithm | " + " | ".join(f"{n} requests" for n in args.requests) + " |")
    print("|---|" + "---:|" * len(args.requests))
    for algorithm in ("NGRAM", "STANDALONE"):
        cells = [statistics.median(time_rounds(algorithm, n, args.rounds, seed) for seed in range(3)) * 1e3
                 for n in args.requests]
        print(f"| {algorithm} | " + " | ".join(f"{ms:.2f} ms" for ms in cells) + " |")
    lookups = {n: [time_lookups(n, 50, args.context, seed) for seed in range(3)] for n in args.requests}
    print(f"\n| context lookup ({args.context} tokens) | " + " | ".join(f"{n} requests" for n in args.requests) + " |")
    print("|---|" + "---:|" * len(args.requests))
    cells = [statistics.median(t[1] for t in lookups[n]) * 1e3 for n in args.requests]
    print("| per round | " + " | ".join(f"{ms:.2f} ms" for ms in cells) + " |")
    first = statistics.median(t[0] for runs in lookups.values() for t in runs) * 1e3
    print(f"\nfirst lookup of a {args.context}-token context (its prompt indexed): {first:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
