"""The demo without a real node: the operator and the Ready replica's worker run as local
processes (KWOK nodes run no containers). The operator runs on the chart ServiceAccount's token with
the chart Deployment's own arguments (the Deployment is scaled to 0); the worker runs the Ready
pod's own command line, with the model store mapped to the local folder, CPU instead of CUDA, and a
local port standing in for the Service."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from common import (BIN, DEMO_NS, EXAMPLE, MODEL, NUM_DRAFT_TOKENS, RELEASE, SDD, STATE, SYSTEM_NS, T0, chat,
                    fail, say, shown)
from devtools import processes
from devtools.cluster.controlplane import ControlPlane, free_ports
from devtools.cluster.planner_runtime import map_paths, volume_paths
from specdecode_worker.contract import MemoryPlan

GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"  # a product of the fake nodes (devtools/cluster/nodes.yaml)
CHART_VALUES = ["--set", "replicaCount=0"]  # the operator runs here, not in the Deployment
CPU_KV_TOKENS = 16384  # KV slots the CPU worker allocates (the plan's count is for an 80 GiB GPU)
# OpenMP threads that spin while they wait burn a shared CPU: on a busy 2-core machine one chat
# completion took 10 CPU-seconds and 45 s instead of 1 CPU-second and 2-4 s. Waiting passively
# costs nothing on a quiet machine. (Set it yourself to override.)
WORKER_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}

OPERATOR = processes.Background(STATE, "operator", marker="specdecode-operator")
WORKER = processes.Background(STATE, "worker", marker="specdecode-worker")


def stop(child: processes.Background) -> None:
    pid = child.stop()
    if pid is not None:
        say(f"stopped {child.name} (pid {pid})")


def wait_ready(child: processes.Background, proc: subprocess.Popen, url: str, timeout: float) -> None:
    try:
        processes.wait_http(url, proc, timeout)
    except processes.NotReady as exc:
        fail(f"{child.name} {exc}; last lines of {shown(child.log.name)}:\n{child.tail()}")


def fullname() -> str:
    return RELEASE


def sa_kubeconfig(plane: ControlPlane) -> Path:
    token = plane.kubectl("create", "token", fullname(), "-n", SYSTEM_NS, "--duration=24h").stdout.strip()
    admin = yaml.safe_load(Path(plane.kubeconfig).read_text())
    user = f"system:serviceaccount:{SYSTEM_NS}:{fullname()}"
    config = {
        "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": admin["clusters"][0]["name"], "user": "operator"}}],
        "current-context": "operator",
    }
    path = STATE / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    whoami = plane.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
                           f"--kubeconfig={path}").stdout
    if whoami != user:
        fail(f"the token authenticates as {whoami!r}, expected {user}")
    return path


def start_operator(plane: ControlPlane) -> None:
    dep = json.loads(plane.kubectl("get", "deployment", fullname(), "-n", SYSTEM_NS, "-o", "json").stdout)
    args = [a for a in dep["spec"]["template"]["spec"]["containers"][0]["args"]
            if not a.startswith(("--liveness", "--log-format"))] + ["--log-format=plain"]
    say(f"the chart's operator arguments: {' '.join(args)}")
    say(f"  credentials: ServiceAccount {SYSTEM_NS}/{fullname()} (token in {shown('operator.kubeconfig')}); "
        f"log: {shown('operator.log')}")
    previous = OPERATOR.reusable(args)
    if previous:
        say(f"operator already running with these arguments (pid {OPERATOR.pid()}), "
            f"liveness {previous['health']} answers")
        return
    stop(OPERATOR)
    kubeconfig = sa_kubeconfig(plane)
    health = f"http://127.0.0.1:{free_ports(1)[0]}/healthz"
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    say(f"$ specdecode-operator {' '.join(args)} --liveness={health}")
    proc = OPERATOR.start([str(BIN / "specdecode-operator"), *args, f"--liveness={health}"], env)
    wait_ready(OPERATOR, proc, health, 60)
    OPERATOR.remember(args, health=health)
    say(f"operator running (pid {proc.pid}), liveness {health} answers")


def demo_sdd() -> dict:
    sdd = yaml.safe_load(EXAMPLE.read_text())
    sdd["metadata"] = {"name": SDD, "namespace": DEMO_NS}
    spec = sdd["spec"]
    spec["replicas"] = 1
    spec["target"] = {"model": MODEL}
    spec["draft"] = {"algorithm": "NGRAM", "numDraftTokens": NUM_DRAFT_TOKENS}
    spec["serving"] = {"contextLength": 2048, "maxRunningRequests": 4}
    spec["gpu"] = {"product": GPU_PRODUCT}
    spec["modelStore"] = {"pvc": {"claimName": "models"}}
    return sdd


def ready_pod(plane: ControlPlane, sdd: dict) -> dict:
    selector = sdd["status"]["selector"]
    pods = json.loads(plane.kubectl("get", "pods", "-n", DEMO_NS, "-l", selector, "-o", "json").stdout)["items"]
    for pod in pods:
        conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
        if conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp"):
            return pod
    fail(f"no Ready worker pod matches {selector}")


def plan_json(plane: ControlPlane, pod: dict, container: dict) -> tuple[str, Path]:
    """The plan ConfigMap's mount path in the pod, and a local folder holding its files."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        cm = volumes.get(mount["name"], {}).get("configMap")
        if cm:
            data = json.loads(plane.kubectl("get", "configmap", cm["name"], "-n", DEMO_NS, "-o", "json").stdout)
            local = STATE / "worker" / "plan"
            local.mkdir(parents=True, exist_ok=True)
            for key, value in (data.get("data") or {}).items():
                (local / key).write_text(value)
            return mount["mountPath"].rstrip("/"), local
    fail("the worker pod mounts no plan ConfigMap")


