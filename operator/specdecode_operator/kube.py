"""A small synchronous Kubernetes client over ``kubernetes.client.ApiClient``: plain dicts in and
out, server-side apply, and status writes guarded by resourceVersion."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from .labels import FIELD_MANAGER
from .spec import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

_PLURALS = {"Pod": "pods", "ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
            "Event": "events", "SpecDecodeDeployment": PLURAL}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def path(api_version: str, kind_or_plural: str, namespace: str | None, name: str | None = None,
         sub: str | None = None) -> str:
    plural = _PLURALS.get(kind_or_plural, kind_or_plural)
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    p = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        p += f"/{quote(name)}"
    if sub:
        p += f"/{sub}"
    return p


def sdd_path(namespace: str, name: str, sub: str | None = None) -> str:
    return path(f"{GROUP}/{VERSION}", PLURAL, namespace, name, sub)


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

    def _call(self, method: str, p: str, body: Any = None, query: dict[str, Any] | None = None,
              content_type: str = "application/json") -> dict[str, Any] | None:
        self.requests += 1
        _, url, headers, body, _ = self._api.param_serialize(
            method, p, query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"],
        )
        try:
            resp = self._api.call_api(method, url, header_params=headers, body=body, _request_timeout=60)
            resp.read()
        except Exception as exc:  # kubernetes.client.ApiException raised by the REST layer
            if getattr(exc, "status", None) is None:
                raise
            resp = exc
        status = int(resp.status)
        data = resp.data if getattr(resp, "data", None) is not None else getattr(resp, "body", b"")
        if status >= 400:
            try:
                message = json.loads(data).get("message", data)
            except Exception:
                message = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
            raise ApiError(status, message)
        return json.loads(data) if data else None

    def get(self, p: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", p)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, p: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return (self._call("GET", p, query=query) or {}).get("items", [])

    def create(self, p: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", p, body)

    def delete(self, p: str) -> None:
        try:
            self._call("DELETE", p, {"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply, owning every field we send (force: the operator is the authority)."""
        meta = obj["metadata"]
        p = path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        return self._call("PATCH", p, obj, {"fieldManager": FIELD_MANAGER, "force": "true"},
                          "application/apply-patch+yaml")

    def write_status(self, sdd: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Replace the status subresource, read-modify-write: a 409 if the object changed since
        ``sdd`` was read (nothing written by others is clobbered; the caller reconciles again)."""
        meta = sdd["metadata"]
        body = {"apiVersion": sdd["apiVersion"], "kind": sdd["kind"], "metadata": {
            "name": meta["name"], "namespace": meta["namespace"], "resourceVersion": meta["resourceVersion"]},
            "spec": sdd.get("spec"), "status": status}
        return self._call("PUT", sdd_path(meta["namespace"], meta["name"], "status"), body)

    def event(self, sdd: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        meta = sdd["metadata"]
        ts = now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": sdd.get("apiVersion", f"{GROUP}/{VERSION}"),
                               "kind": sdd.get("kind", "SpecDecodeDeployment"), "name": meta["name"],
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
            self.create(path("v1", "Event", meta["namespace"]), body)
        except ApiError as exc:  # an Event is best effort: never fail a reconcile over it
            log.warning("could not post event %s: %s", reason, exc)
