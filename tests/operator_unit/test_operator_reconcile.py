"""The reconciler against an in-memory API: the planner pod lifecycle, children, scaling,
re-planning, failures with backoff, conflicts and restarts. No cluster, no kopf."""

from __future__ import annotations

import json
import pytest

from specdecode_operator import conditions as c
from specdecode_operator import labels
from specdecode_operator import kube as k8s
from specdecode_operator.kube import ApiError
from specdecode_operator.reconcile import Options, Reconciler
from specdecode_operator.spec import parse_spec, plan_key, planner_pod_name
from tests.operator_helpers import NS, Clock, FakeKube, example, make_plan

@pytest.fixture
def kube():
    k = FakeKube()
    k.put_sdd(example())
    return k


def reconciler(kube, clock=None):
    return Reconciler(kube, Options(default_image="img:1"), clock=clock or Clock())


def cond(sdd, ctype):
    return c.get(sdd["status"]["conditions"], ctype)


def test_full_lifecycle_plan_then_children_then_ready(kube):
    r = reconciler(kube)
    res = r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    view = parse_spec(sdd, "img:1")
    key = plan_key(view)
    assert kube.created == [planner_pod_name(view, key)]
    assert sdd["status"]["phase"] == "Planning" and cond(sdd, c.PLANNED)["status"] == "Unknown"
    assert res.requeue_after is not None
    assert kube.deployment() is None  # nothing scheduled before the plan

    r.reconcile(NS, "llama-8b-eagle3")  # still running: no second pod
    assert len(kube.created) == 1

    plan = make_plan(tp=2)
    kube.finish_planner(0, json.dumps(plan))
    r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    stored = {k: v for k, v in sdd["status"]["plan"].items() if k not in ("key", "plannerPod")}
    assert stored == {k: v for k, v in plan.items() if k not in ("apiVersion", "kind")}
    assert sdd["status"]["plan"]["key"] == key
    assert cond(sdd, c.PLANNED)["reason"] == c.PLAN_READY
    dep = kube.deployment()
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert sdd["status"]["phase"] == "Deploying" and sdd["status"]["gpusPerReplica"] == 2
    assert json.loads(kube.get(k8s.Ref("v1", "ConfigMap", NS, "llama-8b-eagle3-plan"))["data"]["plan.json"]) == plan
    assert kube.get(k8s.Ref("v1", "Service", NS, "llama-8b-eagle3")) is not None

    kube.roll_out()
    r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    assert sdd["status"]["phase"] == "Ready" and sdd["status"]["readyReplicas"] == 1
    assert cond(sdd, c.AVAILABLE)["status"] == "True" and cond(sdd, c.READY)["status"] == "True"
    assert sdd["status"]["observedGeneration"] == 1
    assert sdd["status"]["selector"] == "specdecode.io/name=llama-8b-eagle3,specdecode.io/role=worker"
    transitions = [(e[1].split(":")[0], e[0]) for e in kube.events]  # ("Planned=Unknown", "Planning"), ...
    assert transitions.count(("Planned=Unknown", c.PLANNING)) == 1
    assert transitions.count(("Planned=True", c.PLAN_READY)) == 1
    assert transitions.count(("Ready=True", "Ready")) == 1
    assert not [e for e in kube.events if e[2]]  # a clean deploy posts no Warning

    # a reconcile with nothing new writes nothing and posts nothing
    rv, n_events = sdd["metadata"]["resourceVersion"], len(kube.events)
    r.reconcile(NS, "llama-8b-eagle3")
    assert kube.sdd()["metadata"]["resourceVersion"] == rv and len(kube.events) == n_events


def _ready(kube, r, tp=1):
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(make_plan(tp=tp)))
    r.reconcile(NS, "llama-8b-eagle3")
    kube.roll_out()
    r.reconcile(NS, "llama-8b-eagle3")
    assert kube.sdd()["status"]["phase"] == "Ready"


