"""The operator end to end on the real control plane, driven with kubectl as a user would.

Each test gets a namespace, a `models` PVC holding sparse copies of published checkpoints (real
configs and safetensors headers: the planner pod runs the real `specdecode-worker plan` on them),
and its own `specdecode-operator --namespace <ns>` process. Worker pods become Ready through KWOK;
no worker process runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from devtools.cluster.wait import wait_for
from tests.e2e_helpers import (
    DRAFT, OTHER_DRAFT, Operator, ROOT, TARGET, apply, condition, example, get_object, list_objects, local_plan,
    phase_is, planner_pods, wait_sdd,
)

pytestmark = pytest.mark.timeout(300)


NAME = "llama-8b-eagle3"


# --- tests ----------------------------------------------------------------------------------------

def test_example_plans_deploys_scales_replans_and_deletes(cluster, namespace, store, operator):
    apply(cluster, namespace, example())
    sdd = wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready")

    # status.plan is the CLI's own plan for the same inputs
    expected = local_plan(store, "--draft", str(store / DRAFT), "--algorithm", "EAGLE3", "--tp", "auto",
                          "--dtype", "bfloat16", "--gpu-product", "NVIDIA-H100-80GB-HBM3", "--context-length", "8192",
                          "--min-kv-tokens", "65536", "--max-running-requests", "64")
    plan = sdd["status"]["plan"]
    for k in ("apiVersion", "kind", "target", "draft"):  # names are the paths, which differ in the pod
        expected.pop(k)
    assert {k: v for k, v in plan.items() if k in expected} == expected
    tp = plan["tensorParallelSize"]
    assert condition(sdd, "Planned")["reason"] == "PlanReady"
    assert condition(sdd, "Available")["status"] == "True" and condition(sdd, "Degraded")["status"] == "False"
    assert sdd["status"]["observedGeneration"] == sdd["metadata"]["generation"]

    dep = get_object(cluster, namespace, "deployment", NAME)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == tp
    args = container["args"]
    assert args[args.index("--max-total-tokens") + 1] == str(plan["kvCache"]["maxTotalNumTokens"])
    assert dep["metadata"]["ownerReferences"][0]["uid"] == sdd["metadata"]["uid"]
    full = json.loads(cluster.kubectl("get", "deployment", NAME, "-n", namespace, "-o", "json",
                                      "--show-managed-fields").stdout)
    managers = {(m["manager"], m["operation"]) for m in full["metadata"]["managedFields"]}
    assert ("specdecode-operator", "Apply") in managers  # server-side apply with our field manager
    for kind, child in (("configmap", f"{NAME}-plan"), ("service", NAME)):
        owner = get_object(cluster, namespace, kind, child)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == \
            ("SpecDecodeDeployment", sdd["metadata"]["uid"], True)
    workers = list_objects(cluster, namespace, "pods", "specdecode.io/name=llama-8b-eagle3,specdecode.io/role=worker")
    assert len(workers) == 1 and workers[0]["spec"]["nodeName"].startswith("h100-node-")
    pinned = json.loads(get_object(cluster, namespace, "configmap", f"{NAME}-plan")["data"]["plan.json"])
    assert pinned["kvCache"] == plan["kvCache"]
    assert get_object(cluster, namespace, "service", NAME)["spec"]["ports"][0]["port"] == 8000
    table = cluster.kubectl("get", "sdd", NAME, "-n", namespace).stdout
    assert "Ready" in table and str(plan["kvCache"]["maxTotalNumTokens"]) in table
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                             f"involvedObject.name={NAME}", "-o", "json").stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Planning", "PlanReady", "Ready"} <= reasons
    (first_planner,) = planner_pods(cluster, namespace, NAME)

    # scale through the scale subresource: no new plan, the same pod template
    template_hash = dep["spec"]["template"]
    cluster.kubectl("scale", "sdd", NAME, "-n", namespace, "--replicas=3")
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: s["status"].get("readyReplicas") == 3
                   and s["status"]["phase"] == "Ready", "3 ready replicas")
    assert sdd["status"]["plan"]["key"] == plan["key"]
    assert [p["metadata"]["uid"] for p in planner_pods(cluster, namespace, NAME)] == [first_planner["metadata"]["uid"]]
    dep = get_object(cluster, namespace, "deployment", NAME)
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["template"] == template_hash
    assert len(list_objects(cluster, namespace, "replicasets", "specdecode.io/name=llama-8b-eagle3")) == 1

    # a new draft model: a new plan, a rolled pod template, the old planner pod cleaned up
    apply(cluster, namespace, example(replicas=3, draft__model=OTHER_DRAFT))
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: s["status"]["plan"]["key"] != plan["key"]
                   and s["status"]["phase"] == "Ready" and s["status"].get("updatedReplicas") == 3,
                   "re-planned and rolled")
    dep = get_object(cluster, namespace, "deployment", NAME)
    assert dep["spec"]["template"]["metadata"]["annotations"]["specdecode.io/plan-key"] == sdd["status"]["plan"]["key"]
    assert f"/models/{OTHER_DRAFT}" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    wait_for(lambda: [p["metadata"]["labels"]["specdecode.io/plan-key"] for p in planner_pods(cluster, namespace, NAME)]
             == [sdd["status"]["plan"]["key"]], timeout=30, what="only the new planner pod left")

    # deleting the SDD removes every child (owner references + garbage collection)
    cluster.kubectl("delete", "sdd", NAME, "-n", namespace, "--wait=true", "--timeout=60s")

    def all_gone():
        left = []
        for kind in ("deployments", "replicasets", "services", "configmaps", "pods"):
            items = list_objects(cluster, namespace, kind, "specdecode.io/name=llama-8b-eagle3")
            left += [f"{kind}/{i['metadata']['name']}" for i in items]
        return not left or None

    wait_for(all_gone, timeout=60, interval=1, what="every child deleted")


def test_invalid_specs_are_refused_by_the_api_server(cluster, crd, namespace):
    cases = [
        ({"draft": {"algorithm": "EAGLE3"}}, "draft.model is required"),
        ({"draft": {"algorithm": "NGRAM", "model": DRAFT}}, "NGRAM drafts from the prompt"),
        ({"draft": {"algorithm": "MEDUSA", "model": DRAFT}}, "Unsupported value: \"MEDUSA\""),
        ({"draft": {"algorithm": "EAGLE3", "model": DRAFT, "numSteps": 3, "numDraftTokens": 7}},
         "numDraftTokens must equal numSteps + 1"),
        # top-2 over 3 steps has 2 + 2 * 4 = 10 candidates: 11 verified tokens at most
        ({"draft": {"algorithm": "EAGLE3", "model": DRAFT, "numSteps": 3, "topK": 2, "numDraftTokens": 12}},
         "the tree's candidates plus its root"),
        ({"serving": {"memFractionStatic": 1.2}}, "strictly between 0 and 1"),
        ({"serving": {"contextLength": 8}}, "should be greater than or equal to 16"),
        ({"gpu": {}}, "so the planner knows how much memory a GPU has"),
        ({"modelStore": {"pvc": {"claimName": "m"}, "hub": {}}}, "exactly one of modelStore.pvc or modelStore.hub"),
        ({"target": {"model": "/abs/path"}}, "no leading '/'"),
        ({"replicas": -1}, "should be greater than or equal to 0"),
    ]
    for change, message in cases:
        body = example()
        body["spec"].update(change)
        r = apply(cluster, namespace, body, check=False)
        assert r.returncode != 0 and message in r.stderr, (change, r.stderr)
    assert get_object(cluster, namespace, "sdd", NAME) is None
    # every shipped example is accepted (server-side dry run)
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))


def test_model_too_large_for_the_gpus(cluster, namespace, store, operator):
    apply(cluster, namespace, example(gpu={"product": "NVIDIA-H100-80GB-HBM3", "memoryGiB": 4}))
    sdd = wait_sdd(cluster, namespace, NAME, phase_is("Failed"), "Failed")
    planned = condition(sdd, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "InsufficientGPUMemory")
    short = sdd["status"]["plan"]["shortfallBytes"]
    assert short > 0 and str(short) in planned["message"]
    assert sdd["status"]["plan"]["fits"] is False
    assert get_object(cluster, namespace, "deployment", NAME) is None
    assert len(planner_pods(cluster, namespace, NAME)) == 1


def test_planner_failure_is_reported_and_retried(cluster, namespace, store, operator):
    config = store / TARGET / "config.json"
    good = config.read_text()
    broken = json.loads(good)
    del broken["hidden_size"]
    config.write_text(json.dumps(broken))
    apply(cluster, namespace, example())
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: (condition(s, "Planned") or {}).get("reason") == "PlannerFailed",
                   "PlannerFailed")
    message = condition(sdd, "Planned")["message"]
    assert "hidden_size" in message and "bad input" in message, message
    assert sdd["status"]["phase"] == "Failed" and get_object(cluster, namespace, "deployment", NAME) is None
    first_uid = planner_pods(cluster, namespace, NAME)[0]["metadata"]["uid"]
    config.write_text(good)  # the user fixes the model store; the retry picks it up
    sdd = wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready after a retry", timeout=60)
    (pod,) = planner_pods(cluster, namespace, NAME)
    assert pod["metadata"]["uid"] != first_uid
    assert sdd["status"]["planner"]["attempts"] == 0


def test_operator_killed_mid_plan_resumes_with_one_planner_pod(cluster, crd, namespace, store):
    op = Operator(cluster, namespace).start()
    try:
        apply(cluster, namespace, example())
        wait_for(lambda: planner_pods(cluster, namespace, NAME), timeout=60, interval=0.1, what="planner pod created")
        op.kill()  # the planner pod runs on while no operator watches
        (pod,) = planner_pods(cluster, namespace, NAME)
        op.start()
        wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready after the restart")
        assert [p["metadata"]["uid"] for p in planner_pods(cluster, namespace, NAME)] == [pod["metadata"]["uid"]]
        assert len(list_objects(cluster, namespace, "replicasets", "specdecode.io/name=llama-8b-eagle3")) == 1
        op.kill()  # and once more, when everything is done: a restart changes nothing
        rv = get_object(cluster, namespace, "sdd", NAME)["status"]
        op.start()
        wait_for(lambda: "resum" in op.tail(200).lower() or None, timeout=30, what="resume handled")
        assert get_object(cluster, namespace, "sdd", NAME)["status"]["phase"] == "Ready"
        assert len(planner_pods(cluster, namespace, NAME)) == 1
        assert rv["plan"] == get_object(cluster, namespace, "sdd", NAME)["status"]["plan"]
    finally:
        op.stop()


def test_more_gpus_per_replica_than_any_node(cluster, namespace, store, operator):
    # On L4s (one per node here) this model needs tensor parallelism 2. Read from the nodes, one GPU
    # per node spreads a replica over two nodes, which needs LeaderWorkerSet (not installed here).
    apply(cluster, namespace, example(gpu={"product": "NVIDIA-L4"}))
    sdd = wait_sdd(cluster, namespace, NAME, phase_is("Degraded"), "Degraded")
    assert (sdd["status"]["plan"]["tensorParallelSize"], sdd["status"]["plan"]["nodesPerReplica"]) == (2, 2)
    assert (sdd["status"]["planner"]["gpusPerNode"], sdd["status"]["planner"]["gpusPerNodeFrom"]) == (1, "nodes")
    degraded = condition(sdd, "Degraded")
    assert degraded["reason"] == "MultiNodeUnavailable", degraded
    assert "nodes with 2 GPUs of gpu.product (planned for 1 GPUs per node, from nodes)" in degraded["message"]
    # A gpu.perNode the nodes do not have keeps the replica in one pod, which no node can hold.
    apply(cluster, namespace, example(gpu={"product": "NVIDIA-L4", "perNode": 8}))
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: (condition(s, "Degraded") or {}).get("reason")
                   == "PlanExceedsNodeGPUs", "PlanExceedsNodeGPUs")
    assert (sdd["status"]["plan"]["tensorParallelSize"], sdd["status"]["plan"]["nodesPerReplica"]) == (2, 1)
    degraded = condition(sdd, "Degraded")
    assert "needs 2 GPUs per replica" in degraded["message"] and "NVIDIA-L4 offers is 1" in degraded["message"]
    assert "set gpu.perNode to 1" in degraded["message"]
    (pod,) = list_objects(cluster, namespace, "pods", "specdecode.io/name=llama-8b-eagle3,specdecode.io/role=worker")
    assert not pod["spec"].get("nodeName")
    (pod,) = list_objects(cluster, namespace, "pods", "specdecode.io/name=llama-8b-eagle3,specdecode.io/role=worker")
    assert not pod["spec"].get("nodeName")


def test_replicas_beyond_free_gpus_are_unschedulable_with_the_scheduler_message(cluster, namespace, store, operator):
    # 7 GiB GPUs need tensor parallelism 8; two 8-GPU nodes host two such replicas, not three.
    apply(cluster, namespace, example(replicas=3, gpu={"product": "NVIDIA-H100-80GB-HBM3", "memoryGiB": 7}))
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: (condition(s, "Degraded") or {}).get("reason") == "Unschedulable"
                   and s["status"].get("readyReplicas") == 2, "Degraded=Unschedulable with 2 ready replicas")
    degraded = condition(sdd, "Degraded")
    assert degraded["status"] == "True" and "Insufficient nvidia.com/gpu" in degraded["message"], degraded
    assert sdd["status"]["plan"]["tensorParallelSize"] == 8
    assert sdd["status"]["phase"] == "Degraded" and sdd["status"]["readyReplicas"] == 2
    assert condition(sdd, "Available")["status"] == "True"
    # scaling down to what fits clears it
    cluster.kubectl("scale", "sdd", NAME, "-n", namespace, "--replicas=2")
    wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready at 2 replicas")


# Exactly what the operator needs in a watched namespace (plus `list nodes` cluster-wide, optional).
OPERATOR_RULES = [
    {"apiGroups": ["specdecode.io"], "resources": ["specdecodedeployments"],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["specdecode.io"], "resources": ["specdecodedeployments/status"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
    # server-side apply needs create as well as patch when the object does not exist yet
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": ["create", "patch"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]
NODE_RULES = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]


def test_operator_runs_with_least_privilege(cluster, crd, namespace, store, tmp_path):
    sa = "specdecode-operator"
    cluster_role = f"specdecode-nodes-{namespace}"[:63]
    docs = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": sa, "namespace": namespace},
         "rules": OPERATOR_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": sa, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": cluster_role},
         "rules": NODE_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": cluster_role},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
         "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]},
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    op = Operator(cluster, namespace, env=dict(cluster.env, KUBECONFIG=str(kubeconfig))).start()
    try:
        apply(cluster, namespace, example())
        sdd = wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready under least privilege")
        cluster.kubectl("scale", "sdd", NAME, "-n", namespace, "--replicas=2")
        wait_sdd(cluster, namespace, NAME, lambda s: s["status"].get("readyReplicas") == 2
                 and s["status"]["phase"] == "Ready", "2 ready replicas")
        assert "Forbidden" not in op.tail(400) and "forbidden" not in op.tail(400), op.tail(60)
        assert sdd["status"]["plan"]["tensorParallelSize"] == 1
    finally:
        op.stop()
        print(f"--- operator log (tail) ---\n{op.tail(80)}")
        cluster.kubectl("delete", "clusterrole,clusterrolebinding", cluster_role, check=False)


# --- Pod Security "restricted" and refused children ------------------------------------------------

def _enforce(cluster, namespace, level):
    cluster.kubectl("label", "namespace", namespace, "--overwrite", f"pod-security.kubernetes.io/enforce={level}",
                    "pod-security.kubernetes.io/enforce-version=latest")


def test_every_rendered_pod_is_admitted_in_a_restricted_namespace(cluster, namespace):
    """The API server's own PodSecurity admission, as a second judge of what the unit tests check."""
    from tests.restricted_profile import rendered_pods

    _enforce(cluster, namespace, "restricted")
    cluster.kubectl("create", "serviceaccount", "puller", "-n", namespace)  # the variant with spec.pod's account
    for i, (what, spec) in enumerate(rendered_pods()):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"dry-{i}", "namespace": namespace},
               "spec": spec}
        r = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)
        assert r.returncode == 0 and "PodSecurity" not in r.stderr, (what, r.stderr)
    # and the admission is on: a pod the operator would never render is refused
    spec["securityContext"]["runAsUser"] = 0
    r = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root", "namespace": namespace}, "spec": spec}),
        check=False)
    assert r.returncode != 0 and 'violates PodSecurity "restricted:latest"' in r.stderr, r.stderr