def cpu_budget_gib(plan: MemoryPlan, tokens: int) -> float:
    """A CPU memory budget standing in for the GPU: the plan's weights and runtime reserve plus
    `tokens` KV slots, at the plan's mem_fraction_static (rounded up to a quarter GiB)."""
    kv, weights = plan.kv_cache, plan.weights
    need = (weights.target_bytes + weights.draft_bytes + plan.reserve.runtime_bytes
            + tokens * (kv.target_bytes_per_token + kv.draft_bytes_per_token)) / plan.mem_fraction_static
    return -(-need // (1 << 28)) / 4


def worker_argv(plane: ControlPlane, pod: dict, port: int) -> list[str]:
    """The pod's own command line, run here: model store and plan mapped to local folders, a local
    address, and CPU instead of CUDA with a small memory budget standing in for the GPU's."""
    container = pod["spec"]["containers"][0]
    mapping = volume_paths(pod, container, plane.pvc_root, STATE / "worker")
    plan_mount, plan_local = plan_json(plane, pod, container)
    mapping[plan_mount] = str(plan_local)
    args = [map_paths(a, mapping) for a in (container.get("command") or ["specdecode-worker"]) + container["args"]]
    args[0] = str(BIN / "specdecode-worker") if args[0] == "specdecode-worker" else args[0]
    plan = MemoryPlan.from_dict(json.loads(next(plan_local.glob("*.json")).read_text()))
    tokens = min(CPU_KV_TOKENS, plan.kv_cache.max_total_num_tokens)
    replace = {"--device": "cpu", "--host": "127.0.0.1", "--port": str(port), "--max-total-tokens": str(tokens)}
    for i, a in enumerate(args[:-1]):
        if a in replace:
            args[i + 1] = replace.pop(a)
    for flag, value in replace.items():  # flags the pod did not pass
        if flag == "--max-total-tokens":
            args += [flag, value]
    args += ["--device-memory-gib", f"{cpu_budget_gib(plan, tokens):g}"]
    say(f"  changed for this machine: --device cpu, --device-memory-gib {cpu_budget_gib(plan, tokens):g} "
        f"(stands in for the {plan.gpu_memory_bytes / (1 << 30):.1f} GiB GPU), KV capped at {tokens} tokens "
        f"(the plan allows {plan.kv_cache.max_total_num_tokens} on the GPU)")
    return args


def run_worker(plane: ControlPlane, sdd: dict) -> str:
    pod = ready_pod(plane, sdd)
    svc = json.loads(plane.kubectl("get", "service", SDD, "-n", DEMO_NS, "-o", "json").stdout)
    svc_port = svc["spec"]["ports"][0]["port"]
    say(f"Ready replica: pod {pod['metadata']['name']} on node {pod['spec'].get('nodeName')} "
        f"(KWOK runs no containers, so its command runs here)")
    key = worker_argv(plane, pod, 0)  # the command line but for the port
    record = key + [f"{k}={v}" for k, v in WORKER_ENV.items()]
    previous = WORKER.reusable(record)
    if previous:
        url = previous["url"]
        say(f"worker already running with this command line (pid {WORKER.pid()}) at {url}")
    else:
        stop(WORKER)
        port = free_ports(1)[0]
        argv = [str(port) if a == "0" and prev == "--port" else a for prev, a in zip([""] + key, key)]
        say("$ " + " ".join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv)))
        say("  with " + " ".join(f"{k}={v}" for k, v in WORKER_ENV.items()))
        proc = WORKER.start(argv, dict(os.environ, **WORKER_ENV))
        url = f"http://127.0.0.1:{port}"
        wait_ready(WORKER, proc, f"{url}/health", 300)
        WORKER.remember(record, health=f"{url}/health", url=url)
    say(f"  {url} stands in for Service {DEMO_NS}/{SDD} ({svc['spec'].get('clusterIP')}:{svc_port}); "
        f"log: {shown('worker.log')}")
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    chat(url, model)
    return url


def finish(plane: ControlPlane, worker_url: str) -> None:
    say(f"\nDone in {time.monotonic() - T0:.1f}s. Still running: the control plane, the operator "
        f"({shown('operator.log')}) and the worker ({shown('worker.log')}). Look around:")
    say(f"  export KUBECONFIG={plane.kubeconfig} PATH={plane.bin_dir}:$PATH")
    say(f"  kubectl get sdd -A;  kubectl describe sdd {SDD} -n {DEMO_NS};  kubectl get pods,deploy,svc -n {DEMO_NS}")
    say(f"  curl {worker_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
        f"\"max_tokens\": 24}}'")
    say(f"  curl {worker_url}/metrics      # tokens, acceptance, latency histograms, KV pool, plan vs measured")
    if OPERATOR.record.exists():
        health = json.loads(OPERATOR.record.read_text())["health"]
        metrics = health.rsplit("/", 1)[0] + "/metrics"
        say(f"  curl {metrics}   # the SDD's conditions, phase and Ready pods, from the operator")
    say("Stop everything (operator, worker, control plane):")
    say("  .venv/bin/python demo/run.py down")


def stop_all() -> None:
    stop(WORKER)
    stop(OPERATOR)
