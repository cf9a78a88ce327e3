"""How many CPUs this process may keep busy: its affinity, capped by its cgroup's CPU quota.

A pod's CPU limit is a quota, not an affinity: the container still sees every core of the node,
and torch's default of one intra-op thread per core would run dozens of threads against a quota
of a few cores (throttled, and spinning against anything else on them). The quota is read where
the kernel keeps it: cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"), else cgroup v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def quota_cpus(root: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in CPUs (None: no quota, or no cgroup file to read)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cpus(affinity: set[int] | None = None, root: Path = CGROUP) -> int:
    """CPUs this process may use: those it may run on, capped by the quota (rounded up: a quota
    of 1.5 CPUs keeps two threads busy part of the time), at least one."""
    allowed = len(affinity if affinity is not None else os.sched_getaffinity(0))
    quota = quota_cpus(root)
    return max(1, min(allowed, math.ceil(quota)) if quota is not None else allowed)


def threads_per_rank(ranks: int, affinity: set[int] | None = None, root: Path = CGROUP) -> int:
    """Intra-op threads for each of ``ranks`` processes sharing this process's CPUs."""
    return max(1, usable_cpus(affinity, root) // max(1, ranks))
