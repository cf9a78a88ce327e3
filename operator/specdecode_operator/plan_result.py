"""Validation of the planner's MemoryPlan: the worker package's contract check (no torch import)."""

from __future__ import annotations

from typing import Any

from specdecode_worker.plan import validate_plan as _validate


def validate_plan(obj: Any) -> dict[str, Any]:
    """Return the plan, or raise ValueError naming the key that breaks the contract."""
    return _validate(obj)
