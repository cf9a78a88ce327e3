"""LeaderWorkerSet on the loopback control plane: its CRDs, its controller, and its webhooks.

The controller (built from the pinned source by build_lws.sh) runs as one more local process. Its
pod webhook is what labels group pods (group and worker index) and injects LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE and LWS_WORKER_INDEX; without it the controller cannot tell leaders from workers.
So the webhooks run for real: the controller serves them on 127.0.0.1 with a certificate the
plane's CA signs (pki.make_serving_cert), its own certificate rotation is off, and the webhook
configurations point the API server at ``https://127.0.0.1:<port>/<path>`` with that CA. The pod
webhooks only see pods labelled as LWS pods, so the rest of the plane does not depend on them.

``install`` and ``uninstall`` are per test module: tests that need no LWS (and the ones that
check what happens without it) never pay for it.
"""

from __future__ import annotations

import base64
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from . import pki as pki_mod
from .build_scripts import run_build_script
from .controlplane import HERE, ControlPlane, free_ports
from .kube import ApiError

COMPONENT = "lws-controller"
CRD_NAMES = ["leaderworkersets.leaderworkerset.x-k8s.io", "disaggregatedsets.disaggregatedset.x-k8s.io",
             "disaggregatedsetrolescalers.disaggregatedset.x-k8s.io"]
MUTATING, VALIDATING = "specdecode-test-lws-mutating", "specdecode-test-lws-validating"
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
CRDS_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
HOOK_CONFIGS = (("mutatingwebhookconfigurations", MUTATING), ("validatingwebhookconfigurations", VALIDATING))
# (name, path, API group, resource, operations, only LWS pods)
_WEBHOOKS = {
    MUTATING: [
        ("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "leaderworkerset.x-k8s.io",
         "leaderworkersets", ["CREATE", "UPDATE"], False),
        ("mpod.kb.io", "/mutate--v1-pod", "", "pods", ["CREATE"], True),
    ],
    VALIDATING: [
        ("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
         "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"], False),
        ("vpod.kb.io", "/validate--v1-pod", "", "pods", ["CREATE", "UPDATE"], True),
    ],
}


def build(progress=print) -> Path:
    """Run build_lws.sh (instant when cached) and return its folder (bin/, crd/)."""
    script = HERE / "build_lws.sh"
    progress(f"LeaderWorkerSet: checking the controller ({script.name})")
    return run_build_script(script)


class LeaderWorkerSet:
    def __init__(self, plane: ControlPlane, folder: Path):
        self.plane = plane
        self.folder = folder
        self.dir = plane.workdir / "lws"

    def install(self, timeout: float = 120) -> "LeaderWorkerSet":
        api = self.plane.api
        for crd in sorted((self.folder / "crd").glob("*.yaml")):
            self.plane._create(CRDS_PATH, yaml.safe_load(crd.read_text()))
        self.plane._wait(lambda: all(_established(api, n) for n in CRD_NAMES), "LWS CRDs Established", 60)

        webhook_port, health_port = free_ports(2)
        pki = self.plane.workdir / "pki"
        crt, _ = pki_mod.make_serving_cert(pki / "ca.crt", pki / "ca.key", self.dir / "certs", "lws-webhook",
                                           "IP:127.0.0.1")
        config = self.dir / "config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(crt.parent)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }))
        self.plane._spawn(COMPONENT, False, [f"--config={config}", f"--kubeconfig={self.plane.kubeconfig}",
                                             "--zap-log-level=info"],
                          executable=str(self.folder / "bin" / "lws-controller"))
        ca_bundle = _b64(pki / "ca.crt")
        for kind, name in HOOK_CONFIGS:
            self.plane._create(f"/apis/admissionregistration.k8s.io/v1/{kind}",
                               _webhook_configuration(kind, name, webhook_port, ca_bundle))
        self.plane._wait(lambda: _listening(webhook_port), "the LWS webhook server", timeout)
        self.plane._wait(lambda: _http_ok(health_port), "the LWS controller /readyz", timeout)
        return self

    def uninstall(self, timeout: float = 60) -> None:
        """Stop the controller, remove its webhooks and CRDs (and with them every LWS)."""
        api = self.plane.api
        for kind, name in HOOK_CONFIGS:
            _delete(api, f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}")
        comp = self.plane.components.pop(COMPONENT, None)
        if comp is not None:
            comp.signal(signal.SIGTERM)
            if comp.proc is not None:
                try:
                    comp.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    comp.signal(signal.SIGKILL)
                    comp.proc.wait()
        for name in CRD_NAMES:
            _delete(api, f"{CRDS_PATH}/{name}")
        deadline = time.monotonic() + timeout
        while any(_exists(api, f"{CRDS_PATH}/{n}") for n in CRD_NAMES):
            if time.monotonic() > deadline:
                raise TimeoutError("LWS CRDs still present after uninstall")
            time.sleep(0.5)


def _webhook_configuration(kind: str, name: str, port: int, ca_bundle: str) -> dict:
    hooks = []
    for hook, path, group, resource, operations, only_lws_pods in _WEBHOOKS[name]:
        entry = {
            "name": hook,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle},
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": operations,
                       "resources": [resource]}],
        }
        if only_lws_pods:  # other pods never wait on this controller
            entry["objectSelector"] = {"matchExpressions": [{"key": SET_NAME_LABEL, "operator": "Exists"}]}
        hooks.append(entry)
    kind_name = "MutatingWebhookConfiguration" if kind.startswith("mutating") else "ValidatingWebhookConfiguration"
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind_name, "metadata": {"name": name},
            "webhooks": hooks}


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _established(api, name: str) -> bool:
    crd = api.get(f"{CRDS_PATH}/{name}")
    conditions = crd.get("status", {}).get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def _exists(api, path: str) -> bool:
    try:
        api.get(path)
        return True
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise


def _delete(api, path: str) -> None:
    try:
        api.request("DELETE", path)
    except ApiError as exc:
        if exc.status != 404:
            raise


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
