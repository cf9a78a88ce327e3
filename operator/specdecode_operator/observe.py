"""Status from the children: what the Deployment, its pods and the nodes say about the workers.

Pure: takes the objects as the API server returns them and gives condition verdicts, so each
failure reason can be tested from a pod's status alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdecode_worker.contract import ExitCode

from . import conditions as c
from . import refusals


@dataclass(frozen=True)
class Observation:
    verdicts: dict[str, c.Verdict]
    replicas: int
    ready_replicas: int
    updated_replicas: int


def max_node_gpus(nodes: list[dict[str, Any]], product: str | None) -> int | None:
    """Most allocatable nvidia.com/gpu on one schedulable node (of ``product`` if given).

    None when no such node exists: a cluster autoscaler may still add one, so that is not a verdict.
    """
    best = None
    for node in nodes:
        meta, spec = node.get("metadata") or {}, node.get("spec") or {}
        if spec.get("unschedulable"):
            continue
        if product and (meta.get("labels") or {}).get("nvidia.com/gpu.product") != product:
            continue
        gpus = int(str(((node.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu", "0")) or 0)
        best = gpus if best is None else max(best, gpus)
    return best


def capacity_verdict(tp: int, max_per_replica: int | None, node_gpus: int | None,
                     product: str | None, nodes: int = 1) -> c.Verdict | None:
    """PlanExceedsNodeGPUs when the plan needs more GPUs per replica than allowed, or more GPUs per
    pod (a replica spans ``nodes`` pods) than any node offers."""
    if max_per_replica is not None and tp > max_per_replica:
        return c.Verdict("True", c.PLAN_EXCEEDS_NODE_GPUS,
                         f"the plan needs {tp} GPUs per replica but gpu.maxPerReplica is {max_per_replica}: raise it, "
                         "use a GPU with more memory, lower serving.contextLength/minKVTokens "
                         "or use kvCacheDtype fp8_e4m3")
    per_pod = tp // nodes
    if node_gpus is not None and per_pod > node_gpus:
        where = f"nodes labelled nvidia.com/gpu.product={product}" if product else "any node"
        need = f"{tp} GPUs per replica" if nodes == 1 else \
            f"{per_pod} GPUs in each of a replica's {nodes} pods"
        return c.Verdict("True", c.PLAN_EXCEEDS_NODE_GPUS,
                         f"the plan needs {need} but the most {where} offers is {node_gpus}: set gpu.perNode "
                         f"to {node_gpus} (a replica then spans nodes), add larger nodes, choose a gpu.product with "
                         "more memory per GPU, or lower serving.contextLength/minKVTokens")
    return None


def _container_statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    st = pod.get("status") or {}
    return (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])


def pod_problem(pod: dict[str, Any]) -> c.Verdict | None:
    """The most specific reason one worker pod is failing, or None."""
    name = (pod.get("metadata") or {}).get("name", "?")
    for cs in _container_statuses(pod):
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            term = state.get("terminated")
            if term and term.get("reason") == "OOMKilled":
                return c.Verdict("True", c.WORKER_OOM_KILLED,
                                 f"pod {name}: container {cs.get('name')} was OOMKilled (restarts: "
                                 f"{cs.get('restartCount', 0)}); raise resources.memory (host memory) or check that "
                                 "the node's memory is not overcommitted")
    for cs in _container_statuses(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        crashing = waiting.get("reason") == "CrashLoopBackOff"
        failed_exit = term is not None and term.get("exitCode", 0) != 0
        if crashing or failed_exit:
            detail = ((term or {}).get("message") or waiting.get("message") or "").strip()
            code = (term or {}).get("exitCode")
            why = {ExitCode.DOES_NOT_FIT: "the worker refused to serve: the memory it found after loading the "
                   "weights is below the plan (another process on the GPU, or a smaller GPU than planned); ",
                   ExitCode.BAD_INPUT: "the worker rejected its arguments or model files; "}.get(code, "")
            return c.Verdict("True", c.WORKER_STARTUP_FAILED,
                             f"{why}pod {name}: container {cs.get('name')} exited with code "
                             f"{(term or {}).get('exitCode', '?')} (restarts: {cs.get('restartCount', 0)})"
                             + (f": {detail[-2000:]}" if detail else ""))
        if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                                     "CreateContainerConfigError", "CreateContainerError"):
            return c.Verdict("True", c.WORKER_STARTUP_FAILED,
                             f"pod {name}: container {cs.get('name')} cannot start: {waiting.get('reason')} "
                             f"{waiting.get('message', '')}".strip())
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return c.Verdict("True", c.UNSCHEDULABLE, f"pod {name}: {cond.get('message', 'unschedulable')}")
    return None


_PRIORITY = {c.PLAN_EXCEEDS_NODE_GPUS: 0, c.POD_SECURITY_REJECTED: 1, c.QUOTA_EXCEEDED: 1, c.CHILD_REJECTED: 1,
             c.WORKER_OOM_KILLED: 2, c.WORKER_STARTUP_FAILED: 3, c.UNSCHEDULABLE: 4}


def _dep_condition(dep: dict[str, Any], ctype: str) -> dict[str, Any]:
    return c.get((dep.get("status") or {}).get("conditions") or [], ctype) or {}


def replica_failure(deployment: dict[str, Any] | None) -> c.Verdict | None:
    """Worker pods the API server refused to the ReplicaSet controller (admission, quota, a
    webhook): the Deployment's ReplicaFailure condition carries the API server's message."""
    failure = _dep_condition(deployment or {}, "ReplicaFailure")
    if failure.get("status") != "True":
        return None
    message = failure.get("message", "")
    return c.Verdict("True", refusals.reason_for_replica_failure(message),
                     f"the worker pods cannot be created: {message}")


def observe(desired: int, generation_ok: bool, deployment: dict[str, Any] | None, pods: list[dict[str, Any]],
            capacity: c.Verdict | None) -> Observation:
    """Verdicts for Available, Progressing, Degraded and Ready from the workers.

    ``generation_ok``: the Deployment carries the current plan key and template (else a rollout is due).
    """
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    dstat = (deployment or {}).get("status") or {}
    ready = int(dstat.get("readyReplicas", 0) or 0)
    updated = int(dstat.get("updatedReplicas", 0) or 0)
    current = int(dstat.get("replicas", 0) or 0)
    observed = deployment is not None and \
        dstat.get("observedGeneration", 0) >= (deployment.get("metadata") or {}).get("generation", 0)

    problems = [v for v in (capacity, replica_failure(deployment), *(pod_problem(p) for p in live)) if v is not None]
    problems.sort(key=lambda v: _PRIORITY.get(v.reason, 9))
    if problems:
        degraded = problems[0]
    elif deployment is not None and \
            _dep_condition(deployment, "Progressing").get("reason") == "ProgressDeadlineExceeded":
        degraded = c.Verdict("True", c.PODS_NOT_READY,
                             f"{desired - ready} of {desired} replicas not ready before the progress deadline: "
                             f"{_dep_condition(deployment, 'Progressing').get('message', '')}")
    else:
        degraded = c.Verdict("False", "AsExpected", "no worker problem observed")

    if deployment is None:
        available = c.Verdict("False", "Deploying", "the worker Deployment does not exist yet")
    elif desired == 0:
        available = c.Verdict("False", "ScaledToZero", "replicas is 0")
    elif ready > 0:  # the Service answers; Ready says whether every replica does
        available = c.Verdict("True", "ReplicasAvailable", f"{ready} of {desired} replicas ready")
    else:
        available = c.Verdict("False", "RollingOut" if degraded.status == "False" else degraded.reason,
                              f"{ready} of {desired} replicas ready")

    complete = (deployment is not None and generation_ok and observed and updated == desired
                and ready == desired and current == desired)
    if complete:
        progressing = c.Verdict("False", "RolloutComplete", f"{ready} of {desired} replicas ready on the current plan")
    elif degraded.status == "True":
        progressing = c.Verdict("False", degraded.reason, "the rollout is blocked: see Degraded")
    else:
        progressing = c.Verdict("True", "RollingOut",
                                f"{updated} of {desired} replicas updated, {ready} ready")

    if complete and degraded.status == "False":
        ready_v = c.Verdict("True", "Ready", f"{ready} of {desired} replicas ready")
    elif degraded.status == "True":
        ready_v = c.Verdict("False", degraded.reason, degraded.message)
    else:
        ready_v = c.Verdict("False", "RollingOut" if deployment is not None else "Deploying",
                            f"{ready} of {desired} replicas ready, {updated} updated")
    return Observation(
        verdicts={c.AVAILABLE: available, c.PROGRESSING: progressing, c.DEGRADED: degraded, c.READY: ready_v},
        replicas=current, ready_replicas=ready, updated_replicas=updated,
    )
