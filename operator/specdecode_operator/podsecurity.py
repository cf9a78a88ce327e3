"""Pod Security "restricted" for every pod the operator creates (planner, workers and their
model-download init containers).

Pure: ``restrict`` takes a rendered pod spec and returns it with the restricted defaults, so each
builder stays about what its pod runs. A cluster may still add to them through ``spec.pod``
(a ``serviceAccountName`` for image pulls, a ``securityContext`` for another image's user).
"""

from __future__ import annotations

import copy
from typing import Any

# The user the worker image runs as (the Dockerfile's worker target: USER 10001:10001).
IMAGE_UID = 10001
# The root filesystem is read-only; these are the only places a container writes.
TMP_VOLUME, TMP_DIR = "tmp", "/tmp"
CACHE_VOLUME, CACHE_DIR = "cache", "/var/cache/specdecode"
TMP_SIZE = "1Gi"
CACHE_SIZE = "4Gi"
# Libraries that write under $HOME by default (hub downloads, Triton and CUDA kernel caches).
CACHE_ENV = {
    "XDG_CACHE_HOME": CACHE_DIR,
    "HF_HOME": f"{CACHE_DIR}/huggingface",
    "TRITON_HOME": CACHE_DIR,
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "CUDA_CACHE_PATH": f"{CACHE_DIR}/nv",
}


def pod_security_context(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    base: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_UID,
        "runAsGroup": IMAGE_UID,
        "fsGroup": IMAGE_UID,
        # A model volume can hold hundreds of GiB: change its group once, not file by file each start.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return base | dict(overrides or {})


def container_security_context() -> dict[str, Any]:
    # runAsNonRoot and seccomp are the pod's: one place for spec.pod.securityContext to change them.
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _writable_dirs(container: dict[str, Any]) -> None:
    mounts = container.setdefault("volumeMounts", [])
    taken = {m["mountPath"] for m in mounts}
    for name, path in ((TMP_VOLUME, TMP_DIR), (CACHE_VOLUME, CACHE_DIR)):
        if path not in taken:
            mounts.append({"name": name, "mountPath": path})
    env = container.setdefault("env", [])
    have = {e["name"] for e in env}
    env.extend({"name": k, "value": v} for k, v in CACHE_ENV.items() if k not in have)


def restrict(pod_spec: dict[str, Any], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``pod_spec`` made restricted-clean: security contexts, writable emptyDirs for /tmp and the
    caches, no ServiceAccount token (nothing in these pods talks to the API)."""
    spec = copy.deepcopy(pod_spec)
    spec["securityContext"] = pod_security_context(overrides)
    spec["automountServiceAccountToken"] = False
    volumes = spec.setdefault("volumes", [])
    names = {v["name"] for v in volumes}
    for name, size in ((TMP_VOLUME, TMP_SIZE), (CACHE_VOLUME, CACHE_SIZE)):
        if name not in names:
            volumes.append({"name": name, "emptyDir": {"sizeLimit": size}})
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        container["securityContext"] = container_security_context() | dict(container.get("securityContext") or {})
        container["securityContext"]["capabilities"] = {"drop": ["ALL"]}
        _writable_dirs(container)
    return spec
