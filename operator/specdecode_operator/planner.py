"""The planner pod: what it runs, what its terminated container says, and ``PlannerDriver``, which
runs it one step per reconcile; then status.plan, as the Planned condition and the worker read it.

The pod runs ``specdecode-worker plan`` once (restartPolicy Never) and writes the MemoryPlan JSON to
its termination log; the operator never reads tensor data or needs a GPU itself.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from specdecode_worker.contract import (
    DEFAULT_ENGINE,
    EAGLE_ALGORITHMS,
    GIB,
    PLAN_API_VERSION,
    PLAN_KIND,
    ExitCode,
    MemoryPlan,
)

from . import conditions as c
from . import kube as k8s
from . import labels, models, podsecurity
from .kube import ApiError, Kube, epoch
from .nodecapacity import NodeCapacity
from .plan_result import explains_misfit, read_plan
from .refusals import RefusalBook
from .spec import DEFAULT_MAX_TP, DEFAULT_VERIFY_WIDTH, SpecView, draft_proposals, planner_pod_name, verify_width

TERMINATION_LOG = "/dev/termination-log"
# A planner that reads a few headers finishes in seconds; a hung one must not block forever.
ACTIVE_DEADLINE_SECONDS = 900
# A planner pod not finished (or just restarted) is read again after this; its pod events also trigger a read.
POLL_SECONDS = 30.0

log = logging.getLogger(__name__)


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


# --- the driver ------------------------------------------------------------------------------------

class PlannerDriver:
    """One planner pod per plan key: created, read, and after a failure run again with backoff.
    status.planner is its bookkeeping; the GPUs per node it told the planner come from ``nodes``."""

    def __init__(self, kube: Kube, nodes: NodeCapacity, refusals: RefusalBook,
                 clock: Callable[[], float] = time.time):
        self.kube = kube
        self.nodes = nodes
        self.refusals = refusals
        self.clock = clock

    def step(self, view: SpecView, key: str, owner: dict[str, Any],
             status: dict[str, Any]) -> tuple[dict[str, Any] | None, c.Verdict, float | None]:
        """Drive the planner pod one step. Returns (status.plan or None, Planned, requeue delay)."""
        name = planner_pod_name(view, key)
        pod_ref = k8s.pods(view.namespace, name)
        tracker = status.get("planner") or {}
        if tracker.get("key") != key:
            tracker = {"key": key, "attempts": 0}
        tracker["pod"] = name
        status["planner"] = tracker
        pod = self.kube.get(pod_ref)
        if pod is None:
            try:
                self._create(view, key, owner, pod_ref, tracker)
            except ApiError as exc:
                return None, self.refusals.verdict(view, f"planner pod {name}", exc), None
            started = c.Verdict("Unknown", c.PLANNING, _with_note(f"planner pod {name} started", tracker))
            return None, started, POLL_SECONDS
        outcome = read_outcome(pod)
        if outcome.state == "fits" and view.hub:  # workers pin the commits the plan read
            try:
                models.sources(view, MemoryPlan.from_dict(outcome.plan))
            except ValueError as exc:
                outcome = replace(outcome, state="failed", message=str(exc))
        if outcome.state in ("pending", "running"):
            return None, c.Verdict("Unknown", c.PLANNING, f"{name}: {outcome.message}"), POLL_SECONDS
        if outcome.state in ("fits", "misfit"):
            record = dict(outcome.plan or {})
            record.pop("apiVersion", None)
            record.pop("kind", None)
            record["key"] = key
            record["plannerPod"] = name
            status["plan"] = record
            tracker["attempts"] = 0
            tracker.pop("failedPodUID", None)
            return record, planned_verdict(record, tracker), None
        # failed: count each failed pod once (by uid), back off, then run it again
        uid = (pod.get("metadata") or {}).get("uid")
        if tracker.get("failedPodUID") != uid:
            tracker["attempts"] = int(tracker.get("attempts", 0)) + 1
            tracker["failedPodUID"] = uid
        attempts = tracker["attempts"]
        delay = retry_delay(attempts)
        finished = epoch(outcome.finished_at) or epoch((pod.get("metadata") or {}).get("creationTimestamp"))
        wait = (finished or self.clock()) + delay - self.clock()
        if wait <= 0:
            self.kube.delete(pod_ref)
            try:
                self._create(view, key, owner, pod_ref, tracker)
            except ApiError as exc:
                if exc.status != 409:  # 409: the old pod is still terminating, next time
                    return None, self.refusals.verdict(view, f"planner pod {name}", exc), None
            wait = POLL_SECONDS
            message = f"{outcome.message} (attempt {attempts} failed; planner pod restarted)"
        else:
            message = f"{outcome.message} (attempt {attempts} failed; retrying in {int(wait + 0.999)}s)"
        return None, c.Verdict("False", c.PLANNER_FAILED, message), max(wait, 1.0)

    def _create(self, view: SpecView, key: str, owner: dict[str, Any], pod_ref: k8s.Ref,
                tracker: dict[str, Any]) -> dict[str, Any]:
        """The planner pod, told the GPUs per node (recorded in ``tracker``, i.e. status.planner)."""
        per_node = self.nodes.per_node(view)
        tracker.update(gpusPerNode=per_node.count, gpusPerNodeFrom=per_node.source)
        if per_node.note:
            tracker["gpusPerNodeMessage"] = per_node.note
        else:
            tracker.pop("gpusPerNodeMessage", None)
        body = render_planner_pod(view, key, owner, per_node.planner_flag)
        try:
            created = self.kube.create(body)
            log.info("%s/%s planner pod %s created for plan key %s", view.namespace, view.name,
                     body["metadata"]["name"], key)
            return created
        except ApiError as exc:
            if exc.status == 409:  # created by an earlier run of this reconcile
                return self.kube.get(pod_ref) or body
            raise

    def cleanup(self, view: SpecView, key: str) -> None:
        """Planner pods of earlier plan keys; the current one stays for `kubectl logs`."""
        pods = self.kube.list(k8s.pods(view.namespace),
                              f"{labels.NAME}={view.name},{labels.ROLE}={labels.ROLE_PLANNER}")
        for pod in pods:
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get(labels.PLAN_KEY) != key:
                self.kube.delete(k8s.pods(view.namespace, meta["name"]))


# --- status.plan -----------------------------------------------------------------------------------

def plan_body(record: dict[str, Any]) -> dict[str, Any]:
    """The MemoryPlan as the planner wrote it (what the worker's --plan reads) from status.plan."""
    body = {k: v for k, v in record.items() if k not in ("key", "plannerPod")}
    return {"apiVersion": PLAN_API_VERSION, "kind": PLAN_KIND, **body}


def planned_verdict(record: dict[str, Any], tracker: dict[str, Any] | None = None) -> c.Verdict:
    """Planned from status.plan, with where its GPUs per node came from (``status.planner``).

    Read from the dict: a misfit plan's numbers may be out of the contract's range.
    """
    if (tracker or {}).get("key") != record.get("key"):
        tracker = None
    if record.get("fits"):
        return c.Verdict("True", c.PLAN_READY, _with_note(record.get("message", "plan ready"), tracker))
    short = record.get("shortfallBytes", 0)
    return c.Verdict("False", c.INSUFFICIENT_GPU_MEMORY, _with_note(
        f"{in_spec_terms(record.get('message', 'the models do not fit'))} (short by {short / GIB:.2f} GiB "
        f"= {short} bytes per GPU)", tracker))


def _with_note(message: str, tracker: dict[str, Any] | None) -> str:
    note = (tracker or {}).get("gpusPerNodeMessage")
    return f"{message}; {note}" if note else message


def one_node_hint(tp: int, tracker: dict[str, Any] | None) -> str:
    """What keeps a replica of ``tp`` GPUs on one node, given the GPUs per node it was planned for."""
    if tp > DEFAULT_MAX_TP:
        return f"gpu.maxPerReplica {DEFAULT_MAX_TP} or less"
    per_node = (tracker or {}).get("gpusPerNode")
    planned_for = f" (planned for {per_node} GPUs per node, from {(tracker or {}).get('gpusPerNodeFrom')})" \
        if per_node else ""
    return f"nodes with {tp} GPUs of gpu.product{planned_for}, or a gpu.product with more memory per GPU"


# The planner speaks in CLI flags; a user of the SDD changes spec fields.
_FLAG_TO_FIELD = (
    ("--kv-cache-dtype ", "spec.serving.kvCacheDtype: "),
    ("--mem-fraction-static ", "spec.serving.memFractionStatic: "),
    ("--context-length", "spec.serving.contextLength"),
    ("--min-kv-tokens", "spec.serving.minKVTokens"),
    ("--max-running-requests", "spec.serving.maxRunningRequests"),
    ("--gpu-memory-gib", "spec.gpu.memoryGiB"),
    ("--tp ", "tensor parallelism "),
)


def in_spec_terms(message: str) -> str:
    for flag, field in _FLAG_TO_FIELD:
        message = message.replace(flag, field)
    return message
