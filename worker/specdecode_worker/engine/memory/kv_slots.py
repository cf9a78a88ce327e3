"""The one owner of request rows and KV slots.

Every pool of a deployment (the target's, a standalone draft's, an EAGLE head's, the MTP layer's)
is addressed by the same slot numbers through the target's ``req_to_token`` rows, and every slot
comes from one allocator (phase 2 makes the drafts adopt both). So one object opens and closes
request rows, reserves slots for positions, and takes back what a round rejected or a finished
request held. The scheduler, the speculators and the warm-up ask it; nothing else touches the
free lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import alloc_positions, free_position_ranges
from .pools import ReqToTokenPool, TokenToKVPoolAllocator


@dataclass(frozen=True)
class SlotsSnapshot:
    """The free lists at one moment, in order (the warm-up puts them back exactly)."""

    rows: list[int]
    slots: torch.Tensor


class KVSlots:
    def __init__(self, rows: ReqToTokenPool, allocator: TokenToKVPoolAllocator):
        self.rows, self.allocator = rows, allocator

    @property
    def req_to_token(self) -> torch.Tensor:
        """``[rows, positions]``: the slot that holds each position of each request row."""
        return self.rows.req_to_token

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.allocator.size

    def free_slots(self) -> int:
        return self.allocator.available_size()

    def free_rows(self) -> int:
        return self.rows.available_size()

    def used(self) -> int:
        return self.size - self.free_slots()

    # ---- request rows ---------------------------------------------------------------------
    def open_row(self) -> int:
        return self.rows.alloc()

    def close_rows(self, rows: list[tuple[int, int]]) -> None:
        """Give back each ``(row, kv_len)``: the slots of its first ``kv_len`` positions, then the
        row (only after its slots are read: a freed row may be handed out again)."""
        self.release([(row, 0, kv_len) for row, kv_len in rows])
        for row, _ in rows:
            self.rows.free(row)

    # ---- positions ------------------------------------------------------------------------
    def reserve(self, row: int, start: int, end: int) -> None:
        """Fresh slots for positions ``start .. end - 1`` of ``row``."""
        alloc_positions(self.rows, self.allocator, row, start, end)

    def release(self, ranges: list[tuple[int, int, int]]) -> None:
        """The slots of every ``(row, start, end)`` back, with one read of them to the host (each
        read waits for the GPU: a round's rejections must not cost one wait each)."""
        free_position_ranges(self.rows, self.allocator, ranges)

    def take(self, n: int) -> torch.Tensor:
        """``n`` slots that belong to no position yet (a draft tree's scratch K/V)."""
        return self.allocator.alloc(n)

    def give_back(self, slots: torch.Tensor) -> None:
        """Slots from ``take``, or a round's rejected slots read back already."""
        self.allocator.free(slots)

    # ---- the warm-up's undo ----------------------------------------------------------------
    def snapshot(self) -> SlotsSnapshot:
        return SlotsSnapshot(self.rows.free_rows(), self.allocator.free_slots())

    def restore(self, snapshot: SlotsSnapshot) -> None:
        self.rows.restore_free_rows(snapshot.rows)
        self.allocator.restore_free_slots(snapshot.slots)
