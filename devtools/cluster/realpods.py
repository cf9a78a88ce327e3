"""What the demo and the real-node tests share: the project's images in the real node, the chart's
operator as a pod there, a restricted namespace with SmolLM2 in its model store, and an NGRAM SDD
that the real node serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import yaml

from . import realnode
from .controlplane import free_ports

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specdecode-operator"
CRD = ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml"
EXAMPLE = ROOT / "examples" / "ngram.yaml"
MODEL = "SmolLM2-135M-Instruct"  # its folder in the model store
ON_REAL_NODE = {"specdecode.io/real-node": "true"}


def image_names() -> dict[str, str]:
    """The names the chart (operator) and the operator (worker) pull by default."""
    from specdecode_operator.spec import DEFAULT_WORKER_IMAGE

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    return {"operator": f"{values['image']['repository']}:{values['image']['tag'] or version}",
            "worker": DEFAULT_WORKER_IMAGE}


def load_images(plane, built: dict[str, str], say: Callable[[str], None]) -> dict[str, str]:
    """Copy podman's images (``built``: {"operator": name, "worker": name}) into the real node under
    the names the chart and the operator expect; returns those names."""
    names = image_names()
    for role in ("operator", "worker"):
        plane.node.import_image(built[role], [names[role]], say)
    return names


def install_operator(plane, release: str, namespace: str, timeout: str = "180s") -> None:
    """The chart, with its operator Deployment on the real node (the KWOK nodes run nothing)."""
    plane.kubectl("apply", "--server-side", "-f", str(CRD))
    args = ["upgrade", "--install", release, str(CHART), "-n", namespace, "--create-namespace", "--wait",
            "--timeout", timeout]
    for key, value in ON_REAL_NODE.items():
        args += ["--set-string", f"nodeSelector.{key.replace('.', chr(92) + '.')}={value}"]
    plane.helm(*args)


def restricted_namespace(plane, name: str) -> None:
    plane.kubectl("create", "namespace", name, check=False)
    plane.kubectl("label", "namespace", name, "--overwrite", "pod-security.kubernetes.io/enforce=restricted")


def model_store(plane, namespace: str, model_dir: Path) -> Path:
    """Claim `models` in ``namespace``, holding ``model_dir`` as MODEL/ (hard links where possible)."""
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }))
    store = plane.pvc_root / namespace / "models"  # the test bed binds claim `models` to this folder
    dst = store / MODEL
    dst.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    return store


def ngram_sdd(name: str, namespace: str, **spec_changes) -> dict:
    """examples/ngram.yaml for SmolLM2, on what only the real node has: its GPU product, planned with
    the memory the node gives each pod, one CPU, and the planner pod there too."""
    sdd = yaml.safe_load(EXAMPLE.read_text())
    sdd["metadata"] = {"name": name, "namespace": namespace}
    sdd["spec"].update({
        "replicas": 1,
        "target": {"model": MODEL},
        "draft": {"algorithm": "NGRAM", "numDraftTokens": 4},
        "serving": {"contextLength": 2048, "maxRunningRequests": 4},
        "gpu": {"product": realnode.GPU_PRODUCT, "memoryGiB": realnode.GPU_MEMORY_MIB // 1024},
        "modelStore": {"pvc": {"claimName": "models"}},
        "resources": {"cpu": "1"},
        "pod": {"nodeSelector": dict(ON_REAL_NODE)},
        **spec_changes,
    })
    return sdd

@contextlib.contextmanager
def port_forward(plane, namespace: str, service: str) -> Iterator[str]:
    """`kubectl port-forward service/<service>` from a free local port; yields its URL."""
    svc = json.loads(plane.kubectl("get", "service", service, "-n", namespace, "-o", "json").stdout)
    port, local = svc["spec"]["ports"][0]["port"], free_ports(1)[0]
    forward = subprocess.Popen([str(plane.bin_dir / "kubectl"), "port-forward", "-n", namespace, f"service/{service}",
                                f"{local}:{port}"], env=plane.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert forward.stdout is not None and forward.stderr is not None
        first = forward.stdout.readline()
        if "Forwarding from" not in first:
            raise RuntimeError(f"kubectl port-forward service/{service} failed: {first}{forward.stderr.read()}")
        yield f"http://127.0.0.1:{local}"
    finally:
        forward.terminate()
        forward.wait(10)
