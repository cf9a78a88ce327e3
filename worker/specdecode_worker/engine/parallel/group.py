"""The tensor-parallel group a sharded layer reduces over: this process's rank and the collectives.

Model code reads only this (``TPGroup``, ``SINGLE`` without parallelism); how ranks are started,
led and supervised is ``distributed``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600  # a model collective that waits longer than this means a rank is gone
_CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (size 1: no parallelism, no collectives)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    cpu_group: Any = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over all ranks (every rank gets it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (control messages; pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


SINGLE = TPGroup()
_current = SINGLE


def get_tp() -> TPGroup:
    """The group this process belongs to (``SINGLE`` unless ``init_tp`` ran)."""
    return _current


def init_tp(rank: int, size: int, port: int, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
            master_addr: str = "127.0.0.1", local_rank: int | None = None) -> TPGroup:
    global _current
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    cpu_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _current = TPGroup(rank, size, dist.group.WORLD, cpu_group)
    return _current


def destroy_tp() -> None:
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = SINGLE
