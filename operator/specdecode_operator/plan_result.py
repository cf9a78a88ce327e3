"""The planner's MemoryPlan as the operator reads it: the worker package's pure contract (no torch import)."""

from __future__ import annotations

from typing import Any

from specdecode_worker.contract import PLAN_KIND, MemoryPlan


def read_plan(obj: Any) -> MemoryPlan:
    """The typed plan, or ValueError naming the key that breaks the contract."""
    return MemoryPlan.from_dict(obj)


def explains_misfit(obj: Any) -> bool:
    """Whether a plan the contract refuses still says that, and why, the models do not fit.

    A misfit plan's numbers may be out of range (a negative fraction); its verdict stands.
    """
    return (isinstance(obj, dict) and obj.get("kind") == PLAN_KIND and obj.get("fits") is False
            and isinstance(obj.get("message"), str) and isinstance(obj.get("shortfallBytes"), int)
            and isinstance(obj.get("tensorParallelSize"), int))
