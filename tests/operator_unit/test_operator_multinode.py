"""Replicas larger than one node, operator side: the spec fields that let a plan span nodes reach
the planner and its key, and the CRD (crds/ and the chart's copy) accepts them."""

from __future__ import annotations

import json

import pytest
import yaml

from specdecode_operator import planner
from specdecode_operator.spec import parse_spec, plan_key
from tests.operator_helpers import ROOT, example, typed

CRD_PATHS = [ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml",
             ROOT / "charts" / "specdecode-operator" / "crds" / "specdecode.io_specdecodedeployments.yaml"]


def _with_gpu(**gpu) -> dict:
    body = example()
    body["spec"].setdefault("gpu", {}).update(gpu)
    return body


def _flags(body: dict) -> list[str]:
    args = planner.planner_args(parse_spec(body))
    return [a for a in args if a in ("--max-tp", "--gpus-per-node")] + \
        [args[i + 1] for i, a in enumerate(args) if a in ("--max-tp", "--gpus-per-node")]


def test_max_per_replica_beyond_a_node_lets_the_planner_choose_more():
    assert _flags(example()) == []
    assert _flags(_with_gpu(maxPerReplica=16)) == ["--max-tp", "16"]
    assert _flags(_with_gpu(maxPerReplica=32, perNode=4)) == ["--max-tp", "--gpus-per-node", "32", "4"]
    # Below 8 it does not shrink the plan (a larger plan is reported as PlanExceedsNodeGPUs instead).
    assert _flags(_with_gpu(maxPerReplica=4)) == []


@pytest.mark.parametrize("gpu, replans", [
    ({"maxPerReplica": 16}, True),
    ({"perNode": 4}, True),
    ({"maxPerReplica": 8}, False),
    ({"maxPerReplica": 4}, False),
])
def test_plan_key_follows_what_spreads_a_replica(gpu, replans):
    before = plan_key(parse_spec(example()))
    assert (plan_key(parse_spec(_with_gpu(**gpu))) != before) == replans


def test_crds_accept_replicas_over_nodes():
    for path in CRD_PATHS:
        crd = yaml.safe_load(path.read_text())
        gpu = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gpu"]
        assert gpu["properties"]["maxPerReplica"]["enum"] == [1, 2, 4, 8, 16, 32]
        assert gpu["properties"]["perNode"]["minimum"] == 1
    assert CRD_PATHS[0].read_text() == CRD_PATHS[1].read_text()


# --- rendering ------------------------------------------------------------------------------------

def _group_plan(tp=16, nodes=2) -> dict:
    from specdecode_worker.contract import validate_plan

    from tests.operator_helpers import make_plan

    return validate_plan({**make_plan(tp=tp), "nodesPerReplica": nodes})


OWNER = {"apiVersion": "specdecode.io/v1alpha1", "kind": "SpecDecodeDeployment", "name": "llama-8b-eagle3",
         "uid": "u-1", "controller": True, "blockOwnerDeletion": True}


