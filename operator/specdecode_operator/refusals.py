"""Which API errors mean "the cluster refused this child", and the reason a user acts on.

A refusal is final until something in the cluster changes (a namespace label, a quota, a webhook,
the spec): it becomes a condition and a retry with backoff. Anything else (a conflict, throttling,
a server error) is transient and simply retried.
"""

from __future__ import annotations

from . import conditions as c

# How long to wait before trying a refused child again: 5 s doubling to 5 min.
FIRST_RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 300.0

_TRANSIENT = frozenset({404, 408, 409, 429})  # gone namespace, timeout, conflict, throttled


def is_refusal(status: int) -> bool:
    return 400 <= status < 500 and status not in _TRANSIENT


def reason_for(status: int, message: str) -> str | None:
    """The condition reason for an API error on create/apply of a child, or None if transient."""
    if not is_refusal(status):
        return None
    if status == 403 and "violates PodSecurity" in message:
        return c.POD_SECURITY_REJECTED
    if status == 403 and ("exceeded quota" in message or "failed quota" in message):
        return c.QUOTA_EXCEEDED
    return c.CHILD_REJECTED


def reason_for_replica_failure(message: str) -> str:
    """The same reasons for a message the ReplicaSet controller got when it created worker pods
    (the Deployment's ReplicaFailure condition carries the API server's text, not its code)."""
    status = 403 if "is forbidden" in message else 422
    return reason_for(status, message) or c.CHILD_REJECTED


def retry_delay(refusals: int) -> float:
    return min(FIRST_RETRY_SECONDS * 2 ** max(refusals - 1, 0), MAX_RETRY_SECONDS)
