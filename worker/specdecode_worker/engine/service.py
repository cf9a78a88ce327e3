"""What serving asks of the engine, and the one snapshot it reads back.

The HTTP layer submits and aborts requests, starts and stops the engine, and reads an
``EngineReport``: readiness, load, KV usage, memory against the plan and what speculation
measured. It never reaches into the worker's fields, so the engine behind ``EngineService`` can
change (another process, another runtime) without the API noticing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .request import Request
from .stats import Stats


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

    def submit(self, req: Request) -> Request:
        """Queue ``req``; raises InputError for one that can never run here."""

    def abort(self, req: Request) -> None:
        """Ask the engine to end ``req`` (client gone, stop string seen); thread-safe."""

    def start_up(self) -> None:
        """The three phases, then the loop; blocks until ready (or raises)."""

    def stop(self) -> None: ...

    def report(self) -> EngineReport: ...