def test_replicas_change_scales_without_planning(kube):
    r = reconciler(kube)
    _ready(kube, r)
    template = kube.deployment()["spec"]["template"]
    body = kube.sdd()
    body["spec"]["replicas"] = 3
    kube.put_sdd(body)
    r.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.created) == 1  # still the one planner pod
    dep = kube.deployment()
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["template"] == template
    sdd = kube.sdd()
    assert sdd["status"]["phase"] == "Deploying" and sdd["status"]["observedGeneration"] == 2


def test_draft_change_replans_rolls_and_cleans_up(kube):
    r = reconciler(kube)
    _ready(kube, r)
    old_key = kube.sdd()["status"]["plan"]["key"]
    body = kube.sdd()
    body["spec"]["draft"]["model"] = "other/eagle3-head"
    kube.put_sdd(body)
    r.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.created) == 2
    sdd = kube.sdd()
    assert sdd["status"]["phase"] == "Planning"
    assert sdd["status"]["plan"]["key"] == old_key  # the plan in effect until the new one exists
    # the old workers still serve; the new spec is not rolled out yet
    assert cond(sdd, c.AVAILABLE)["status"] == "True" and sdd["status"]["readyReplicas"] == 1
    assert (cond(sdd, c.READY)["status"], cond(sdd, c.READY)["reason"]) == ("False", c.PLANNING)
    assert (cond(sdd, c.PROGRESSING)["status"], cond(sdd, c.PROGRESSING)["reason"]) == ("True", c.PLANNING)
    assert kube.deployment()["spec"]["template"]["metadata"]["annotations"][labels.PLAN_KEY] == old_key

    kube.finish_planner(0, json.dumps(make_plan(tp=2)))
    r.reconcile(NS, "llama-8b-eagle3")
    new_key = kube.sdd()["status"]["plan"]["key"]
    assert new_key != old_key
    tmpl = kube.deployment()["spec"]["template"]
    assert tmpl["metadata"]["annotations"][labels.PLAN_KEY] == new_key
    assert "/models/other/eagle3-head" in tmpl["spec"]["containers"][0]["args"]
    assert [p["metadata"]["labels"][labels.PLAN_KEY] for p in kube.pods("planner")] == [new_key]


def test_model_too_large_is_insufficient_gpu_memory_and_no_workload(kube):
    r = reconciler(kube)
    r.reconcile(NS, "llama-8b-eagle3")
    misfit = make_plan(tp=8, fits=False)
    kube.finish_planner(3, json.dumps(misfit))
    r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    planned = cond(sdd, c.PLANNED)
    assert (planned["status"], planned["reason"]) == ("False", c.INSUFFICIENT_GPU_MEMORY)
    assert "5.00 GiB" in planned["message"] and str(5 << 30) in planned["message"]
    assert sdd["status"]["phase"] == "Failed"
    assert kube.deployment() is None and kube.applied == []
    r.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.created) == 1  # a misfit is final for this spec: no retry
    assert (c.INSUFFICIENT_GPU_MEMORY, True) in [(e[0], e[2]) for e in kube.events]


def test_planner_crash_is_retried_with_backoff(kube):
    clock = Clock()
    r = reconciler(kube, clock)
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(1, "Traceback (most recent call last): RuntimeError: boom")
    clock.t += 11
    res = r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    planned = cond(sdd, c.PLANNED)
    assert (planned["status"], planned["reason"]) == ("False", c.PLANNER_FAILED)
    assert "boom" in planned["message"] and "attempt 1" in planned["message"]
    assert sdd["status"]["planner"]["attempts"] == 1
    # finished at +10 s with a 10 s backoff: at +11 s we wait ~9 s more
    assert 8 <= res.requeue_after <= 10 and len(kube.created) == 1
    clock.t += 10
    r.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.created) == 2 and kube.deleted  # same name, a fresh pod
    kube.finish_planner(1, "boom again")
    r.reconcile(NS, "llama-8b-eagle3")
    r.reconcile(NS, "llama-8b-eagle3")  # the same failed pod is counted once
    assert kube.sdd()["status"]["planner"]["attempts"] == 2
    assert "retrying in" in cond(kube.sdd(), c.PLANNED)["message"]
    clock.t += 25
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(make_plan()))
    r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    assert cond(sdd, c.PLANNED)["reason"] == c.PLAN_READY and sdd["status"]["planner"]["attempts"] == 0
    assert kube.deployment() is not None


