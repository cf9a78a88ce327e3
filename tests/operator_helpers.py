"""Shared inputs for operator tests: the repository's example SDDs, MemoryPlans that keep the
contract, and an in-memory API server with a settable clock for the reconciler."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from specdecode_operator import kube as k8s
from specdecode_operator import labels
from specdecode_operator.kube import ApiError
from specdecode_worker.contract import GIB, MemoryPlan, kv_token_capacity, validate_plan

ROOT = Path(__file__).resolve().parents[1]
OWNER = {"apiVersion": "specdecode.io/v1alpha1", "kind": "SpecDecodeDeployment", "name": "llama-8b-eagle3",
         "uid": "u-1", "controller": True, "blockOwnerDeletion": True}


def example(name: str = "spec-deploy.yaml") -> dict:
    """An example SpecDecodeDeployment as the API server would hand it over (namespace, uid, generation)."""
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update(namespace="ns", uid="u-1", generation=1)
    return body


TARGET_COMMIT = "1" * 40
DRAFT_COMMIT = "2" * 40


def hub_sources(target_parts=(6_000_000_000, 5_000_000_000, 5_060_522_496), draft_parts=(849_763_584,)):
    """``plan.sources`` as a hub planner records them for the example's target and draft."""
    return {"target": {"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main", "commit": TARGET_COMMIT,
                       "bytes": sum(target_parts), "partBytes": list(target_parts)},
            "draft": {"repo": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "revision": "main", "commit": DRAFT_COMMIT,
                      "bytes": sum(draft_parts), "partBytes": list(draft_parts)}}


