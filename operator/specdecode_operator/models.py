"""How pods reach the model files: a read-only PVC at /models, or a hub download into a cache."""

from __future__ import annotations

from typing import Any

from .spec import MODELS_MOUNT, SpecView

VOLUME = "models"

# Runs in the worker image (huggingface_hub comes with transformers).
_FETCH = (
    "import os, sys\n"
    "from huggingface_hub import snapshot_download\n"
    "for spec in sys.argv[1:]:\n"
    "    repo, _, rev = spec.partition('@')\n"
    "    snapshot_download(repo, revision=rev or None, local_dir=os.path.join('/models', repo),\n"
    "                      allow_patterns=os.environ.get('SPECDECODE_FETCH_PATTERNS', '*').split(','))\n"
)


def volumes(view: SpecView) -> list[dict[str, Any]]:
    if view.pvc_claim:
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": view.pvc_claim, "readOnly": True}}]
    return [{"name": VOLUME, "emptyDir": {}}]


def mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MODELS_MOUNT, "readOnly": True}


def fetch_init_containers(view: SpecView, image: str, patterns: str = "*") -> list[dict[str, Any]]:
    """For a hub store: download the models before the main container starts."""
    if not view.hub:
        return []
    refs = [view.target] + ([view.draft] if view.draft else [])
    env: list[dict[str, Any]] = [{"name": "SPECDECODE_FETCH_PATTERNS", "value": patterns}]
    if view.hub.get("endpoint"):
        env.append({"name": "HF_ENDPOINT", "value": view.hub["endpoint"]})
    secret = view.hub.get("tokenSecret")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key", "token")}}})
    return [{
        "name": "fetch-models",
        "image": image,
        "command": ["python", "-c", _FETCH],
        "args": [r.model + (f"@{r.revision}" if r.revision else "") for r in refs],
        "env": env,
        "volumeMounts": [{"name": VOLUME, "mountPath": MODELS_MOUNT}],
    }]
