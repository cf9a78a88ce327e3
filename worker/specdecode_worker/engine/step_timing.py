"""Phase-3 warm-up for the speculation policy: a few timed forward passes seed its cost model."""

from __future__ import annotations

import time

from .batch import Segment, alloc_positions, forward_segments, free_positions
from .model_runner import ModelRunner
from .spec_policy import CostCurve


def time_forward(runner: ModelRunner, batch: int, width: int, repeats: int = 2) -> float:
    """Seconds of one pass over ``batch`` requests of ``width`` new tokens each (after one untimed pass)."""
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    rows = [pool.alloc() for _ in range(batch)]
    try:
        for idx in rows:
            alloc_positions(pool, alloc, idx, 0, width)
        segments = [Segment(idx, [0] * width, 0) for idx in rows]
        forward_segments(runner, segments, last_only=False)
        start = time.perf_counter()
        for _ in range(repeats):
            forward_segments(runner, segments, last_only=False)
        return (time.perf_counter() - start) / repeats
    finally:
        for idx in rows:
            free_positions(pool, alloc, idx, 0, width)
            pool.free(idx)


def measure_curve(runner: ModelRunner, batches: list[int], widths: list[int]) -> CostCurve:
    """Seconds by total tokens in a pass, measured at every batch x width given."""
    return CostCurve({b * w: time_forward(runner, b, w) for b in sorted(set(batches)) for w in sorted(set(widths))})
