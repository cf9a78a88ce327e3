"""Start-up timing for the speculation policy: whole rounds, run as serving runs them.

Throw-away requests (``warmup.LeavesNoTrace``: every slot, row and counter is put back) with a
cached prefix decode through the speculator's own ``decode_round``, so each timed round runs every
pass a round of that shape runs, with its host work: a head's extend, each draft step, the verify
pass at its width (padded into a graph where one takes it), sampling and acceptance; an n-gram
round is handed proposals of the lengths it times. The shapes are timed in turn, several
times over, and each keeps its fastest time: a load spike then spoils one repeat, not the model.
Requests take turns, so that each grows by about as much; when one would outgrow its room, a
fresh set is prefilled (and its drafts caught up, untimed).
"""

from __future__ import annotations

import time

import torch

from ..request import SamplingParams
from .rounds import take_cached_lengths
from ..warmup import LeavesNoTrace, prefill_requests
from .round_cost import RoundCost
from .algorithms import Drafter
from .rounds import Lookup

PREFIX_TOKENS = 128  # context each request has cached (less when the pool or the context is small)
GREEDY = SamplingParams(max_tokens=1)


def round_shapes(batch: int, k: int) -> list[tuple[int, int, int]]:
    """(requests, of them drafting, k): at batch sizes 1, 2, 4, ... and ``batch``, a plain round,
    every request drafting 1 and k (a round's passes and verify width grow in step with k, so the
    depths between are interpolated), and one request drafting k."""
    sizes = sorted({min(2 ** i, batch) for i in range(batch.bit_length() + 1)})
    shapes = []
    for b in sizes:
        shapes += [(b, 0, 0)] + [(b, b, d) for d in sorted({1, k})] + ([(b, 1, k)] if b > 1 else [])
    return shapes


def time_rounds(spec, batch: int, context_len: int, chunk_tokens: int = 0, repeats: int = 3) -> RoundCost:
    """``RoundCost`` from the fastest of ``repeats`` timings of every ``round_shapes`` shape (after
    one untimed pass over them all)."""
    shapes = round_shapes(batch, spec.k)
    todo = shapes * (repeats + 1)
    best: dict[tuple[int, int, int], float] = {}
    done = 0
    while done < len(todo):
        with LeavesNoTrace(spec) as trace:
            reqs, limit = _fresh_requests(spec, trace, batch, context_len, chunk_tokens)
            started = done
            while done < len(todo):
                b, j, k = todo[done]
                if any(r.kv_len + spec.slots_per_round > limit for r in reqs[:b]):
                    break
                seconds = _timed_round(spec, reqs[:b], [k] * j + [0] * (b - j))
                if done >= len(shapes):
                    best[(b, j, k)] = min(seconds, best.get((b, j, k), seconds))
                reqs = reqs[1:] + reqs[:1]  # the next round starts with another request
                done += 1
            if done == started:
                raise RuntimeError(f"the KV pool has no room to time a round of {batch} requests")
    plain = {b: s for (b, j, k), s in best.items() if j == 0}
    drafting = {(b, k): s for (b, j, k), s in best.items() if j == b and k}
    one = {b: best.get((b, 1, spec.k), drafting[(b, spec.k)]) for b in plain}
    return RoundCost(plain, drafting, one)


def _fresh_requests(spec, trace: LeavesNoTrace, batch: int, context_len: int, chunk_tokens: int):
    """``batch`` requests with a cached prefix, their drafts caught up over it; and the KV length
    none of them may pass with a round's slots (its share of the pool, at most its context)."""
    slots, per_round = spec.target.slots, spec.slots_per_round
    share = min(slots.free_slots() // batch, context_len)
    prefix = max(1, min(PREFIX_TOKENS, context_len // 4, share // 2 - per_round))
    period = spec.k + 1
    pattern = [1 + i % period for i in range(prefix + 1)]
    reqs = [trace.request(pattern[:-1], rid=-1000 - i, params=GREEDY) for i in range(batch)]
    prefill_requests(spec, reqs, chunk_tokens or prefix * batch, lambda r: pattern[-1])
    _timed_round(spec, reqs, [spec.k] * batch)  # a draft's first round catches up over the prefix
    return reqs, share


def _timed_round(spec, reqs, ks: list[int]) -> float:
    """Seconds of one round drafting ``ks``; a lookup is handed proposals of exactly those lengths
    (serving looks up before the round, outside its time, too)."""
    device = spec.target.device
    lookup = Lookup([[1] * k for k in ks], [0] * len(ks)) if spec.method.drafter is Drafter.LOOKUP else None
    _wait_for(device)
    start = time.perf_counter()
    results = spec.decode_round(reqs, ks, lookup)
    _wait_for(device)  # a round ends with a read of its results; a plain one may not
    seconds = time.perf_counter() - start
    take_cached_lengths(reqs, results)
    for r, result in zip(reqs, results):
        r.output_ids.extend(result.tokens)
    return seconds


def _wait_for(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