def test_restricted_namespace_plans_and_reaches_ready(cluster, namespace, store, operator):
    _enforce(cluster, namespace, "restricted")
    apply(cluster, namespace, example())
    sdd = wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready in a restricted namespace")
    assert condition(sdd, "Planned")["reason"] == "PlanReady"
    (worker,) = list_objects(cluster, namespace, "pods", f"specdecode.io/name={NAME},specdecode.io/role=worker")
    assert worker["spec"]["securityContext"]["runAsNonRoot"] is True
    assert worker["spec"]["automountServiceAccountToken"] is False
    assert not [v for v in worker["spec"]["volumes"] if "projected" in v]  # no token volume was injected


def test_planner_pod_refused_by_admission_shows_in_status_and_recovers(cluster, namespace, store, operator):
    _enforce(cluster, namespace, "restricted")
    # an image that runs as root is what a restricted namespace refuses
    apply(cluster, namespace, example(pod={"securityContext": {"runAsUser": 0}}))
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: (condition(s, "Planned") or {}).get("reason")
                   == "PodSecurityRejected", "Planned=False PodSecurityRejected", timeout=15)
    planned = condition(sdd, "Planned")
    assert planned["status"] == "False" and 'violates PodSecurity "restricted:latest"' in planned["message"]
    assert "runAsUser=0" in planned["message"], planned["message"]
    assert sdd["status"]["phase"] == "Failed" and not planner_pods(cluster, namespace, NAME)

    def warnings():
        events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                                            f"involvedObject.name={NAME},type=Warning", "-o", "json").stdout)
        return [e for e in events["items"] if e["reason"] == "PodSecurityRejected"]

    (event,) = warnings()
    assert "violates PodSecurity" in event["message"]
    # the platform team relaxes the namespace: the operator's retry goes through, no edit, no restart
    _enforce(cluster, namespace, "baseline")
    wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready after the namespace was relaxed", timeout=120)
    assert len(warnings()) == 1 and operator.starts == 1


def _quota(cluster, namespace, gpus):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"},
        "spec": {"hard": {"requests.nvidia.com/gpu": str(gpus)}}}))


def test_gpu_quota_below_the_plan_is_quota_exceeded_then_ready_once_raised(cluster, namespace, store, operator):
    _quota(cluster, namespace, 0)
    wait_for(lambda: get_object(cluster, namespace, "resourcequota", "gpus").get("status", {}).get("hard"),
             timeout=30, what="quota status computed")
    apply(cluster, namespace, example())
    sdd = wait_sdd(cluster, namespace, NAME, lambda s: (condition(s, "Degraded") or {}).get("reason")
                   == "QuotaExceeded", "Degraded=True QuotaExceeded")
    degraded = condition(sdd, "Degraded")
    assert degraded["status"] == "True" and "exceeded quota: gpus" in degraded["message"], degraded
    assert "requests.nvidia.com/gpu" in degraded["message"]
    assert condition(sdd, "Ready")["reason"] == "QuotaExceeded" and sdd["status"]["phase"] == "Degraded"
    _quota(cluster, namespace, 1)
    wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready after the quota was raised", timeout=180)
