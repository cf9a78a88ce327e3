"""How pods reach the model files.

- ``modelStore.pvc``: the claim, mounted read-only at /models; models are folders in it.
- ``modelStore.hub`` with a ``cache``: the cache claim, mounted read-only at /models; a download Job
  (modelcache.py) has put each model at ``/models/<owner>/<name>/<commit>`` before any worker starts.
- ``modelStore.hub`` without a cache: an emptyDir at /models that init containers fill at every pod
  start (every replica and every restart downloads the whole model again: for small models only).

The planner of a hub store mounts nothing: it reads configs and safetensors headers over HTTP.
Hub pods pin the commit the plan read (``plan.sources``), so a moved branch never changes what runs.
"""

from __future__ import annotations

from typing import Any

from specdecode_worker.contract import MemoryPlan, PlanSource

from .spec import MODELS_MOUNT, SpecView

VOLUME = "models"
TERMINATION_LOG = "/dev/termination-log"
TARGET, DRAFT = "target", "draft"


def hub_env(view: SpecView) -> list[dict[str, Any]]:
    """Endpoint and token for huggingface_hub: the token only as a Secret reference, so it never
    appears in a pod spec, a log line of ours, an Event or the status."""
    hub = view.hub or {}
    env: list[dict[str, Any]] = []
    if hub.get("endpoint"):
        env.append({"name": "HF_ENDPOINT", "value": hub["endpoint"]})
    secret = hub.get("tokenSecret")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", "token")}}})
    # No usage reports to the public hub from inside a cluster.
    env.append({"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"})
    return env


def sources(view: SpecView, plan: MemoryPlan) -> dict[str, PlanSource]:
    """The hub repositories the plan read, by role (target, and draft unless MTP reuses the target
    or NGRAM has none): each with repo, commit, bytes and part_bytes.

    Raises ValueError when the plan does not record them (a planner image without hub planning).
    """
    recorded = {TARGET: plan.sources.target, DRAFT: plan.sources.draft} if plan.sources else {}
    roles = [TARGET] + ([DRAFT] if view.hub_draft is not None else [])
    out = {}
    for role in roles:
        src = recorded.get(role)
        if src is None or not src.repo:  # the contract checked the commit of a recorded source
            raise ValueError(f"the plan records no hub commit for the {role} model: the planner image "
                             f"({view.planner_image}) predates planning from the hub; use a newer worker image")
        out[role] = src
    return out


def cache_dir(repo: str, commit: str) -> str:
    """Where a downloaded model lives inside a pod: the cache layout ``<owner>/<name>/<commit>``."""
    return f"{MODELS_MOUNT}/{repo.strip('/')}/{commit}"


def model_dirs(view: SpecView, plan: MemoryPlan) -> tuple[str, str | None]:
    """The worker's --target and --draft folders."""
    if not view.hub:
        return view.model_path(view.target), view.draft_dir
    found = sources(view, plan)
    target = cache_dir(found[TARGET].repo, found[TARGET].commit)
    if view.algorithm == "NGRAM":
        return target, None
    if DRAFT in found:
        return target, cache_dir(found[DRAFT].repo, found[DRAFT].commit)
    return target, target  # MTP drafts with the target's own NextN layers


def volumes(view: SpecView) -> list[dict[str, Any]]:
    claim = view.pvc_claim or cache_claim(view)
    if claim:
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]
    return [{"name": VOLUME, "emptyDir": {}}]


def cache_claim(view: SpecView) -> str | None:
    """The PVC that caches hub downloads, or None without a cache."""
    cache = view.hub_cache if view.hub else None
    if cache is None:
        return None
    return f"{view.name}-model-cache" if cache.create else cache.claim_name


def mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MODELS_MOUNT, "readOnly": True}


def fetch_args(repo: str, commit: str, parts: int | None = None) -> list[str]:
    """``specdecode-worker fetch`` of one model at the plan's commit (one part of it with ``parts``:
    the Job's index from $JOB_COMPLETION_INDEX)."""
    args = ["fetch", "--repo", repo, "--commit", commit, "--dest", cache_dir(repo, commit)]
    if parts is not None:
        args += ["--parts", str(parts), "--part", "env"]
    return args + ["--termination-log", TERMINATION_LOG]


def fetch_init_containers(view: SpecView, plan: MemoryPlan) -> list[dict[str, Any]]:
    """A hub store without a cache: each worker pod downloads its models before it starts."""
    if not view.hub or cache_claim(view):
        return []
    return [{
        "name": f"fetch-{role}",
        "image": view.image,
        "imagePullPolicy": view.image_pull_policy,
        "command": ["specdecode-worker"],
        "args": fetch_args(src.repo, src.commit),
        "env": hub_env(view),
        "volumeMounts": [{"name": VOLUME, "mountPath": MODELS_MOUNT}],
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    } for role, src in sources(view, plan).items()]