def test_a_replica_over_two_nodes_renders_a_leaderworkerset_group():
    from specdecode_operator import group, workload

    view = parse_spec(_with_gpu(maxPerReplica=16) | {"spec": example()["spec"] | {"replicas": 3}})
    plan = _group_plan()
    cm, lws, svc = group.render_children(view, typed(plan), "k1", OWNER, generation=4)
    assert cm == workload.render_configmap(view, typed(plan), "k1", OWNER)
    assert (lws["apiVersion"], lws["kind"], lws["metadata"]["name"]) == \
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama-8b-eagle3-group")
    assert lws["metadata"]["annotations"] == {"specdecode.io/plan-key": "k1", "specdecode.io/generation": "4"}
    assert lws["metadata"]["ownerReferences"] == [OWNER]
    spec = lws["spec"]
    assert spec["replicas"] == 3
    tmpl = spec["leaderWorkerTemplate"]
    assert tmpl["size"] == 2 and tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    dep = workload.render_deployment(view, typed(plan), "k1", OWNER, 4)
    dep_container = dep["spec"]["template"]["spec"]["containers"][0]
    for role, pod in (("leader", tmpl["leaderTemplate"]), ("worker", tmpl["workerTemplate"])):
        (container,) = pod["spec"]["containers"]
        assert pod["metadata"]["labels"]["specdecode.io/group-role"] == role
        assert pod["metadata"]["annotations"]["specdecode.io/plan-key"] == "k1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8  # 16 GPUs over 2 pods
        args = container["args"]
        assert args[:len(dep_container["args"])] == dep_container["args"]  # --tp 16 and the pinned plan
        assert args[args.index("--tp") + 1] == "16"
        assert args[-4:] == ["--nnodes", "2", "--master-port", "29500"]
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
        assert pod["spec"]["securityContext"] == dep["spec"]["template"]["spec"]["securityContext"]
        assert pod["spec"]["volumes"] == dep["spec"]["template"]["spec"]["volumes"]
        # this pod's 8 ranks' weights (per GPU bytes x 8) plus headroom, not all 16 ranks'
        per_gpu = plan["weights"]["targetBytes"] + plan["weights"]["draftBytes"]
        assert container["resources"]["requests"]["memory"] == f"{-(-(per_gpu * 8 + 2 * 1024**3) // 1024**3)}Gi"
    leader = tmpl["leaderTemplate"]["spec"]["containers"][0]
    worker = tmpl["workerTemplate"]["spec"]["containers"][0]
    assert leader["startupProbe"] == dep_container["startupProbe"]
    assert leader["readinessProbe"] == dep_container["readinessProbe"]
    assert leader["livenessProbe"] == dep_container["livenessProbe"]
    assert "http" in [p["name"] for p in leader["ports"]]
    assert not any(k in worker for k in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert "http" not in [p["name"] for p in worker["ports"]]
    assert svc["metadata"]["name"] == "llama-8b-eagle3"
    assert svc["spec"]["selector"] == {"specdecode.io/name": "llama-8b-eagle3", "specdecode.io/role": "worker",
                                       "specdecode.io/group-role": "leader"}


def test_the_rendered_group_is_one_the_lws_watch_selects():
    import kopf

    from specdecode_operator import group, handlers

    view = parse_spec(_with_gpu(maxPerReplica=16))
    lws = group.render_leaderworkerset(view, typed(_group_plan()), "k1", OWNER)
    lws_labels = lws["metadata"]["labels"]
    for key, want in handlers.LWS_EVENT_LABELS.items():
        assert key in lws_labels and (want is kopf.PRESENT or lws_labels[key] == want), key
    assert lws_labels["specdecode.io/name"] == "llama-8b-eagle3"  # the owner the event reconciles


def test_lws_status_reads_like_a_deployment():
    from specdecode_operator import group

    assert group.as_deployment_status(None) is None
    lws = {"metadata": {"generation": 3, "annotations": {"specdecode.io/plan-key": "k"}},
           "spec": {"leaderWorkerTemplate": {"leaderTemplate": {"metadata": {"annotations": {"a": "b"}}}}},
           "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                      "conditions": [{"type": "Available", "status": "True"},
                                     {"type": "UpdateInProgress", "status": "False"}]}}
    dep = group.as_deployment_status(lws)
    assert dep["status"] == {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2, "observedGeneration": 3,
                             "conditions": [{"type": "Available", "status": "True"}]}
    assert dep["spec"]["template"] == {"metadata": {"annotations": {"a": "b"}}}
    assert dep["metadata"]["annotations"] == {"specdecode.io/plan-key": "k"}


# --- reconciling ----------------------------------------------------------------------------------

def _kube(serves_lws: bool):
    """The reconciler's fake API (tests/operator_helpers.py) plus discovery of the LWS API."""
    from tests.operator_helpers import FakeKube

    kube = FakeKube()
    kube.serves = lambda api_version, kind: serves_lws and (api_version, kind) == \
        ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    kube.put_sdd(_with_gpu(maxPerReplica=16))
    return kube


