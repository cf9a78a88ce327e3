"""One tensor-parallel rank's life: the three phases, then lead (rank 0) or follow.

Every rank runs ``Scheduler.init_model_worker`` on its shards: phase 1 loads its slice of every
weight, phase 2 profiles with all of them resident and the ranks agree on the fewest KV slots any
of them can hold, phase 3 builds its own backends. Rank 0 then schedules and serves; the others
replay its forward passes until it stops them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from .distributed import SINGLE, RankFailure, expect_followers, follow, get_tp, launch
from .scheduler import EngineArgs, Scheduler


def _sharded_runners(sched: Scheduler) -> dict:
    # A replicated draft runs on rank 0 alone, so followers replay only the sharded models.
    return {r.name: r for r in sched._runners() if getattr(r, "tp", SINGLE).size > 1}


def run_rank(args: EngineArgs, lead: Callable[[Scheduler], Any],
             report: Callable[[Scheduler], Any] | None = None) -> Any:
    """Rank 0 returns ``lead(sched)``; a follower returns ``report(sched)`` once released (or None)."""
    if get_tp().is_leader:
        expect_followers()
    sched = Scheduler(args)
    sched.init_model_worker()
    if get_tp().is_leader:
        try:
            return lead(sched)
        finally:
            sched.stop()  # releases the followers
    follow(_sharded_runners(sched))
    return report(sched) if report else None


def follow_rank(args: EngineArgs) -> None:
    """A follower's whole life: its shards through the three phases, then replay until released."""
    sched = Scheduler(args)
    sched.init_model_worker()
    follow(_sharded_runners(sched))


def _serve_rank(argv: list[str]) -> int:
    from ..serve_cli import main, parser, resolve

    if get_tp().is_leader:
        return main(argv)  # inside the group this serves HTTP as a single worker would
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {get_tp().rank} %(name)s: %(message)s")
    engine_args, _plan = resolve(parser().parse_args(argv))
    follow_rank(engine_args)
    return 0


def serve_tensor_parallel(argv: list[str], tp: int, device: str) -> int | None:
    """Start ``tp`` rank processes for ``serve`` and supervise them; None when this process serves.

    Returns rank 0's exit code, or 1 with the failing rank's message when any rank fails (the
    others are stopped, so the pod restarts as a whole).
    """
    if tp == 1 or get_tp().size > 1:
        return None
    try:
        codes = launch(tp, _serve_rank, (list(argv),), device=device)
    except RankFailure as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return codes[0] if codes[0] is not None else 1
