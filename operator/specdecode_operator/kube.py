"""A small synchronous Kubernetes client over ``kubernetes.client.ApiClient``: plain dicts in and
out, server-side apply, and status writes guarded by resourceVersion.

Objects are named by a typed ``Ref`` (apiVersion, kind, namespace, name); ``rest_path`` turns one
into the REST path in one place. It is a table, not the official client's typed APIs or its
DynamicClient: those would add a discovery request per kind (DynamicClient) or one model
(de)serialisation per call, while every call here is exactly one HTTP request.
"""

from __future__ import annotations

import calendar
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from .labels import FIELD_MANAGER
from .spec import API_VERSION, KIND, PLURAL

log = logging.getLogger(__name__)

# Every kind the operator touches, with its plural (the resource name in REST paths).
PLURALS = {"Pod": "pods", "ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
           "Event": "events", "Node": "nodes", KIND: PLURAL, "LeaderWorkerSet": "leaderworkersets",
           "Job": "jobs", "PersistentVolumeClaim": "persistentvolumeclaims", "NetworkPolicy": "networkpolicies"}


@dataclass(frozen=True)
class Ref:
    """Which object (or, with ``name`` None, which collection) a call is about."""

    api_version: str
    kind: str
    namespace: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, obj: dict[str, Any]) -> "Ref":
        meta = obj.get("metadata") or {}
        return cls(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta.get("name"))

    def collection(self) -> "Ref":
        return Ref(self.api_version, self.kind, self.namespace)

    def named(self, name: str) -> "Ref":
        return Ref(self.api_version, self.kind, self.namespace, name)


def pods(namespace: str, name: str | None = None) -> Ref:
    return Ref("v1", "Pod", namespace, name)


def deployment(namespace: str, name: str) -> Ref:
    return Ref("apps/v1", "Deployment", namespace, name)


def job(namespace: str, name: str) -> Ref:
    return Ref("batch/v1", "Job", namespace, name)


def claim(namespace: str, name: str) -> Ref:
    return Ref("v1", "PersistentVolumeClaim", namespace, name)


def sdd(namespace: str, name: str) -> Ref:
    return Ref(API_VERSION, KIND, namespace, name)


NODES = Ref("v1", "Node")


def rest_path(ref: Ref, sub: str | None = None) -> str:
    """``/api/v1/namespaces/ns/pods/name`` and the like; ``sub`` is a subresource (``status``)."""
    base = f"/apis/{ref.api_version}" if "/" in ref.api_version else f"/api/{ref.api_version}"
    p = base + (f"/namespaces/{quote(ref.namespace)}" if ref.namespace else "") + f"/{PLURALS[ref.kind]}"
    if ref.name:
        p += f"/{quote(ref.name)}"
    if sub:
        p += f"/{sub}"
    return p


# A request the API server throttles (429) is sent again this many times, after the wait its
# Retry-After asks for, within these bounds (client-go retries 10 times and honours the header).
THROTTLED_RETRIES = 10
RETRY_AFTER_S = (0.5, 10.0)


def retry_after(headers: Any) -> float:
    """Seconds to wait before resending a throttled request: the server's Retry-After, bounded."""
    low, high = RETRY_AFTER_S
    try:
        asked = float((headers or {}).get("Retry-After", low))
    except (TypeError, ValueError):
        asked = low
    return min(high, max(low, asked))


class ApiError(Exception):
    def __init__(self, status: int, message: str, reason: str = ""):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.reason = reason  # the Status object's reason: Forbidden, Invalid, Conflict, ...


