"""The demo on the real node: the chart's operator, the planner pod and the worker pod run as
containers, from the images `make images` builds, under Pod Security `restricted`; the chat
completion goes through `kubectl port-forward` to the SDD's Service."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

from common import DEMO_NS, ROOT, SDD, SYSTEM_NS, RELEASE, T0, chat, fail, say
from devtools.cluster import realnode, realpods
from devtools.cluster.controlplane import ControlPlane

# The operator's Deployment runs on the real node (the KWOK nodes run no containers).
CHART_VALUES = [arg for key, value in realpods.ON_REAL_NODE.items()
                for arg in ("--set-string", f"nodeSelector.{key.replace('.', chr(92) + '.')}={value}")]
WHERE = f"the real node {realnode.NAME} (gpu.product {realnode.GPU_PRODUCT}: its CPU stands in for the GPU)"


def build_images() -> dict[str, str]:
    """images/build.sh, its progress shown; returns {"operator": name, "worker": name}."""
    say("$ make images   (rebuilds only what changed; the first build takes several minutes)")
    env = dict(os.environ, CONTAINERS_CONF=str(ROOT / "images" / "containers.conf"))
    result = subprocess.run(["bash", str(ROOT / "images" / "build.sh")], stdout=subprocess.PIPE, text=True, env=env)
    if result.returncode != 0:
        fail(f"images/build.sh exited {result.returncode}; its progress is above")
    operator, worker = result.stdout.split()
    return {"operator": operator, "worker": worker}


def load_images(plane: ControlPlane, built: dict[str, str]) -> None:
    names = realpods.load_images(plane, built, lambda msg: say(f"  {msg}"))
    say(f"the chart pulls {names['operator']}, the operator runs {names['worker']} (imagePullPolicy "
        f"IfNotPresent: the node has them, no registry needed)")


def operator_log() -> str:
    return f"(kubectl logs -n {SYSTEM_NS} deployment/{RELEASE})"


def show_operator(plane: ControlPlane) -> None:
    pods = plane.kubectl("get", "pods", "-n", SYSTEM_NS, "-l", f"app.kubernetes.io/instance={RELEASE}",
                         "-o", "wide").stdout.rstrip()
    say("  " + pods.replace("\n", "\n  "))


def demo_sdd() -> dict:
    return realpods.ngram_sdd(SDD, DEMO_NS)


def serve(plane: ControlPlane, sdd: dict) -> None:
    """The Ready worker pod, its three start-up phases from its log, and one chat completion
    through the Service."""
    pods = json.loads(plane.kubectl("get", "pods", "-n", DEMO_NS, "-l", sdd["status"]["selector"],
                                    "-o", "json").stdout)["items"]
    ready = [p for p in pods if not p["metadata"].get("deletionTimestamp")
             and {c["type"]: c["status"] for c in p["status"].get("conditions", [])}.get("Ready") == "True"]
    if not ready:
        fail(f"no Ready worker pod matches {sdd['status']['selector']}")
    pod = ready[0]["metadata"]["name"]
    say(f"Ready replica: pod {pod} on node {ready[0]['spec'].get('nodeName')}")
    logs = plane.kubectl("logs", "-n", DEMO_NS, pod).stdout
    phases = next((line for line in logs.splitlines() if "ready: phases took" in line), None)
    say(f"$ kubectl logs -n {DEMO_NS} {pod} | grep phases\n  {phases or '(not logged yet)'}")
    say(f"$ kubectl port-forward -n {DEMO_NS} service/{SDD} <local port>:8000")
    deadline = time.monotonic() + 60
    while True:
        try:
            with realpods.port_forward(plane, DEMO_NS, SDD) as url:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
                    model = json.loads(resp.read())["data"][0]["id"]
                chat(url, model)
                return
        except (RuntimeError, OSError) as exc:  # the Service's endpoints can lag the pod's readiness
            if time.monotonic() > deadline:
                fail(f"no answer through service/{SDD}: {exc}")
            time.sleep(2)


def finish(plane: ControlPlane) -> None:
    say(f"\nDone in {time.monotonic() - T0:.1f}s. Still running: the control plane and its real node, with the "
        f"operator and the worker as pods. Look around:")
    say(f"  export KUBECONFIG={plane.kubeconfig} PATH={plane.bin_dir}:$PATH")
    say(f"  kubectl get sdd -A;  kubectl describe sdd {SDD} -n {DEMO_NS};  kubectl get pods,deploy,svc -n {DEMO_NS}")
    say(f"  kubectl logs -n {SYSTEM_NS} deployment/{RELEASE};  kubectl logs -n {DEMO_NS} deployment/{SDD}")
    say(f"  kubectl port-forward -n {DEMO_NS} service/{SDD} 8000:8000 &")
    say("  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' "
        "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
        "\"max_tokens\": 24}'")
    say("Stop everything (the control plane, its node and every pod):")
    say("  .venv/bin/python demo/run.py down")
