"""Rank 0's one channel to the other ranks of its tensor-parallel group.

Model and speculator code runs the same on every rank and never asks which rank it is: each pass
it runs over sharded weights goes to its runner's ``Mirror``, which on rank 0 of a group sends it
to the followers (``distributed.follow`` runs it there on their shards, so the collectives inside
the model line up) and otherwise does nothing. Three kinds of pass: a runner's forward pass, a
speculator's graph replay (the graph's key and its staged inputs), and a speculator's own eager
pass (``call``).

A graph replay is sent in two parts: a pickled header on the control group (the batch's type, its
host-side lengths, and the name, shape and dtype of every tensor), then the tensors themselves on
the model's group, one broadcast per dtype (device to device under NCCL). Rank 0 never reads a
device value back for it, so a round keeps its one host sync.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from ..forward_batch import ForwardBatch
from .group import TPGroup, get_tp


class Mirror:
    def __init__(self, tp: TPGroup):
        self.tp = tp

    @property
    def sending(self) -> bool:
        """Whether anyone follows this rank's passes (rank 0 of a group of two or more)."""
        return self.tp.size > 1 and self.tp.is_leader

    def forward(self, runner: str, fb: ForwardBatch, req_to_token: torch.Tensor, last_only: bool) -> None:
        """``runner``'s forward pass: the batch plus the request rows it reads."""
        if not self.sending:
            return
        width = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else 0
        rows = req_to_token[fb.req_pool_indices, :width].cpu()
        batch = {k: getattr(fb, k).cpu()
                 for k in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")}
        self.tp.broadcast(("forward", runner, batch, list(fb.extend_lens), list(fb.seq_lens_cpu), rows, last_only))

    def graph(self, runner: str, key, fb: ForwardBatch, req_to_token: torch.Tensor, extras=()) -> None:
        """The speculator replays graph ``key`` with this batch, the req_to_token rows it reads
        and the per-token ``extras`` (an EAGLE head's features); ``runner`` names the pool."""
        if not self.sending:
            return
        width = max(fb.seq_lens_cpu, default=0)
        tensors, host = {}, {}
        for f in dataclasses.fields(fb):
            value = getattr(fb, f.name)
            (tensors if isinstance(value, torch.Tensor) else host)[f.name] = value
        tensors[_ROWS] = req_to_token[fb.req_pool_indices, :width]
        tensors.update({f"{_EXTRA}{i}": x for i, x in enumerate(extras)})
        specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        self.tp.broadcast(("graph", runner, key, type(fb), host, specs))
        _broadcast_tensors(self.tp, specs, list(tensors.values()), req_to_token.device)

    def call(self, payload: tuple) -> None:
        """One of the speculator's own eager passes, as it describes it (its ``replay`` runs it)."""
        if self.sending:
            self.tp.broadcast(("replay", None, payload))


_ROWS, _EXTRA = "@rows", "@extra"


def receive_graph(msg: tuple, req_to_token: torch.Tensor) -> tuple[Any, ForwardBatch, list[torch.Tensor]]:
    """A follower: the graph key, the batch and the extras of an announced replay; the batch's
    req_to_token rows are mirrored into this rank's pool."""
    _, _, key, batch_type, host, specs = msg
    got = dict(zip((name for name, _, _ in specs), _broadcast_tensors(get_tp(), specs, None, req_to_token.device)))
    rows = got.pop(_ROWS)
    extras = [got.pop(name) for name, _, _ in specs if name.startswith(_EXTRA)]
    fb = batch_type(**got, **host)
    req_to_token[fb.req_pool_indices, : rows.shape[1]] = rows
    return key, fb, extras


def _broadcast_tensors(tp: TPGroup, specs, tensors, device) -> list[torch.Tensor]:
    """Rank 0's ``tensors`` (None on the others) on every rank, as ``specs`` describe them."""
    out: list[torch.Tensor | None] = [None] * len(specs)
    for dtype in sorted({d for _, _, d in specs}, key=str):
        idx = [i for i, (_, _, d) in enumerate(specs) if d == dtype]
        sizes = [math.prod(specs[i][1]) for i in idx]
        if tensors is not None:
            flat = torch.cat([tensors[i].to(device).reshape(-1) for i in idx])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=0, group=tp.group)
        for i, part in zip(idx, flat.split(sizes)):
            out[i] = part.view(specs[i][1])
    return out
