"""The planner runtime's rules, without a cluster: path mapping, $(VAR) expansion, kubelet's
termination message, and the volume each claim gets."""

from __future__ import annotations

from pathlib import Path

from devtools.cluster.local_volumes import volume_for_claim
from devtools.cluster.planner_runtime import (
    exit_status,
    expand_vars,
    map_paths,
    plan_launch,
    termination_message,
)

POD = {
    "metadata": {"name": "sd-plan-1234", "namespace": "team-a", "uid": "u-1"},
    "spec": {
        "nodeName": "h100-node-1",
        "volumes": [
            {"name": "store", "persistentVolumeClaim": {"claimName": "models"}},
            {"name": "cache", "hostPath": {"path": "/var/cache/hf"}},
            {"name": "token", "projected": {"sources": []}},
        ],
        "containers": [{
            "name": "planner",
            "image": "specdecode/worker:test",
            "args": ["plan", "--target=/models/llama", "--draft", "/models/eagle",
                     "--output", "/dev/termination-log", "--cache", "/var/cache/hf/x", "--gpus=$(GPUS)"],
            "env": [
                {"name": "GPUS", "value": "8"},
                {"name": "STORE", "value": "/models"},
                {"name": "NOT_A_MOUNT", "value": "/modelsX/a"},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
            "volumeMounts": [
                {"name": "store", "mountPath": "/models", "readOnly": True},
                {"name": "cache", "mountPath": "/cache"},
                {"name": "token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
            ],
        }],
    },
}


def test_launch_maps_claims_termination_log_env_and_default_entrypoint(tmp_path):
    launch = plan_launch(POD, Path("/pvc"), tmp_path / "scratch", {"PATH": "/usr/bin", "HOME": "/root"})
    assert launch.argv == [
        "specdecode-worker", "plan", "--target=/pvc/team-a/models/llama", "--draft", "/pvc/team-a/models/eagle",
        "--output", str(tmp_path / "scratch" / "termination-log"), "--cache", "/var/cache/hf/x", "--gpus=8",
    ]
    assert launch.env["STORE"] == "/pvc/team-a/models"
    assert launch.env["NOT_A_MOUNT"] == "/modelsX/a"
    assert launch.env["POD"] == "sd-plan-1234"
    assert launch.env["HOME"] == "/root"
    assert launch.env["PATH"].endswith(":/usr/bin")
    assert launch.termination_file.read_bytes() == b""
    assert not launch.fallback_to_logs


def test_map_paths_only_whole_path_components():
    mapping = {"/models": "/pvc/ns/m", "/models/sub": "/other"}
    assert map_paths("/models", mapping) == "/pvc/ns/m"
    assert map_paths("/models/a/b", mapping) == "/pvc/ns/m/a/b"
    assert map_paths("/models/sub/x", mapping) == "/other/x"  # the longest mount wins
    assert map_paths("cat /models/a > out", mapping) == "cat /pvc/ns/m/a > out"
    assert map_paths("--dir='/models/a'", mapping) == "--dir='/pvc/ns/m/a'"
    assert map_paths("/modelsX", mapping) == "/modelsX"
    assert map_paths("/data/models", mapping) == "/data/models"
    assert map_paths("x>/models/a;y", mapping) == "x>/pvc/ns/m/a;y"
    assert map_paths("$(cat /models)|z", mapping) == "$(cat /pvc/ns/m)|z"
    assert map_paths("/models.bak /models-old /models_x", mapping) == "/models.bak /models-old /models_x"


def test_expand_vars_like_kubernetes():
    env = {"A": "1", "B_C": "two"}
    assert expand_vars("$(A)-$(B_C)", env) == "1-two"
    assert expand_vars("$(MISSING)", env) == "$(MISSING)"
    assert expand_vars("$$(A)", env) == "$(A)"
    assert expand_vars("$A", env) == "$A"


def test_termination_message_follows_kubelet():
    assert termination_message(b"plan", b"logs", 0, True) == "plan"
    assert termination_message(b"x" * 5000, b"", 0, False) == "x" * 4096
    assert termination_message(b"", b"logs\n", 1, False) == ""
    assert termination_message(b"", b"logs\n", 0, True) == ""
    many = b"".join(b"line %d\n" % i for i in range(100))
    assert termination_message(b"", many, 1, True) == "".join(f"line {i}\n" for i in range(20, 100))
    long = b"y" * 3000
    assert termination_message(b"", long, 1, True) == "y" * 2048


def test_exit_status_of_signalled_process():
    assert exit_status(3) == 3
    assert exit_status(-9) == 137


def test_claim_gets_prebound_host_path_volume():
    claim = {"metadata": {"name": "models", "namespace": "team-a", "uid": "c-1"},
             "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "standard",
                      "resources": {"requests": {"storage": "50Gi"}}}}
    pv = volume_for_claim(claim, Path("/pvc"))
    assert pv["spec"]["hostPath"]["path"] == "/pvc/team-a/models"
    assert pv["spec"]["claimRef"]["uid"] == "c-1"
    assert pv["spec"]["capacity"] == {"storage": "50Gi"}
    assert pv["spec"]["storageClassName"] == "standard"
    assert pv["spec"]["accessModes"] == ["ReadOnlyMany"]


class FakeApi:
    """Serves a fixed pod list and two nodes, one of them KWOK's, and records annotation patches."""

    def __init__(self, pods):
        self.pods = pods
        self.patches = []
        self.nodes = [{"metadata": {"name": "h100-node-1", "annotations": {"kwok.x-k8s.io/node": "fake"}}},
                      {"metadata": {"name": "real-node-0"}}]

    def get(self, path, **query):
        if path == "/api/v1/nodes":
            return {"items": self.nodes}
        assert query == {"labelSelector": "specdecode.io/role in (planner,model-cache)"}
        return {"items": self.pods}

    def merge_patch(self, path, patch):
        self.patches.append((path, patch))


def _running_pod(uid, annotations=None):
    return {
        "metadata": {"name": f"p-{uid}", "namespace": "ns", "uid": uid, "annotations": annotations or {}},
        "spec": {"nodeName": "h100-node-1", "containers": [{"name": "c", "command": ["true"]}]},
        "status": {"phase": "Running"},
    }


def test_runner_never_reruns_a_pod_an_earlier_runner_started(tmp_path):
    from devtools.cluster.planner_runtime import ANN_EXIT_CODE, Runner

    api = FakeApi([_running_pod("started-before"), _running_pod("done", {ANN_EXIT_CODE: "0"})])
    (tmp_path / "started-before.started").touch()
    runner = Runner(api, tmp_path, tmp_path, tmp_path)
    runner.poll_once()
    runner.poll_once()
    assert runner.active == {}
    assert len(api.patches) == 1
    path, patch = api.patches[0]
    assert path == "/api/v1/namespaces/ns/pods/p-started-before"
    assert patch["metadata"]["uid"] == "started-before"
    assert patch["metadata"]["annotations"][ANN_EXIT_CODE] == "137"


def test_read_only_root_leaves_only_the_mounts_writable(tmp_path):
    import copy
    import subprocess

    pod = copy.deepcopy(POD)
    pod["spec"]["volumes"].append({"name": "tmp", "emptyDir": {}})
    container = pod["spec"]["containers"][0]
    container["volumeMounts"].append({"name": "tmp", "mountPath": "/tmp"})
    container["securityContext"] = {"readOnlyRootFilesystem": True}
    launch = plan_launch(pod, Path("/pvc"), tmp_path / "scratch", {"PATH": "/usr/bin", "HOME": "/root",
                                                                  "TMPDIR": "/var/tmp"})
    assert launch.env["TMPDIR"] == str(tmp_path / "scratch" / "volumes" / "tmp")
    assert launch.env["HOME"] != "/root" and launch.cwd != str(tmp_path / "scratch")
    # what stands in for the read-only root refuses writes even to root
    for target in (f"{launch.env['HOME']}/.cache/x", f"{launch.cwd}/x"):
        r = subprocess.run(["sh", "-c", f"mkdir -p {target}"], cwd=launch.cwd,
                           capture_output=True)
        assert r.returncode != 0, target
    writable = subprocess.run(["sh", "-c", 'touch "$TMPDIR/x"'], cwd=launch.cwd, env=launch.env)
    assert writable.returncode == 0

    container["securityContext"] = {}  # a writable root: the runtime's own defaults
    launch = plan_launch(pod, Path("/pvc"), tmp_path / "scratch2", {"PATH": "/usr/bin", "HOME": "/root"})
    assert launch.env["HOME"] == "/root" and launch.cwd == str(tmp_path / "scratch2")


def test_runner_leaves_pods_on_a_real_node_to_its_kubelet(tmp_path):
    from devtools.cluster.planner_runtime import Runner

    pod = _running_pod("on-real-node")
    pod["spec"]["nodeName"] = "real-node-0"
    runner = Runner(FakeApi([pod]), tmp_path, tmp_path, tmp_path)
    runner.poll_once()
    assert runner.active == {} and not (tmp_path / "on-real-node.started").exists()
