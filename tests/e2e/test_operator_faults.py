"""The operator under faults in the middle of a storm of SDDs, each ending with nothing lost:
every SDD Ready, exactly one planner pod per plan key ever created, no orphaned child, and
conditions that tell the truth.

Each storm applies STORM copies of examples/spec-deploy.yaml at once (real planner pods, KWOK
workers on H100 nodes added for the storm). Where each fault comes from:
- the operator is SIGKILLed three times while the storm is reconciled, and started again each time;
- the API server stops for 30 s while the storm is reconciled, then starts again with the same
  command line (its clients, the operator included, see connections refused, then reconnect);
  the controller manager and the scheduler restart after it, as they do when they lose their
  leader lease in such an outage;
- the operator's watches expire (410 Gone): it is frozen with its watches open while half the
  storm is applied, etcd is compacted and the API server restarted, so that the version its
  watches resume from is gone, and it must list again to find what it missed;
- API Priority and Fairness throttles the operator (429): it runs as a ServiceAccount whose
  FlowSchema leads to a priority level with the smallest concurrency share, rejecting what it
  cannot seat at once.
"""

from __future__ import annotations

import copy
import base64
import json
import signal
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from devtools.cluster.wait import wait_for
from tests.e2e_helpers import NODES_FILE, Operator, condition, example

pytestmark = pytest.mark.slow

STORM = 64
READY_TIMEOUT = 420


@pytest.fixture
def storm_nodes(cluster):
    """H100 KWOK nodes enough for the storm's one GPU per SDD (the plane's own two hold 16)."""
    base = next(d for d in yaml.safe_load_all(NODES_FILE.read_text()) if d["metadata"]["name"] == "h100-node-1")
    names = []
    for i in range(-(-STORM // 8)):
        node = copy.deepcopy(base)
        name = node["metadata"]["name"] = f"h100-storm-{i}"
        node["metadata"]["labels"]["kubernetes.io/hostname"] = name
        node["status"]["addresses"] = [{"type": "InternalIP", "address": f"10.3.0.{i + 10}"},
                                       {"type": "Hostname", "address": name}]
        names.append(name)
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(node))
    yield names
    cluster.kubectl("delete", "node", *names, "--wait=false", check=False)


def storm(cluster, namespace: str, indices: range = range(STORM)) -> list[str]:
    bodies = []
    for i in indices:
        body = example()
        body["metadata"] = {"name": f"storm-{i:03d}", "namespace": namespace}
        bodies.append(body)
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(bodies), timeout=120)
    return [b["metadata"]["name"] for b in bodies]


def sdds(cluster, namespace: str) -> list[dict]:
    return json.loads(cluster.kubectl("get", "sdd", "-n", namespace, "-o", "json", timeout=60).stdout)["items"]


def wait_all_ready(cluster, namespace: str, names: list[str]) -> None:
    def all_ready():
        items = sdds(cluster, namespace)
        return len(items) == len(names) and all((s.get("status") or {}).get("phase") == "Ready" for s in items)

    wait_for(all_ready, timeout=READY_TIMEOUT, interval=2, what=f"{len(names)} SDDs Ready")


