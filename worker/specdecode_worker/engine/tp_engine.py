"""One tensor-parallel rank's life: the three phases, then lead (rank 0) or follow.

Every rank runs ``Scheduler.init_model_worker`` on its shards: phase 1 loads its slice of every
weight, phase 2 profiles with all of them resident and the ranks agree on the fewest KV slots any
of them can hold, phase 3 builds its own backends. Rank 0 then schedules and serves; the others
replay its forward passes until it stops them.
"""

from __future__ import annotations

from typing import Any, Callable

from .distributed import follow, get_tp
from .scheduler import EngineArgs, Scheduler


def run_rank(args: EngineArgs, lead: Callable[[Scheduler], Any],
             report: Callable[[Scheduler], Any] | None = None) -> Any:
    """Rank 0 returns ``lead(sched)``; a follower returns ``report(sched)`` once released (or None)."""
    sched = Scheduler(args)
    sched.init_model_worker()
    if get_tp().is_leader:
        try:
            return lead(sched)
        finally:
            sched.stop()  # releases the followers
    follow({r.name: r for r in sched._runners() if r.tp.size > 1})
    return report(sched) if report else None
