"""The Pod Security Standard "restricted" (baseline included) as a checker for pod specs.

Written from the published standard (kubernetes.io/docs/concepts/security/pod-security-standards)
so rendered pods can be checked without a cluster; the e2e tests hold the same pods to the API
server's own PodSecurity admission in a namespace labelled enforce=restricted.
"""

from __future__ import annotations

from typing import Any

from specdecode_operator import modelcache, models, planner, workload
from specdecode_operator.spec import parse_spec, plan_key
from tests.operator_helpers import OWNER, example, hub_sources, make_plan, typed

ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                        "projected", "secret"}
ALLOWED_ADD_CAPABILITIES = {"NET_BIND_SERVICE"}
ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every way ``pod_spec`` breaks the restricted profile (empty when it passes)."""
    out: list[str] = []
    psc = pod_spec.get("securityContext") or {}
    containers = [c for key in ("initContainers", "containers", "ephemeralContainers")
                  for c in pod_spec.get(key) or []]
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            out.append(f"{flag} is true")
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUME_TYPES:
            out.append(f"volume {volume['name']} has type {sorted(kinds - ALLOWED_VOLUME_TYPES)}")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not safe")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser is 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ALLOWED_SECCOMP:
        out.append(f"pod seccompProfile is {pod_seccomp}")
    for c in containers:
        name = c.get("name", "?")
        sc = c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        if sc.get("privileged"):
            out.append(f"container {name} is privileged")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"container {name} procMount is {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"container {name} uses hostPort {port['hostPort']}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name} must set allowPrivilegeEscalation=false")
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {name} must drop ALL capabilities")
        extra = set(caps.get("add") or []) - ALLOWED_ADD_CAPABILITIES
        if extra:
            out.append(f"container {name} adds capabilities {sorted(extra)}")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"container {name} must run with runAsNonRoot=true")
        if sc.get("runAsUser") == 0:
            out.append(f"container {name} runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ALLOWED_SECCOMP:
            out.append(f"container {name} seccompProfile is {seccomp} (RuntimeDefault or Localhost required)")
    return out


def pod_spec_of(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Pod, or of a workload's pod template."""
    if obj["kind"] == "Pod":
        return obj["spec"]
    return obj["spec"]["template"]["spec"]


def hub_store(body, cache=None):
    """The SDD with its models from a hub: downloaded by each pod (init containers), or with
    ``cache`` ({"claimName": ...} or {"create": {...}}) once into a cache PVC by a Job."""
    hub = {"endpoint": "https://hub.example", "tokenSecret": {"name": "hf"}}
    if cache is not None:
        hub["cache"] = cache
    body["spec"]["modelStore"] = {"hub": hub}
    return body


def _variants():
    yield "pvc", example()
    yield "hub", hub_store(example())
    yield "hub-cache", hub_store(example(), {"create": {}})
    gpu = example()
    gpu["spec"]["planner"] = {"requestGPU": True}
    yield "planner-gpu", gpu
    sa = example()
    sa["spec"]["pod"] = {"serviceAccountName": "puller", "imagePullSecrets": [{"name": "reg"}]}
    yield "service-account", sa


def rendered_pods():
    """(what, pod spec) for every pod the operator creates, in each store and parallelism."""
    for name, body in _variants():
        view = parse_spec(body)
        key = plan_key(view)
        yield f"{name}/planner", pod_spec_of(planner.render_planner_pod(view, key, OWNER))
        sources = hub_sources() if view.hub else None
        for tp in (1, 4):
            dep = workload.render_deployment(view, typed(make_plan(tp=tp, sources=sources)), key, OWNER)
            yield f"{name}/worker-tp{tp}", pod_spec_of(dep)
        if models.cache_claim(view):
            source = typed(make_plan(sources=sources)).sources.target
            job = modelcache.render_job(view, models.cache_claim(view), source, OWNER)
            yield f"{name}/model-cache", job["spec"]["template"]["spec"]
