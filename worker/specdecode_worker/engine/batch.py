"""Building forward batches: KV slot allocation per position and the flattened batch layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forward_batch import ForwardBatch, to_device
from .memory.pools import ReqToTokenPool, TokenToKVPoolAllocator


def alloc_positions(req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, req_idx: int, start: int,
                    end: int) -> None:
    """Give positions ``start..end-1`` of request row ``req_idx`` fresh KV slots."""
    if end > start:
        req_pool.req_to_token[req_idx, start:end] = allocator.alloc(end - start)


def free_position_ranges(req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                         ranges: list[tuple[int, int, int]]) -> None:
    """Return the slots of positions ``start .. end - 1`` for every ``(req_idx, start, end)``, in that
    order (rejected draft tokens, finished requests), with one read of the
    slots back to the host (each read waits for the GPU: a round's frees must not cost one each)."""
    parts = [req_pool.req_to_token[idx, start:end] for idx, start, end in ranges if end > start]
    if parts:
        allocator.free(torch.cat(parts))


@dataclass
class Segment:
    """New tokens of one request: ``tokens`` at positions ``start .. start + len(tokens) - 1``."""

    req_idx: int
    tokens: list[int]
    start: int


def chunk_segments(slots, reqs, ends: list[int]) -> list[Segment]:
    """Take KV slots (``KVSlots``) for prefill positions ``r.kv_len .. end - 1`` of each request;
    one segment each."""
    segments = []
    for r, end in zip(reqs, ends):
        slots.reserve(r.req_idx, r.kv_len, end)
        segments.append(Segment(r.req_idx, r.prefill_ids[r.kv_len : end], r.kv_len))
    return segments


def make_batch(segments: list[Segment], device) -> ForwardBatch:
    ids, pos = [], []
    for s in segments:
        ids.extend(s.tokens)
        pos.extend(range(s.start, s.start + len(s.tokens)))
    seq_lens = [s.start + len(s.tokens) for s in segments]
    return ForwardBatch(
        input_ids=to_device(ids, device, torch.int64),
        positions=to_device(pos, device, torch.int64),
        out_cache_loc=torch.empty(0, dtype=torch.int64),
        req_pool_indices=to_device([s.req_idx for s in segments], device, torch.int64),  # never a pageable copy
        seq_lens=to_device(seq_lens, device, torch.int64),
        extend_lens=[len(s.tokens) for s in segments],
        seq_lens_cpu=seq_lens,
    )


def with_cache_locs(fb: ForwardBatch, req_pool: ReqToTokenPool, segments: list[Segment]) -> ForwardBatch:
    """Fill ``out_cache_loc`` from the slots already assigned to each segment's positions."""
    rows = req_pool.req_to_token
    fb.out_cache_loc = torch.cat([rows[s.req_idx, s.start : s.start + len(s.tokens)] for s in segments])
    return fb


PAD_SLOT = 0  # the KV slot padding writes to: the allocator never hands it out, no request reads it


@dataclass(frozen=True)
class PaddedChains:
    """How a padded verify batch lays out its chains: ``width`` rows per request, the first
    ``lengths[i]`` (a device tensor) request i's own."""

    width: int
    lengths: torch.Tensor


def padded_chain_batch(req_pool: ReqToTokenPool, req_indices: list[int], starts: list[int], chains: torch.Tensor,
                       lengths: list[int], width: int) -> tuple[ForwardBatch, PaddedChains]:
    """A chain verify batch of ``width`` rows per request, whatever each request verifies, so one
    graph of that width serves every mix of draft lengths (the adaptive policy's, short n-gram
    lookups, requests that do not draft this round).

    ``chains``: ``[B, <= width]`` tokens on the device, row i's first ``lengths[i]`` request i's
    (its last committed token, then its proposals). They are its rows at positions ``starts[i]..``, written to its
    own slots; the padding rows repeat its last position and write their K/V to ``PAD_SLOT``.
    Attention reads keys by position through ``req_to_token`` (never the pad slot) up to
    ``seq_lens``, the real length, so no valid row sees a padding row and the layout is the same
    for the Triton kernels and the torch-native reference. Returns the batch and its layout.
    """
    device = chains.device
    req_idx, start, lens = to_device([req_indices, starts, lengths], device, torch.int64).unbind(0)  # one copy
    offsets = torch.arange(width, device=device)
    positions = start[:, None] + torch.minimum(offsets[None], lens[:, None] - 1)
    slots = req_pool.req_to_token[req_idx[:, None], positions]
    slots = torch.where(offsets[None] < lens[:, None], slots, PAD_SLOT)
    seq_lens = [s + n for s, n in zip(starts, lengths)]
    fb = ForwardBatch(
        input_ids=torch.nn.functional.pad(chains, (0, width - chains.shape[1])).reshape(-1),
        positions=positions.reshape(-1), out_cache_loc=slots.reshape(-1), req_pool_indices=req_idx,
        seq_lens=start + lens, extend_lens=[width] * len(starts), seq_lens_cpu=seq_lens,
    )
    return fb, PaddedChains(width, lens)


def forward_segments(runner, segments: list[Segment], last_only: bool,
                     input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``runner`` over segments whose positions already have slots; returns float32 logits.
    ``input_ids``: the segments' tokens already on the device (sampled there), in their order;
    the segments' own token lists then only give lengths."""
    fb = with_cache_locs(make_batch(segments, runner.device), runner.req_to_token_pool, segments)
    if input_ids is not None:
        fb.input_ids = input_ids
    return runner.forward(fb, last_only)
