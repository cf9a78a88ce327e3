"""Labels and annotations the operator puts on what it creates."""

from __future__ import annotations

from .spec import API_VERSION, KIND

NAME = "specdecode.io/name"
ROLE = "specdecode.io/role"
PLAN_KEY = "specdecode.io/plan-key"
GENERATION = "specdecode.io/generation"  # the SDD generation a Deployment was rendered from
# The worker pod's readiness gate for vllm and sglang: True once the engine itself reports the
# planned KV tokens (kvcheck.py), so a pod whose engine sized less never takes traffic.
KV_VERIFIED = "specdecode.io/kv-cache-verified"
ROLE_PLANNER = "planner"
ROLE_WORKER = "worker"
FIELD_MANAGER = "specdecode-operator"
MANAGED_BY = "app.kubernetes.io/managed-by"


def common(name: str, role: str) -> dict[str, str]:
    # Label values are limited to 63 characters; the CRD limits SDD names accordingly.
    return {
        "app.kubernetes.io/name": "specdecode-worker",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": role,
        MANAGED_BY: FIELD_MANAGER,
        NAME: name,
        ROLE: role,
    }


def selector(name: str) -> dict[str, str]:
    """The worker pods' selector (immutable in a Deployment, so never add to it)."""
    return {NAME: name, ROLE: ROLE_WORKER}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def owner_reference(sdd: dict) -> dict:
    meta = sdd["metadata"]
    return {
        "apiVersion": sdd.get("apiVersion", API_VERSION),
        "kind": sdd.get("kind", KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
