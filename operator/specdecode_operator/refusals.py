"""Which API errors mean "the cluster refused this child", and the reason a user acts on.

A refusal is final until something in the cluster changes (a namespace label, a quota, a webhook,
the spec): it becomes a condition and a retry with backoff. Anything else (a conflict, throttling,
a server error) is transient and simply retried.
"""

from __future__ import annotations

import logging

from . import conditions as c
from .kube import ApiError
from .spec import SpecView

log = logging.getLogger(__name__)

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


# The condition reasons of a refused child: the rollout waits on one, retried after retry_delay.
REASONS = frozenset({c.POD_SECURITY_REJECTED, c.QUOTA_EXCEEDED, c.CHILD_REJECTED})


class RefusalBook:
    """Refusals in a row per SDD, for the retry backoff (a restart starts it afresh).

    One book for every driver: a refused planner pod, PVC, Job or workload child counts alike.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    def verdict(self, view: SpecView, what: str, exc: ApiError) -> c.Verdict:
        """The verdict for a child the API server refused; re-raises what is not a refusal."""
        reason = reason_for(exc.status, exc.message)
        if reason is None:
            raise exc
        key = (view.namespace, view.name)
        self._counts[key] = self._counts.get(key, 0) + 1
        log.warning("%s/%s: %s refused (%s): %s", view.namespace, view.name, what, exc.status, exc.message)
        return c.Verdict("False", reason, f"{what} was refused by the API server: {exc.message}")

    def retry_delay(self, namespace: str, name: str) -> float:
        return retry_delay(self._counts[(namespace, name)])

    def forget(self, namespace: str, name: str) -> None:
        self._counts.pop((namespace, name), None)
