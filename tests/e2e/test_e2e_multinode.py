"""Replicas larger than one node on the real control plane, with the LeaderWorkerSet controller
built from its pinned source (devtools/cluster/lws.py) and its webhooks served on loopback."""

from __future__ import annotations

import json
import signal

import pytest
import yaml

from devtools.checkpoints import write_model
from devtools.cluster import lws as lws_mod
from devtools.cluster.wait import wait_for
from tests.e2e_helpers import Operator, get_object

pytestmark = pytest.mark.timeout(420)
TARGET = "meta-llama/Llama-3.1-70B-Instruct"
NAME = "llama-70b-ngram"
# Llama-3.1-70B on H100s holds ~1.55M KV tokens on 8 GPUs; 1.6M needs 16: two 8-GPU nodes a replica.
SDD = {
    "apiVersion": "specdecode.io/v1alpha1", "kind": "SpecDecodeDeployment", "metadata": {"name": NAME},
    "spec": {
        "replicas": 1,
        "target": {"model": TARGET, "dtype": "bfloat16"},
        "draft": {"algorithm": "NGRAM"},
        "serving": {"contextLength": 8192, "maxRunningRequests": 64, "minKVTokens": 1_600_000},
        "gpu": {"product": "NVIDIA-H100-80GB-HBM3", "maxPerReplica": 16},
        "modelStore": {"pvc": {"claimName": "models"}},
        "resources": {"cpu": "8"},
    },
}


@pytest.fixture(scope="module")
def lws(cluster):
    folder = lws_mod.build(progress=print)
    installed = lws_mod.LeaderWorkerSet(cluster, folder).install()
    yield installed
    installed.uninstall()


