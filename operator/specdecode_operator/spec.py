"""A typed, defaulted view of a SpecDecodeDeployment spec, and the plan key.

The API server applies the CRD's defaults, but the operator must also cope with objects written
before a default existed, so every default lives here too (and a unit test keeps the two equal).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode_worker.contract import DEFAULT_ENGINE, DEFAULT_MAX_TP, VERIFY_TOKENS

GROUP = "specdecode.io"
VERSION = "v1alpha1"
PLURAL = "specdecodedeployments"
KIND = "SpecDecodeDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

MODELS_MOUNT = "/models"
DEFAULT_WORKER_IMAGE = "ghcr.io/specdecode/worker:0.1.0"
NGRAM_DEFAULT_DRAFT_TOKENS = 8
# The engines' own images, run unmodified, at the versions whose sizing rules the planner holds.
DEFAULT_ENGINE_IMAGES = {"vllm": "vllm/vllm-openai:v0.32.0", "sglang": "lmsysorg/sglang:v0.5.23"}
DEFAULT_VERIFY_WIDTH = VERIFY_TOKENS  # the width the planner assumes when it is not told one


@dataclass(frozen=True)
class ModelRef:
    model: str
    revision: str | None = None


@dataclass(frozen=True)
class HubCache:
    """``modelStore.hub.cache``: an existing claim, or one the operator creates (``create``)."""

    claim_name: str | None = None
    create: bool = False
    storage_class: str | None = None
    access_mode: str = "ReadWriteMany"
    size: str | None = None  # None: the plan's weight bytes plus a margin


@dataclass(frozen=True)
class Serving:
    context_length: int = 8192
    max_running_requests: int = 64
    min_kv_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float | None = None
    cuda_graph_max_batch_size: int | None = None
    chunked_prefill_size: int | None = None
    prefix_cache: bool = True  # prompts that start as an earlier one did reuse its KV


@dataclass(frozen=True)
class Runtime:
    """``spec.runtime``: the engine the worker pods run."""

    engine: str = DEFAULT_ENGINE
    image: str | None = None  # vllm/sglang: the engine's image (specdecode uses spec.image)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecView:
    """The spec with defaults applied, in the operator's terms."""

    name: str
    namespace: str
    replicas: int
    target: ModelRef
    target_dtype: str
    algorithm: str
    draft: ModelRef | None
    num_steps: int
    top_k: int
    num_draft_tokens: int
    serving: Serving
    gpu_product: str | None
    gpu_memory_gib: float | None
    gpu_max_per_replica: int | None
    gpu_per_node: int | None
    pvc_claim: str | None
    hub: dict[str, Any] | None
    image: str
    image_pull_policy: str
    cpu: str | None
    memory: str | None
    pod: dict[str, Any] = field(default_factory=dict)
    planner_image: str = ""
    planner_request_gpu: bool = False
    planner_resources: dict[str, Any] = field(default_factory=dict)
    spec_policy: str = "adaptive"  # draft.policy.mode: adaptive or fixed draft lengths
    hub_cache: HubCache | None = None
    runtime: Runtime = field(default_factory=Runtime)

    @property
    def engine(self) -> str:
        return self.runtime.engine

    @property
    def worker_image(self) -> str:
        """The image worker pods run: the engine's own for vllm and sglang."""
        if self.engine == DEFAULT_ENGINE:
            return self.image
        return self.runtime.image or DEFAULT_ENGINE_IMAGES[self.engine]

    def model_path(self, ref: ModelRef) -> str:
        """Where a model's files are inside a pod (the store is mounted at /models)."""
        return f"{MODELS_MOUNT}/{ref.model.strip('/')}"

    @property
    def hub_draft(self) -> ModelRef | None:
        """The draft repository a hub store plans and downloads; MTP without a draft uses the
        target's own checkpoint (the planner's default), NGRAM has none."""
        return None if self.algorithm == "NGRAM" else self.draft

    @property
    def planner_max_tp(self) -> int:
        """The largest t the planner may choose: 8, or more where gpu.maxPerReplica allows it.

        A smaller maxPerReplica does not shrink the plan: a plan above it is reported as
        PlanExceedsNodeGPUs, which says what to change.
        """
        return max(DEFAULT_MAX_TP, self.gpu_max_per_replica or 0)

    @property
    def draft_dir(self) -> str | None:
        """The planner's and worker's --draft directory: MTP defaults to the target's checkpoint."""
        if self.algorithm == "NGRAM":
            return None
        if self.draft is None:
            return self.model_path(self.target) if self.algorithm == "MTP" else None
        return self.model_path(self.draft)


def _quantity(value: Any) -> str | None:
    return None if value is None else str(value)


