"""Phase-3 warm-up for the speculation policy: a few timed forward passes seed its cost model.

Each pass is decode-shaped: ``width`` new tokens per request after a cached prefix, because
attention over the context is part of a round's cost that does not grow with the draft length.
"""

from __future__ import annotations

import time

from .batch import Segment, alloc_positions, forward_segments, free_positions
from .model_runner import ModelRunner
from .spec_policy import CostCurve

PREFIX_TOKENS = 128  # context each request has cached in the warm-up (less when the pool is small)


def time_forward(runner: ModelRunner, batch: int, width: int, prefix: int, repeats: int = 2) -> float:
    """Seconds of one pass over ``batch`` requests of ``width`` new tokens after ``prefix`` cached
    ones (the prefix is filled once, untimed; the timed passes rewrite the same positions)."""
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    rows = [pool.alloc() for _ in range(batch)]
    try:
        for idx in rows:
            alloc_positions(pool, alloc, idx, 0, prefix + width)
        if prefix:
            forward_segments(runner, [Segment(idx, [0] * prefix, 0) for idx in rows], last_only=True)
        segments = [Segment(idx, [0] * width, prefix) for idx in rows]
        forward_segments(runner, segments, last_only=False)
        start = time.perf_counter()
        for _ in range(repeats):
            forward_segments(runner, segments, last_only=False)
        return (time.perf_counter() - start) / repeats
    finally:
        for idx in rows:
            free_positions(pool, alloc, idx, 0, prefix + width)
            pool.free(idx)


def measure_curve(runner: ModelRunner, batches: list[int], widths: list[int], context_len: int) -> CostCurve:
    """Seconds by total tokens in a pass, measured at every batch x width given."""
    slots = runner.token_to_kv_pool_allocator.available_size()
    prefix = max(0, min(PREFIX_TOKENS, context_len // 4, slots // (2 * max(batches)) - max(widths)))
    return CostCurve({b * w: time_forward(runner, b, w, prefix)
                      for b in sorted(set(batches)) for w in sorted(set(widths))})