_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def request_kind(method: str, p: str) -> str:
    """``"list pods"``, ``"update specdecodedeployments/status"``: the Kubernetes verb and the
    resource of one request, as the API server's audit log names them (discovery is ``get discovery``)."""
    parts = p.strip("/").split("/")
    if parts[0] == "apis" and len(parts) <= 3:
        return "get discovery"
    parts = parts[2:] if parts[0] == "api" else parts[3:]  # drop /api/v1 or /apis/group/version
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]
    resource, named = parts[0], len(parts) > 1
    if len(parts) > 2:
        resource += "/" + parts[2]
    verb = _VERBS.get(method) or ("get" if named else "list")
    return f"{verb} {resource}"


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def epoch(ts: str | None) -> float | None:
    """Seconds since the epoch of an API timestamp (``2026-01-01T00:00:00Z``), or None."""
    if not ts:
        return None
    try:
        return float(calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


class Kube:
    """The operations the reconciler needs. Tests substitute an in-memory fake."""

    def __init__(self, api_client=None):
        if api_client is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self._api = api_client
        self.requests = 0
        self.requests_by_kind: Counter[str] = Counter()  # request_kind -> count
        self.throttled = 0  # requests the API server answered 429 (each retried)
        self._count_lock = threading.Lock()

    def _call(self, method: str, p: str, body: Any = None, query: dict[str, Any] | None = None,
              content_type: str = "application/json") -> dict[str, Any] | None:
        _, url, headers, body, _ = self._api.param_serialize(
            method, p, query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"],
        )
        for attempt in range(THROTTLED_RETRIES + 1):
            with self._count_lock:
                self.requests += 1
                self.requests_by_kind[request_kind(method, p)] += 1
            try:
                resp = self._api.call_api(method, url, header_params=headers, body=body, _request_timeout=60)
                resp.read()
            except Exception as exc:  # kubernetes.client.ApiException raised by the REST layer
                if getattr(exc, "status", None) is None:
                    raise
                resp = exc
            status = int(resp.status)
            if status != 429 or attempt == THROTTLED_RETRIES:
                break
            # Throttled (API Priority and Fairness, or a max-in-flight limit): wait as the server
            # asks and try again, as client-go does, instead of failing the whole reconcile.
            with self._count_lock:
                self.throttled += 1
            wait = retry_after(getattr(resp, "headers", None))
            log.debug("429 from %s %s; retrying in %.1f s", method, p, wait)
            time.sleep(wait)
        data = resp.data if getattr(resp, "data", None) is not None else getattr(resp, "body", b"")
        if status >= 400:
            raise _api_error(status, data)
        return json.loads(data) if data else None

    def get(self, ref: Ref) -> dict[str, Any] | None:
        try:
            return self._call("GET", rest_path(ref))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, ref: Ref, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return (self._call("GET", rest_path(ref.collection()), query=query) or {}).get("items", [])

    def serves(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves ``kind`` (discovery: a CRD that is not installed is absent)."""
        try:
            found = self._call("GET", f"/apis/{api_version}") or {}
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("kind") == kind for r in found.get("resources") or [])

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", rest_path(Ref.of(obj).collection()), obj)

    def delete(self, ref: Ref) -> None:
        try:
            self._call("DELETE", rest_path(ref), {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply, owning every field we send (force: the operator is the authority)."""
        return self._call("PATCH", rest_path(Ref.of(obj)), obj, {"fieldManager": FIELD_MANAGER, "force": "true"},
                          "application/apply-patch+yaml")

    def set_pod_condition(self, pod: dict[str, Any], condition: dict[str, Any]) -> dict[str, Any]:
        """Add or replace one condition of a pod's status (a strategic merge by type), as a
        readiness gate's controller does; the kubelet keeps conditions it does not own."""
        meta = pod["metadata"]  # pods from a list carry no apiVersion or kind
        return self._call("PATCH", rest_path(pods(meta["namespace"], meta["name"]), "status"),
                          {"status": {"conditions": [condition]}},
                          content_type="application/strategic-merge-patch+json")

    def write_status(self, obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Replace the status subresource, read-modify-write: a 409 if the object changed since
        ``obj`` was read (nothing written by others is clobbered; the caller reconciles again)."""
        meta = obj["metadata"]
        body = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": {
            "name": meta["name"], "namespace": meta["namespace"], "resourceVersion": meta["resourceVersion"]},
            "spec": obj.get("spec"), "status": status}
        return self._call("PUT", rest_path(Ref.of(obj), "status"), body)

    def event(self, obj: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        meta = obj["metadata"]
        ts = now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion", API_VERSION),
                               "kind": obj.get("kind", KIND), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
        }
        try:
            self.create(body)
        except ApiError as exc:  # an Event is best effort: never fail a reconcile over it
            log.warning("could not post event %s: %s", reason, exc)


def _api_error(status: int, data: Any) -> ApiError:
    """The API server's Status object (message and reason) as an ApiError."""
    try:
        body = json.loads(data)
        return ApiError(status, str(body.get("message", data)), str(body.get("reason", "")))
    except Exception:
        text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        return ApiError(status, text)
