"""A local volume provisioner: binds every PersistentVolumeClaim to a folder under pvc_root.

The control plane has no storage driver, and the scheduler keeps pods with unbound claims
Pending. For each Pending claim this creates a hostPath PersistentVolume at
``<pvc_root>/<namespace>/<claim>`` (the same folder the planner runner maps the claim's mount
path to), pre-bound to the claim, so KCM's binder marks both Bound. Released volumes are
deleted; their folders are left for the tests that filled them.
"""

from __future__ import annotations

from pathlib import Path

from .kube import ApiError, KubeClient

PROVISIONER = "specdecode.test/local-path"
STORAGE_CLASS = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": "standard", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
    "provisioner": PROVISIONER,
    "reclaimPolicy": "Delete",
    "volumeBindingMode": "Immediate",
}


def volume_for_claim(claim: dict, pvc_root: Path) -> dict:
    meta, spec = claim["metadata"], claim["spec"]
    folder = pvc_root / meta["namespace"] / meta["name"]
    size = spec.get("resources", {}).get("requests", {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": spec.get("storageClassName") or "",
            "volumeMode": spec.get("volumeMode", "Filesystem"),
            "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                         "name": meta["name"], "uid": meta["uid"]},
        },
    }


def sync_volumes(client: KubeClient, pvc_root: Path) -> None:
    """One pass: provision Pending claims, delete our Released volumes."""
    volumes = client.get("/api/v1/persistentvolumes")["items"]
    claimed = {v["spec"].get("claimRef", {}).get("uid") for v in volumes}
    for claim in client.get("/api/v1/persistentvolumeclaims")["items"]:
        if claim.get("status", {}).get("phase") != "Pending" or claim["spec"].get("volumeName"):
            continue
        if claim["metadata"].get("deletionTimestamp") or claim["metadata"]["uid"] in claimed:
            continue
        pv = volume_for_claim(claim, pvc_root)
        Path(pv["spec"]["hostPath"]["path"]).mkdir(parents=True, exist_ok=True)
        try:
            client.create("/api/v1/persistentvolumes", pv)
        except ApiError as exc:
            if exc.status != 409:
                raise
    for v in volumes:
        ours = v["metadata"].get("annotations", {}).get("pv.kubernetes.io/provisioned-by") == PROVISIONER
        if ours and v.get("status", {}).get("phase") == "Released":
            try:
                client.request("DELETE", f"/api/v1/persistentvolumes/{v['metadata']['name']}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