def test_restart_mid_plan_finds_the_existing_pod(kube):
    reconciler(kube).reconcile(NS, "llama-8b-eagle3")
    # a new operator process: fresh reconciler, same cluster
    fresh = reconciler(kube)
    fresh.reconcile(NS, "llama-8b-eagle3")
    fresh.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.created) == 1
    # even if the status write of the first run was lost, the deterministic name finds the pod
    kube.objects[k8s.sdd(NS, "llama-8b-eagle3")]["status"] = {}
    fresh.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.created) == 1 and kube.sdd()["status"]["phase"] == "Planning"


def test_status_conflict_is_retried_not_clobbered(kube):
    r = reconciler(kube)
    kube.conflict_next_status_write = True
    r.reconcile(NS, "llama-8b-eagle3")
    assert kube.sdd()["status"]["phase"] == "Planning"
    assert len(kube.created) == 1


def test_plan_exceeds_node_gpus(kube):
    kube.nodes = [{"metadata": {"name": "h", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                   "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "4"}}}]
    r = reconciler(kube)
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(make_plan(tp=8)))
    r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    degraded = cond(sdd, c.DEGRADED)
    assert (degraded["status"], degraded["reason"]) == ("True", c.PLAN_EXCEEDS_NODE_GPUS)
    assert "needs 8 GPUs" in degraded["message"] and "offers is 4" in degraded["message"]
    assert sdd["status"]["phase"] == "Degraded"
    assert kube.deployment() is not None  # applied anyway: pods pend until a large enough node exists


def test_forbidden_nodes_are_skipped(kube):
    kube.nodes = None
    r = reconciler(kube)
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(make_plan(tp=8)))
    r.reconcile(NS, "llama-8b-eagle3")
    assert cond(kube.sdd(), c.DEGRADED)["status"] == "False"


def test_deleted_sdd_is_gone(kube):
    r = reconciler(kube)
    del kube.objects[k8s.sdd(NS, "llama-8b-eagle3")]
    assert r.reconcile(NS, "llama-8b-eagle3").gone


def test_child_events_refresh_status_without_reapplying(kube):
    r = reconciler(kube)
    _ready(kube, r)
    n = len(kube.applied)
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False)
    assert len(kube.applied) == n  # nothing changed: reads only
    kube.roll_out(ready=0)  # a worker went unready
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False)
    assert len(kube.applied) == n and kube.sdd()["status"]["phase"] == "Deploying"
    body = kube.sdd()
    body["spec"]["replicas"] = 2  # a new generation is applied even from a child event
    kube.put_sdd(body)
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False)
    assert len(kube.applied) == n + 3 and kube.deployment()["spec"]["replicas"] == 2


def test_misfit_message_names_spec_fields():
    from specdecode_operator.planner import in_spec_terms

    msg = ("does not fit on 8 GPU(s) of 8.00 GiB: 57231 KV tokens for a floor of 65536, short by 0.14 GiB per GPU; "
           "or with --mem-fraction-static 0.636 on 8 GPU(s); or lower --context-length/--min-kv-tokens, use "
           "--kv-cache-dtype fp8_e4m3, or a larger GPU")
    out = in_spec_terms(msg)
    assert "--" not in out
    assert "spec.serving.memFractionStatic: 0.636" in out and "spec.serving.kvCacheDtype: fp8_e4m3" in out
    assert "spec.serving.contextLength/spec.serving.minKVTokens" in out


# --- children the API server refuses ----------------------------------------------------------------

PSA_MESSAGE = ('pods "llama-8b-eagle3-plan-1" is forbidden: violates PodSecurity "restricted:latest": '
               'runAsNonRoot != true (pod or container "planner" must set securityContext.runAsNonRoot=true)')
QUOTA_MESSAGE = ('deployments.apps "llama-8b-eagle3" is forbidden: exceeded quota: gpus, '
                 'requested: count/deployments.apps=1, used: count/deployments.apps=1, '
                 'limited: count/deployments.apps=1')