def assert_nothing_lost(cluster, namespace: str, names: list[str]) -> None:
    items = {s["metadata"]["name"]: s for s in sdds(cluster, namespace)}
    assert sorted(items) == sorted(names)
    # Conditions that tell the truth: Ready with its replicas, planned, nothing degraded.
    for name, sdd in items.items():
        status = sdd["status"]
        assert status["phase"] == "Ready", (name, status)
        for ctype, want in (("Ready", "True"), ("Available", "True"), ("Planned", "True"), ("Degraded", "False")):
            assert condition(sdd, ctype)["status"] == want, (name, ctype, condition(sdd, ctype))
        assert status.get("readyReplicas") == sdd["spec"]["replicas"], (name, status)
    # Exactly one planner pod per plan key ever created: the scheduler's Scheduled events name every
    # pod it ever bound, deleted ones included, by UID.
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Scheduled",
                                        "-o", "json", timeout=60).stdout)["items"]
    uids_by_pod: dict[str, set[str]] = defaultdict(set)
    for e in events:
        obj = e["involvedObject"]
        if obj.get("kind") == "Pod" and "-plan-" in obj["name"]:
            uids_by_pod[obj["name"]].add(obj["uid"])
    planners = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "specdecode.io/role=planner",
                                          "-o", "json", timeout=60).stdout)["items"]
    keys_by_sdd: dict[str, set[str]] = defaultdict(set)
    for pod in planners:
        meta = pod["metadata"]
        keys_by_sdd[meta["labels"]["specdecode.io/name"]].add(meta["labels"]["specdecode.io/plan-key"])
        assert uids_by_pod[meta["name"]] == {meta["uid"]}, (meta["name"], uids_by_pod[meta["name"]])
    for name, sdd in items.items():
        assert keys_by_sdd[name] == {sdd["status"]["plan"]["key"]}, (name, keys_by_sdd[name])
    more = {n: u for n, u in uids_by_pod.items() if len(u) > 1}
    assert not more, f"planner pods created more than once: {more}"
    # No orphaned child: every object the operator made belongs to a live SDD, and each SDD has one
    # Deployment and one Service.
    uids = {s["metadata"]["uid"] for s in items.values()}
    owned: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for kind in ("deployments", "services", "configmaps", "pods"):
        objs = json.loads(cluster.kubectl("get", kind, "-n", namespace, "-l", "specdecode.io/name", "-o", "json",
                                          timeout=60).stdout)["items"]
        for obj in objs:
            refs = obj["metadata"].get("ownerReferences") or []
            if kind == "pods" and any(r["kind"] == "ReplicaSet" for r in refs):
                continue  # a worker pod: its ReplicaSet's Deployment is checked
            assert any(r.get("uid") in uids for r in refs), (kind, obj["metadata"]["name"], refs)
            owned[kind][obj["metadata"]["labels"]["specdecode.io/name"]] += 1
    for name in names:
        assert owned["deployments"][name] == 1 and owned["services"][name] == 1, (name, dict(owned))


def test_operator_sigkilled_three_times_in_a_storm_loses_nothing(cluster, crd, namespace, store, storm_nodes):
    op = Operator(cluster, namespace).start()
    try:
        names = storm(cluster, namespace)
        for delay in (3, 6, 9):
            time.sleep(delay)
            op.kill()
            op.start()
        wait_all_ready(cluster, namespace, names)
        assert op.starts == 4
        assert_nothing_lost(cluster, namespace, names)
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.tail(60)}")


def test_api_server_stopped_30s_in_a_storm_loses_nothing(cluster, crd, namespace, store, storm_nodes):
    op = Operator(cluster, namespace).start()
    try:
        names = storm(cluster, namespace)
        time.sleep(4)  # planners and pods on their way
        cluster.restart("kube-apiserver", down_for=30)
        # The controller manager and the scheduler lose their leader lease in such an outage, exit,
        # and their supervisor starts them again (the test bed runs them without leader election;
        # left running, the controller manager's caches stay behind its own writes).
        for name in ("kube-controller-manager", "kube-scheduler"):
            cluster.restart(name)
        assert op.proc.poll() is None, f"the operator exited during the outage: {op.tail()}"
        wait_all_ready(cluster, namespace, names)
        assert_nothing_lost(cluster, namespace, names)
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.tail(60)}")