@pytest.fixture
def store(cluster, namespace):
    """The `models` PVC with a sparse Llama-3.1-70B-Instruct."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
    write_model(cluster.pvc_root / namespace / "models" / TARGET, "llama-3.1-70b-instruct")
    wait_for(lambda: get_object(cluster, namespace, "pvc", "models")["status"].get("phase") == "Bound",
             timeout=30, what="PVC models bound")


@pytest.fixture
def operator(cluster, crd, namespace, store):  # noqa: F811 - crd is the imported fixture
    op = Operator(cluster, namespace).start()
    yield op
    # Gone before the namespace goes: an operator watching every namespace (the chart's, in a later
    # test) must not find an SDD in a namespace that refuses new pods while it terminates.
    cluster.kubectl("delete", "sdd", "--all", "-n", namespace, "--wait=true", timeout=120, check=False)
    op.stop()
    print(f"--- operator log (tail) ---\n{op.tail(80)}")


def _cond(sdd, ctype):
    return next((c for c in (sdd or {}).get("status", {}).get("conditions", []) if c["type"] == ctype), None)


def _wait_sdd(cluster, namespace, predicate, what, timeout=180):
    def check():
        sdd = get_object(cluster, namespace, "sdd", NAME)
        return sdd if sdd and predicate(sdd) else None

    return wait_for(check, timeout=timeout, interval=1.0, what=f"{NAME}: {what}")


def _apply(cluster, namespace, body):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(body))


# Runs before the `lws` fixture installs LeaderWorkerSet (tests run in file order).
def test_without_leaderworkerset_the_sdd_reports_multinode_unavailable(cluster, namespace, operator):
    _apply(cluster, namespace, SDD)
    sdd = _wait_sdd(cluster, namespace, lambda s: (_cond(s, "Degraded") or {}).get("status") == "True",
                    "Degraded")
    degraded = _cond(sdd, "Degraded")
    assert degraded["reason"] == "MultiNodeUnavailable", degraded
    assert "leaderworkersets.leaderworkerset.x-k8s.io" in degraded["message"]
    assert "helm install lws" in degraded["message"]
    assert sdd["status"]["plan"]["tensorParallelSize"] == 16 and sdd["status"]["plan"]["nodesPerReplica"] == 2
    assert sdd["status"]["phase"] == "Degraded"
    # No partial workload: no Deployment, ConfigMap or Service.
    for kind, name in (("deployment", NAME), ("configmap", f"{NAME}-plan"), ("service", NAME)):
        assert get_object(cluster, namespace, kind, name) is None, kind


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


def _group_pods(cluster, namespace):
    return {p["metadata"]["name"]: p for p in _pods(cluster, namespace, f"specdecode.io/name={NAME}")
            if p["metadata"]["labels"].get("specdecode.io/role") == "worker"}


def test_a_replica_needing_16_gpus_runs_as_a_group_over_two_nodes(cluster, lws, namespace, operator):
    _apply(cluster, namespace, SDD)
    sdd = _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready", "Ready")
    plan = sdd["status"]["plan"]
    assert (plan["tensorParallelSize"], plan["nodesPerReplica"]) == (16, 2)
    assert sdd["status"]["nodesPerReplica"] == 2 and sdd["status"]["readyReplicas"] == 1
    assert get_object(cluster, namespace, "deployment", NAME) is None

    group = get_object(cluster, namespace, "leaderworkerset", f"{NAME}-group")
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 2 and group["spec"]["replicas"] == 1
    pods = _group_pods(cluster, namespace)
    leader_name, worker_name = f"{NAME}-group-0", f"{NAME}-group-0-1"
    assert sorted(pods) == [leader_name, worker_name]
    leader, worker = pods[leader_name], pods[worker_name]
    assert {leader["spec"]["nodeName"], worker["spec"]["nodeName"]} == {"h100-node-1", "h100-node-2"}
    for pod, index in ((leader, "0"), (worker, "1")):
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        env = _env(pod)
        assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == index
        assert env["LWS_LEADER_ADDRESS"] == f"{leader_name}.{NAME}-group.{namespace}"
        args = container["args"]
        assert args[args.index("--tp") + 1] == "16" and args[args.index("--nnodes") + 1] == "2"
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert "readinessProbe" not in worker["spec"]["containers"][0]
    service = get_object(cluster, namespace, "service", NAME)
    assert service["spec"]["selector"]["specdecode.io/group-role"] == "leader"
    endpoints = json.loads(cluster.kubectl("get", "endpointslices", "-n", namespace, "-l",
                                           f"kubernetes.io/service-name={NAME}", "-o", "json").stdout)["items"]
    targets = {e["targetRef"]["name"] for s in endpoints for e in s.get("endpoints") or []}
    assert targets <= {leader_name}


@pytest.fixture
def operator_with_rank_policy(cluster, crd, namespace, store):  # noqa: F811 - crd is the imported fixture
    op = Operator(cluster, namespace, "--worker-network-policy").start()
    yield op
    cluster.kubectl("delete", "sdd", "--all", "-n", namespace, "--wait=true", timeout=120, check=False)
    op.stop()
    print(f"--- operator log (tail) ---\n{op.tail(80)}")


def test_a_group_gets_a_rank_policy_for_its_own_pods(cluster, lws, namespace, operator_with_rank_policy):
    """The API server accepts the rank policy and it selects the group's pods. This control plane
    runs no network plugin, so nothing enforces it here: what it admits is tested on the rendering."""
    _apply(cluster, namespace, SDD)
    policy = wait_for(lambda: get_object(cluster, namespace, "networkpolicy", f"{NAME}-ranks"),
                      timeout=180, interval=1.0, what=f"NetworkPolicy {NAME}-ranks")
    sdd = get_object(cluster, namespace, "sdd", NAME)
    [owner] = policy["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("SpecDecodeDeployment", NAME, sdd["metadata"]["uid"])
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": selector}}]}]
    wait_for(lambda: len(_group_pods(cluster, namespace)) == 2, timeout=180, interval=1.0, what="the group's pods")
    for pod in _group_pods(cluster, namespace).values():
        assert selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["name"]


def test_status_follows_a_change_of_the_group_itself(cluster, lws, namespace, operator):
    """The LWS's own readiness reaches status through its watch, not the periodic resync (minutes
    for a Ready SDD): with the LWS controller paused no pod changes, only the LWS status does."""
    _apply(cluster, namespace, SDD)
    _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready"
              and s["status"].get("readyReplicas") == 1, "Ready")
    controller = cluster.components[lws_mod.COMPONENT]
    controller.signal(signal.SIGSTOP)  # nothing rewrites the LWS status or touches the pods meanwhile
    try:
        cluster.kubectl("patch", "leaderworkerset", f"{NAME}-group", "-n", namespace, "--subresource=status",
                        "--type=merge", "-p", json.dumps({"status": {"readyReplicas": 0}}))
        sdd = _wait_sdd(cluster, namespace, lambda s: s["status"].get("readyReplicas") == 0,
                        "status follows the LWS's readyReplicas", timeout=60)
        assert sdd["status"]["phase"] != "Ready" and _cond(sdd, "Ready")["status"] == "False"
    finally:
        controller.signal(signal.SIGCONT)
    _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready"
              and s["status"].get("readyReplicas") == 1, "Ready again once the LWS controller restores its status")


def _added_nodes(cluster, names, labels=None, gpus=None):
    """Nodes copied from h100-node-1 under ``names`` (with ``labels`` and ``gpus`` allocatable GPUs
    when given), Ready while the caller's test runs, deleted afterwards."""
    base = next(n for n in yaml.safe_load_all(lws_mod.HERE.joinpath("nodes.yaml").read_text())
                if n["metadata"]["name"] == "h100-node-1")
    for name in names:
        node = json.loads(json.dumps(base))
        node["metadata"]["name"] = name
        node["metadata"]["labels"].update({"kubernetes.io/hostname": name, **(labels or {})})
        node["status"]["addresses"] = [{"type": "Hostname", "address": name}]
        if gpus is not None:
            for amounts in (node["status"]["capacity"], node["status"]["allocatable"]):
                amounts["nvidia.com/gpu"] = str(gpus)
        cluster.api.create("/api/v1/nodes", node)
    wait_for(lambda: cluster.kubectl("wait", "--for=condition=Ready", *(f"node/{n}" for n in names),
                                     "--timeout=5s", check=False).returncode == 0, timeout=60, what="added nodes Ready")
    yield
    for name in names:
        cluster.kubectl("delete", "node", name, "--wait=false", check=False)


