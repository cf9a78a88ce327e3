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

from ..forward_batch import host_to_device, pack_to_device
from .pools import ReqToTokenPool, TokenToKVPoolAllocator
from .prefix_cache import Hit, Node, PrefixCache


@dataclass(frozen=True)
class SlotsSnapshot:
    """The free lists at one moment, in order (the warm-up puts them back exactly)."""

    rows: list[int]
    slots: torch.Tensor


@dataclass(frozen=True)
class Keep:
    """What a closing row leaves in the prefix cache: the tokens of its first positions, how many of
    them hold valid draft K/V, the token after them (None: unknown), and the node it holds."""

    tokens: list[int]
    draft_valid: int
    next_token: int | None
    held: Node | None


@dataclass(frozen=True)
class Closing:
    """A row to close: its slots for positions ``0 .. kv_len - 1`` go back, or into the cache (``keep``)."""

    row: int
    kv_len: int
    keep: Keep | None = None


class KVSlots:
    def __init__(self, rows: ReqToTokenPool, allocator: TokenToKVPoolAllocator):
        self.rows, self.allocator = rows, allocator
        self.cache: PrefixCache | None = None  # set once: from then on closed rows leave their KV in it

    @property
    def req_to_token(self) -> torch.Tensor:
        """``[rows, positions]``: the slot that holds each position of each request row."""
        return self.rows.req_to_token

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.allocator.size

    def free_slots(self) -> int:
        """Slots a step may take: the allocator's, and cached ones no running request holds."""
        return self.allocator.available_size() + (self.cache.evictable if self.cache else 0)

    def cached(self) -> int:
        """Positions the prefix cache holds (held by running requests or not)."""
        return self.cache.size if self.cache else 0

    def free_rows(self) -> int:
        return self.rows.available_size()

    def used(self) -> int:
        """Slots out of the allocator: held by requests, or cached."""
        return self.size - self.allocator.available_size()

    # ---- request rows ---------------------------------------------------------------------
    def borrow(self, tokens: list[int], limit: int) -> Hit | None:
        """Hold the longest cached prefix of ``tokens`` (at most ``limit`` positions) for a row
        about to open; ``give_back_hit`` undoes it when the row does not open."""
        return self.cache.match(tokens, limit) if self.cache else None

    def give_back_hit(self, hit: Hit) -> None:
        self.cache.release(hit.node)

    def open_row(self, hit: Hit | None = None) -> int:
        """A request row; with ``hit``, its first positions already hold the cached slots."""
        row = self.rows.alloc()
        if hit is not None:
            self.req_to_token[row, : hit.length] = host_to_device(hit.slots, self.req_to_token.device)
        return row

    def close_rows(self, rows: list[tuple[int, int] | Closing]) -> None:
        """Close each row (a ``Closing``, or ``(row, kv_len)`` for one that keeps nothing): its slots
        go back or into the cache, then the row (only after its slots are read: a freed row may be
        handed out again). One read of every row's slots to the host."""
        rows = [c if isinstance(c, Closing) else Closing(*c) for c in rows]
        if self.cache is None or all(c.keep is None for c in rows):
            self.release([(c.row, 0, c.kv_len) for c in rows])
        else:
            free = []
            for c, slots in zip(rows, self._read_rows([(c.row, c.kv_len) for c in rows])):
                if c.keep is None:
                    free.append(slots)
                    continue
                n = len(c.keep.tokens)
                _, refused = self.cache.insert(c.keep.tokens, slots[:n], c.keep.draft_valid, c.keep.next_token)
                free += [refused, slots[n:]]
                if c.keep.held is not None:
                    self.cache.release(c.keep.held)
            self.allocator.free(torch.cat(free))
        for c in rows:
            self.rows.free(c.row)

    def returned_by(self, kv_len: int, held: Node | None) -> int:
        """Slots a closing row of ``kv_len`` positions makes free or evictable: all but the cached
        positions another request holds too."""
        return kv_len - (self.cache.shared(held) if held is not None else 0)

    def keepable(self, keep: Keep) -> int:
        """Positions of a running row ``keep_rows`` would cache now."""
        return self.cache.keyable(len(keep.tokens), keep.draft_valid, keep.next_token)

    def keep_rows(self, rows: list[tuple[int, Keep]]) -> list[Node]:
        """Cache the first positions of running rows (``keepable`` of them) and hold them: later
        prompts that start the same way reuse them while these requests still run. A position the
        cache already held under another slot moves to the cache's slot and its own goes back."""
        cut = []
        for row, keep in rows:
            n = self.keepable(keep)
            after = keep.tokens[n] if n < len(keep.tokens) else keep.next_token
            cut.append((row, Keep(keep.tokens[:n], min(keep.draft_valid, n), after, keep.held)))
        nodes, free = [], []
        for (row, keep), slots in zip(cut, self._read_rows([(row, len(keep.tokens)) for row, keep in cut])):
            node, duplicates = self.cache.insert(keep.tokens, slots, keep.draft_valid, keep.next_token)
            self.cache.hold(node)
            if keep.held is not None:
                self.cache.release(keep.held)
            if duplicates.numel():
                free.append(duplicates)
                path = self.cache.path_slots(node)
                self.req_to_token[row, : path.numel()] = host_to_device(path, self.req_to_token.device)
            nodes.append(node)
        if free:
            self.allocator.free(torch.cat(free))
        return nodes

    def _read_rows(self, rows: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The slots of positions ``0 .. n - 1`` of each ``(row, n)``, on the host, in one read."""
        flat = torch.cat([self.req_to_token[row, :n] for row, n in rows]).to("cpu", torch.int64)
        return list(torch.split(flat, [n for _, n in rows]))

    # ---- positions ------------------------------------------------------------------------
    def reserve(self, ranges: list[tuple[int, int, int]], also: tuple[list[int], ...] = ()) -> list[torch.Tensor]:
        """Fresh slots for positions ``start .. end - 1`` of every ``(row, start, end)``, sent to
        the device in one copy whatever the batch, with the host lists ``also`` (the round's other
        metadata); returns those on the device."""
        rows, positions = [], []
        for row, start, end in ranges:
            rows += [row] * (end - start)
            positions += range(start, end)
        rows_d, positions_d, slots_d, *sent = pack_to_device([rows, positions, self.fresh(len(rows)), *also],
                                                             self.req_to_token.device)
        self.req_to_token[rows_d, positions_d] = slots_d
        return sent

    def fresh(self, n: int) -> torch.Tensor:
        """``n`` slots that belong to no position yet, on the host (the caller sends them with its
        pass and places them), evicting cached positions when the allocator is short."""
        self.make_free(n)
        return self.allocator.alloc(n)

    def make_free(self, n: int) -> None:
        """Evict cached positions until the allocator has ``n`` slots (no-op when it has)."""
        short = n - self.allocator.available_size()
        if short > 0 and self.cache is not None:
            self.allocator.free(self.cache.evict(short))

    def release(self, ranges: list[tuple[int, int, int]]) -> None:
        """The slots of every ``(row, start, end)`` back, with one read of them to the host (each
        read waits for the GPU: a round's rejections must not cost one wait each)."""
        _free_position_ranges(self.rows, self.allocator, ranges)

    def give_back(self, slots: torch.Tensor) -> None:
        """Slots from ``fresh`` no position took, or a round's rejected slots read back already."""
        self.allocator.free(slots)

    # ---- the warm-up's undo ----------------------------------------------------------------
    def snapshot(self) -> SlotsSnapshot:
        return SlotsSnapshot(self.rows.free_rows(), self.allocator.free_slots())

    def restore(self, snapshot: SlotsSnapshot) -> None:
        self.rows.restore_free_rows(snapshot.rows)
        self.allocator.restore_free_slots(snapshot.slots)


def _free_position_ranges(req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                         ranges: list[tuple[int, int, int]]) -> None:
    """Return the slots of positions ``start .. end - 1`` for every ``(req_idx, start, end)``, in that
    order (rejected draft tokens, finished requests), with one read of the
    slots back to the host (each read waits for the GPU: a round's frees must not cost one each)."""
    parts = [req_pool.req_to_token[idx, start:end] for idx, start, end in ranges if end > start]
    if parts:
        allocator.free(torch.cat(parts))
