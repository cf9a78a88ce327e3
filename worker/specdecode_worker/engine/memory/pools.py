"""Paged KV memory: a req_to_token map, per-layer K/V buffers and a token-slot allocator.

One slot index addresses a token in every pool that shares the allocator: the target owns the
allocator and the req_to_token map, a standalone draft adopts both and adds only its own K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract import FP8_KV_CACHE_DTYPES
from ...errors import InputError

# --kv-cache-dtype values: auto stores K/V in the compute dtype; the fp8 formats store one byte per
# element, the planner's cell. There is no calibration: every tensor's scale is 1.0 (values are cast
# as they are), which is what serving engines do for an fp8 KV cache without calibrated scales.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, **{name: getattr(torch, dtype) for name, dtype in FP8_KV_CACHE_DTYPES.items()}}


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast for storing in a ``dtype`` pool. An fp8 cast of a value beyond the format's range
    gives NaN (e4m3 has no infinity), and one NaN key poisons every later attention over that slot:
    fp8 stores saturate at the format's largest finite value, as serving engines' fp8 caches do."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def resolve_kv_dtype(name: str | None, compute_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the K/V buffers for a ``--kv-cache-dtype`` value (None: auto)."""
    if name is None:
        return compute_dtype
    if name not in KV_CACHE_DTYPES:
        raise InputError(f"--kv-cache-dtype '{name}' is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or compute_dtype


class OutOfSlotsError(RuntimeError):
    """The KV pool has fewer free token slots than a step needs."""


@dataclass(frozen=True)
class MemoryPoolConfig:
    """Sizes every pool of one engine agrees on (decided once, in phase 2)."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int


class ReqToTokenPool:
    """Row r holds, for request slot r, the KV slot index of each of its token positions."""

    def __init__(self, size: int, context_len: int, device: torch.device | str):
        self.size = size
        self.context_len = context_len
        self.req_to_token = torch.zeros((size, context_len), dtype=torch.int64, device=device)
        self._free = list(range(size))

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlotsError("no free request slot")
        return self._free.pop()

    def free(self, idx: int) -> None:
        self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)

    def free_rows(self) -> list[int]:
        """The free list as it stands, for ``restore_free_rows`` (a pass that must leave no trace)."""
        return list(self._free)

    def restore_free_rows(self, rows: list[int]) -> None:
        self._free = list(rows)

    def nbytes(self) -> int:
        return self.req_to_token.numel() * self.req_to_token.element_size()


class TokenToKVPoolAllocator:
    """Free list of KV token slots. Slot 0 is a padding slot that is never handed out.

    A ring over one preallocated buffer, first freed first reused: taking n slots or giving n back
    touches those n entries only, so a round that rejects a token costs O(rejected), not O(pool).
    """

    def __init__(self, size: int, device: torch.device | str):
        self.size = size
        self.device = device
        self._ring = torch.arange(1, size + 1, dtype=torch.int64)
        self._head = 0  # where the oldest free slot sits
        self._count = size  # free slots, from the head on (wrapping)

    def available_size(self) -> int:
        return self._count

    def _positions(self, start: int, n: int) -> torch.Tensor:
        return (start + torch.arange(n)) % self.size

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` free slots, on the host: the caller sends them with the rest of its pass (one copy)."""
        if n > self._count:
            raise OutOfSlotsError(f"need {n} KV slots, {self._count} free")
        out = self._ring[self._positions(self._head, n)]
        self._head, self._count = (self._head + n) % self.size, self._count - n
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if not n:
            return
        if self._count + n > self.size:
            raise RuntimeError(f"freeing {n} KV slots with {self._count} of {self.size} already free: "
                               "a slot was freed twice")
        self._ring[self._positions(self._head + self._count, n)] = slots.to("cpu", torch.int64).reshape(-1)
        self._count += n

    def free_slots(self) -> torch.Tensor:
        """The free list in its order, for ``restore_free_slots`` (a pass that must leave no trace)."""
        return self._ring[self._positions(self._head, self._count)].clone()

    def restore_free_slots(self, slots: torch.Tensor) -> None:
        self._ring[: slots.numel()] = slots
        self._head, self._count = 0, slots.numel()


class MHATokenToKVPool:
    """K and V buffers per layer, ``[size + 1, kv_heads, head_dim]`` each (row 0 is padding).

    ``dtype`` is the storage dtype: new K/V are cast to it on store (scale 1.0 for fp8) and the
    attention backend upcasts what it reads to the compute dtype.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.k_buffer = [torch.zeros((size + 1, kv_heads, head_dim), dtype=dtype, device=device)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.zeros((size + 1, kv_heads, v_head_dim), dtype=dtype, device=device)
                         for _ in range(num_layers)]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer][loc] = to_storage(k, self.dtype)
        self.v_buffer[layer][loc] = to_storage(v, self.dtype)

    def bytes_per_token(self) -> int:
        return sum(b[0].numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)
