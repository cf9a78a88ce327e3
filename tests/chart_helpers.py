"""Helpers for tests that run the operator with the chart's own credentials and arguments: a
ServiceAccount kubeconfig, the operator as a local process, the standalone-draft example on tiny
local models, and a wait for Ready that fails on any RBAC refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from devtools import processes
from devtools.cluster.controlplane import free_ports
from devtools.cluster.wait import wait_for

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "specdecode-operator"
EXAMPLE = ROOT / "examples" / "standalone-draft.yaml"
H100 = "NVIDIA-H100-80GB-HBM3"  # a product of the test bed's fake nodes (devtools/cluster/nodes.yaml)
OPERATOR = Path(sys.executable).with_name("specdecode-operator")

RELEASE = "sdo"


def sa_kubeconfig(cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig holding only a token of the chart's ServiceAccount (no admin certificate)."""
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=2h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": sa, "context": {"cluster": admin["clusters"][0]["name"], "user": sa,
                                                "namespace": namespace}}],
        "current-context": sa,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class OperatorProcess:
    """An operator run as a child process: started, then polled on its liveness endpoint until
    healthy (failing at once if it exits); its log is kept for failure messages."""

    what = "operator"
    health: str

    def launch(self, cmd: list[str], env: dict, log: Path, timeout: float) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self._healthy, timeout=timeout, what=f"{self.what} liveness {self.health}")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"{self.what} exited {self.proc.returncode}:\n{self.tail()}"
        try:
            with urllib.request.urlopen(self.health, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class LocalOperator(OperatorProcess):
    """specdecode-operator as a local process with the chart Deployment's own arguments."""

    def __init__(self, args: list[str], kubeconfig: Path, log: Path):
        port = free_ports(1)[0]
        self.health = f"http://127.0.0.1:{port}/healthz"
        args = [a for a in args if not a.startswith("--liveness")] + [f"--liveness={self.health}"]
        env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.launch([str(OPERATOR), *args], env, log, timeout=60)

    def stop(self) -> None:
        processes.stop(self.proc, timeout=20)
        self._out.close()


def container_args(cluster, namespace: str) -> list[str]:
    dep = json.loads(cluster.kubectl("get", "deployment", f"{RELEASE}-specdecode-operator", "-n", namespace,
                                     "-o", "json").stdout)
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def local_example(cluster, namespace: str, name: str) -> dict:
    """The standalone-draft example pointed at a tiny local target + draft in a claim of `namespace`."""
    from devtools.tiny_models import write_tiny_pair

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }))
    store = Path(cluster.pvc_root) / namespace / "models"  # the test bed's claim -> folder rule
    if not (store / "llama-target" / "config.json").exists():
        write_tiny_pair(store, "llama")
    sdd = yaml.safe_load(EXAMPLE.read_text())
    sdd["metadata"] = {"name": name, "namespace": namespace}
    spec = sdd["spec"]
    spec["replicas"] = 1
    spec["target"]["model"] = "llama-target"
    spec["draft"]["model"] = "llama-draft"
    spec["serving"] = {"contextLength": 256, "maxRunningRequests": 4}
    spec["gpu"] = {"product": H100}
    spec["modelStore"] = {"pvc": {"claimName": "models"}}
    return sdd


def sdd_status(cluster, namespace: str, name: str) -> dict:
    obj = json.loads(cluster.kubectl("get", "sdd", name, "-n", namespace, "-o", "json").stdout)
    return obj.get("status") or {}


def wait_ready(cluster, op: OperatorProcess, namespace: str, name: str, timeout: float = 180) -> dict:
    """Status once Ready; fails at once when the operator dies or the API server refuses it."""
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        assert op.proc.poll() is None, f"operator exited {op.proc.returncode}:\n{op.tail()}"
        # kopf's cluster-scope discovery may be refused in namespace scope: it falls back by design.
        refused = [line for line in forbidden_lines(op) if "namespaces" not in line.lower()
                   and "customresourcedefinitions" not in line.lower()]
        assert not refused, "the chart's RBAC refused the operator:\n" + "\n".join(refused[:5])
        status = sdd_status(cluster, namespace, name)
        assert status.get("phase") != "Failed", f"{name} failed: {status}\n{op.tail()}"
        if status.get("phase") == "Ready":
            return status
        time.sleep(1)
    raise AssertionError(f"sdd {namespace}/{name} not Ready after {timeout}s: {status}\noperator log:\n{op.tail()}")


def assert_example_reconciles(cluster, op: OperatorProcess, namespace: str, name: str) -> None:
    """The local example applied as ``name`` is Ready with its one replica, Planned and Available, and
    the API server refused the operator nothing on the way."""
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(local_example(cluster, namespace, name)))
    status = wait_ready(cluster, op, namespace, name)
    assert status["readyReplicas"] == 1
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions.get("Planned") == "True" and conditions.get("Available") == "True", conditions
    assert not forbidden_lines(op), "\n".join(forbidden_lines(op))


def can_i(cluster, sa_user: str, *args: str) -> bool:
    result = cluster.kubectl("auth", "can-i", *args, f"--as={sa_user}", check=False)
    return result.stdout.strip() == "yes"


# A cluster-scoped operator also sees other tests' namespaces; one being deleted refuses new
# objects with 403 "forbidden" too, which is the namespace's lifecycle, not the operator's RBAC.
NAMESPACE_TERMINATING = "because it is being terminated"


def forbidden_lines(op: OperatorProcess) -> list[str]:
    """Lines where the API server refused the operator for its permissions."""
    return [line for line in op.log.read_text(errors="replace").splitlines()
            if ("forbidden" in line.lower() or " 403" in line) and NAMESPACE_TERMINATING not in line]
