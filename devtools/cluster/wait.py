"""Polling with a deadline: the one way tests wait for the cluster to reach a state."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    interval: float = 0.25,
    what: str = "condition",
) -> T:
    """Call ``predicate`` until it returns a truthy value and return that value.

    Raises ``TimeoutError`` naming ``what`` and the last value seen (or the last exception
    the predicate raised) when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except Exception as exc:  # a transient API error must not end the wait early
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}; last value: {last!r}")
        time.sleep(interval)
