"""What the reconciler reads, from kopf's watches instead of the API server.

kopf already watches the SDDs, the pods and the Deployments that carry ``specdecode.io/name`` (their
events trigger reconciles). Its indexes (handlers.py) keep the last body of each, less what the
reconciler never reads (managedFields; the specs of pods and Deployments): SDDs and Deployments by
(namespace, name), pods by (namespace, name) and by (namespace, owner SDD). kopf
fills every index from its initial list before any other handler runs, so a restarted operator
reconciles from a complete picture.

``CachedKube`` is the reconciler's client with reads of those kinds answered from the indexes: a
reconcile costs no request unless it writes. Everything else (Jobs, PVCs, nodes, LeaderWorkerSets,
discovery) and every write goes to the API server. Reads go to the API server too, and refresh
what they read, inside ``read_through()``: the reconciler uses it for the periodic resync and
after a status write conflict, so a cache that is stale (a watch that missed a deletion while it
reconnected) is repaired, and a write never rests on a stale read: status writes carry the
resourceVersion they read, and a conflict is retried with a fresh read.

An SDD the operator has just written is kept as written until the watch delivers that version,
so the next reconcile does not start from the status before it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping

from . import kube as k8s
from . import labels
from .kube import Kube, Ref

# kopf index ids (the handler functions' names in handlers.py).
SDDS = "sdd_index"
DEPLOYMENTS = "deployment_index"
PODS = "pod_index"
PODS_BY_OWNER = "pods_by_owner"
INDEXES = (SDDS, DEPLOYMENTS, PODS, PODS_BY_OWNER)


def trim(body: Mapping[str, Any]) -> dict[str, Any]:
    """What an index keeps of an object: all of it but ``managedFields`` (a shallow copy)."""
    out = dict(body)
    meta = out.get("metadata")
    if isinstance(meta, Mapping) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def trim_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """A pod as the reconciler reads it: metadata and status (no spec but its node): at 1,000 SDDs
    the indexes hold 2,000 pods, and their specs would be most of the operator's memory."""
    out = trim(body)
    out["spec"] = {"nodeName": (body.get("spec") or {}).get("nodeName")}
    return out


def trim_deployment(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Deployment as the reconciler reads it: metadata, status, replicas and the template's metadata."""
    out = trim(body)
    spec = body.get("spec") or {}
    template = {"metadata": (spec.get("template") or {}).get("metadata")}
    out["spec"] = {"replicas": spec.get("replicas"), "template": template}
    return out


def _rv(obj: Mapping[str, Any] | None) -> int | None:
    rv = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else None


def _uid(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("uid")


def _newest(values: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One object of a name: two only after a watch missed a deletion (a new uid); the newer wins."""
    if len(values) <= 1:
        return values[0] if values else None
    return max(values, key=lambda o: _rv(o) or 0)


def _store(index: Any, key: Any) -> list[dict[str, Any]]:
    """The values under ``key`` (kopf mutates its indexes in the event loop: copy them at once)."""
    try:
        return list(index[key])
    except KeyError:
        return []


def parse_selector(selector: str | None) -> dict[str, str] | None:
    """``a=b,c=d`` as a dict; None for anything but equality terms."""
    out: dict[str, str] = {}
    for term in (selector or "").split(","):
        k, eq, v = term.partition("=")
        if not eq or not k or k.endswith("!") or "=" in v:
            return None
        out[k.strip()] = v.strip()
    return out


class Cache:
    """kopf's indexes, bound at startup (``bind``), and the SDDs the operator wrote since."""

    def __init__(self) -> None:
        self.indexes: dict[str, Any] | None = None
        self._written: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def bind(self, indices: Mapping[str, Any]) -> None:
        if all(i in indices for i in INDEXES):
            self.indexes = {i: indices[i] for i in INDEXES}

    @property
    def bound(self) -> bool:
        return self.indexes is not None

    def sdd(self, namespace: str, name: str) -> dict[str, Any] | None:
        seen = _newest(_store(self.indexes[SDDS], (namespace, name)))
        with self._lock:
            written = self._written.get((namespace, name))
            if written is not None:
                if seen is None or _uid(seen) != _uid(written) or (_rv(seen) or 0) >= (_rv(written) or 0):
                    # the watch caught up, or the SDD is gone (or gone and made again): the watch's word
                    del self._written[(namespace, name)]
                else:
                    return written
        return seen

    def wrote(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if _rv(obj) is not None:
            with self._lock:
                self._written[(meta.get("namespace"), meta.get("name"))] = obj

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._written.pop((namespace, name), None)

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _newest(_store(self.indexes[DEPLOYMENTS], (namespace, name)))

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _newest(_store(self.indexes[PODS], (namespace, name)))

    def pods(self, namespace: str, owner: str, match: dict[str, str]) -> list[dict[str, Any]]:
        return [p for p in _store(self.indexes[PODS_BY_OWNER], (namespace, owner))
                if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in match.items())]


class CachedKube:
    """``Kube`` with reads of SDDs, owned pods and Deployments from ``cache`` (see the module)."""

    def __init__(self, api: Kube, cache: Cache):
        self.api = api
        self.cache = cache
        self._local = threading.local()

    # the request counters are the API client's
    @property
    def requests(self) -> int:
        return self.api.requests

    @property
    def requests_by_kind(self):
        return self.api.requests_by_kind

    @property
    def throttled(self) -> int:
        return self.api.throttled

    @contextlib.contextmanager
    def read_through(self) -> Iterator[None]:
        """Reads in this block (this thread) go to the API server."""
        before = getattr(self._local, "through", False)
        self._local.through = True
        try:
            yield
        finally:
            self._local.through = before

    def _cached(self) -> bool:
        return self.cache.bound and not getattr(self._local, "through", False)

    def get(self, ref: Ref) -> dict[str, Any] | None:
        if self._cached() and ref.namespace and ref.name:
            if ref.kind == k8s.KIND:
                return self.cache.sdd(ref.namespace, ref.name)
            if ref.kind == "Deployment":
                return self.cache.deployment(ref.namespace, ref.name)
            if ref.kind == "Pod":
                return self.cache.pod(ref.namespace, ref.name)
        obj = self.api.get(ref)
        if ref.kind == k8s.KIND and ref.namespace and ref.name:
            self.cache.forget(ref.namespace, ref.name)  # read fresh: nothing older to hold on to
        return obj

    def list(self, ref: Ref, label_selector: str | None = None) -> list[dict[str, Any]]:
        match = parse_selector(label_selector) if ref.kind == "Pod" and ref.namespace else None
        if self._cached() and match and labels.NAME in match:
            return self.cache.pods(ref.namespace, match[labels.NAME], match)
        return self.api.list(ref, label_selector)

    def write_status(self, obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        written = self.api.write_status(obj, status)
        if written:
            self.cache.wrote(written)
        return written

    def __getattr__(self, name: str) -> Any:  # create, apply, delete, event, serves, set_pod_condition
        return getattr(self.api, name)
