"""The kopf layer: triggers only. Each handler names an SDD and hands it to the reconciler.

- create/update/resume of an SDD: reconcile now (resume covers objects that changed while the
  operator was down; update covers every spec change, so no field handler goes unpaired).
- events of owned pods, Deployments and LeaderWorkerSets (label ``specdecode.io/name``): reconcile
  the owner, so status follows the children and a finished planner pod is picked up at once. An
  LWS's readiness changes after its pods' do, so its own events matter. kopf watches it only
  while the cluster serves the LWS CRD (found at startup, and later through the CRD watch when
  every namespace is watched); without it, nothing is watched and nothing is needed.
- a requeue loop started at startup: reconciles an SDD again when it asked to be (a planner
  backoff) and every few minutes anyway. It is not a kopf timer, which would put a finalizer on
  every SDD and make them undeletable while the operator is down.

Reads come from kopf's indexes (cache.py) of the objects these handlers watch anyway: SDDs, pods and
Deployments by name, pods by owner. Only the periodic resync and a reconcile after an error read
through to the API server (and re-apply the children), which repairs whatever a watch missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import kopf

from . import cache, group, health, labels
from .kube import Kube
from .metrics import StatusBook
from .reconcile import Options, Reconciler
from .spec import GROUP, PLURAL, VERSION

log = logging.getLogger("specdecode_operator")
RESYNC_SECONDS = 300.0
TICK_SECONDS = 1.0
# A reconcile that raised (the API server down, a 5xx) is retried after 2 s doubling to 5 min.
ERROR_RETRY_SECONDS = 2.0


class Controller:
    """The reconciler plus when each SDD is due again. ``clock`` gives seconds (tests pass a fake)."""

    def __init__(self, reconciler: Reconciler, workers: int = 4, clock: Callable[[], float] = time.time):
        self.reconciler = reconciler
        self.clock = clock
        self.due: dict[tuple[str, str], float] = {}
        self.running: set[tuple[str, str]] = set()
        self.poked: set[tuple[str, str]] = set()
        # due for a full reconcile at its next time (the periodic resync): re-apply, read through;
        # a child event that comes first makes it a light one
        self.full: set[tuple[str, str]] = set()
        # the last reconcile failed: the next one re-applies and reads through, whatever triggers it
        # (a child its failed apply never made stays missing otherwise, until the resync)
        self.repair: set[tuple[str, str]] = set()
        self.errors: dict[tuple[str, str], int] = {}  # failed reconciles in a row
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reconcile")
        self.statuses = StatusBook()  # what /metrics reports

    def poke(self, namespace: str, name: str, delay: float = 0.5) -> None:
        """Reconcile soon; a burst of child events becomes one reconcile."""
        key = (namespace, name)
        self.due[key] = min(self.due.get(key, float("inf")), self.clock() + delay)
        self.poked.add(key)

    def reconcile(self, namespace: str, name: str, force_apply: bool = True, fresh: bool = False) -> None:
        """``force_apply``: re-apply the children; ``fresh``: read through to the API server."""
        key = (namespace, name)
        self.poked.discard(key)
        self.full.discard(key)
        if force_apply:
            self.repair.discard(key)
        try:
            result = self.reconciler.reconcile(namespace, name, force_apply, fresh)
        except Exception:
            errors = self.errors[key] = self.errors.get(key, 0) + 1
            delay = min(ERROR_RETRY_SECONDS * 2 ** (errors - 1), RESYNC_SECONDS)
            log.exception("reconcile of %s/%s failed; retrying in %.0fs", namespace, name, delay)
            self.due[key] = self.clock() + delay
            self.repair.add(key)
            return
        self.errors.pop(key, None)
        if result.gone:
            self.due.pop(key, None)
            self.statuses.forget(*key)
            return
        if result.status is not None:
            self.statuses.record(namespace, name, result.status)
        delay = RESYNC_SECONDS if result.requeue_after is None else min(result.requeue_after, RESYNC_SECONDS)
        if key in self.poked:  # a child changed while we were reconciling: look again
            delay = 0.5
        elif delay == RESYNC_SECONDS:
            self.full.add(key)
        self.due[key] = self.clock() + delay

    def due_now(self) -> list[tuple[str, str]]:
        """SDDs whose time has come and that are not being reconciled already."""
        now = self.clock()
        return [key for key, when in list(self.due.items()) if when <= now and key not in self.running]

    async def requeue_loop(self, stopped: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stopped.is_set():
            for key in self.due_now():
                self.running.add(key)
                # child events and requeues only refresh status from the cache; the periodic resync
                # re-applies and reads through, and so does anything after a failed reconcile
                full = key in self.repair or (key in self.full and key not in self.poked)
                fut = loop.run_in_executor(self.pool, self.reconcile, *key, full, full)
                fut.add_done_callback(lambda _f, k=key: self.running.discard(k))
            try:
                await asyncio.wait_for(stopped.wait(), TICK_SECONDS)
            except asyncio.TimeoutError:
                pass


CONTROLLER: Controller | None = None
CACHE = cache.Cache()
_STOP: asyncio.Event | None = None
# With exact namespaces there is nothing to discover: no need to list namespaces or watch CRDs.
_SCANNING = True
# Liveness and /metrics on one port (kopf's own liveness server serves one path only).
_HEALTH_URL: str | None = None
_HEALTH: Any = None


def configure(options: Options, kube: Kube | None = None, scanning: bool = True,
              health_url: str | None = None) -> None:
    """Called by main() before kopf starts (tests may pass a fake client)."""
    global CONTROLLER, _SCANNING, _HEALTH_URL
    CONTROLLER = Controller(Reconciler(kube or cache.CachedKube(Kube(), CACHE), options))
    _SCANNING = scanning
    _HEALTH_URL = health_url


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    # Progress and diff-base in annotations of our own prefix: status stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # The reconciler posts one Event per condition transition; kopf's log echo would duplicate them.
    settings.posting.enabled = False
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.execution.max_workers = 8
    settings.scanning.disabled = not _SCANNING
    if CONTROLLER is None:
        configure(Options())
    CACHE.bind(kwargs)  # kopf's indexes: empty now, filled before any SDD handler runs
    global _STOP
    _STOP = asyncio.Event()
    asyncio.get_running_loop().create_task(CONTROLLER.requeue_loop(_STOP))
    if _HEALTH_URL:
        global _HEALTH
        try:
            _HEALTH = await health.serve(_HEALTH_URL, probe, CONTROLLER.statuses)
        except OSError as exc:
            raise kopf.PermanentError(f"cannot serve --liveness {_HEALTH_URL}: {exc}") from exc


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if _STOP is not None:
        _STOP.set()
    if _HEALTH is not None:
        await _HEALTH.cleanup()


@kopf.on.probe(id="reconciler")
def probe(**_: Any) -> dict[str, Any]:
    """Shown on the liveness endpoint: SDDs tracked and API requests the reconciler made (in all,
    and by verb and resource; each resend of a throttled one counts), and how many were throttled."""
    if CONTROLLER is None:
        return {}
    kube = CONTROLLER.reconciler.kube
    return {"tracked": len(CONTROLLER.due), "apiRequests": getattr(kube, "requests", 0),
            "apiRequestsByVerb": dict(sorted(getattr(kube, "requests_by_kind", {}).items())),
            "apiThrottled": getattr(kube, "throttled", 0)}


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def sdd_changed(name: str, namespace: str, **_: Any) -> None:
    CONTROLLER.reconcile(namespace, name)


# --- the indexes the reconciler reads (cache.py); their ids are the functions' names -------------

OWNED = {labels.NAME: kopf.PRESENT}


@kopf.index(GROUP, VERSION, PLURAL)
async def sdd_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): cache.trim(body)}


@kopf.index("apps", "v1", "deployments", labels=OWNED)
async def deployment_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): cache.trim_deployment(body)}


@kopf.index("v1", "pods", labels=OWNED)
async def pod_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): cache.trim_pod(body)}


@kopf.index("v1", "pods", labels=OWNED)
async def pods_by_owner(namespace: str, body: kopf.Body, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {(namespace, meta["labels"][labels.NAME]): cache.trim_pod(body)}


# --- child events --------------------------------------------------------------------------------

def _owner_changed(namespace: str, meta: dict[str, Any]) -> None:
    owner = (meta.get("labels") or {}).get(labels.NAME)
    if owner and CONTROLLER is not None:
        CONTROLLER.poke(namespace, owner)


# The child's labels are read from `meta`: kopf's `labels` argument would hide the labels module.
# Async: a poke is a few dict operations, not worth a hop to kopf's thread pool.
@kopf.on.event("v1", "pods", labels=OWNED)
async def pod_event(namespace: str, meta: dict[str, Any], **_: Any) -> None:
    _owner_changed(namespace, meta)


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
async def deployment_event(namespace: str, meta: dict[str, Any], **_: Any) -> None:
    _owner_changed(namespace, meta)


# Only the LWS the operator renders: it carries the owner's name and the operator as manager.
LWS_EVENT_LABELS = {labels.NAME: kopf.PRESENT, labels.MANAGED_BY: labels.FIELD_MANAGER}


@kopf.on.event(group.LWS_GROUP, group.LWS_VERSION, "leaderworkersets", labels=LWS_EVENT_LABELS)
async def leaderworkerset_event(namespace: str, meta: dict[str, Any], **_: Any) -> None:
    _owner_changed(namespace, meta)
