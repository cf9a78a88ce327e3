"""What serving asks of the engine, and the one snapshot it reads back.

The HTTP layer submits and aborts requests, starts and stops the engine, and reads an
``EngineReport``: readiness, load, KV usage, memory against the plan and what speculation
measured. It never reaches into the worker's fields, so the engine behind ``EngineService`` can
change (another process, another runtime) without the API noticing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .request import Request
from .stats import Stats

if TYPE_CHECKING:
    from .speculation.spec_policy import SpecPolicy


@dataclass(frozen=True)
class KVUsage:
    used: int  # slots running requests hold (cached ones they share included)
    capacity: int  # slots in the pool


@dataclass(frozen=True)
class EngineReport:
    ready: bool
    phase: str  # the last start-up phase every model finished
    stats: Stats  # counters since start
    running: int = 0
    waiting: int = 0
    kv: KVUsage | None = None  # once ready
    prefix_cache: dict[str, int] | None = None  # cachedTokens, evictableTokens, evictedTokens, poolTokens
    memory: dict | None = None  # phase 2's measured profile, the phase seconds and the pool's tokens
    kv_tokens_actual: int | None = None  # max_total_num_tokens measured in phase 2
    dynamic: dict = field(default_factory=dict)  # phase 3's warm-up: DynamicPeak.as_dict()
    allocator_peak_bytes: int | None = None  # the allocator's peak beyond weights and pools since start (CUDA)
    policy: dict | None = None  # the adaptive policy: mode, timedRounds, measuredSpeedup, probeRounds


class EngineService(Protocol):
    vocab_size: int
    ready: bool  # phase 3 and the scheduler are done: requests are taken

    def submit(self, req: Request) -> Request:
        """Queue ``req``; raises InputError for one that can never run here."""

    def abort(self, req: Request) -> None:
        """Ask the engine to end ``req`` (client gone, stop string seen); thread-safe."""

    def start_up(self) -> None:
        """The three phases, then the loop; blocks until ready (or raises)."""

    def stop(self) -> None: ...

    def report(self) -> EngineReport: ...


def report_of(engine) -> EngineReport:
    """The report of ``engine`` (an ``engine.Engine``), read from its worker's fields: the one place
    that reads them."""
    profile, pool = engine.memory_profile, engine.memory_pool_config
    memory = None
    if profile is not None:
        memory = {**profile.as_dict(), "phaseSeconds": engine.stats.phase_seconds,
                  "poolTokens": pool.max_total_num_tokens if pool else None}
    ready = engine.ready
    return EngineReport(
        ready=ready, phase=engine.phase.name, stats=engine.stats, running=engine.num_running,
        waiting=engine.num_waiting, kv=KVUsage(*engine.kv_usage()) if ready else None,
        prefix_cache=engine.prefix_cache_usage() if ready else None, memory=memory,
        kv_tokens_actual=profile.max_total_num_tokens if profile else None,
        dynamic=engine.dynamic_peak.as_dict() if engine.dynamic_peak else {},
        allocator_peak_bytes=_allocator_peak_bytes(engine), policy=_policy_view(engine.policy))


def _allocator_peak_bytes(engine) -> int | None:
    """Peak device bytes beyond the static part (weights and KV pools): the measured counterpart
    of R_dynamic. Only CUDA keeps an allocator peak; elsewhere there is nothing to report."""
    profile, pools = engine.memory_profile, engine.memory_pool_config
    if profile is None or pools is None or engine.device.type != "cuda":
        return None
    import torch

    cell = profile.target_bytes_per_token + profile.draft_bytes_per_token
    static = profile.target_weight_bytes + profile.draft_weight_bytes + pools.max_total_num_tokens * cell
    return max(0, torch.cuda.max_memory_allocated(engine.device) - static)


def _policy_view(policy: SpecPolicy | None) -> dict | None:
    """What the speculation policy timed at start-up and has measured since (None: not adaptive)."""
    if policy is None:
        return None
    return {"mode": policy.mode, "timedRounds": policy.cost.table() if policy.cost is not None else None,
            "measuredSpeedup": policy.speedups(), "probeRounds": policy.probes}
