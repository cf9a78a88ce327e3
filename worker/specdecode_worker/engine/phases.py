"""The three initialisation phases, the error raised when one runs out of order, and the one raised
when the worker cannot serve what was planned."""

from __future__ import annotations

from enum import IntEnum


class Phase(IntEnum):
    CREATED = 0
    WEIGHTS_LOADED = 1
    POOLS_ALLOCATED = 2
    BACKENDS_READY = 3


PHASE_STEP = {
    Phase.WEIGHTS_LOADED: "phase 1 (load weights)",
    Phase.POOLS_ALLOCATED: "phase 2 (allocate KV pools)",
    Phase.BACKENDS_READY: "phase 3 (init attention backends and CUDA graphs)",
}


class PhaseError(RuntimeError):
    """A step of initialisation ran before the phase it depends on finished."""


def require(current: Phase, needed: Phase, doing: str, who: str) -> None:
    if current < needed:
        raise PhaseError(f"{who}: cannot {doing} before {PHASE_STEP[needed]} has finished (now after {current.name})")


class StartupError(RuntimeError):
    """The worker cannot serve what was planned (for example fewer KV tokens than the floor)."""