EXTRA_NODES = ("h100-node-3", "h100-node-4")


@pytest.fixture
def two_more_h100_nodes(cluster):
    """Two more 8-GPU nodes, so that two 16-GPU groups fit; removed afterwards."""
    yield from _added_nodes(cluster, EXTRA_NODES)


def test_scaling_to_two_replicas_makes_two_groups(cluster, lws, namespace, operator, two_more_h100_nodes):
    _apply(cluster, namespace, SDD)
    _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready", "Ready")
    cluster.kubectl("scale", "sdd", NAME, "-n", namespace, "--replicas=2")
    sdd = _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready"
                    and s["status"].get("readyReplicas") == 2, "2 groups Ready")
    assert sdd["status"]["replicas"] == 2
    assert get_object(cluster, namespace, "leaderworkerset", f"{NAME}-group")["spec"]["replicas"] == 2
    pods = _group_pods(cluster, namespace)
    assert sorted(pods) == [f"{NAME}-group-{g}{s}" for g in (0, 1) for s in ("", "-1")]
    nodes = [p["spec"]["nodeName"] for p in pods.values()]
    assert len(set(nodes)) == 4  # 8 GPUs each: one pod per node


def test_deleting_a_worker_pod_recreates_its_group(cluster, lws, namespace, operator):
    _apply(cluster, namespace, SDD)
    _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready", "Ready")
    before = {n: p["metadata"]["uid"] for n, p in _group_pods(cluster, namespace).items()}
    leader_name, worker_name = f"{NAME}-group-0", f"{NAME}-group-0-1"
    h100 = "--selector=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
    # Cordoned nodes hold the recreated group Pending, so its progress can be seen in the status.
    cluster.kubectl("cordon", h100)
    try:
        cluster.kubectl("delete", "pod", worker_name, "-n", namespace, "--wait=false")

        def recreated():  # RecreateGroupOnPodRestart: the leader goes too, and the group comes back whole
            pods = _group_pods(cluster, namespace)
            fresh = {n: p["metadata"]["uid"] for n, p in pods.items() if not p["metadata"].get("deletionTimestamp")}
            return leader_name in fresh and fresh[leader_name] != before[leader_name]

        wait_for(recreated, timeout=120, interval=0.5, what="a new leader pod: the group is recreated")
        sdd = _wait_sdd(cluster, namespace, lambda s: s["status"].get("readyReplicas") == 0
                        and s["status"].get("phase") != "Ready", "the recreated group reported not ready")
        assert _cond(sdd, "Ready")["status"] == "False" and _cond(sdd, "Available")["status"] == "False"
    finally:
        cluster.kubectl("uncordon", h100)
    sdd = _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready"
                    and s["status"].get("readyReplicas") == 1, "Ready again")
    after = {n: p["metadata"]["uid"] for n, p in _group_pods(cluster, namespace).items()}
    assert sorted(after) == [leader_name, worker_name] and all(after[n] != before[n] for n in after)


A100 = "NVIDIA-A100-SXM4-80GB"
A100_NODES = ("a100-node-1", "a100-node-2")


@pytest.fixture
def two_a100_nodes_of_4_gpus(cluster):
    """Two 4-GPU A100 nodes; removed afterwards."""
    labels = {"nvidia.com/gpu.product": A100, "nvidia.com/gpu.count": "4", "nvidia.com/gpu.memory": "81920"}
    yield from _added_nodes(cluster, A100_NODES, labels, gpus=4)


def test_gpus_per_node_come_from_the_nodes_when_the_spec_does_not_say(cluster, lws, namespace,
                                                                      two_a100_nodes_of_4_gpus, operator):
    # 900k KV tokens of Llama-3.1-70B need t = 8 on A100-80GB; the nodes hold 4 GPUs each and the
    # spec sets neither gpu.perNode nor gpu.maxPerReplica: one replica spans both nodes.
    body = json.loads(json.dumps(SDD))
    body["spec"]["gpu"] = {"product": A100}
    body["spec"]["serving"]["minKVTokens"] = 900_000
    _apply(cluster, namespace, body)
    sdd = _wait_sdd(cluster, namespace, lambda s: s.get("status", {}).get("phase") == "Ready", "Ready")
    plan, planner = sdd["status"]["plan"], sdd["status"]["planner"]
    assert (plan["tensorParallelSize"], plan["nodesPerReplica"]) == (8, 2)
    assert (planner["gpusPerNode"], planner["gpusPerNodeFrom"]) == (4, "nodes")
    assert "GPUs per node: 4" in _cond(sdd, "Planned")["message"]
    assert get_object(cluster, namespace, "deployment", NAME) is None
    pods = _group_pods(cluster, namespace)
    assert sorted(pods) == [f"{NAME}-group-0", f"{NAME}-group-0-1"]
    assert {p["spec"]["nodeName"] for p in pods.values()} == set(A100_NODES)
    for pod in pods.values():
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
