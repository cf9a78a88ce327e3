"""Replicas larger than one node on the real control plane, with the LeaderWorkerSet controller
built from its pinned source (tests/cluster/lws.py) and its webhooks served on loopback."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.cluster import lws as lws_mod
from tests.cluster.wait import wait_for


@pytest.fixture(scope="module")
def lws(cluster):
    folder = lws_mod.build(progress=print)
    installed = lws_mod.LeaderWorkerSet(cluster, folder).install()
    yield installed
    installed.uninstall()


def _pods(cluster, namespace, selector):
    return json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]


def _env(pod) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}


def test_the_lws_controller_makes_groups_with_the_webhook_environment(cluster, lws, namespace):
    body = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
        "metadata": {"name": "probe"},
        "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": {"containers": [
            {"name": "c", "image": "registry.invalid/none:0", "resources": {"limits": {"nvidia.com/gpu": 8}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}}},
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))

    def group_ready():
        got = json.loads(cluster.kubectl("get", "leaderworkerset", "probe", "-n", namespace, "-o", "json").stdout)
        return got if got.get("status", {}).get("readyReplicas") == 1 else None

    wait_for(group_ready, timeout=120, interval=0.5, what="LWS probe: one ready group")
    pods = {p["metadata"]["name"]: p for p in _pods(cluster, namespace, "leaderworkerset.sigs.k8s.io/name=probe")}
    assert sorted(pods) == ["probe-0", "probe-0-1"]
    leader, worker = pods["probe-0"], pods["probe-0-1"]
    assert leader["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert worker["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "1"
    for pod, index in ((leader, "0"), (worker, "1")):
        env = _env(pod)
        assert env["LWS_LEADER_ADDRESS"] == f"probe-0.probe.{namespace}"
        assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == index
    # 8 GPUs each: the two pods sit on the two H100 nodes.
    assert {leader["spec"]["nodeName"], worker["spec"]["nodeName"]} == {"h100-node-1", "h100-node-2"}
