"""The test bed behaves like a real cluster: version, scheduling by GPUs, garbage collection,
CRD validation with CEL, and planner pods that really run and terminate with a message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from devtools.cluster.wait import wait_for

PINS = Path(__file__).parents[2] / "devtools" / "cluster" / "versions.env"
VERSIONS = dict(
    line.split("=", 1) for line in PINS.read_text().splitlines()
    if line and not line.startswith("#")
)


def apply(cluster, namespace: str, *docs: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(docs))


def get(cluster, namespace: str, kind: str, name: str) -> dict | None:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        assert "NotFound" in result.stderr, result.stderr
        return None
    return json.loads(result.stdout)


def pod(name: str, command: list[str], *, labels: dict | None = None, gpus: int = 0, **container_extra) -> dict:
    container = {"name": "main", "image": "specdecode/worker:test", "command": command, **container_extra}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"restartPolicy": "Never", "containers": [container]},
    }


def planner_pod(name: str, command: list[str], **container_extra) -> dict:
    return pod(name, command, labels={"specdecode.io/role": "planner"}, **container_extra)


def finished(cluster, namespace: str, name: str):
    def check():
        p = get(cluster, namespace, "pod", name)
        return p if p and p["status"].get("phase") in ("Succeeded", "Failed") else None

    return wait_for(check, timeout=60, what=f"pod {name} to finish")


def test_server_reports_pinned_versions(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == f"v{VERSIONS['KUBERNETES_VERSION']}"
    assert version["clientVersion"]["gitVersion"] == f"v{VERSIONS['KUBERNETES_VERSION']}"
    helm = cluster.helm("version", "--short").stdout
    assert helm.startswith(f"v{VERSIONS['HELM_VERSION']}"), helm


def test_fake_gpu_nodes(cluster):
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    gpus = {n["metadata"]["name"]: (n["metadata"]["labels"]["nvidia.com/gpu.product"],
                                    n["status"]["allocatable"]["nvidia.com/gpu"]) for n in nodes}
    assert gpus == {
        "h100-node-1": ("NVIDIA-H100-80GB-HBM3", "8"),
        "h100-node-2": ("NVIDIA-H100-80GB-HBM3", "8"),
        "l4-node-1": ("NVIDIA-L4", "1"),
    }


def test_deployment_pods_run_on_gpu_nodes(cluster, namespace):
    template = pod("x", ["serve"], gpus=4)
    template["metadata"] = {"labels": {"app": "web"}}
    template["spec"]["restartPolicy"] = "Always"
    template["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": template["metadata"], "spec": template["spec"]}},
    }
    apply(cluster, namespace, deployment)

    def ready():
        d = get(cluster, namespace, "deployment", "web")
        return d if d.get("status", {}).get("readyReplicas") == 3 else None

    wait_for(ready, timeout=60, what="deployment web to have 3 ready replicas")
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-l", "app=web", "-o", "json").stdout)["items"]
    assert len(pods) == 3
    for p in pods:
        assert p["status"]["phase"] == "Running"
        assert p["spec"]["nodeName"] in {"h100-node-1", "h100-node-2"}
        ready_condition = next(c for c in p["status"]["conditions"] if c["type"] == "Ready")
        assert ready_condition["status"] == "True"
    # 3 pods x 4 GPUs on two 8-GPU nodes: both nodes are used.
    assert {p["spec"]["nodeName"] for p in pods} == {"h100-node-1", "h100-node-2"}


def test_pod_asking_for_too_many_gpus_is_unschedulable(cluster, namespace):
    apply(cluster, namespace, pod("greedy", ["serve"], gpus=9))

    def unschedulable():
        p = get(cluster, namespace, "pod", "greedy")
        cond = next((c for c in p["status"].get("conditions", []) if c["type"] == "PodScheduled"), None)
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(unschedulable, timeout=30, what="PodScheduled=False on pod greedy")
    assert cond["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    assert get(cluster, namespace, "pod", "greedy")["status"]["phase"] == "Pending"


def test_deleting_owner_garbage_collects_dependents(cluster, namespace):
    apply(cluster, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    owner_uid = get(cluster, namespace, "configmap", "owner")["metadata"]["uid"]
    apply(cluster, namespace, {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dependent", "ownerReferences": [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}]},
    })
    assert get(cluster, namespace, "configmap", "dependent") is not None
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(lambda: get(cluster, namespace, "configmap", "dependent") is None, timeout=60,
             what="the garbage collector to delete the dependent")


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.specdecode.test"},
    "spec": {
        "group": "smoke.specdecode.test", "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
            "type": "object",
            "properties": {"spec": {
                "type": "object",
                "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
                "x-kubernetes-validations": [{"rule": "self.min <= self.max", "message": "min must not exceed max"}],
            }},
        }}}],
    },
}


def test_crd_cel_rule_rejects_bad_object(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(CRD))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD['metadata']['name']}", "--timeout=30s")

    def widget(name, lo, hi):
        return {"apiVersion": "smoke.specdecode.test/v1", "kind": "Widget", "metadata": {"name": name},
                "spec": {"min": lo, "max": hi}}

    # Discovery may lag the Established condition by a moment.
    wait_for(lambda: cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(widget("good", 1, 2)),
                                     check=False).returncode == 0, timeout=30, what="a valid Widget to be accepted")
    bad = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(widget("bad", 3, 2)), check=False)
    assert bad.returncode != 0
    assert "min must not exceed max" in bad.stderr
    assert get(cluster, namespace, "widget", "bad") is None


def test_planner_pod_succeeds_with_termination_message(cluster, namespace):
    apply(cluster, namespace, planner_pod("plan-ok", ["sh", "-c", "echo hello > /dev/termination-log"]))
    p = finished(cluster, namespace, "plan-ok")
    assert p["status"]["phase"] == "Succeeded"
    terminated = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert terminated["reason"] == "Completed"
    assert terminated["message"] == "hello\n"
    assert "running" not in p["status"]["containerStatuses"][0]["state"]


def test_planner_pod_failure_reports_exit_code(cluster, namespace):
    apply(cluster, namespace, planner_pod("plan-fail", ["sh", "-c", "echo bad input >&2; exit 3"]))
    p = finished(cluster, namespace, "plan-fail")
    assert p["status"]["phase"] == "Failed"
    terminated = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert terminated["reason"] == "Error"
    # Policy File (the default) with an empty file: no message, as with kubelet.
    assert "message" not in terminated


def test_planner_pod_falls_back_to_logs_on_error(cluster, namespace):
    apply(cluster, namespace, planner_pod("plan-logs", ["sh", "-c", "echo first; echo 'bad input' >&2; exit 2"],
                                          terminationMessagePolicy="FallbackToLogsOnError"))
    terminated = finished(cluster, namespace, "plan-logs")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 2
    assert terminated["message"] == "first\nbad input\n"


def test_planner_pod_sees_claim_folder_env_and_runs_once(cluster, namespace):
    apply(cluster, namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}},
    })
    wait_for(lambda: get(cluster, namespace, "pvc", "models")["status"].get("phase") == "Bound", timeout=30,
             what="claim models to be bound")
    store = cluster.pvc_root / namespace / "models"
    (store / "tiny").mkdir(parents=True)
    (store / "tiny" / "config.json").write_text('{"hidden_size": 64}')

    manifest = planner_pod(
        "plan-store",
        ["sh", "-c", 'cat "$MODEL_DIR/config.json" > /dev/termination-log; echo run >> /models/runs.txt'],
        env=[{"name": "MODEL_DIR", "value": "/models/tiny"}],
        volumeMounts=[{"name": "store", "mountPath": "/models"}],
    )
    manifest["spec"]["volumes"] = [{"name": "store", "persistentVolumeClaim": {"claimName": "models"}}]
    apply(cluster, namespace, manifest)
    p = finished(cluster, namespace, "plan-store")
    terminated = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (p["status"]["phase"], terminated["message"]) == ("Succeeded", '{"hidden_size": 64}')
    assert (store / "runs.txt").read_text() == "run\n"


def test_worker_entry_point_resolves_from_project_venv(cluster, namespace):
    apply(cluster, namespace, planner_pod(
        "plan-which", ["sh", "-c", "command -v specdecode-worker > /dev/termination-log"]))
    terminated = finished(cluster, namespace, "plan-which")["status"]["containerStatuses"][0]["state"]["terminated"]
    import sys

    assert terminated["message"].strip() == str(Path(sys.executable).parent / "specdecode-worker")


def test_deleting_a_running_planner_pod_kills_its_process(cluster, namespace, tmp_path):
    import os

    # "$$$$": Kubernetes turns "$$" into "$", so the shell sees "$$", its own pid.
    manifest = planner_pod("plan-slow", ["sh", "-c", "echo $$$$ > /work/pid; sleep 300"],
                           volumeMounts=[{"name": "work", "mountPath": "/work"}])
    manifest["spec"]["volumes"] = [{"name": "work", "hostPath": {"path": str(tmp_path)}}]
    apply(cluster, namespace, manifest)
    pid_file = tmp_path / "pid"
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=60,
                       what="the planner process to start"))
    os.kill(pid, 0)  # running
    cluster.kubectl("delete", "pod", "plan-slow", "-n", namespace, "--timeout=30s")

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=30, what=f"process {pid} to be killed")


def test_helm_install_waits_for_a_ready_deployment(cluster, namespace, tmp_path):
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    # kubeVersion is checked against the server's stamped version.
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\nkubeVersion: '>=1.30.0-0'\n")
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "tiny"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "tiny"}},
                 "template": {"metadata": {"labels": {"app": "tiny"}},
                              "spec": {"containers": [{"name": "c", "image": "specdecode/operator:test"}]}}},
    }
    (chart / "templates" / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    cluster.helm("install", "tiny", str(chart), "-n", namespace, "--wait", "--timeout", "60s")
    status = json.loads(cluster.helm("status", "tiny", "-n", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    assert get(cluster, namespace, "deployment", "tiny")["status"]["readyReplicas"] == 1

    too_new = chart.parent / "too-new"
    shutil.copytree(chart, too_new)
    (too_new / "Chart.yaml").write_text("apiVersion: v2\nname: too-new\nversion: 0.1.0\nkubeVersion: '>=9.0.0'\n")
    refused = cluster.helm("install", "too-new", str(too_new), "-n", namespace, check=False)
    assert refused.returncode != 0
    assert f"v{VERSIONS['KUBERNETES_VERSION']}" in refused.stderr, refused.stderr
