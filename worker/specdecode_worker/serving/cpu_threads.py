"""A CPU worker's intra-op threads: as many as the CPUs its pod may use, and, alone on its CPUs,
as many as no neighbour keeps busy (``cpus.ThreadGovernor``)."""

from __future__ import annotations

import logging
import os

from .. import cpus

log = logging.getLogger("specdecode_worker.serve")


def use_cpus(device: str, ranks: int = 1) -> int | None:
    """On CPU, intra-op threads for the CPUs this process may use (its pod's limit, not the node's
    cores), shared among the ranks on this pod; returns them. ``OMP_NUM_THREADS`` decides instead
    where it is set."""
    if device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    usable = cpus.usable_cpus()
    threads = cpus.threads_per_rank(ranks, usable)
    torch.set_num_threads(threads)
    log.info("%d intra-op threads for %d usable CPUs (affinity and cgroup quota) over %d rank(s)", threads, usable,
             ranks)
    return threads


def thread_governor(device: str) -> cpus.ThreadGovernor | None:
    """Intra-op threads that follow the load beside them (``cpus.ThreadGovernor``): one rank on CPU
    whose CPUs are those it may run on. Not under a quota below them (the quota, not a neighbour,
    decides its time there), nor where ``OMP_NUM_THREADS`` is set."""
    from ..engine.parallel.group import get_tp

    if device != "cpu" or os.environ.get("OMP_NUM_THREADS") or get_tp().size > 1:
        return None
    affinity = os.sched_getaffinity(0)
    if len(affinity) < 2 or cpus.usable_cpus(affinity) < len(affinity):
        return None
    import torch

    return cpus.ThreadGovernor(affinity, set_threads=torch.set_num_threads)


def follow_load(device: str):
    """The loop's ``before_step`` hook on ``device``: the governor's tick, or None without one."""
    governor = thread_governor(device)
    return governor.tick if governor is not None else None
