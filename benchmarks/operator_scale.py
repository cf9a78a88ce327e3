"""Operator at scale on the local control plane: N SpecDecodeDeployments applied at once.

Measures the time until every SDD is Ready (each runs the real planner in its planner pod), the
time from apply to Ready of each SDD (p50, p99: from its creationTimestamp to the moment a
``kubectl get --watch`` saw it Ready), the API requests the reconciler made per SDD in all and by
verb and resource (from the operator's liveness endpoint, which reports its request counter;
kopf's watch streams are not included), the operator's peak RSS, and the CPU seconds each process
of the control plane spent during the run (the planner runtime's include the planner processes it
ran), which says where the machine's two cores went. Fake H100 nodes are added so every replica
has a GPU.

    .venv/bin/python benchmarks/operator_scale.py --count 100
"""

from __future__ import annotations

import argparse
import calendar
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and of the children it has waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))]


class ReadyWatch:
    """``kubectl get sdd --watch``: when each SDD was first seen Ready, and its creationTimestamp."""

    FORMAT = '{.metadata.name} {.metadata.creationTimestamp} {.status.phase}{"\\n"}'

    def __init__(self, kubectl: list[str], env: dict[str, str]):
        self.ready: dict[str, tuple[float, float]] = {}  # name -> (created epoch, seen Ready epoch)
        self.proc = subprocess.Popen([*kubectl, "get", "sdd", "-n", NS, "--watch", "-o", f"jsonpath={self.FORMAT}"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "Ready" and parts[0] not in self.ready:
                created = calendar.timegm(time.strptime(parts[1], "%Y-%m-%dT%H:%M:%SZ"))
                self.ready[parts[0]] = (created, time.time())

    def stop(self) -> None:
        self.proc.terminate()


def apply_all(plane: ControlPlane, bodies: list[dict], parallel: int) -> None:
    """All SDDs at once: ``parallel`` kubectl processes, each a server-side apply (one request per
    object; a client-side apply reads each object first) of every ``parallel``-th SDD."""
    procs = []
    for i in range(max(1, parallel)):
        chunk = bodies[i::max(1, parallel)]
        if chunk:
            proc = subprocess.Popen([str(plane.bin_dir / "kubectl"), "apply", "--server-side", "-f", "-"],
                                    env=plane.env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            procs.append((proc, yaml.safe_dump_all(chunk)))
    for proc, text in procs:
        _, err = proc.communicate(text, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl apply exited {proc.returncode}: {err}")


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
    ap.add_argument("--poll", type=float, default=5.0,
                    help="seconds between full lists of the SDDs (the watch times each one)")
    ap.add_argument("--apply-parallel", type=int, default=4,
                    help="kubectl processes that apply the SDDs at once (server-side apply, one request each)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (operator.log, logs/)")
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
        live0 = json.loads(urllib.request.urlopen(health, timeout=5).read())
        watch = ReadyWatch([str(plane.bin_dir / "kubectl")], plane.env)
        pids = {name: c.pid for name, c in plane.components.items()} | {"operator": op.pid}
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}

        t0, wall0 = time.monotonic(), time.time()
        apply_all(plane, [sdd(i) for i in range(args.count)], args.apply_parallel)
        applied = time.monotonic() - t0
        peak, ready, last_poll = rss_idle, 0, 0.0
        while time.monotonic() - t0 < args.timeout:
            peak = max(peak, _rss_kib(op.pid))
            if len(watch.ready) >= args.count or time.monotonic() - last_poll >= args.poll:
                # the watch may miss nothing, but a full list is the ground truth
                last_poll = time.monotonic()
                items = json.loads(k("get", "sdd", "-n", NS, "-o", "json", timeout=120).stdout)["items"]
                ready = sum(1 for s in items if s.get("status", {}).get("phase") == "Ready")
                if ready == args.count:
                    break
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        cpu = {name: round(cpu_seconds(pid) - cpu0[name], 1) for name, pid in pids.items()}
        watch.stop()
        live = json.loads(urllib.request.urlopen(health, timeout=5).read())
        requests = reconciler_requests(live) - reconciler_requests(live0)
        before = live0.get("apiRequestsByVerb") or {}
        by_verb = {kind: round((n - before.get(kind, 0)) / args.count, 2)
                   for kind, n in (live.get("apiRequestsByVerb") or {}).items() if n - before.get(kind, 0)}
        latencies = [seen - created for created, seen in watch.ready.values()]
        result = {
            "sdds": args.count, "ready": ready, "secondsUntilAllReady": round(elapsed, 1),
            "secondsToApply": round(applied, 1),
            "applyToReadySeconds": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                                    "max": percentile(latencies, 100), "timed": len(latencies)},
            "reconcilerRequestsPerSDD": round(requests / args.count, 1),
            "reconcilerRequestsPerSDDByVerb": dict(sorted(by_verb.items(), key=lambda kv: -kv[1])),
            "operatorRssMiB": {"idle": round(rss_idle / 1024, 1), "peak": round(peak / 1024, 1)},
            "cpuSecondsByProcess": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
            "startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall0)),
            "command": f"benchmarks/operator_scale.py --count {args.count}",
        }
        if latencies:
            result["applyToReadySeconds"] = {k_: (round(v, 1) if isinstance(v, float) else v)
                                             for k_, v in result["applyToReadySeconds"].items()}
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
        if args.keep:
            print(f"work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
