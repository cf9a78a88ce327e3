"""One tensor-parallel rank's life: the three phases, then lead (rank 0) or follow.

Every rank runs ``Engine.init_model_worker`` on its shards: phase 1 loads its slice of every
weight, phase 2 profiles with all of them resident and the ranks agree on the fewest KV slots any
of them can hold, phase 3 builds its own backends. Rank 0 then schedules and serves; the others
replay its forward passes until it stops them. Ranks receive resolved ``EngineArgs``: the
command line is parsed and the plan made once, in the process that starts them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ...contract import ExitCode
from ..engine import Engine, EngineArgs
from ..model_runner import ModelRunner
from .distributed import ONE_NODE, Nodes, RankFailure, expect_followers, follow, get_tp, launch


def sharded_runners(engine: Engine) -> dict[str, ModelRunner]:
    """The runners followers replay: a replicated draft runs on rank 0 alone."""
    return {r.name: r for r in engine.model_runners() if r.tp.size > 1}


def run_rank(args: EngineArgs, lead: Callable[[Engine], Any], report: Callable[[Engine], Any] | None = None,
             prepare: Callable[[Engine], Any] | None = None) -> Any:
    """Rank 0 returns ``lead(engine)``; a follower returns ``report(engine)`` once released (or None).
    ``prepare(engine)`` runs on every rank after the three phases (all ranks in step: it may run
    collectives, as capturing graphs does)."""
    if get_tp().is_leader:
        expect_followers()
    engine = Engine(args)
    engine.init_model_worker()
    if prepare is not None:
        prepare(engine)
    if get_tp().is_leader:
        try:
            return lead(engine)
        finally:
            engine.stop()  # releases the followers
    follow(sharded_runners(engine), engine.speculator)
    return report(engine) if report else None


def follow_rank(args: EngineArgs) -> None:
    """A follower's whole life: its shards through the three phases, then replay until released."""
    engine = Engine(args)
    engine.init_model_worker()
    follow(sharded_runners(engine), engine.speculator)


def run_tensor_parallel(tp: int, rank_main: Callable[..., int], args: tuple, device: str,
                        nodes: Nodes = ONE_NODE) -> int:
    """Run ``rank_main(*args)`` in this pod's rank processes (all ``tp``, or its share over
    ``nodes``) and supervise them.

    Returns the first local rank's exit code (rank 0's in the leader pod), or 1 with the failing
    pod and rank when any rank of the group fails (every rank of every pod is stopped, so the pods
    restart as a whole).
    """
    try:
        codes = launch(tp, rank_main, args, device=device, nodes=nodes)
    except RankFailure as exc:
        print(str(exc), file=sys.stderr)
        return ExitCode.INTERNAL_ERROR
    return codes[0] if codes[0] is not None else ExitCode.INTERNAL_ERROR
