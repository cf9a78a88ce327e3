"""GPUs per node for the planner: spec, then the nodes' allocatable GPUs, then the default; and
the reconciler passing it to the planner pod once per plan, without re-planning on node changes."""

from __future__ import annotations

import json

import pytest

from specdecode_operator import conditions as c
from specdecode_operator.nodecapacity import FROM_DEFAULT, FROM_NODES, FROM_SPEC, gpus_per_node
from specdecode_operator.reconcile import Options, Reconciler
from tests.operator_helpers import NS, Clock, FakeKube, example, make_plan

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"


def node(name, product, gpus, unschedulable=False):
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product} if product else {}},
            "spec": {"unschedulable": True} if unschedulable else {},
            "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "8"}}}


def test_the_spec_wins_over_the_nodes():
    got = gpus_per_node(2, H100, [node("a", H100, 8)])
    assert (got.count, got.source, got.note, got.planner_flag) == (2, FROM_SPEC, "", 2)


def test_the_largest_schedulable_node_of_the_product():
    nodes = [node("a", H100, 4), node("b", H100, 2), node("c", H100, 8, unschedulable=True), node("d", A100, 16)]
    got = gpus_per_node(None, H100, nodes)
    assert (got.count, got.source, got.planner_flag) == (4, FROM_NODES, 4)
    assert f"nvidia.com/gpu.product={H100}" in got.note


def test_without_a_product_every_node_counts():
    got = gpus_per_node(None, None, [node("a", H100, 4), node("b", A100, 2), node("cpu", None, 0)])
    assert (got.count, got.source) == (4, FROM_NODES)


@pytest.mark.parametrize("nodes", [[], [node("a", A100, 8)], [node("a", H100, 0)], [node("a", H100, 8, True)]])
def test_no_matching_gpu_node_leaves_the_default(nodes):
    got = gpus_per_node(None, H100, nodes)
    assert (got.count, got.source, got.planner_flag) == (8, FROM_DEFAULT, None)
    assert "no schedulable" in got.note and "gpu.perNode" in got.note


def test_unreadable_nodes_leave_the_default_and_say_why():
    got = gpus_per_node(None, H100, None, "the operator may not list nodes")
    assert (got.count, got.source, got.planner_flag) == (8, FROM_DEFAULT, None)
    assert "may not list nodes" in got.note and "set gpu.perNode" in got.note


# --- the reconciler ----------------------------------------------------------------------------


def _planner_args(kube):
    (pod,) = kube.pods("planner")
    return pod["spec"]["containers"][0]["args"]


def _sdd(per_node=None):
    body = example()
    if per_node is not None:
        body["spec"].setdefault("gpu", {})["perNode"] = per_node
    return body


def _reconciler(kube, check_nodes=True):
    return Reconciler(kube, Options(default_image="img:1", check_nodes=check_nodes), clock=Clock())


def test_nodes_with_four_gpus_tell_the_planner_and_the_status():
    kube = FakeKube()
    kube.put_sdd(_sdd())
    product = kube.sdd()["spec"]["gpu"]["product"]
    kube.nodes = [node("a", product, 4), node("b", product, 4)]
    r = _reconciler(kube)
    r.reconcile(NS, "llama-8b-eagle3")
    args = _planner_args(kube)
    assert args[args.index("--gpus-per-node") + 1] == "4"
    tracker = kube.sdd()["status"]["planner"]
    assert (tracker["gpusPerNode"], tracker["gpusPerNodeFrom"]) == (4, FROM_NODES)
    assert "GPUs per node: 4" in c.get(kube.sdd()["status"]["conditions"], c.PLANNED)["message"]

    kube.finish_planner(0, json.dumps(make_plan(tp=2)))
    r.reconcile(NS, "llama-8b-eagle3")
    planned = c.get(kube.sdd()["status"]["conditions"], c.PLANNED)
    assert planned["reason"] == c.PLAN_READY and "GPUs per node: 4" in planned["message"]

    # A node change is not a new plan: no second planner pod, the workload stays.
    kube.nodes = [node("a", product, 8)]
    r.node_capacity._cache = None  # past the node cache
    r.reconcile(NS, "llama-8b-eagle3")
    assert len(kube.pods("planner")) == 1 and kube.sdd()["status"]["plan"]["tensorParallelSize"] == 2


def test_the_spec_per_node_is_passed_and_no_node_is_read():
    kube = FakeKube()
    kube.put_sdd(_sdd(per_node=2))
    kube.nodes = None  # reading nodes would be refused
    _reconciler(kube).reconcile(NS, "llama-8b-eagle3")
    args = _planner_args(kube)
    assert args[args.index("--gpus-per-node") + 1] == "2"
    tracker = kube.sdd()["status"]["planner"]
    assert (tracker["gpusPerNode"], tracker["gpusPerNodeFrom"]) == (2, FROM_SPEC)
    assert "gpusPerNodeMessage" not in tracker


@pytest.mark.parametrize("check_nodes, why", [(True, "may not list nodes"), (False, "--no-node-check")])
def test_unreadable_nodes_fall_back_to_the_default_and_say_so(check_nodes, why):
    kube = FakeKube()
    kube.put_sdd(_sdd())
    kube.nodes = None  # 403, as in a namespace-scoped install without rbac.readNodes
    r = _reconciler(kube, check_nodes)
    r.reconcile(NS, "llama-8b-eagle3")
    assert "--gpus-per-node" not in _planner_args(kube)  # the planner's own default
    kube.finish_planner(0, json.dumps(make_plan(tp=1)))
    r.reconcile(NS, "llama-8b-eagle3")
    sdd = kube.sdd()
    assert sdd["status"]["planner"]["gpusPerNodeFrom"] == FROM_DEFAULT
    planned = c.get(sdd["status"]["conditions"], c.PLANNED)
    assert planned["status"] == "True" and why in planned["message"] and "gpu.perNode" in planned["message"]
    assert any(why in message for _, message, _ in kube.events)  # the transition's Event says it too


def test_without_lws_a_split_made_by_the_nodes_names_what_keeps_a_replica_on_one_node():
    from specdecode_worker.contract import validate_plan

    kube = FakeKube()
    kube.serves = lambda api_version, kind: False  # no LeaderWorkerSet
    kube.put_sdd(_sdd())
    product = kube.sdd()["spec"]["gpu"]["product"]
    kube.nodes = [node("a", product, 4)]
    r = _reconciler(kube)
    r.reconcile(NS, "llama-8b-eagle3")
    kube.finish_planner(0, json.dumps(validate_plan({**make_plan(tp=8), "nodesPerReplica": 2})))
    r.reconcile(NS, "llama-8b-eagle3")
    degraded = c.get(kube.sdd()["status"]["conditions"], c.DEGRADED)
    assert degraded["reason"] == c.MULTI_NODE_UNAVAILABLE
    assert "nodes with 8 GPUs of gpu.product (planned for 4 GPUs per node, from nodes)" in degraded["message"]
    assert "maxPerReplica" not in degraded["message"]  # t = 8 is not above it: no help there
