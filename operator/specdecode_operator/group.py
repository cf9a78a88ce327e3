"""A replica larger than one node: the worker pod of the Deployment, rendered as a LeaderWorkerSet.

When the plan spreads a replica over ``nodesPerReplica`` pods, one replica is one LWS group:
the leader pod (node rank 0, global ranks 0..k-1) serves HTTP with the probes a Deployment's pod
has; the worker pods run the other ranks and follow it. Each pod asks for t / nodesPerReplica
GPUs. The LWS controller's pod webhook injects LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
LWS_WORKER_INDEX, which ``serve`` reads as --master-addr, --nnodes and --node-rank; the pod name
comes through the downward API for failure messages. A failing pod recreates the whole group
(``RecreateGroupOnPodRestart``): torch.distributed cannot take a rank back.

Pure functions: the group is derived from ``workload.render_deployment``'s output, so the pod
template (security contexts, volumes, model store, scheduling) has one definition.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from specdecode_worker.contract import GIB, MemoryPlan

from . import labels, workload
from .kube import Ref

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_KIND = "LeaderWorkerSet"
LWS_CRD = f"leaderworkersets.{LWS_GROUP}"
INSTALL_HINT = ("install LeaderWorkerSet (https://lws.sigs.k8s.io/docs/installation/), for example "
                "`helm install lws oci://ghcr.io/kubernetes-sigs/lws-charts/lws -n lws-system --create-namespace`")
# torch.distributed's rendezvous on the leader pod; pod supervision uses the next port.
MASTER_PORT = 29500
GROUP_ROLE = "specdecode.io/group-role"
LEADER, FOLLOWER = "leader", "worker"


def nodes_per_replica(plan: MemoryPlan) -> int:
    return plan.nodes_per_replica or 1  # plans for one node leave it out


def lws_name(name: str) -> str:
    """The LWS's own headless Service takes its name, so it must differ from the SDD's Service."""
    return f"{name}-group"


def group_host_memory(view, plan: MemoryPlan) -> str:
    """The user's value, else this pod's ranks' weights plus headroom (a pod holds t / nodes ranks)."""
    if view.memory:
        return view.memory
    ranks = plan.tensor_parallel_size // nodes_per_replica(plan)
    total = workload.weight_bytes_per_gpu(plan) * ranks + workload.HOST_MEMORY_HEADROOM
    return f"{math.ceil(total / GIB)}Gi"


def _pod_template(dep: dict[str, Any], view, plan: MemoryPlan, role: str) -> dict[str, Any]:
    template = copy.deepcopy(dep["spec"]["template"])
    template["metadata"]["labels"][GROUP_ROLE] = role
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "worker"]
    nodes = nodes_per_replica(plan)
    container["args"] = container["args"] + ["--nnodes", str(nodes), "--master-port", str(MASTER_PORT)]
    container["resources"]["limits"]["nvidia.com/gpu"] = plan.tensor_parallel_size // nodes
    container["resources"]["requests"]["memory"] = group_host_memory(view, plan)
    container["env"] = list(container.get("env") or []) + [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    container["ports"] = [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"},
                          {"name": "supervision", "containerPort": MASTER_PORT + 1, "protocol": "TCP"}]
    if role == LEADER:
        container["ports"].insert(0, {"name": "http", "containerPort": workload.HTTP_PORT, "protocol": "TCP"})
    else:  # no HTTP server: a worker pod lives as long as its ranks and the link to the leader
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            container.pop(probe, None)
    return template


def render_leaderworkerset(view, plan: MemoryPlan, key: str, owner: dict[str, Any],
                           generation: int = 0) -> dict[str, Any]:
    dep = workload.render_deployment(view, plan, key, owner, generation)
    meta = dep["metadata"] | {"name": lws_name(view.name)}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": meta,
        "spec": {
            "replicas": view.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": nodes_per_replica(plan),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(dep, view, plan, LEADER),
                "workerTemplate": _pod_template(dep, view, plan, FOLLOWER),
            },
        },
    }


def render_leader_service(view, owner: dict[str, Any]) -> dict[str, Any]:
    """The SDD's Service, selecting leader pods only: they alone serve HTTP."""
    svc = workload.render_service(view, owner)
    svc["spec"]["selector"] = svc["spec"]["selector"] | {GROUP_ROLE: LEADER}
    return svc


def rank_policy_name(name: str) -> str:
    return f"{name}-ranks"


def render_rank_network_policy(view, owner: dict[str, Any]) -> dict[str, Any]:
    """Ingress on any port to this SDD's worker pods from this SDD's worker pods only.

    The ranks of a group talk on ports torch.distributed picks (NCCL, gloo); the chart's worker
    policy admits only the serving port, and NetworkPolicy cannot say "the same SDD as the
    destination", so each SDD gets its own rule. Policies add up: the serving port stays open.
    """
    own_workers = {"matchLabels": labels.selector(view.name) | {labels.MANAGED_BY: labels.FIELD_MANAGER}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": rank_policy_name(view.name),
            "namespace": view.namespace,
            "labels": labels.common(view.name, labels.ROLE_WORKER),
            "ownerReferences": [owner],
        },
        "spec": {
            "podSelector": own_workers,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": own_workers}]}],
        },
    }


def rank_network_policy_ref(namespace: str, name: str) -> Ref:
    return Ref("networking.k8s.io/v1", "NetworkPolicy", namespace, rank_policy_name(name))


def render_children(view, plan: MemoryPlan, key: str, owner: dict[str, Any],
                    generation: int = 0, rank_policy: bool = False) -> list[dict[str, Any]]:
    """In apply order, as ``workload.render_children`` for one node: ConfigMap, workload, Service.

    With ``rank_policy`` (the chart's worker NetworkPolicy is on), the group's rank policy comes
    before the workload, so its pods can reach each other as soon as they start.
    """
    policy = [render_rank_network_policy(view, owner)] if rank_policy else []
    return [workload.render_configmap(view, plan, key, owner), *policy,
            render_leaderworkerset(view, plan, key, owner, generation),
            render_leader_service(view, owner)]


def as_deployment_status(lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """The LWS in the shape ``observe.observe`` reads from a Deployment (groups count as replicas).

    LWS reports readyReplicas and updatedReplicas per group, and Available/Progressing conditions;
    the plan key annotation rides on its leader template as on a Deployment's pod template.
    """
    if lws is None:
        return None
    st = lws.get("status") or {}
    conds = []
    for cond in st.get("conditions") or []:
        if cond.get("type") in ("Available", "Progressing"):
            conds.append(cond)
    template = ((lws.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("leaderTemplate") or {}
    return {
        "metadata": lws.get("metadata") or {},
        "spec": {"template": template},
        "status": {
            "replicas": st.get("replicas", 0),
            "readyReplicas": st.get("readyReplicas", 0),
            "updatedReplicas": st.get("updatedReplicas", 0),
            # LWS publishes no observedGeneration: its status is current once its groups exist.
            "observedGeneration": (lws.get("metadata") or {}).get("generation", 0),
            "conditions": conds,
        },
    }


def leaderworkerset_ref(namespace: str, name: str) -> Ref:
    """The LWS of the SDD ``name``."""
    return Ref(LWS_API_VERSION, LWS_KIND, namespace, lws_name(name))
