"""Operator at scale on the local control plane: N SpecDecodeDeployments applied at once.

Measures the time until every SDD is Ready (each runs the real planner in its planner pod), the
API requests the reconciler made per SDD (from the operator's liveness endpoint, which reports
its request counter; kopf's few watch streams are not included), and the operator's peak RSS.
Fake H100 nodes are added so every replica has a GPU.

    .venv/bin/python benchmarks/operator_scale.py --count 100
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.checkpoints import write_model  # noqa: E402
from devtools.cluster.controlplane import ControlPlane, build_binaries  # noqa: E402

NS = "scale"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def extra_nodes(count: int) -> list[dict]:
    base = next(d for d in yaml.safe_load_all((ROOT / "devtools/cluster/nodes.yaml").read_text())
                if d and d["metadata"]["name"] == "h100-node-1")
    nodes = []
    for i in range(count):
        n = copy.deepcopy(base)
        name = f"h100-scale-{i}"
        n["metadata"]["name"] = name
        n["metadata"]["labels"]["kubernetes.io/hostname"] = name
        n["status"]["addresses"] = [{"type": "InternalIP", "address": f"10.2.{i // 200}.{i % 200 + 10}"},
                                    {"type": "Hostname", "address": name}]
        nodes.append(n)
    return nodes


def sdd(i: int) -> dict:
    body = yaml.safe_load((ROOT / "examples/spec-deploy.yaml").read_text())
    body["metadata"] = {"name": f"sdd-{i:03d}", "namespace": NS}
    return body


def reconciler_requests(live: dict) -> int:
    """The reconciler's API request counter from the operator's liveness endpoint (its own JSON:
    ``{"tracked": N, "apiRequests": N}``). A reply without it is an error, not a zero."""
    if "apiRequests" not in live:
        raise KeyError(f"the operator's liveness endpoint reports no apiRequests: {live}")
    return int(live["apiRequests"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    plane = ControlPlane(work, build_binaries(progress=lambda m: print(m, file=sys.stderr)))
    plane.start(progress=lambda m: print(m, file=sys.stderr))
    op = None
    try:
        k = plane.kubectl
        k("apply", "--server-side", "-f", str(ROOT / "crds/specdecode.io_specdecodedeployments.yaml"))
        k("wait", "--for=condition=Established", "crd/specdecodedeployments.specdecode.io")
        k("create", "namespace", NS)
        k("apply", "-f", "-", input=yaml.safe_dump_all(extra_nodes(-(-args.count // 8))))
        k("apply", "-n", NS, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        store = plane.pvc_root / NS / "models"
        write_model(store / "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct")
        write_model(store / "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3-llama-3.1-8b")

        port = _free_port()
        log = open(work / "operator.log", "wb")
        op = subprocess.Popen([str(Path(sys.executable).parent / "specdecode-operator"), "--namespace", NS,
                               "--log-format", "plain", "--liveness", f"http://127.0.0.1:{port}/healthz"],
                              env=plane.env, stdout=log, stderr=subprocess.STDOUT)
        health = f"http://127.0.0.1:{port}/healthz"
        for _ in range(120):
            try:
                urllib.request.urlopen(health, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        rss_idle = _rss_kib(op.pid)

        t0 = time.monotonic()
        k("apply", "-f", "-", input=yaml.safe_dump_all([sdd(i) for i in range(args.count)]), timeout=300)
        peak, ready = rss_idle, 0
        while time.monotonic() - t0 < args.timeout:
            items = json.loads(k("get", "sdd", "-n", NS, "-o", "json", timeout=120).stdout)["items"]
            ready = sum(1 for s in items if s.get("status", {}).get("phase") == "Ready")
            peak = max(peak, _rss_kib(op.pid))
            if ready == args.count:
                break
            time.sleep(2)
        elapsed = time.monotonic() - t0
        requests = reconciler_requests(json.loads(urllib.request.urlopen(health, timeout=5).read()))
        result = {
            "sdds": args.count, "ready": ready, "secondsUntilAllReady": round(elapsed, 1),
            "reconcilerRequestsPerSDD": round(requests / args.count, 1),
            "operatorRssMiB": {"idle": round(rss_idle / 1024, 1), "peak": round(peak / 1024, 1)},
            "command": f"benchmarks/operator_scale.py --count {args.count}",
        }
        print(json.dumps(result, indent=2))
        return 0 if ready == args.count else 1
    finally:
        if op is not None and op.poll() is None:
            op.send_signal(signal.SIGTERM)
            try:
                op.wait(15)
            except subprocess.TimeoutExpired:
                op.kill()
        plane.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
