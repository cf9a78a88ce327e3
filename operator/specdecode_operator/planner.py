"""The planner pod: what it runs, and what its terminated container says.

The pod runs ``specdecode-worker plan`` once (restartPolicy Never) and writes the MemoryPlan JSON to
its termination log; the operator never reads tensor data or needs a GPU itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specdecode_worker.contract import DEFAULT_ENGINE, EAGLE_ALGORITHMS, ExitCode

from . import labels, models, podsecurity
from .plan_result import explains_misfit, read_plan
from .spec import DEFAULT_MAX_TP, DEFAULT_VERIFY_WIDTH, SpecView, draft_proposals, planner_pod_name, verify_width

TERMINATION_LOG = "/dev/termination-log"
# A planner that reads a few headers finishes in seconds; a hung one must not block forever.
ACTIVE_DEADLINE_SECONDS = 900


def planner_args(view: SpecView, gpus_per_node: int | None = None) -> list[str]:
    """``specdecode-worker plan`` arguments for this spec (the plan's inputs, nothing else).

    ``gpus_per_node``: what the nodes offer when the spec does not say (nodecapacity.py).
    """
    s = view.serving
    args = ["plan", *_model_args(view), "--algorithm", view.algorithm, "--tp", "auto"]
    if view.target_dtype != "auto":  # priced as the worker computes (workload.worker_args renders the same)
        args += ["--dtype", view.target_dtype]
    if verify_width(view) != DEFAULT_VERIFY_WIDTH:  # the worker's verify graphs are priced at its width
        args += ["--num-draft-tokens", str(draft_proposals(view))]
    if view.planner_max_tp > DEFAULT_MAX_TP:
        args += ["--max-tp", str(view.planner_max_tp)]
    per_node = view.gpu_per_node if view.gpu_per_node is not None else gpus_per_node
    if per_node is not None:
        args += ["--gpus-per-node", str(per_node)]
    if view.gpu_memory_gib is not None:
        args += ["--gpu-memory-gib", _num(view.gpu_memory_gib)]
    elif view.gpu_product and not view.planner_request_gpu:
        args += ["--gpu-product", view.gpu_product]
    args += ["--mem-fraction-static", "auto" if s.mem_fraction_static is None else _num(s.mem_fraction_static)]
    args += ["--kv-cache-dtype", s.kv_cache_dtype, "--context-length", str(s.context_length)]
    if s.min_kv_tokens is not None:
        args += ["--min-kv-tokens", str(s.min_kv_tokens)]
    args += ["--max-running-requests", str(s.max_running_requests)]
    if s.cuda_graph_max_batch_size is not None:
        args += ["--cuda-graph-max-bs", str(s.cuda_graph_max_batch_size)]
    if s.chunked_prefill_size is not None:
        args += ["--chunked-prefill-size", str(s.chunked_prefill_size)]
    if view.algorithm in EAGLE_ALGORITHMS and view.top_k > 1:  # a tree's graphs are priced from its shape
        args += ["--speculative-num-steps", str(view.num_steps), "--speculative-eagle-topk", str(view.top_k)]
    if view.engine != DEFAULT_ENGINE:
        args += ["--engine", view.engine]
    args += ["--output", "json", "--termination-log", TERMINATION_LOG]
    return args


def _model_args(view: SpecView) -> list[str]:
    """Folders in the mounted store, or hub repositories (and revisions) read over HTTP."""
    if not view.hub:
        args = ["--target", view.model_path(view.target)]
        return args + (["--draft", view.draft_dir] if view.draft_dir else [])
    args = ["--model-source", "hub", "--target", view.target.model]
    if view.target.revision:
        args += ["--target-revision", view.target.revision]
    draft = view.hub_draft
    if draft is not None:
        args += ["--draft", draft.model]
        if draft.revision:
            args += ["--draft-revision", draft.revision]
    return args


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def render_planner_pod(view: SpecView, key: str, owner: dict[str, Any],
                       gpus_per_node: int | None = None) -> dict[str, Any]:
    meta_labels = labels.common(view.name, labels.ROLE_PLANNER) | {labels.PLAN_KEY: key}
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    for k in ("cpu", "memory"):
        if view.planner_resources.get(k) is not None:
            resources["requests"][k] = str(view.planner_resources[k])
            if k == "memory":
                resources["limits"]["memory"] = str(view.planner_resources[k])
    node_selector = dict(view.pod.get("nodeSelector") or {})
    if view.planner_request_gpu:
        resources["limits"]["nvidia.com/gpu"] = 1
        if view.gpu_product:
            node_selector["nvidia.com/gpu.product"] = view.gpu_product
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": ACTIVE_DEADLINE_SECONDS,
        "enableServiceLinks": False,
        "containers": [{
            "name": "planner",
            "image": view.planner_image,
            "imagePullPolicy": view.image_pull_policy,
            "command": ["specdecode-worker"],
            "args": planner_args(view, gpus_per_node),
            "resources": resources,
            # A hub store is read over HTTP (headers only): no model volume, only the hub's address and token.
            "volumeMounts": [] if view.hub else [models.mount()],
            "env": models.hub_env(view) if view.hub else [],
            # The plan goes to the termination log; on a crash the log tail explains it instead.
            "terminationMessagePath": TERMINATION_LOG,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": [] if view.hub else models.volumes(view),
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    for k in ("tolerations", "affinity", "imagePullSecrets"):
        if view.pod.get(k):
            spec[k] = view.pod[k]
    if view.planner_request_gpu:
        gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        spec.setdefault("tolerations", []).append(gpu_toleration)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": planner_pod_name(view, key),
            "namespace": view.namespace,
            "labels": meta_labels,
            "ownerReferences": [owner],
        },
        "spec": podsecurity.restrict(spec, view.pod.get("securityContext")),
    }


@dataclass(frozen=True)
class PlannerOutcome:
    """What a planner pod says. ``state``: pending, running, fits, misfit or failed."""

    state: str
    plan: dict[str, Any] | None = None
    message: str = ""
    exit_code: int | None = None
    finished_at: str | None = None


def read_outcome(pod: dict[str, Any]) -> PlannerOutcome:
    """Interpret a planner pod: its phase, or its exit code and the MemoryPlan it wrote."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    terminated = None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") == "planner":
            terminated = (cs.get("state") or {}).get("terminated")
    if terminated is None:
        if phase == "Failed":  # e.g. DeadlineExceeded or evicted before the container ran
            return PlannerOutcome("failed", message=f"planner pod failed: {status.get('reason', '')} "
                                  f"{status.get('message', '')}".strip())
        if phase in ("Pending", "Running", "Unknown", "Succeeded"):
            return PlannerOutcome("pending" if phase == "Pending" else "running",
                                  message=_pending_message(status))
    code = terminated.get("exitCode")
    message = (terminated.get("message") or "").strip()
    finished = terminated.get("finishedAt")
    if code in (ExitCode.OK, ExitCode.DOES_NOT_FIT):
        parsed = None
        try:
            parsed = json.loads(message)
            plan = read_plan(parsed)
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            if code == ExitCode.DOES_NOT_FIT and explains_misfit(parsed):
                return PlannerOutcome("misfit", plan=parsed, message=parsed["message"], exit_code=code,
                                      finished_at=finished)
            return PlannerOutcome("failed", message=f"planner exited {code} but its termination message is not a "
                                  f"valid MemoryPlan: {exc}", exit_code=code, finished_at=finished)
        if code == ExitCode.OK and not plan.fits:
            return PlannerOutcome("failed", message="planner exited 0 with a plan that says it does not fit",
                                  exit_code=code, finished_at=finished)
        return PlannerOutcome("fits" if code == ExitCode.OK else "misfit", plan=plan.document, message=plan.message,
                              exit_code=code, finished_at=finished)
    reason = terminated.get("reason") or "Error"
    what = "bad input" if code == ExitCode.BAD_INPUT else f"exit code {code} ({reason})"
    return PlannerOutcome("failed", message=f"planner failed, {what}: {message or 'no message'}"[:4000],
                          exit_code=code, finished_at=finished)


def _pending_message(status: dict[str, Any]) -> str:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"planner pod not scheduled: {cond.get('message', cond.get('reason', ''))}"
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return (f"planner container {cs.get('name')} waiting: {waiting.get('reason')} "
                    f"{waiting.get('message', '')}").strip()
    return "planner pod is running"


def retry_delay(attempts: int) -> float:
    """Backoff after ``attempts`` failed runs: 10 s doubling to 5 min."""
    return float(min(10 * 2 ** max(attempts - 1, 0), 300))
