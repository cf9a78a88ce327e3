"""The worker children rendered from (spec, plan): ConfigMap with the plan, Deployment, Service.

Pure functions: the operator applies what they return with server-side apply. Everything the
worker must honour is pinned from the plan (tensor parallelism, memory fraction, KV token count),
so a worker never re-derives a budget the planner already fixed.
"""

from __future__ import annotations

import json
import math
from typing import Any

from specdecode_worker.contract import (
    DEFAULT_ENGINE, EAGLE_ALGORITHMS, GIB, MIB, MemoryPlan, sglang_flags, vllm_flags,
)

from . import labels, models, podsecurity
from .spec import SpecView, draft_proposals

HTTP_PORT = 8000
PLAN_DIR = "/etc/specdecode"
PLAN_FILE = "plan.json"
# Host memory beyond the weights: Python, tokenizer, pinned buffers.
HOST_MEMORY_HEADROOM = 2 * GIB
# Slowest weight loading we plan the startup probe for (network volumes), and a fixed allowance
# for CUDA graphs and backend initialisation.
LOAD_BYTES_PER_SECOND = 200 * MIB
STARTUP_FIXED_SECONDS = 300
STARTUP_PERIOD_SECONDS = 10
SHM_SIZE = "16Gi"


def configmap_name(view: SpecView) -> str:
    return f"{view.name}-plan"


def render_configmap(view: SpecView, plan: MemoryPlan, key: str, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(view),
            "namespace": view.namespace,
            "labels": labels.common(view.name, labels.ROLE_WORKER) | {labels.PLAN_KEY: key},
            "ownerReferences": [owner],
        },
        # The planner's document as it wrote it: the worker's --plan checks its flags against it.
        "data": {PLAN_FILE: json.dumps(plan.document, separators=(",", ":"))},
    }


def _planned(value: int | None, spec_value: int | None) -> int | None:
    """The plan's number where it records one (plans written before lack it), else the spec's."""
    return spec_value if value is None else value


def worker_args(view: SpecView, plan: MemoryPlan) -> list[str]:
    """``specdecode-worker serve`` arguments: the plan's numbers, pinned."""
    s, reserve = view.serving, plan.reserve
    target_dir, draft_dir = models.model_dirs(view, plan)
    args = ["serve", "--target", target_dir]
    if draft_dir:
        args += ["--draft", draft_dir]
    args += [
        "--algorithm", view.algorithm,
        "--plan", f"{PLAN_DIR}/{PLAN_FILE}",
        "--device", "cuda",
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--tp", str(plan.tensor_parallel_size),
        "--mem-fraction-static", repr(float(plan.mem_fraction_static)),
        "--max-total-tokens", str(plan.kv_cache.max_total_num_tokens),
        "--context-length", str(s.context_length),
        "--kv-cache-dtype", s.kv_cache_dtype,
        "--max-running-requests", str(_planned(reserve.max_running_requests, s.max_running_requests)),
    ]
    graph_bs = _planned(reserve.cuda_graph_max_bs, s.cuda_graph_max_batch_size)
    if graph_bs is not None:
        args += ["--cuda-graph-max-bs", str(graph_bs)]
    chunk = _planned(reserve.chunked_prefill_size, s.chunked_prefill_size)
    if chunk is not None:
        args += ["--chunked-prefill-size", str(chunk)]
    args += ["--dtype", view.target_dtype, "--num-draft-tokens", str(draft_proposals(view)),
             "--spec-policy", view.spec_policy]
    if not s.prefix_cache:
        args.append("--disable-prefix-cache")
    if view.algorithm in EAGLE_ALGORITHMS:
        args += ["--speculative-num-steps", str(view.num_steps), "--speculative-eagle-topk", str(view.top_k)]
    return args


# How each engine's own image starts its OpenAI server, and its health endpoint.
ENGINE_COMMANDS = {
    DEFAULT_ENGINE: ["specdecode-worker"],
    # `vllm serve` looks its version up under the distribution name and fails on the CPU build.
    "vllm": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
    "sglang": ["python3", "-m", "sglang.launch_server"],
}
ENGINE_ENV = {
    DEFAULT_ENGINE: [],
    "vllm": [{"name": "VLLM_NO_USAGE_STATS", "value": "1"}, {"name": "HF_HUB_OFFLINE", "value": "1"}],
    "sglang": [{"name": "SGLANG_DISABLE_USAGE_STATS", "value": "1"}, {"name": "HF_HUB_OFFLINE", "value": "1"}],
}


def engine_args(view: SpecView, plan: MemoryPlan) -> list[str]:
    """The engine's own server arguments: every planned number pinned, then runtime.extraArgs."""
    if view.engine == DEFAULT_ENGINE:
        return worker_args(view, plan)
    s, reserve = view.serving, plan.reserve
    target_dir, draft_dir = models.model_dirs(view, plan)
    common = dict(
        target_dir=target_dir, served_name=view.target.model, draft_dir=draft_dir, algorithm=view.algorithm,
        plan=plan, context_length=s.context_length,
        max_running=int(_planned(reserve.max_running_requests, s.max_running_requests)),
        chunk=int(reserve.chunked_prefill_size or s.chunked_prefill_size or s.context_length),
        graph_bs=int(reserve.cuda_graph_max_bs or s.cuda_graph_max_batch_size or 1),
        kv_cache_dtype=s.kv_cache_dtype, dtype=view.target_dtype, port=HTTP_PORT, prefix_cache=s.prefix_cache,
    )
    if view.engine == "vllm":
        args = vllm_flags.args(proposals=draft_proposals(view), **common)
    else:
        args = sglang_flags.args(num_steps=view.num_steps, proposals=draft_proposals(view), **common)
    return args + list(view.runtime.extra_args)