def etcd_compact(cluster) -> int:
    """Compact etcd up to its current revision (what the API server does every 5 minutes); returns it."""
    base = f"http://127.0.0.1:{cluster.ports['etcd']}/v3/kv"

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(f"{base}/{path}", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    revision = int(post("range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
    post("compaction", {"revision": str(revision), "physical": True})
    return revision


def watch_events(cluster, namespace: str, resource_version: str) -> list[dict]:
    """The events a watch of the namespace's SDDs from ``resource_version`` gets in 2 s."""
    path = (f"/apis/specdecode.io/v1alpha1/namespaces/{namespace}/specdecodedeployments"
            f"?watch=1&resourceVersion={resource_version}&timeoutSeconds=2")
    out = cluster.kubectl("get", "--raw", path, timeout=60, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_watches_expired_by_compaction_lose_nothing(cluster, crd, namespace, store, storm_nodes):
    """410 Gone. The operator is frozen (SIGSTOP) with its watches open; the storm's second half is
    applied, etcd is compacted, and the API server restarts (its watch cache begins after the
    compaction). When the operator runs again its watches resume from versions that are gone, get
    410 Gone, and list again: the SDDs it never saw are reconciled like the others."""
    op = Operator(cluster, namespace, "--verbose").start()
    half = STORM // 2
    try:
        names = storm(cluster, namespace, range(half))
        time.sleep(4)  # the operator sees them and starts planning
        op.proc.send_signal(signal.SIGSTOP)
        names += storm(cluster, namespace, range(half, STORM))
        last_seen = max(int(s["metadata"]["resourceVersion"]) for s in sdds(cluster, namespace))
        cluster.kubectl("create", "configmap", "after-the-storm", "-n", namespace)  # etcd moves past every SDD
        assert etcd_compact(cluster) > last_seen
        cluster.restart("kube-apiserver", down_for=1)
        for name in ("kube-controller-manager", "kube-scheduler"):  # as in the outage above
            cluster.restart(name)
        expired = [e for e in watch_events(cluster, namespace, str(last_seen)) if e["type"] == "ERROR"]
        assert expired and expired[0]["object"]["code"] == 410, expired  # what the operator's watches will get
        op.proc.send_signal(signal.SIGCONT)
        wait_all_ready(cluster, namespace, names)
        assert_nothing_lost(cluster, namespace, names)
        assert "Restarting the watch-stream for specdecodedeployments" in op.log.read_text()  # kopf's 410 path
    finally:
        op.proc.send_signal(signal.SIGCONT)
        op.stop()
        print(f"--- operator log (tail) ---\n{op.tail(60)}")


def throttled_kubeconfig(cluster, namespace: str, path) -> tuple[str, str]:
    """A ServiceAccount for the operator (cluster-admin: its rules are not what this is about),
    classed by a FlowSchema into a priority level of 1 concurrency share that rejects (429) what
    it cannot seat; returns (kubeconfig written to ``path``, the FlowSchema's name)."""
    name = f"throttled-{namespace}"[:63]
    cluster.kubectl("create", "serviceaccount", "specdecode-operator", "-n", namespace)
    cluster.kubectl("create", "clusterrolebinding", name, "--clusterrole=cluster-admin",
                    f"--serviceaccount={namespace}:specdecode-operator")
    level = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
             "metadata": {"name": name},
             "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 1, "lendablePercent": 0,
                                                     "borrowingLimitPercent": 0, "limitResponse": {"type": "Reject"}}}}
    everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"], "clusterScope": True}
    schema = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": name},
              "spec": {"priorityLevelConfiguration": {"name": name}, "matchingPrecedence": 500,
                       "distinguisherMethod": {"type": "ByUser"},
                       "rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                           "name": "specdecode-operator", "namespace": namespace}}],
                                  "resourceRules": [everything],
                                  "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([level, schema]))
    token = cluster.kubectl("create", "token", "specdecode-operator", "-n", namespace, "--duration=2h").stdout.strip()
    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    path.write_text(yaml.safe_dump(config))
    return str(path), name


def rejected_by_flow_control(cluster, flow_schema: str) -> int:
    """Requests API Priority and Fairness rejected in ``flow_schema``, from the API server's metrics."""
    total = 0
    for line in cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout.splitlines():
        if line.startswith("apiserver_flowcontrol_rejected_requests_total{") and f'flow_schema="{flow_schema}"' in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_operator_throttled_by_priority_and_fairness_loses_nothing(cluster, crd, namespace, store, storm_nodes,
                                                                  tmp_path):
    kubeconfig, schema = throttled_kubeconfig(cluster, namespace, tmp_path / "operator.kubeconfig")
    op = Operator(cluster, namespace, env={**cluster.env, "KUBECONFIG": kubeconfig}).start()
    try:
        names = storm(cluster, namespace)
        wait_all_ready(cluster, namespace, names)
        assert_nothing_lost(cluster, namespace, names)
        rejected = rejected_by_flow_control(cluster, schema)
        assert rejected > 0, "the storm was never throttled: the fault did not happen"
        with urllib.request.urlopen(op.health, timeout=10) as r:
            print(f"429s: {rejected} rejected by APF; the operator's liveness: {r.read().decode()[:400]}")
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.tail(60)}")
        name = f"throttled-{namespace}"[:63]
        cluster.kubectl("delete", "flowschema,prioritylevelconfiguration,clusterrolebinding", name, check=False)
