"""metav1.Condition bookkeeping, the phase, and which transitions deserve an Event.

``lastTransitionTime`` changes only when a condition's status flips; ``observedGeneration`` is
always the generation the operator just reconciled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

PLANNED = "Planned"
MODELS_READY = "ModelsReady"  # only for a hub store with a cache: every model is downloaded into it
AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
READY = "Ready"
ORDER = (PLANNED, MODELS_READY, AVAILABLE, PROGRESSING, DEGRADED, READY)

# Reasons a user acts on (capacity vs runtime failures are told apart).
PLANNING = "Planning"
PLAN_READY = "PlanReady"
INSUFFICIENT_GPU_MEMORY = "InsufficientGPUMemory"
PLANNER_FAILED = "PlannerFailed"
PLAN_EXCEEDS_NODE_GPUS = "PlanExceedsNodeGPUs"
UNSCHEDULABLE = "Unschedulable"
WORKER_STARTUP_FAILED = "WorkerStartupFailed"
WORKER_OOM_KILLED = "WorkerOOMKilled"
PODS_NOT_READY = "PodsNotReady"
DOWNLOADING = "Downloading"
DOWNLOADED = "Downloaded"
MODEL_DOWNLOAD_FAILED = "ModelDownloadFailed"  # with the hub's message: 401, 404, disk full
CACHE_CLAIM_NOT_FOUND = "CacheClaimNotFound"  # modelStore.hub.cache.claimName names no PVC
MULTI_NODE_UNAVAILABLE = "MultiNodeUnavailable"  # the plan spans nodes and LeaderWorkerSet is not installed
# The API server refused a child (the planner pod, the plan ConfigMap, the Deployment, the Service,
# or the worker pods the ReplicaSet creates): by Pod Security admission, by a ResourceQuota, or
# for any other reason (a webhook, a LimitRange, validation).
# vllm or sglang reported fewer KV tokens than the plan (kvcheck.py): the pod stays un-Ready.
KV_CACHE_BELOW_PLAN = "KVCacheBelowPlan"
POD_SECURITY_REJECTED = "PodSecurityRejected"
QUOTA_EXCEEDED = "QuotaExceeded"
CHILD_REJECTED = "ChildRejected"

MAX_MESSAGE = 32768


@dataclass(frozen=True)
class Verdict:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str = ""


def set_condition(conditions: list[dict[str, Any]], ctype: str, verdict: Verdict, generation: int,
                  now: str) -> list[dict[str, Any]]:
    """A new list with ``ctype`` set; the others untouched and the order stable."""
    out = [dict(c) for c in conditions]
    new = {
        "type": ctype,
        "status": verdict.status,
        "reason": verdict.reason,
        "message": verdict.message[:MAX_MESSAGE],
        "observedGeneration": generation,
    }
    for i, old in enumerate(out):
        if old.get("type") == ctype:
            new["lastTransitionTime"] = old.get("lastTransitionTime") if old.get("status") == verdict.status \
                and old.get("lastTransitionTime") else now
            out[i] = new
            return out
    new["lastTransitionTime"] = now
    out.append(new)
    out.sort(key=lambda c: ORDER.index(c["type"]) if c.get("type") in ORDER else len(ORDER))
    return out


def apply_verdicts(conditions: list[dict[str, Any]], verdicts: dict[str, Verdict], generation: int,
                   now: str) -> list[dict[str, Any]]:
    for ctype in ORDER:
        if ctype in verdicts:
            conditions = set_condition(conditions, ctype, verdicts[ctype], generation, now)
    return conditions


def get(conditions: Iterable[dict[str, Any]], ctype: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == ctype), None)


FAILURE_REASONS = frozenset({INSUFFICIENT_GPU_MEMORY, PLANNER_FAILED, PLAN_EXCEEDS_NODE_GPUS, UNSCHEDULABLE,
                             WORKER_STARTUP_FAILED, WORKER_OOM_KILLED, PODS_NOT_READY,
                             POD_SECURITY_REJECTED, QUOTA_EXCEEDED, CHILD_REJECTED, MULTI_NODE_UNAVAILABLE,
                             MODEL_DOWNLOAD_FAILED, CACHE_CLAIM_NOT_FOUND, KV_CACHE_BELOW_PLAN})


def is_bad(ctype: str, status: str, reason: str = "") -> bool:
    """Whether a condition in this state is a problem worth a Warning (not a rollout in progress)."""
    bad_status = status == "True" if ctype == DEGRADED else status == "False"
    return bad_status and reason in FAILURE_REASONS


@dataclass(frozen=True)
class Transition:
    ctype: str
    status: str
    reason: str
    message: str
    warning: bool


def transitions(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[Transition]:
    """Conditions whose status or reason changed: each becomes an Event."""
    out = []
    for c in new:
        prev = get(old, c["type"])
        if prev is None or prev.get("status") != c["status"] or prev.get("reason") != c["reason"]:
            out.append(Transition(c["type"], c["status"], c["reason"], c.get("message", ""),
                                  is_bad(c["type"], c["status"], c["reason"])))
    return out


# Healthy changes of these conditions are an Event each (one per reason); those of the others
# (Available, Progressing, Degraded) mostly move with Ready and are named in its Event.
EVENT_CONDITIONS = (PLANNED, MODELS_READY, READY)


def events(changes: list[Transition]) -> list[tuple[str, str, bool]]:
    """The Events (reason, message, warning) of one status write: one per Warning reason; one per
    reason of a healthy change of Planned, ModelsReady or Ready; the other healthy changes named in
    the first of those (or, when none moved, one Event of their own). An Event is a write to the
    API server: a rollout posts Planning, PlanReady, RollingOut and Ready rather than seven."""
    out: list[tuple[str, str, bool]] = []
    folded: list[Transition] = []
    for t in changes:
        if t.reason in {r for r, _, _ in out}:
            continue
        if t.warning or t.ctype in EVENT_CONDITIONS:
            out.append((t.reason, f"{t.ctype}={t.status}: {t.message}", t.warning))
        else:
            folded.append(t)
    folded = [t for t in folded if t.reason not in {r for r, _, _ in out}]
    if folded:
        normal = next((i for i, (_, _, warning) in enumerate(out) if not warning), None)
        if normal is None:
            head, folded = folded[0], folded[1:]
            out.append((head.reason, f"{head.ctype}={head.status}: {head.message}", False))
            normal = len(out) - 1
        if folded:
            reason, message, _ = out[normal]
            also = ", ".join(f"{t.ctype}={t.status} {t.reason}" for t in folded)
            out[normal] = (reason, f"{message} (also {also})", False)
    return out


def phase(conditions: list[dict[str, Any]], ready: int, desired: int) -> str:
    planned = get(conditions, PLANNED)
    if planned is None:
        return "Pending"
    if planned["status"] == "Unknown":
        return "Planning"
    if planned["status"] == "False":
        return "Degraded" if ready > 0 else "Failed"
    models = get(conditions, MODELS_READY)
    if models is not None and models["status"] == "False" and models.get("reason") in FAILURE_REASONS:
        return "Degraded" if ready > 0 else "Failed"
    degraded = get(conditions, DEGRADED)
    if degraded is not None and degraded["status"] == "True":
        return "Degraded"
    rdy = get(conditions, READY)
    if rdy is not None and rdy["status"] == "True":
        return "Ready"
    return "Deploying"