def parse_spec(body: dict[str, Any], default_image: str = DEFAULT_WORKER_IMAGE) -> SpecView:
    """Build the view from a full SDD object (``metadata`` and ``spec``)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    target = spec.get("target") or {}
    draft = spec.get("draft") or {}
    serving = spec.get("serving") or {}
    gpu = spec.get("gpu") or {}
    store = spec.get("modelStore") or {}
    planner = spec.get("planner") or {}
    resources = spec.get("resources") or {}
    runtime = spec.get("runtime") or {}

    algorithm = draft.get("algorithm", "")
    num_steps = int(draft.get("numSteps", 3))
    top_k = int(draft.get("topK", 1))
    if draft.get("numDraftTokens") is not None:
        num_draft_tokens = int(draft["numDraftTokens"])
    elif algorithm == "NGRAM":
        num_draft_tokens = NGRAM_DEFAULT_DRAFT_TOKENS
    else:
        num_draft_tokens = num_steps + 1
    image = spec.get("image") or default_image
    return SpecView(
        name=meta.get("name", ""),
        namespace=meta.get("namespace", "default"),
        replicas=int(spec.get("replicas", 1)),
        target=ModelRef(target.get("model", ""), target.get("revision")),
        target_dtype=target.get("dtype", "auto"),
        algorithm=algorithm,
        draft=ModelRef(draft["model"], draft.get("revision")) if draft.get("model") else None,
        num_steps=num_steps,
        top_k=top_k,
        num_draft_tokens=num_draft_tokens,
        spec_policy=(draft.get("policy") or {}).get("mode", "adaptive"),
        serving=Serving(
            context_length=int(serving.get("contextLength", 8192)),
            max_running_requests=int(serving.get("maxRunningRequests", 64)),
            min_kv_tokens=serving.get("minKVTokens"),
            kv_cache_dtype=serving.get("kvCacheDtype", "auto"),
            mem_fraction_static=serving.get("memFractionStatic"),
            cuda_graph_max_batch_size=serving.get("cudaGraphMaxBatchSize"),
            chunked_prefill_size=serving.get("chunkedPrefillSize"),
            prefix_cache=serving.get("prefixCache", True),
        ),
        gpu_product=gpu.get("product"),
        gpu_memory_gib=gpu.get("memoryGiB"),
        gpu_max_per_replica=gpu.get("maxPerReplica"),
        gpu_per_node=gpu.get("perNode"),
        pvc_claim=(store.get("pvc") or {}).get("claimName"),
        hub=store.get("hub"),
        image=image,
        image_pull_policy=spec.get("imagePullPolicy", "IfNotPresent"),
        cpu=_quantity(resources.get("cpu")),
        memory=_quantity(resources.get("memory")),
        pod=dict(spec.get("pod") or {}),
        planner_image=planner.get("image") or image,
        planner_request_gpu=bool(planner.get("requestGPU", False)),
        planner_resources=dict(planner.get("resources") or {}),
        hub_cache=_hub_cache((store.get("hub") or {}).get("cache")),
        runtime=Runtime(engine=runtime.get("engine") or DEFAULT_ENGINE, image=runtime.get("image") or None,
                        extra_args=tuple(runtime.get("extraArgs") or ())),
    )


def _hub_cache(cache: dict[str, Any] | None) -> HubCache | None:
    if not cache:
        return None
    create = cache.get("create")
    if create is None:
        return HubCache(claim_name=cache.get("claimName"))
    return HubCache(create=True, storage_class=create.get("storageClassName"),
                    access_mode=create.get("accessMode", "ReadWriteMany"), size=_quantity(create.get("size")))


def planner_inputs(view: SpecView) -> dict[str, Any]:
    """Everything the plan depends on: models and revisions, dtypes, algorithm, serving limits,
    GPU memory source and the planner image. Replicas, pod overrides and host resources are not
    here, so changing them never re-plans."""
    return {
        "target": asdict(view.target),
        "targetDtype": view.target_dtype,
        "algorithm": view.algorithm,
        "draft": asdict(view.draft) if view.draft else None,
        "serving": asdict(view.serving),
        "gpu": {
            "product": view.gpu_product,
            "memoryGiB": view.gpu_memory_gib,
            "measured": view.planner_request_gpu,
            # Only what moves the plan beyond one 8-GPU node, so existing plans keep their keys.
            **({"maxTp": view.planner_max_tp} if view.planner_max_tp > DEFAULT_MAX_TP else {}),
            **({"perNode": view.gpu_per_node} if view.gpu_per_node is not None else {}),
        },
        # A hub store plans from headers over HTTP and records the commits it read (plan.sources);
        # the cache is not an input: it holds the same files.
        "store": {"pvc": view.pvc_claim, "hub": (view.hub or {}).get("endpoint") if view.hub else None,
                  **({"hubPlanning": "headers"} if view.hub else {})},
        "plannerImage": view.planner_image,
        # Only a width other than the planner's default, so existing plans keep their keys.
        **({"verifyWidth": verify_width(view)} if verify_width(view) != DEFAULT_VERIFY_WIDTH else {}),
        # Another engine restates the plan in its own arithmetic; specdecode plans keep their keys.
        **({"engine": view.engine} if view.engine != DEFAULT_ENGINE else {}),
        # A dtype other than auto is priced by the planner (--dtype): plans made before it was are
        # re-made, auto plans keep their keys.
        **({"pricedDtype": view.target_dtype} if view.target_dtype != "auto" else {}),
    }


def draft_proposals(view: SpecView) -> int:
    """Tokens the worker proposes per verify round.

    The spec's numDraftTokens counts the verified root as well (numSteps + 1 for a chain); the
    worker counts proposals only: numSteps for a chain, the tree's nodes below the root for an
    EAGLE tree, numDraftTokens for NGRAM (it has no root of its own).
    """
    if view.algorithm == "NGRAM":
        return view.num_draft_tokens
    if view.top_k > 1:
        return view.num_draft_tokens - 1
    return view.num_steps


def verify_width(view: SpecView) -> int:
    """Rows per request of the worker's verify batches (and of their CUDA graphs): proposals + 1."""
    return draft_proposals(view) + 1


def plan_key(view: SpecView) -> str:
    """A stable hash of ``planner_inputs``: a new plan is made only when it changes."""
    canonical = json.dumps(planner_inputs(view), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def planner_pod_name(view: SpecView, key: str) -> str:
    """Deterministic, so a restarted operator finds the pod it already created."""
    return f"{_truncate(view.name, 253 - 14)}-plan-{key[:8]}"


def _truncate(name: str, limit: int) -> str:
    return name if len(name) <= limit else name[:limit].rstrip("-.")