def make_plan(tp=1, fits=True, target=16_060_522_496, draft=849_763_584, f=0.83, g=85_520_809_984, sources=None):
    """A MemoryPlan that satisfies the contract's identity (built with the planner's own formula);
    ``sources``: the hub repositories and commits it was read from."""
    t_cell, d_cell = 131_072 // tp, 4_096 // tp
    tokens = kv_token_capacity(g, f, target // tp, draft // tp, GIB, t_cell, d_cell)
    return validate_plan({
        "apiVersion": "specdecode.io/v1alpha1", "kind": "MemoryPlan", "fits": fits, "algorithm": "EAGLE3",
        "target": "t", "draft": "d", "tensorParallelSize": tp, "gpuMemoryBytes": g, "memFractionStatic": f,
        "weights": {"targetBytes": target // tp, "draftBytes": draft // tp},
        "kvCache": {"targetBytesPerToken": t_cell, "draftBytesPerToken": d_cell, "draftNumLayers": 1,
                    "maxTotalNumTokens": tokens},
        "reserve": {"runtimeBytes": GIB, "dynamicBytes": 2 * GIB, "chunkedPrefillSize": 8192,
                    "cudaGraphMaxBs": 256, "maxRunningRequests": 64},
        "shortfallBytes": 0 if fits else 5 * GIB, "minMemFractionStatic": 0.3,
        "legacy": {"maxTotalNumTokens": tokens, "peakBytes": g}, "layerRatio": {"maxTotalNumTokens": tokens},
        "message": "fits" if fits else "does not fit",
        **({"sources": sources} if sources else {}),
    })


def typed(plan: dict) -> MemoryPlan:
    """The plan as the operator's renderers take it (the reconciler reads status.plan so)."""
    return MemoryPlan.from_dict(plan)


NS = "ns"


class FakeKube:
    """Objects by Ref; resourceVersion checks on status writes; counts what is created.

    ``refuse[(verb, kind)]`` is an ApiError raised on every create/apply of that kind, as the API
    server does while an admission plugin or a quota refuses it.
    """

    def __init__(self):
        self.objects: dict[k8s.Ref, dict] = {}
        self.rv = 0
        self.events: list[tuple[str, str, bool]] = []
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.applied: list[dict] = []
        self.nodes: list[dict] | None = []
        self.conflict_next_status_write = False
        self.refuse: dict[tuple[str, str], ApiError] = {}
        self.pod_conditions: list[tuple[str, dict]] = []

    def _bump(self, obj):
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)

    def _check(self, verb, obj):
        if (verb, obj["kind"]) in self.refuse:
            raise self.refuse[(verb, obj["kind"])]

    def get(self, ref):
        obj = self.objects.get(ref)
        return copy.deepcopy(obj) if obj else None

    def list(self, ref, label_selector=None):
        if ref == k8s.NODES:
            if self.nodes is None:
                raise ApiError(403, "nodes is forbidden")
            return self.nodes
        want = dict(kv.split("=") for kv in label_selector.split(",")) if label_selector else {}
        return [copy.deepcopy(o) for r, o in self.objects.items() if r.collection() == ref.collection()
                and all(o["metadata"].get("labels", {}).get(a) == b for a, b in want.items())]

    def create(self, body):
        self._check("create", body)
        ref = k8s.Ref.of(body)
        if ref in self.objects:
            raise ApiError(409, f"{ref.name} already exists")
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = f"uid-{len(self.created)}"
        obj["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
        obj["status"] = {"phase": "Pending"}
        self._bump(obj)
        self.objects[ref] = obj
        self.created.append(ref.name)
        return obj

    def delete(self, ref):
        if self.objects.pop(ref, None) is not None:
            self.deleted.append(ref.name)

    def apply(self, obj):
        self._check("apply", obj)
        ref = k8s.Ref.of(obj)
        old = self.objects.get(ref)
        new = copy.deepcopy(obj)
        new["status"] = (old or {}).get("status", {})
        gen = (old or {}).get("metadata", {}).get("generation", 0)
        changed = old is None or {k: v for k, v in old.items() if k != "status" and k != "metadata"} != \
            {k: v for k, v in new.items() if k != "status" and k != "metadata"}
        new["metadata"]["generation"] = gen + 1 if changed else gen
        self._bump(new)
        self.objects[ref] = new
        self.applied.append(obj)
        return new

    def write_status(self, sdd, status):
        cur = self.objects[k8s.Ref.of(sdd)]
        if self.conflict_next_status_write or cur["metadata"]["resourceVersion"] != sdd["metadata"]["resourceVersion"]:
            self.conflict_next_status_write = False
            raise ApiError(409, "the object has been modified")
        cur["status"] = copy.deepcopy(status)
        self._bump(cur)
        return cur

    def event(self, sdd, reason, message, warning):
        self.events.append((reason, message, warning))

    def set_pod_condition(self, pod, condition):
        cur = self.objects[k8s.pods(pod["metadata"]["namespace"], pod["metadata"]["name"])]
        conds = [x for x in cur.setdefault("status", {}).get("conditions", []) if x["type"] != condition["type"]]
        cur["status"]["conditions"] = conds + [copy.deepcopy(condition)]
        self._bump(cur)
        self.pod_conditions.append((pod["metadata"]["name"], copy.deepcopy(condition)))
        return copy.deepcopy(cur)

    # --- helpers for tests --------------------------------------------------------------------

    def put_sdd(self, body):
        body = copy.deepcopy(body)
        body.setdefault("apiVersion", "specdecode.io/v1alpha1")
        body.setdefault("kind", "SpecDecodeDeployment")
        key = k8s.Ref.of(body)
        old = self.objects.get(key)
        body["metadata"]["generation"] = (old["metadata"]["generation"] + 1) if old else 1
        if old:
            body["status"] = old.get("status", {})
        self._bump(body)
        self.objects[key] = body

    def sdd(self, name="llama-8b-eagle3"):
        return self.get(k8s.sdd(NS, name))

    def pods(self, role):
        return [o for r, o in self.objects.items() if r.kind == "Pod" and o["metadata"]["labels"][labels.ROLE] == role]

    def finish_planner(self, code, message):
        (pod,) = [p for p in self.pods("planner") if p["status"].get("phase") in ("Pending", "Running")]
        pod["status"] = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [{
            "name": "planner", "state": {"terminated": {"exitCode": code, "message": message,
                                                        "finishedAt": "2026-01-01T00:00:10Z"}}}]}
        return pod

    def deployment(self, name="llama-8b-eagle3"):
        return self.get(k8s.deployment(NS, name))

    def roll_out(self, ready=None):
        """What the Deployment controller and kubelets would report once the pods are up."""
        dep = self.objects[k8s.deployment(NS, "llama-8b-eagle3")]
        n = dep["spec"]["replicas"] if ready is None else ready
        dep["status"] = {"observedGeneration": dep["metadata"]["generation"], "replicas": dep["spec"]["replicas"],
                         "readyReplicas": n, "updatedReplicas": dep["spec"]["replicas"],
                         "conditions": [{"type": "Available", "status": "True" if n else "False"}]}


class Clock:
    def __init__(self, t=1767225600.0):  # 2026-01-01T00:00:00Z
        self.t = t

    def __call__(self):
        return self.t
