"""A minimal Kubernetes REST client (standard library only) for the test bed's own plumbing.

The control plane uses it to wait for readiness and register nodes, and the planner runner uses
it to watch and annotate pods, so neither depends on the operator's client libraries. Tests
drive the cluster with kubectl or their own clients instead.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class KubeClient:
    """Talks to the server of a kubeconfig's current context with its credentials."""

    def __init__(self, kubeconfig: str | os.PathLike[str]):
        config = yaml.safe_load(Path(kubeconfig).read_text())
        context_name = config["current-context"]
        context = _named(config["contexts"], context_name)["context"]
        cluster = _named(config["clusters"], context["cluster"])["cluster"]
        user = _named(config["users"], context["user"])["user"]
        self.server = cluster["server"].rstrip("/")
        self._ssl = ssl.create_default_context()
        if cluster.get("insecure-skip-tls-verify"):
            self._ssl.check_hostname = False
            self._ssl.verify_mode = ssl.CERT_NONE
        elif "certificate-authority-data" in cluster:
            self._ssl.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
        elif "certificate-authority" in cluster:
            self._ssl.load_verify_locations(cafile=cluster["certificate-authority"])
        self._headers = {"Accept": "application/json"}
        if "token" in user:
            self._headers["Authorization"] = f"Bearer {user['token']}"
        if "client-certificate-data" in user:
            # ssl only loads client certificates from files.
            with tempfile.TemporaryDirectory() as d:
                cert, key = Path(d, "client.crt"), Path(d, "client.key")
                cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
                key.write_bytes(base64.b64decode(user["client-key-data"]))
                self._ssl.load_cert_chain(cert, key)
        elif "client-certificate" in user:
            self._ssl.load_cert_chain(user["client-certificate"], user["client-key"])

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> Any:
        url = self.server + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, method, path, exc.read().decode(errors="replace")) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def get(self, path: str, **query: str) -> Any:
        return self.request("GET", path, query=query or None)

    def create(self, path: str, obj: dict) -> Any:
        return self.request("POST", path, obj)

    def merge_patch(self, path: str, patch: dict) -> Any:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")


def _named(items: list[dict], name: str) -> dict:
    for item in items:
        if item["name"] == name:
            return item
    raise KeyError(f"kubeconfig has no entry named {name!r}")
