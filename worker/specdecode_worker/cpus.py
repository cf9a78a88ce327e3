"""How many CPUs this process may keep busy: its affinity, capped by its cgroup's CPU quota.

A pod's CPU limit is a quota, not an affinity: the container still sees every core of the node,
and torch's default of one intra-op thread per core would run dozens of threads against a quota
of a few cores (throttled, and spinning against anything else on them). The quota is read where
the kernel keeps it: cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"), else cgroup v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")

log = logging.getLogger(__name__)


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


def threads_per_rank(ranks: int, usable: int) -> int:
    """Intra-op threads for each of ``ranks`` processes sharing ``usable`` CPUs."""
    return max(1, usable // max(1, ranks))


def busy_ticks(proc_stat: str, cpus: set[int]) -> int:
    """Clock ticks ``cpus`` have spent busy, from ``/proc/stat``: user, nice, system, irq, softirq
    and steal (a hypervisor's time on them is load too); not idle or iowait."""
    total = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in rest.split()[:8])
            total += user + nice + system + irq + softirq + steal
    return total


def process_ticks(pid_stat: str) -> int:
    """Clock ticks a process (all its threads) has run, from ``/proc/<pid>/stat``: utime + stime."""
    fields = pid_stat.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return int(fields[11]) + int(fields[12])


def read_ticks(cpus: set[int]) -> tuple[int, int]:
    """(busy ticks of ``cpus``, this process's ticks) now."""
    return busy_ticks(Path("/proc/stat").read_text(), cpus), process_ticks(Path("/proc/self/stat").read_text())


class ThreadGovernor:
    """Intra-op threads for this process's CPUs, less the CPUs other processes keep busy on them.

    A parallel region ends when its slowest thread does. Where another process holds one of the
    cores, the thread that shares it runs only in the slices the scheduler gives it, and every
    region waits for it: SmolLM2 on 2 cores beside one busy process served 9.8 tok/s on 2 threads
    and 25.8 on 1 (docs/benchmarks.md). Every ``interval`` seconds ``tick`` (called by the thread
    that runs the model, between steps: each thread has its own OpenMP team size) compares how busy
    the CPUs were with how much of it was this process, and runs ``max(1, CPUs - others)`` threads,
    others rounded to whole CPUs.
    """

    def __init__(self, cpus: set[int], interval: float = 1.0, read=read_ticks, set_threads=None,
                 clock=time.monotonic, ticks_per_second: int | None = None):
        self.cpus = set(cpus)
        self.interval = interval
        self.threads = len(self.cpus)
        self.others = 0.0  # CPUs other processes kept busy over the last interval
        self._read = read
        self._set = set_threads
        self._clock = clock
        self._hz = ticks_per_second or os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, int, int] | None = None

    def tick(self) -> int:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        busy, own = self._read(self.cpus)
        if self._last is not None:
            then, busy0, own0 = self._last
            self.others = max(0, (busy - busy0) - (own - own0)) / (self._hz * (now - then))
            threads = max(1, len(self.cpus) - int(self.others + 0.5))
            if threads != self.threads:
                log.info("%d intra-op threads: other processes kept %.1f of CPUs %s busy", threads, self.others,
                         sorted(self.cpus))
                self.threads = threads
                if self._set is not None:
                    self._set(threads)
        self._last = (now, busy, own)
        return self.threads
