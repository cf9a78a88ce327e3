"""Phase-3 warm-up for the speculation policy: a few timed forward passes seed its cost model.

Each pass is decode-shaped: ``width`` new tokens per request after a cached prefix, because
attention over the context is part of a round's cost that does not grow with the draft length.
The shapes are timed in turn, several times over, and each keeps its fastest time: a load spike
on a shared machine then spoils one repeat, not the shape of the model.
"""

from __future__ import annotations

import time

import torch

from ..batch import Segment, forward_segments, make_batch, padded_chain_batch, with_cache_locs
from ..cuda_graph import chain_graph_width
from ..model_runner import ModelRunner

PREFIX_TOKENS = 128  # context each request has cached in the warm-up (less when the pool is small)


def time_passes(runner: ModelRunner, shapes: list[tuple[int, int]], context_len: int,
                repeats: int = 3, speculator=None, chunk_tokens: int = 0) -> dict[tuple[int, int], float]:
    """Fastest seconds of one pass over ``batch`` requests of ``width`` new tokens each after a
    cached prefix, by (batch, width); the shapes interleaved ``repeats`` times. ``speculator``: run
    the target's passes as its rounds do (an EAGLE or MTP target replays the speculator's graphs).
    ``chunk_tokens``: most prefix tokens prefilled in one pass (0: no cap), as the plan priced."""
    slots = runner.slots
    batch = max(b for b, _ in shapes)
    widest = max(w for _, w in shapes)
    prefix = max(0, min(PREFIX_TOKENS, context_len // 4, slots.free_slots() // (2 * batch) - widest))
    rows = [slots.open_row() for _ in range(batch)]
    try:
        slots.reserve([(idx, 0, prefix + widest) for idx in rows])
        if prefix:
            _prefill_prefixes(runner, rows, prefix, chunk_tokens)
        best = {}
        for repeat in range(repeats + 1):  # the first round is untimed: it warms every shape up
            for b, w in shapes:
                _wait_for(runner.device)
                start = time.perf_counter()
                _verify_pass(runner, speculator, rows[:b], prefix, w)
                _wait_for(runner.device)  # a GPU pass is queued, not done, when the call returns
                seconds = time.perf_counter() - start
                if repeat:
                    best[(b, w)] = min(seconds, best.get((b, w), seconds))
        return best
    finally:
        slots.close_rows([(idx, prefix + widest) for idx in rows])


def _prefill_prefixes(runner: ModelRunner, rows: list[int], prefix: int, chunk_tokens: int) -> None:
    """Cache ``prefix`` tokens for every row, whole rows per pass, at most ``chunk_tokens`` per pass:
    one pass over every row at the largest batch (256 x 128 tokens) is larger than the plan's
    largest prefill chunk, and its activations would not fit what the plan left free."""
    per_pass = len(rows) if not chunk_tokens else max(1, chunk_tokens // prefix)
    for start in range(0, len(rows), per_pass):
        segments = [Segment(idx, [0] * prefix, 0) for idx in rows[start : start + per_pass]]
        forward_segments(runner, segments, last_only=True)


def _wait_for(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _verify_pass(runner: ModelRunner, speculator, rows: list[int], prefix: int, width: int) -> None:
    """``width`` new tokens per request, run as a round runs them: a verify pass that the verify
    graphs take is padded to their width (its cost does not grow with the draft length)."""
    graphs = runner.verify_graphs if speculator is None else speculator.chain_verify_graphs
    padded_width = chain_graph_width(graphs, len(rows), width - 1)
    if padded_width:
        chains = torch.zeros(len(rows), width, dtype=torch.int64, device=runner.device)
        fb, _ = padded_chain_batch(runner.req_to_token_pool, rows, [prefix] * len(rows), chains,
                                   [width] * len(rows), padded_width)
    else:
        segments = [Segment(idx, [0] * width, prefix) for idx in rows]
        fb = with_cache_locs(make_batch(segments, runner.device), runner.req_to_token_pool, segments)
    if speculator is None:
        runner.forward(fb, last_only=False)
    else:
        speculator.target_pass(fb)


def target_points(runner: ModelRunner, batch: int, k: int, context_len: int, speculator=None,
                  chunk_tokens: int = 0) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """Seconds of a target pass by (requests, draft tokens verified in all): plain decode at batch
    1 and ``batch``, and verify passes of k at batch 1, and of 1 and k per request at ``batch``
    (what separates the switch to the verify path from the cost of each verified token); and
    seconds of a plain pass by batch size, at 1, 2, 4, ... and ``batch`` (what a request still
    running costs a round, which is not linear: see ``StepCost.plain``)."""
    sizes = sorted({min(2 ** i, batch) for i in range(batch.bit_length() + 1)})
    shapes = [(1, 1), (batch, 1), (1, k + 1), (batch, 2), (batch, k + 1)] + [(b, 1) for b in sizes]
    timed = time_passes(runner, sorted(set(shapes)), context_len, speculator=speculator, chunk_tokens=chunk_tokens)
    target = {(b, b * (w - 1)): timed[(b, w)] for b, w in shapes[:5]}
    return target, {b: timed[(b, 1)] for b in sizes}


CATCH_UP_TOKENS = 32  # the width of the timed catch-up pass


def draft_points(runner: ModelRunner, batch: int, context_len: int,
                 chunk_tokens: int = 0) -> tuple[dict[int, float], float]:
    """Seconds of one draft pass (one token per request) by the number of requests in it, and
    seconds per token that a request's committed tokens add to a draft pass (``catch_up_seconds``)."""
    timed = time_passes(runner, sorted({(1, 1), (batch, 1), (1, CATCH_UP_TOKENS)}), context_len,
                        chunk_tokens=chunk_tokens)
    passes = {b: s for (b, w), s in timed.items() if w == 1}
    return passes, catch_up_seconds(timed[(1, 1)], timed[(1, CATCH_UP_TOKENS)], CATCH_UP_TOKENS)


def catch_up_seconds(one: float, wide: float, width: int) -> float:
    """Seconds per committed token a draft caches, from a pass of one token and one of ``width``:
    the tokens ride in the first proposal pass, whose one-token cost a drafting round already
    pays, so each adds only the pass's cost per token beyond the first (on a CPU the fixed part of
    a pass is a third of a 32-token one: counting it would price a catch-up half again too dear)."""
    return max(wide - one, 0.0) / (width - 1)
