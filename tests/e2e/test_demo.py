"""The demo, the README's first command: demo/run.py on a control plane of its own serves
SmolLM2-135M-Instruct through the operator, and its answer is the model's own greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from devtools import smollm2  # noqa: E402
from tests.e2e_helpers import greedy_reply  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    return smollm2.smollm2_dir_or_skip()


def run_demo(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 1200):
    env = dict(env or os.environ, SPECDECODE_CLUSTER_DIR=str(tmp_path / "plane"),
               SPECDECODE_DEMO_DIR=str(tmp_path / "demo"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run([sys.executable, str(ROOT / "demo" / "run.py"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def check_first_run(out: str, record: dict, model_dir: Path) -> str:
    """What every first run shows: seven steps, the conditions ending Ready, the plan, and an
    answer that is the model's own greedy output, with the drafts it accepted."""
    for step in range(1, 8):
        assert f"[{step}/7]" in out
    assert "Ready        True" in out, out  # the conditions as they changed, ending Ready
    assert "Planned      True   PlanReady" in out
    assert "MemoryPlan  NGRAM" in out and "fits: yes" in out
    assert "demo/run.py down" in out
    request, choice = record["request"], record["response"]["choices"][0]
    answer = choice["message"]["content"]
    assert answer == greedy_reply(model_dir, request["messages"], request["max_tokens"])
    assert f"assistant: {answer}" in out
    # the answer quotes the prompt, so prompt-lookup drafts are accepted, and the demo says how many
    draft = record["draft"]
    assert 0 < draft["accepted"] <= draft["proposed"]
    assert f"acceptance rate {draft['acceptanceRate']:.0%}" in out
    return answer


@pytest.mark.images
def test_demo_serves_smollm2_from_real_pods_through_its_service(cluster, model_dir, tmp_path):
    """`cluster` only guarantees the binaries: the demo starts and stops a plane of its own, with
    the real node, where the chart's operator, the planner and the worker run as pods."""
    from devtools.cluster import realnode

    realnode.install_packages()
    missing = realnode.missing_parts()
    if missing and os.environ.get("SPECDECODE_REQUIRE_REAL_NODE") == "1":
        pytest.fail(f"no real node: {missing}")
    if missing:
        pytest.skip(f"this machine cannot run a real node: {missing}")
    try:
        first = run_demo(tmp_path)
        assert first.returncode == 0, f"demo failed:\n{first.stdout[-4000:]}\n{first.stderr[-2000:]}"
        out = first.stdout
        record = json.loads((tmp_path / "demo" / "completion.json").read_text())
        answer = check_first_run(out, record, model_dir)
        assert "No real node here" not in out
        assert "in the node as ghcr.io/specdecode/worker" in out or "in the node already" in out
        assert "specdecode-operator-" in out and realnode.NAME in out  # the operator's pod, on the node
        assert "ready: phases took" in out and "kubectl port-forward" in out

        second = run_demo(tmp_path, timeout=300)
        assert second.returncode == 0, f"second demo run failed:\n{second.stdout[-4000:]}"
        assert "reusing the control plane" in second.stdout
        assert "in the node already" in second.stdout and "(skipped: this chart" in second.stdout
        again = json.loads((tmp_path / "demo" / "completion.json").read_text())
        assert again["response"]["choices"][0]["message"]["content"] == answer
    finally:
        down = run_demo(tmp_path, "down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert not (tmp_path / "plane" / "state.json").exists()
    assert subprocess.run(["ip", "link", "show", realnode.BRIDGE], capture_output=True).returncode != 0


def test_demo_without_a_real_node_runs_the_operator_and_worker_as_local_processes(cluster, model_dir, tmp_path):
    env = dict(os.environ, SPECDECODE_NO_REAL_NODE="1")
    try:
        first = run_demo(tmp_path, env=env, timeout=900)
        assert first.returncode == 0, f"demo failed:\n{first.stdout[-4000:]}\n{first.stderr[-2000:]}"
        out = first.stdout
        assert "No real node here" in out and "SPECDECODE_NO_REAL_NODE=1 turns it off" in out
        answer = check_first_run(out, json.loads((tmp_path / "demo" / "completion.json").read_text()), model_dir)
        # the operator ran on the chart ServiceAccount's token, not the admin certificate
        op_kubeconfig = yaml.safe_load((tmp_path / "demo" / "operator.kubeconfig").read_text())
        assert list(op_kubeconfig["users"][0]["user"]) == ["token"]

        second = run_demo(tmp_path, env=env, timeout=300)
        assert second.returncode == 0, f"second demo run failed:\n{second.stdout[-4000:]}"
        assert "reusing the control plane" in second.stdout
        assert "operator already running" in second.stdout and "worker already running" in second.stdout
        again = json.loads((tmp_path / "demo" / "completion.json").read_text())
        assert again["response"]["choices"][0]["message"]["content"] == answer
    finally:
        down = run_demo(tmp_path, "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    for name in ("operator", "worker"):
        assert not (tmp_path / "demo" / f"{name}.pid").exists()
    assert not (tmp_path / "plane" / "state.json").exists()