def weight_bytes_per_gpu(plan: MemoryPlan) -> int:
    """Target and draft weights one rank holds."""
    return plan.weights.target_bytes + plan.weights.draft_bytes


def host_memory_request(view: SpecView, plan: MemoryPlan) -> str:
    """The user's value, else every rank's weights plus headroom (weights pass through host memory)."""
    if view.memory:
        return view.memory
    total = weight_bytes_per_gpu(plan) * plan.tensor_parallel_size + HOST_MEMORY_HEADROOM
    return f"{math.ceil(total / GIB)}Gi"


def startup_failure_threshold(plan: MemoryPlan) -> int:
    """Probe attempts covering loading every weight at the slowest expected rate, plus init."""
    total = weight_bytes_per_gpu(plan) * plan.tensor_parallel_size
    seconds = STARTUP_FIXED_SECONDS + total / LOAD_BYTES_PER_SECOND
    return max(30, math.ceil(seconds / STARTUP_PERIOD_SECONDS))


def render_deployment(view: SpecView, plan: MemoryPlan, key: str, owner: dict[str, Any],
                      generation: int = 0) -> dict[str, Any]:
    tp = plan.tensor_parallel_size
    pod_labels = dict(view.pod.get("labels") or {}) | labels.common(view.name, labels.ROLE_WORKER)
    annotations = dict(view.pod.get("annotations") or {}) | {labels.PLAN_KEY: key}
    requests: dict[str, Any] = {"cpu": view.cpu or "2", "memory": host_memory_request(view, plan)}
    ours = view.engine == DEFAULT_ENGINE
    volumes = models.volumes(view) + [{"name": "plan", "configMap": {"name": configmap_name(view)}}]
    mounts = [models.mount(), {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True}]
    if tp > 1 or not ours:  # NCCL's shared-memory transport between ranks; the engines' IPC
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    container = {
        "name": "worker",
        "image": view.worker_image,
        "imagePullPolicy": view.image_pull_policy,
        "command": ENGINE_COMMANDS[view.engine],
        "args": engine_args(view, plan),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": {"requests": requests, "limits": {"nvidia.com/gpu": tp}},
        "volumeMounts": mounts,
        "startupProbe": probe | {"periodSeconds": STARTUP_PERIOD_SECONDS,
                                 "failureThreshold": startup_failure_threshold(plan), "timeoutSeconds": 5},
        "readinessProbe": probe | {"periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5},
        "livenessProbe": probe | {"periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": 10},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if ENGINE_ENV[view.engine]:
        container["env"] = ENGINE_ENV[view.engine]
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        + list(view.pod.get("tolerations") or []),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
    }
    if not ours:  # Ready only once the engine reports the planned KV tokens
        pod_spec["readinessGates"] = [{"conditionType": labels.KV_VERIFIED}]
    init = models.fetch_init_containers(view, plan)
    if init:
        pod_spec["initContainers"] = init
    node_selector = dict(view.pod.get("nodeSelector") or {})
    if view.gpu_product:
        node_selector["nvidia.com/gpu.product"] = view.gpu_product
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    for k in ("affinity", "imagePullSecrets", "serviceAccountName"):
        if view.pod.get(k):
            pod_spec[k] = view.pod[k]
    startup_budget = startup_failure_threshold(plan) * STARTUP_PERIOD_SECONDS
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": view.name,
            "namespace": view.namespace,
            "labels": labels.common(view.name, labels.ROLE_WORKER),
            "annotations": {labels.PLAN_KEY: key, labels.GENERATION: str(generation)},
            "ownerReferences": [owner],
        },
        "spec": {
            "replicas": view.replicas,
            "selector": {"matchLabels": labels.selector(view.name)},
            "revisionHistoryLimit": 3,
            # Progress is judged only after the slowest weight load had its chance.
            "progressDeadlineSeconds": startup_budget + 300,
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations},
                         "spec": podsecurity.restrict(pod_spec, view.pod.get("securityContext"))},
        },
    }


def render_service(view: SpecView, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": view.name,
            "namespace": view.namespace,
            "labels": labels.common(view.name, labels.ROLE_WORKER),
            "ownerReferences": [owner],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": labels.selector(view.name),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_children(view: SpecView, plan: MemoryPlan, key: str, owner: dict[str, Any],
                    generation: int = 0) -> list[dict[str, Any]]:
    """In apply order: the plan ConfigMap before the Deployment that mounts it."""
    return [render_configmap(view, plan, key, owner), render_deployment(view, plan, key, owner, generation),
            render_service(view, owner)]