def test_refused_planner_pod_is_a_condition_with_the_api_message_and_backs_off(kube):
    kube.refuse[("create", "Pod")] = ApiError(403, PSA_MESSAGE, "Forbidden")
    r = reconciler(kube)
    delays = [r.reconcile(NS, "llama-8b-eagle3").requeue_after for _ in range(4)]
    sdd = kube.sdd()
    planned = cond(sdd, c.PLANNED)
    assert (planned["status"], planned["reason"]) == ("False", c.POD_SECURITY_REJECTED)
    assert PSA_MESSAGE in planned["message"] and "planner pod" in planned["message"]
    assert (cond(sdd, c.READY)["status"], cond(sdd, c.READY)["reason"]) == ("False", c.POD_SECURITY_REJECTED)
    assert sdd["status"]["phase"] == "Failed"
    assert delays == [5, 10, 20, 40]  # backoff, not a spin
    warnings = [e for e in kube.events if e[2]]
    assert [e[0] for e in warnings] == [c.POD_SECURITY_REJECTED]  # one Event for the change, not one per retry
    assert kube.created == []

    del kube.refuse[("create", "Pod")]  # the namespace relabelled: the next retry goes through
    res = r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    assert cond(sdd, c.PLANNED)["reason"] == c.PLANNING and len(kube.created) == 1
    assert res.requeue_after == pytest.approx(30.0)  # the backoff is forgotten once accepted


def test_refused_deployment_is_degraded_with_the_quota_message_then_converges(kube):
    r = reconciler(kube)
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(make_plan()))
    kube.refuse[("apply", "Deployment")] = ApiError(403, QUOTA_MESSAGE, "Forbidden")
    res = r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    degraded = cond(sdd, c.DEGRADED)
    assert (degraded["status"], degraded["reason"]) == ("True", c.QUOTA_EXCEEDED)
    assert QUOTA_MESSAGE in degraded["message"] and "Deployment llama-8b-eagle3" in degraded["message"]
    assert (cond(sdd, c.PROGRESSING)["status"], cond(sdd, c.READY)["reason"]) == ("False", c.QUOTA_EXCEEDED)
    assert cond(sdd, c.PLANNED)["reason"] == c.PLAN_READY and sdd["status"]["phase"] == "Degraded"
    assert res.requeue_after == 5 and kube.deployment() is None
    # a child event or a requeue tries again (the Deployment is not there yet), with a longer wait
    assert r.reconcile(NS, "llama-8b-eagle3", force_apply=False).requeue_after == 10
    assert [e[0] for e in kube.events if e[2]] == [c.QUOTA_EXCEEDED]  # one Warning for the change

    del kube.refuse[("apply", "Deployment")]
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False)
    kube.roll_out()
    r.reconcile(NS, "llama-8b-eagle3")
    assert kube.sdd()["status"]["phase"] == "Ready"


def test_worker_pods_refused_to_the_replicaset_are_reported_from_the_deployment(kube):
    r = reconciler(kube)
    _ready(kube, r)
    message = ('pods "llama-8b-eagle3-5d8f-x" is forbidden: exceeded quota: gpus, '
               'requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=1, '
               'limited: requests.nvidia.com/gpu=1')
    dep = kube.objects[k8s.deployment(NS, "llama-8b-eagle3")]
    dep["status"]["readyReplicas"] = 0
    dep["status"]["conditions"].append({"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                        "message": message})
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False)
    degraded = cond(kube.sdd(), c.DEGRADED)
    assert (degraded["status"], degraded["reason"]) == ("True", c.QUOTA_EXCEEDED) and message in degraded["message"]
    assert kube.events[-1][2]  # a Warning


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_transient_errors_are_not_refusals_and_propagate(kube, status):
    kube.refuse[("create", "Pod")] = ApiError(status, "etcdserver: request timed out")
    with pytest.raises(ApiError):
        reconciler(kube).reconcile(NS, "llama-8b-eagle3")
    assert "conditions" not in kube.sdd().get("status", {})
