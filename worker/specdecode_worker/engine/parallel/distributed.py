"""Tensor parallelism across the GPUs of one pod: rank processes, their groups, and supervision.

One process per rank. ``launch`` starts them and supervises: the first rank that fails stops
every other rank and the whole worker fails with that rank's message, so the pod restarts as a
whole and no rank is left waiting in a collective. Rank 0 schedules; the other ranks follow:
every pass rank 0 runs on sharded weights reaches them through its runner's ``Mirror``
(``mirror.py``, the one seam model and speculator code sees), and ``follow`` runs it here, so
the collectives inside the model line up.

A replica larger than one node runs the same group over several pods (``nnodes``): each pod's
supervisor starts its local ranks (global ranks ``node_rank * local ... + local - 1``), the
rendezvous is at the leader pod's ``master_addr:master_port``, and ``pod_link`` carries failures
between the pods' supervisors, so a rank failing in any pod stops the whole group.

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
from typing import Any, Callable


from ..forward_batch import ForwardBatch
from .group import DEFAULT_TIMEOUT_S, SINGLE, TPGroup, destroy_tp, get_tp, init_tp  # noqa: F401 - one import for callers
from .mirror import receive_graph

log = logging.getLogger(__name__)



class RankFailure(RuntimeError):
    """A rank of a tensor-parallel worker failed; every other rank was stopped."""


# ---- rank 0 leads, the others follow ---------------------------------------------------------

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


def follow(runners: dict[str, Any], speculator: Any = None) -> int:
    """Replay rank 0's passes on this rank's shards until it says stop; returns the count. A
    runner's forward pass is replayed by that runner; a speculator's own passes (a graph, or an
    EAGLE round's target pass or head step) by ``speculator``."""
    tp = get_tp()
    count = 0
    while True:
        msg = tp.broadcast()
        if msg[0] == "stop":
            return count
        if msg[0] == "graph":  # a speculator's graph, replayed with rank 0's staged inputs
            speculator.replay_graph(*receive_graph(msg, runners[msg[1]].req_to_token_pool.req_to_token))
            count += 1
            continue
        if msg[0] == "replay":
            speculator.replay(msg[2])
            count += 1
            continue
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


@dataclass(frozen=True)
class Nodes:
    """Where this pod sits in a replica that spans pods (the default: one pod holds every rank)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one node: a free local port
    pod: str = ""  # named in failure messages; default: this host's name

    def pod_name(self) -> str:
        return self.pod or os.environ.get("POD_NAME") or socket.gethostname()

    def local_ranks(self, size: int) -> list[int]:
        if self.nnodes < 1 or size % self.nnodes:
            raise ValueError(f"{size} ranks do not split evenly over {self.nnodes} pods")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        local = size // self.nnodes
        return list(range(self.node_rank * local, (self.node_rank + 1) * local))


ONE_NODE = Nodes()


def _rank_main(fn, rank, size, port, device, timeout_s, args, results, master_addr="127.0.0.1",
               local_rank=None) -> None:
    _die_with_parent()
    try:
        init_tp(rank, size, port, device, timeout_s, master_addr, local_rank)
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
           wall_timeout_s: float | None = None, nodes: Nodes = ONE_NODE) -> list[Any]:
    """Run ``fn(*args)`` in this pod's rank processes, each inside the group; returns their results.

    ``size`` is the whole group; this pod runs ``size / nodes.nnodes`` of its ranks. The first
    rank that fails (an exception, or an exit without a result), in this pod or another, stops
    all ranks of every pod and raises ``RankFailure`` naming that pod and rank. When rank 0
    returns, followers still running are stopped. ``wall_timeout_s`` bounds the whole run.
    Results are this pod's, in rank order.
    """
    ranks = nodes.local_ranks(size)
    multi = nodes.nnodes > 1
    if multi and nodes.master_port is None:
        raise ValueError("a group over several pods needs the leader pod's master port")
    pod = nodes.pod_name()
    where = (lambda r: f"rank {r} of {size} (pod {pod}, node rank {nodes.node_rank})") if multi else \
        (lambda r: f"rank {r} of {size}")
    link = None
    if multi:
        from .pod_link import PodLink

        link = PodLink(pod, nodes.node_rank, nodes.nnodes, nodes.master_addr, nodes.master_port)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = nodes.master_port if multi else free_port()
    procs = {r: ctx.Process(target=_rank_main, args=(fn, r, size, port, device, timeout_s, args, results,
                                                     nodes.master_addr, i),
                            name=f"tp-rank-{r}", daemon=False) for i, r in enumerate(ranks)}
    for p in procs.values():
        p.start()
    out: dict[int, Any] = {}
    deadline = None if wall_timeout_s is None else time.monotonic() + wall_timeout_s
    previous = None
    if threading.current_thread() is threading.main_thread():
        # A pod being stopped: unwind through the finally below, which stops every rank.
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    def failed(message: str) -> RankFailure:
        if link is not None:
            link.fail(message)
        others = f"every rank of the {nodes.nnodes} pods" if multi else f"the other {size - 1} rank(s)"
        return RankFailure(f"tensor-parallel {message}; stopped {others}")

    try:
        while True:
            while not results.empty():
                rank, status, value = results.get()
                if status == "error":
                    # A rank whose peer in another pod died fails too, inside a collective; wait for
                    # that pod's report of the first cause. A rank's own error is reported at once.
                    remote = _remote_failure(link, PEER_REPORT_WAIT_S if _collective_failure(value) else 0.0)
                    if remote is not None:
                        raise RankFailure(f"tensor-parallel {remote}; stopped this pod's {len(ranks)} rank(s)")
                    raise failed(f"{where(rank)} failed: {value}")
                out[rank] = value
            if 0 in out or len(out) == len(ranks):
                break
            event = link.poll() if link is not None else None
            if event is not None and event.kind == "failed":
                raise RankFailure(f"tensor-parallel {event.message}; stopped this pod's {len(ranks)} rank(s)")
            if event is not None and event.kind == "stop":
                break  # the leader finished: this pod's followers end on its stop message
            exited = [(r, p.exitcode) for r, p in procs.items() if p.exitcode is not None and r not in out]
            if exited:
                time.sleep(0.5)  # its report may still be in flight
                if not results.empty():
                    continue
                rank, code = exited[0]
                raise failed(f"{where(rank)} exited with code {code} without a result")
            if deadline is not None and time.monotonic() > deadline:
                raise failed(f"worker did not finish within {wall_timeout_s:.0f} s ({where(ranks[0])})")
            multiprocessing.connection.wait([p.sentinel for p in procs.values() if p.exitcode is None], timeout=0.2)
        if link is not None:
            link.finish()
        # Rank 0 is done: give followers a moment to finish on its stop message, then end them.
        end = time.monotonic() + 10
        for p in procs.values():
            p.join(timeout=max(0.0, end - time.monotonic()))
        while not results.empty():
            rank, status, value = results.get()
            if status == "ok":
                out[rank] = value
        return [out.get(r) for r in ranks]
    finally:
        _stop(list(procs.values()))
        if link is not None:
            link.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


PEER_REPORT_WAIT_S = 15.0  # how long a rank failing in a collective waits for another pod's cause


def _collective_failure(error: str) -> bool:
    """An error raised by torch.distributed (a peer's socket closed under a collective): a
    consequence of a failure elsewhere rather than a cause."""
    return "distributed_c10d" in error or "gloo" in error.lower() or "nccl" in error.lower()


def _remote_failure(link, wait_s: float) -> str | None:
    """Another pod's failure report, if one arrives within ``wait_s``."""
    if link is None:
        return None
    end = time.monotonic() + wait_s
    while True:
        event = link.poll()
        if event is not None and event.kind == "failed":
            return event.message
        if time.monotonic() >= end:
            return None
        time.sleep(0.05)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
