"""The speculation policy's own time per round: choosing every request's draft length and taking
in what the round measured, on a synthetic batch (no model: the policy is numpy only).

Half of the requests accept everything they draft and half nothing. Printed: milliseconds per
round (median of 3 runs) for NGRAM (proposal classes known before the round, undrafted ones scored)
and STANDALONE (one draft length for the batch), at 1, 16 and 64 requests.

Run:  python benchmarks/policy_time.py [--rounds 300] [--requests 1 16 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))

from specdecode_worker.engine.speculation.round_cost import RoundCost  # noqa: E402
from specdecode_worker.engine.speculation.spec_policy import SpecPolicy  # noqa: E402

K = 4


def cpu_like_cost(batch: int = 64) -> RoundCost:
    """A verify round costs about twice a plain one, as on a CPU (many draft lengths are close)."""
    sizes = [1, 2, 4, 8, 16, 32, 64, batch]
    plain = {b: 0.06 + 0.005 * b for b in sizes}
    drafting = {(b, k): 0.11 + 0.005 * b * (k + 1) + 0.01 * k for b in sizes for k in range(1, K + 1)}
    return RoundCost(plain, drafting, {b: 0.11 + 0.005 * (b + K) + 0.01 * K for b in sizes})


def time_rounds(algorithm: str, requests: int, rounds: int, seed: int = 0) -> float:
    """Seconds per round of choice and update."""
    rng = random.Random(seed)
    ngram = algorithm == "NGRAM"
    policy = SpecPolicy("adaptive", algorithm, K, cpu_like_cost(), classes=K + 1 if ngram else 0)
    rids = list(range(requests))
    spent = 0.0
    for _ in range(rounds):
        classes = [rng.randrange(K + 1) for _ in rids] if ngram else None
        caps = [K if not ngram or c else 0 for c in classes or rids]
        start = time.perf_counter()
        ks = policy.draft_lengths(rids, caps, classes=classes)
        accepted = [k if rid % 2 == 0 else 0 for rid, k in zip(rids, ks)]
        policy.record(rids, ks, ks, accepted, 0.06 + 0.005 * (len(rids) + sum(ks)), classes=classes)
        if ngram:
            undrafted = [i for i, (k, c) in enumerate(zip(ks, caps)) if c and not k]
            policy.score([rids[i] % 2 == 0 for i in undrafted], [classes[i] for i in undrafted])
        spent += time.perf_counter() - start
    return spent / rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--requests", type=int, nargs="*", default=[1, 16, 64])
    args = ap.parse_args(argv)
    print("| algorithm | " + " | ".join(f"{n} requests" for n in args.requests) + " |")
    print("|---|" + "---:|" * len(args.requests))
    for algorithm in ("NGRAM", "STANDALONE"):
        cells = [statistics.median(time_rounds(algorithm, n, args.rounds, seed) for seed in range(3)) * 1e3
                 for n in args.requests]
        print(f"| {algorithm} | " + " | ".join(f"{ms:.2f} ms" for ms in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
