"""Building forward batches: KV slot allocation per position and the flattened batch layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .forward_batch import ForwardBatch, host_to_device, pack_to_device, to_device
from .memory.pools import ReqToTokenPool, TokenToKVPoolAllocator

if TYPE_CHECKING:
    from .memory.kv_slots import KVSlots


def alloc_positions(req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, req_idx: int, start: int,
                    end: int) -> None:
    """Give positions ``start..end-1`` of request row ``req_idx`` fresh KV slots (one request
    outside serving; serving reserves a batch's slots at once: ``KVSlots.reserve``, ``fresh_batch``)."""
    if end > start:
        req_pool.req_to_token[req_idx, start:end] = host_to_device(allocator.alloc(end - start),
                                                                   req_pool.req_to_token.device)


@dataclass
class Segment:
    """New tokens of one request: ``tokens`` at positions ``start .. start + len(tokens) - 1``."""

    req_idx: int
    tokens: list[int]
    start: int


def chunk_segments(reqs, ends: list[int]) -> list[Segment]:
    """Prefill positions ``r.kv_len .. end - 1`` of each request; one segment each."""
    return [Segment(r.req_idx, r.prefill_ids[r.kv_len : end], r.kv_len) for r, end in zip(reqs, ends)]


def _layout(segments: list[Segment]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Host lists of a batch: token ids, positions, each token's request row, each request's
    length after the batch, and each request's last row."""
    ids, pos, rows, seq_lens, last = [], [], [], [], []
    for s in segments:
        n = len(s.tokens)
        ids.extend(s.tokens)
        pos.extend(range(s.start, s.start + n))
        rows.extend([s.req_idx] * n)
        seq_lens.append(s.start + n)
        last.append(len(ids) - 1)
    return ids, pos, rows, seq_lens, last


def make_batch(segments: list[Segment], device) -> ForwardBatch:
    """The batch over positions that hold their slots already (``with_cache_locs`` reads them), in
    one copy to the device."""
    return _send(segments, device, None)


def fresh_batch(slots: KVSlots, segments: list[Segment], device) -> ForwardBatch:
    """The batch over new positions (a prefill chunk, a step where nobody drafts): it takes a free
    slot for each and sends the slots, where they go in ``req_to_token`` and the batch in one copy."""
    return _send(segments, device, slots)


def _send(segments: list[Segment], device, fresh: KVSlots | None) -> ForwardBatch:
    ids, pos, rows, seq_lens, last = _layout(segments)
    new = fresh.fresh(len(ids)) if fresh is not None else []
    input_ids, positions, req_idx, lens, last_rows, token_rows, out_cache_loc = pack_to_device(
        [ids, pos, [s.req_idx for s in segments], seq_lens, last, rows if fresh is not None else [], new], device)
    if fresh is not None:
        fresh.req_to_token[token_rows, positions] = out_cache_loc
    return ForwardBatch(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                        req_pool_indices=req_idx, seq_lens=lens, extend_lens=[len(s.tokens) for s in segments],
                        seq_lens_cpu=seq_lens, last_rows=last_rows)


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


def left_padded_batch(req_pool: ReqToTokenPool, segments: list[Segment], width: int,
                      device) -> tuple[ForwardBatch, torch.Tensor]:
    """The segments (their positions' slots reserved) as ``width`` rows each, padding first, so
    that one extend graph of that width serves any mix of lengths up to it and request i's last
    token is row ``(i + 1) x width - 1``. A padding row repeats its request's first position and
    writes its K/V to ``PAD_SLOT``; attention reads keys through ``req_to_token`` (never the pad
    slot), so no real row sees it. Sent in one copy; returns the batch and the real rows' places."""
    ids, pos, real = [], [], []
    for i, s in enumerate(segments):
        n = len(s.tokens)
        ids += [0] * (width - n) + s.tokens
        pos += [s.start] * (width - n) + list(range(s.start, s.start + n))
        real += range((i + 1) * width - n, (i + 1) * width)
    req_rows = [s.req_idx for s in segments]
    seq_lens = [s.start + len(s.tokens) for s in segments]
    input_ids, positions, req_idx, lens, real_rows = pack_to_device([ids, pos, req_rows, seq_lens, real], device)
    slots = torch.full_like(positions, PAD_SLOT)
    slots[real_rows] = req_pool.req_to_token[req_idx.repeat_interleave(width)[real_rows], positions[real_rows]]
    fb = ForwardBatch(input_ids=input_ids, positions=positions, out_cache_loc=slots, req_pool_indices=req_idx,
                      seq_lens=lens, extend_lens=[width] * len(segments), seq_lens_cpu=seq_lens)
    return fb, real_rows


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
    req_idx, start, lens = to_device([req_indices, starts, lengths], chains.device, torch.int64).unbind(0)  # one copy
    return chain_batch(req_pool.req_to_token, req_idx, start, lens, [s + n for s, n in zip(starts, lengths)], chains,
                       width)


def chain_batch(req_to_token: torch.Tensor, req_idx: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                seq_lens_cpu: list[int], chains: torch.Tensor, width: int) -> tuple[ForwardBatch, PaddedChains]:
    """``padded_chain_batch`` from per-request rows, starts and chain lengths already on the device
    (sent with the round's slots): built there, nothing sent. ``width`` equal to every length is
    the ragged batch itself, without padding."""
    device = chains.device
    offsets = torch.arange(width, device=device)
    positions = starts[:, None] + torch.minimum(offsets[None], lengths[:, None] - 1)
    slots = req_to_token[req_idx[:, None], positions]
    slots = torch.where(offsets[None] < lengths[:, None], slots, PAD_SLOT)
    fb = ForwardBatch(
        input_ids=torch.nn.functional.pad(chains, (0, width - chains.shape[1])).reshape(-1),
        positions=positions.reshape(-1), out_cache_loc=slots.reshape(-1), req_pool_indices=req_idx,
        seq_lens=starts + lengths, extend_lens=[width] * len(seq_lens_cpu), seq_lens_cpu=seq_lens_cpu,
    )
    return fb, PaddedChains(width, lengths)


def step_batch(req_to_token: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor, positions_cpu: list[int],
               input_ids: torch.Tensor) -> ForwardBatch:
    """One token per request at ``positions`` (on the device, their slots reserved), as a draft's
    chain step takes it: built on the device, nothing sent."""
    return ForwardBatch(input_ids=input_ids, positions=positions, out_cache_loc=req_to_token[req_idx, positions],
                        req_pool_indices=req_idx, seq_lens=positions + 1, extend_lens=[1] * len(positions_cpu),
                        seq_lens_cpu=[p + 1 for p in positions_cpu])


def forward_segments(runner, segments: list[Segment], last_only: bool,
                     input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``runner`` over segments whose positions already have slots; returns float32 logits.
    ``input_ids``: the segments' tokens already on the device (sampled there), in their order;
    the segments' own token lists then only give lengths."""
    fb = with_cache_locs(make_batch(segments, runner.device), runner.req_to_token_pool, segments)
    if input_ids is not None:
        fb.input_ids = input_ids
    return runner.forward(fb, last_only)
