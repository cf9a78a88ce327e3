"""Phase 3's warm-up: the dynamic memory peak measured against the plan's ``R_dynamic``.

After the attention backends and CUDA graphs are ready, the engine runs one forward pass at the
largest prefill chunk (``chunkedPrefillSize`` tokens) and one at the largest graph batch with
the verify width (``cudaGraphMaxBs`` requests of k + 1 tokens), over KV slots it takes and gives
back. The allocator's peak over those passes, less what weights and pools hold, is the measured
dynamic peak (activations, logits and the CUDA graph pools, which stay allocated). A measured
value above the plan is logged as a warning with both numbers.

Only CUDA's caching allocator keeps a peak. On CPU there is nothing to read: the warm-up passes
are skipped (they would only cost start-up time) and the measured value is None, reported as
not measured, never estimated.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from .batch import Segment, forward_segments

log = logging.getLogger(__name__)


class WarmUpOutOfMemory(RuntimeError):
    """The largest planned pass does not fit beside the weights and pools."""


@dataclass(frozen=True)
class DynamicPeak:
    planned: int | None  # R_dynamic of the plan served (None: no plan gave one)
    measured: int | None  # allocator peak beyond weights and pools over the warm-up (None: not measurable)
    chunk_tokens: int = 0  # the prefill pass's tokens
    batch: int = 0  # the batch pass's requests ...
    width: int = 0  # ... and tokens per request
    note: str = ""

    @property
    def over_plan(self) -> bool:
        return self.planned is not None and self.measured is not None and self.measured > self.planned

    def as_dict(self) -> dict:
        return asdict(self)


class CudaPeak:
    """The CUDA caching allocator's peak of allocated bytes since ``reset``."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def peak_reader(device: torch.device) -> CudaPeak | None:
    """What reads the allocator's peak on ``device``; None where none is kept (CPU)."""
    return CudaPeak(device) if device.type == "cuda" else None


def static_bytes(runners) -> int:
    """Bytes the plan counts as static: weights, KV pools and the req_to_token map."""
    total = runners[0].req_to_token_pool.nbytes()
    for runner in runners:
        total += runner.weight_bytes + runner.token_to_kv_pool.nbytes()
    return total


def warm_up(runners, planned: int | None, chunk_tokens: int, batch: int, width: int) -> DynamicPeak:
    """Run the two largest passes through ``runners`` (target first; the draft, when it is a model
    of its own, at the same slots) and read the peak. ``runners[0]`` owns the shared pools."""
    target = runners[0]
    reader = peak_reader(target.device)
    if reader is None:
        return DynamicPeak(planned, None, note=f"not measurable on {target.device.type}: no allocator peak")
    pool, alloc = target.req_to_token_pool, target.token_to_kv_pool_allocator
    context = pool.req_to_token.shape[1]
    chunk_tokens = max(1, min(chunk_tokens, context, alloc.available_size()))
    batch = max(1, min(batch, pool.available_size(), alloc.available_size() // max(width, 1)))
    width = max(1, min(width, context))
    static = static_bytes(runners)
    reader.reset()
    try:
        _run(runners, [chunk_tokens], last_only=True)
        _run(runners, [width] * batch, last_only=False)
    except torch.OutOfMemoryError as exc:  # serving would run out at its first full chunk or batch
        raise WarmUpOutOfMemory(
            f"phase 3's warm-up ran out of device memory (a pass of {chunk_tokens} prompt tokens, then one of "
            f"{batch} x {width} tokens), with {planned} bytes planned for activations and graphs "
            f"(reserve.dynamicBytes): give a smaller chunkedPrefillSize or cudaGraphMaxBs, or a lower "
            f"--mem-fraction-static ({exc})") from None
    measured = max(0, reader.peak() - static)
    peak = DynamicPeak(planned, measured, chunk_tokens, batch, width,
                       note=f"warm-up: one pass of {chunk_tokens} prompt tokens, one of {batch} x {width} tokens")
    if peak.over_plan:
        log.warning("dynamic memory peak %d bytes measured in the warm-up is above the plan's %d bytes "
                    "(reserve.dynamicBytes): lower --mem-fraction-static or cudaGraphMaxBs/chunkedPrefillSize",
                    measured, planned)
    else:
        log.info("dynamic memory peak: planned %s bytes, measured %d bytes", planned, measured)
    return peak


def _run(runners, lengths: list[int], last_only: bool) -> None:
    """One forward per runner over fresh requests of ``lengths`` tokens at positions 0..n-1 (token
    id 0), on slots taken for the pass and given back after it."""
    target = runners[0]
    pool, alloc = target.req_to_token_pool, target.token_to_kv_pool_allocator
    rows = [pool.alloc() for _ in lengths]
    slots = alloc.alloc(sum(lengths))
    try:
        segments, start = [], 0
        for row, n in zip(rows, lengths):
            pool.req_to_token[row, :n] = slots[start : start + n]
            segments.append(Segment(row, [0] * n, 0))
            start += n
        for runner in runners:
            forward_segments(runner, segments, last_only)
    finally:
        alloc.free(slots)
        for row in rows:
            pool.free(row)
