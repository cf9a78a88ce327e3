"""Tensor parallelism across the GPUs of one pod: rank processes, their groups, and supervision.

One process per rank. ``launch`` starts them and supervises: the first rank that fails stops
every other rank and the whole worker fails with that rank's message, so the pod restarts as a
whole and no rank is left waiting in a collective. Rank 0 schedules; the other ranks follow:
every forward pass rank 0 runs on a sharded model is announced to them (``announce_forward``)
and ``follow`` replays it, so the collectives inside the model line up.

Two groups: ``group`` carries the model's collectives (NCCL on CUDA, gloo on CPU); ``cpu_group``
(gloo) carries the small control messages. The control group waits without a deadline (a
follower may idle as long as the server does); supervision, not a timeout, ends a stuck rank.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600  # a model collective that waits longer than this means a rank is gone
_CONTROL_TIMEOUT = timedelta(days=365)


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel worker failed; every other rank was stopped."""


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


def init_tp(rank: int, size: int, port: int, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    global _current
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    cpu_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _current = TPGroup(rank, size, dist.group.WORLD, cpu_group)
    return _current


def destroy_tp() -> None:
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = SINGLE


# ---- rank 0 leads, the others follow ---------------------------------------------------------

def announce_forward(name: str, fb: ForwardBatch, req_to_token: torch.Tensor, last_only: bool) -> None:
    """Send the followers one forward pass: the batch plus the request rows it reads."""
    width = max(fb.seq_lens_cpu) if fb.seq_lens_cpu else 0
    rows = req_to_token[fb.req_pool_indices, :width].cpu()
    batch = {k: getattr(fb, k).cpu()
             for k in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")}
    get_tp().broadcast(("forward", name, batch, list(fb.extend_lens), list(fb.seq_lens_cpu), rows, last_only))


_followers_stopped = False


def expect_followers() -> None:
    """The followers are (again) following this rank: the next ``stop_followers`` releases them."""
    global _followers_stopped
    _followers_stopped = False


def stop_followers() -> None:
    """Release the followers from ``follow`` (once; they are gone after it)."""
    global _followers_stopped
    tp = get_tp()
    if tp.size > 1 and tp.is_leader and not _followers_stopped:
        _followers_stopped = True
        tp.broadcast(("stop",))


def follow(runners: dict[str, Any]) -> int:
    """Replay rank 0's forward passes on this rank's shards until it says stop; returns the count."""
    tp = get_tp()
    count = 0
    while True:
        msg = tp.broadcast()
        if msg[0] == "stop":
            return count
        _, name, batch, extend_lens, seq_lens_cpu, rows, last_only = msg
        runner = runners[name]
        dev = runner.device
        fb = ForwardBatch(**{k: v.to(dev) for k, v in batch.items()}, extend_lens=extend_lens,
                          seq_lens_cpu=seq_lens_cpu)
        # The follower's req_to_token mirrors rank 0's rows for the requests in this batch.
        runner.req_to_token_pool.req_to_token[fb.req_pool_indices, : rows.shape[1]] = rows.to(dev)
        runner.forward(fb, last_only)
        count += 1


# ---- launching and supervising the ranks ------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # A supervisor killed outright (OOM, SIGKILL) must not leave ranks behind.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(fn, rank, size, port, device, timeout_s, args, results) -> None:
    _die_with_parent()
    try:
        init_tp(rank, size, port, device, timeout_s)
        out = fn(*args)
        results.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit non-zero
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
        results.put((rank, "error", f"{type(exc).__name__}: {exc}{at}"))
        results.close()
        results.join_thread()
        os._exit(1)
    finally:
        try:
            destroy_tp()
        except Exception:  # noqa: BLE001 - the peers may be gone already
            pass


def launch(size: int, fn: Callable, args: tuple = (), device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
           wall_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``size`` rank processes, each inside its group; returns their results.

    The first rank that fails (an exception, or an exit without a result) stops all others and
    raises ``RankFailure`` with its message. When rank 0 returns, followers still running are
    stopped. ``wall_timeout_s`` bounds the whole run.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, size, port, device, timeout_s, args, results),
                         name=f"tp-rank-{r}", daemon=False) for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = None if wall_timeout_s is None else time.monotonic() + wall_timeout_s
    previous = None
    if threading.current_thread() is threading.main_thread():
        # A pod being stopped: unwind through the finally below, which stops every rank.
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        while True:
            while not results.empty():
                rank, status, value = results.get()
                if status == "error":
                    raise RankFailure(f"tensor-parallel rank {rank} of {size} failed: {value}; "
                                      f"stopped the other {size - 1} rank(s)")
                out[rank] = value
            if 0 in out or len(out) == size:
                break
            exited = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
            if exited:
                time.sleep(0.5)  # its report may still be in flight
                if not results.empty():
                    continue
                rank, code = exited[0]
                raise RankFailure(f"tensor-parallel rank {rank} of {size} exited with code {code} without a "
                                  f"result; stopped the other {size - 1} rank(s)")
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel worker did not finish within {wall_timeout_s:.0f} s; "
                                  f"stopped all {size} rank(s)")
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)
        # Rank 0 is done: give followers a moment to finish on its stop message, then end them.
        end = time.monotonic() + 10
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        while not results.empty():
            rank, status, value = results.get()
            if status == "ok":
                out[rank] = value
        return [out.get(r) for r in range(size)]
    finally:
        _stop(procs)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