def _plan_and_reconcile(kube, plan):
    from specdecode_operator.reconcile import Options, Reconciler
    from tests.operator_helpers import Clock

    r = Reconciler(kube, Options(default_image="img:1"), clock=Clock())
    r.reconcile("ns", "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(plan))
    r.reconcile("ns", "llama-8b-eagle3")
    return r


def _cond(sdd, ctype):
    return next(c for c in sdd["status"]["conditions"] if c["type"] == ctype)


def test_reconcile_applies_the_group_and_follows_its_status():
    from specdecode_operator import group
    from specdecode_operator import kube as k8s

    kube = _kube(serves_lws=True)
    r = _plan_and_reconcile(kube, _group_plan())
    lws_ref = group.leaderworkerset_ref("ns", "llama-8b-eagle3")
    lws = kube.get(lws_ref)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert kube.deployment() is None  # one node would have been a Deployment; not both
    sdd = kube.sdd()
    assert sdd["status"]["nodesPerReplica"] == 2 and sdd["status"]["gpusPerReplica"] == 16
    assert sdd["status"]["phase"] == "Deploying"
    service = kube.get(k8s.Ref("v1", "Service", "ns", "llama-8b-eagle3"))
    assert service["spec"]["selector"]["specdecode.io/group-role"] == "leader"

    kube.objects[lws_ref]["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                                       "conditions": [{"type": "Available", "status": "True"}]}
    r.reconcile("ns", "llama-8b-eagle3")
    sdd = kube.sdd()
    assert sdd["status"]["phase"] == "Ready" and sdd["status"]["readyReplicas"] == 1
    assert _cond(sdd, "Available")["status"] == "True"

    body = kube.sdd()
    body["spec"]["replicas"] = 2
    kube.put_sdd(body)
    r.reconcile("ns", "llama-8b-eagle3")
    assert kube.get(lws_ref)["spec"]["replicas"] == 2  # scaling is the LWS's: 2 groups
    assert kube.sdd()["status"]["phase"] == "Deploying"


def test_without_the_lws_api_the_sdd_is_degraded_and_nothing_is_applied():
    kube = _kube(serves_lws=False)
    _plan_and_reconcile(kube, _group_plan())
    sdd = kube.sdd()
    degraded = _cond(sdd, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "MultiNodeUnavailable"
    assert "leaderworkersets.leaderworkerset.x-k8s.io" in degraded["message"]
    assert "helm install lws" in degraded["message"]
    assert _cond(sdd, "Planned")["status"] == "True"
    assert _cond(sdd, "Ready")["reason"] == "MultiNodeUnavailable"
    assert sdd["status"]["phase"] == "Degraded"
    assert kube.applied == []  # no ConfigMap, Service or workload
    assert ("MultiNodeUnavailable", True) in [(e[0], e[2]) for e in kube.events]


def test_a_new_plan_that_spans_nodes_replaces_the_deployment():
    from specdecode_operator import group
    from tests.operator_helpers import make_plan

    kube = _kube(serves_lws=True)
    r = _plan_and_reconcile(kube, make_plan(tp=8))
    assert kube.deployment() is not None
    body = kube.sdd()
    body["spec"]["serving"]["minKVTokens"] = 1_600_000  # a new plan key
    kube.put_sdd(body)
    r.reconcile("ns", "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(_group_plan()))
    r.reconcile("ns", "llama-8b-eagle3")
    assert kube.get(group.leaderworkerset_ref("ns", "llama-8b-eagle3")) is not None
    assert kube.deployment() is None


def test_installing_lws_later_replaces_the_previous_deployment():
    from specdecode_operator import group
    from tests.operator_helpers import make_plan

    kube = _kube(serves_lws=False)
    r = _plan_and_reconcile(kube, make_plan(tp=8))
    kube.roll_out()
    r.reconcile("ns", "llama-8b-eagle3")
    body = kube.sdd()
    body["spec"]["serving"]["minKVTokens"] = 1_600_000
    kube.put_sdd(body)
    r.reconcile("ns", "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(_group_plan()))
    r.reconcile("ns", "llama-8b-eagle3")
    sdd = kube.sdd()
    assert _cond(sdd, "Degraded")["reason"] == "MultiNodeUnavailable"
    assert _cond(sdd, "Available")["status"] == "True"  # the previous plan's workers still serve
    assert kube.deployment() is not None

    kube.serves = lambda api_version, kind: kind == "LeaderWorkerSet"
    r.reconcile("ns", "llama-8b-eagle3")
    assert kube.get(group.leaderworkerset_ref("ns", "llama-8b-eagle3")) is not None
    assert kube.deployment() is None
    assert kube.sdd()["status"]["nodesPerReplica"] == 2


# --- the rank NetworkPolicy (with the chart's worker NetworkPolicy on) ---------------------------

def _matches(selector: dict, pod_labels: dict) -> bool:
    """A LabelSelector with matchLabels only, as the API server reads it."""
    assert set(selector) == {"matchLabels"}
    return selector["matchLabels"].items() <= pod_labels.items()


def test_the_rank_policy_admits_only_the_sdds_own_pods():
    from specdecode_operator import group
    from specdecode_operator import kube as k8s

    view = parse_spec(_with_gpu(maxPerReplica=16))
    plan = typed(_group_plan())
    cm, policy, lws, svc = group.render_children(view, plan, "k1", OWNER, rank_policy=True)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert policy["metadata"]["name"] == "llama-8b-eagle3-ranks"
    assert k8s.rest_path(k8s.Ref.of(policy)) == \
        f"/apis/networking.k8s.io/v1/namespaces/{view.namespace}/networkpolicies/llama-8b-eagle3-ranks"
    assert policy["metadata"]["namespace"] == view.namespace and policy["metadata"]["ownerReferences"] == [OWNER]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    assert "ports" not in rule  # any port: NCCL and gloo pick theirs
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: the policy's own namespace only

    templates = lws["spec"]["leaderWorkerTemplate"]
    own = [templates["leaderTemplate"]["metadata"]["labels"], templates["workerTemplate"]["metadata"]["labels"]]
    other_view = parse_spec(_with_gpu(maxPerReplica=16) | {"metadata": {"name": "other", "namespace": view.namespace}})
    other_lws = group.render_leaderworkerset(other_view, plan, "k1", OWNER | {"name": "other"})
    other_templates = other_lws["spec"]["leaderWorkerTemplate"]
    other = [other_templates["leaderTemplate"]["metadata"]["labels"],
             other_templates["workerTemplate"]["metadata"]["labels"]]
    for pod_labels in own:  # it selects this SDD's pods, and they may reach each other
        assert _matches(spec["podSelector"], pod_labels) and _matches(peer["podSelector"], pod_labels)
    for pod_labels in other:  # another SDD's pods are neither selected nor admitted
        assert not _matches(spec["podSelector"], pod_labels) and not _matches(peer["podSelector"], pod_labels)
    assert "specdecode.io/name" in spec["podSelector"]["matchLabels"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "specdecode-operator"

    # Off (the default) it is not rendered.
    assert [c["kind"] for c in group.render_children(view, plan, "k1", OWNER)] == \
        ["ConfigMap", "LeaderWorkerSet", "Service"]


def test_reconcile_applies_the_rank_policy_for_a_group_and_deletes_it_for_one_pod():
    from specdecode_operator import group
    from specdecode_operator.reconcile import Options, Reconciler
    from tests.operator_helpers import Clock, make_plan

    kube = _kube(serves_lws=True)
    r = Reconciler(kube, Options(default_image="img:1", rank_network_policy=True), clock=Clock())
    r.reconcile("ns", "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(_group_plan()))
    r.reconcile("ns", "llama-8b-eagle3")
    ref = group.rank_network_policy_ref("ns", "llama-8b-eagle3")
    policy = kube.get(ref)
    assert policy["spec"]["podSelector"]["matchLabels"]["specdecode.io/name"] == "llama-8b-eagle3"
    kinds = [o["kind"] for o in kube.applied]
    assert kinds.index("NetworkPolicy") < kinds.index("LeaderWorkerSet")  # before its pods start

    body = kube.sdd()
    body["spec"]["serving"]["minKVTokens"] = 1_600_000  # a new plan key, one node this time
    kube.put_sdd(body)
    r.reconcile("ns", "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(make_plan(tp=8)))
    r.reconcile("ns", "llama-8b-eagle3")
    assert kube.deployment() is not None and kube.get(ref) is None


def test_without_the_flag_no_rank_policy_is_applied():
    kube = _kube(serves_lws=True)
    _plan_and_reconcile(kube, _group_plan())
    assert "NetworkPolicy" not in [o["kind"] for o in kube.applied]
