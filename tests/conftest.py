"""Shared fixtures.

``cluster`` (session): a real control plane on loopback (devtools/cluster/), started once and torn
down at the end even when tests fail. Tests that use it, directly or through another fixture,
are marked ``e2e`` automatically. A failing e2e test shows the tail of every component log; the
full logs stay in ``cluster.logs_dir`` (under pytest's temporary folder).

``namespace`` (function): a fresh namespace whose default service account exists, deleted after
the test.

``crd`` (module), ``store`` and ``operator`` (function): the operator's end-to-end set-up: the CRD
installed, a `models` claim holding sparse published checkpoints, and `specdecode-operator` running
as a local process for the test's namespace (tests/e2e_helpers.py has the helpers they use).
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from devtools.checkpoints import write_model
from devtools.cluster.controlplane import ControlPlane, build_binaries
from tests.e2e_helpers import CRD, DRAFT, OTHER_DRAFT, TARGET, Operator, get_object
from devtools.cluster.lws import build as lws_build
from devtools.cluster.wait import wait_for

# Without a GPU, Triton kernels can only run under its interpreter, and Triton reads the switch when
# a function is decorated (its own library's too, at its first import, which transformers may do
# while tests are collected): turn it on before anything imports triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

_planes: list[ControlPlane] = []


@pytest.fixture(autouse=True)
def _release_device_memory():
    """On a GPU, give back what a test's engines held before the next test plans the device. A
    failed test's traceback (kept as sys.last_traceback) holds its frames, and with them its engine
    and every pool: without this, one failure fails each later test that plans the whole GPU."""
    yield
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    import gc

    gc.collect()
    torch.cuda.empty_cache()
_build: dict[str, object] = {}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # tryfirst: the marker must exist before `-m "not e2e"` deselects.
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


def pytest_collection_finish(session):
    # Build before any test starts, so a cold build (many minutes) does not count against the
    # first e2e test's timeout. A failure is raised by the fixture, failing only e2e tests.
    if session.config.option.collectonly:
        return
    if any("cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        capture = session.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(file=sys.stderr)
            try:
                _build["bin_dir"] = build_binaries(progress=_progress)
            except Exception as exc:
                _build["error"] = exc
            if any("lws" in getattr(item, "fixturenames", ()) for item in session.items):
                try:  # LeaderWorkerSet too, for the same reason; the fixture finds it cached
                    lws_build(progress=_progress)
                except Exception:  # only the tests that use it fail: the `lws` fixture builds again and raises
                    pass


@pytest.fixture(scope="session")
def cluster(pytestconfig, tmp_path_factory):
    if "error" in _build:
        raise _build["error"]
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    # Show start-up progress live.
    with capture.global_and_fixture_disabled():
        bin_dir = _build.get("bin_dir") or build_binaries(progress=_progress)
        plane = ControlPlane(tmp_path_factory.mktemp("cluster"), bin_dir)
        _progress(f"control plane logs: {plane.logs_dir}")
        plane.start(progress=_progress)
    _planes.append(plane)
    try:
        yield plane
    finally:
        _planes.remove(plane)
        plane.stop()


@pytest.fixture
def namespace(cluster, request):
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             timeout=30, what=f"service account default in namespace {name}")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _planes and "cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("control plane logs (tail)", _planes[0].log_tails()))
    return report


# ---- the operator's end-to-end fixtures: its CRD, a model store claim, the operator process ----

@pytest.fixture(scope="module")
def crd(cluster):
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/specdecodedeployments.specdecode.io", "--timeout=60s")
    return CRD


@pytest.fixture
def store(cluster, namespace):
    """The `models` PVC with sparse Llama-3.1-8B-Instruct and two EAGLE3 heads."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
    root = Path(cluster.pvc_root) / namespace / "models"
    write_model(root / TARGET, "llama-3.1-8b-instruct")
    write_model(root / DRAFT, "eagle3-llama-3.1-8b")
    write_model(root / OTHER_DRAFT, "eagle3-llama-3.1-8b")
    wait_for(lambda: get_object(cluster, namespace, "pvc", "models")["status"].get("phase") == "Bound",
             timeout=30, what="PVC models bound")
    return root


@pytest.fixture
def operator(cluster, crd, namespace, store):
    op = Operator(cluster, namespace).start()
    yield op
    op.stop()
    print(f"--- operator log (tail) ---\n{op.tail(80)}")  # shown by pytest when the test failed
