"""The real-node lane: the operator, its planner pods and its workers run as containers under a real
kubelet and containerd (devtools/cluster/realnode.py), from the images `make images` builds.

The chart installs the operator as a pod with its ServiceAccount token; an NGRAM SmolLM2 SDD in a
namespace that enforces Pod Security `restricted` is planned by a real planner pod and served by a
real worker pod, and answers through its Service (kubectl port-forward). Failures come from the real
kubelet: exit codes and termination messages, image pulls. The KWOK lane (the `cluster` fixture)
keeps the tests that need hundreds of pods or faults injected into planning.

Set SPECDECODE_REQUIRE_REAL_NODE=1 (CI does) to fail rather than skip where a machine cannot run
a real node.
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid

import pytest
import yaml

from devtools import smollm2
from devtools.cluster import realnode, realpods
from devtools.cluster.controlplane import ControlPlane, build_binaries
from devtools.cluster.wait import wait_for
from tests import podman
from tests.e2e_helpers import condition, get_object, greedy_reply, list_objects

pytestmark = [pytest.mark.e2e, pytest.mark.images, pytest.mark.slow]

RELEASE, SYSTEM_NS = "specdecode-operator", "specdecode-system"
READY_TIMEOUT = 420  # a cold planner and worker start on a busy 2-core machine
QUESTION = ("Kubernetes groups containers that make up an application into logical units for easy "
            "management and discovery.\n\nRepeat the sentence above word for word.")


def _say(msg: str) -> None:
    print(f"real node: {msg}", flush=True)


@pytest.fixture(scope="module")
def real_plane(tmp_path_factory, pytestconfig):
    realnode.install_packages(say=_say)
    missing = realnode.missing_parts()
    if missing:
        why = "this machine cannot run a real node; missing: " + "; ".join(missing)
        if os.environ.get("SPECDECODE_REQUIRE_REAL_NODE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        built = podman.build_images()
        plane = ControlPlane(tmp_path_factory.mktemp("real-node"), build_binaries(progress=_say),
                             realnode.build(progress=_say))
        _say(f"control plane logs: {plane.logs_dir}")
        plane.start(progress=_say)
    try:
        with capture.global_and_fixture_disabled():
            realpods.load_images(plane, built, _say)
            realpods.install_operator(plane, RELEASE, SYSTEM_NS)
        yield plane
    finally:
        print(plane.kubectl("logs", "-n", SYSTEM_NS, f"deployment/{RELEASE}", "--tail=60", check=False).stdout)
        plane.stop()
    # Stopping the plane ended every container: none is left in the node's cgroups.
    assert node_processes(plane) == []


def node_processes(plane) -> list[str]:
    """The processes in the real node's cgroups, all of which lie below this test's own cgroup."""
    top = realnode.cgroup_dir("memory", plane.node.cgroup_root, plane.node.cgroup_v1)
    return [pid for procs in (top.rglob("cgroup.procs") if top.is_dir() else []) for pid in procs.read_text().split()]


@pytest.fixture(scope="module")
def model_dir():
    return smollm2.smollm2_dir_or_skip()


@pytest.fixture
def ns(real_plane, model_dir, request):
    name = f"rn-{request.node.name[5:30].replace('_', '-').strip('-')}-{uuid.uuid4().hex[:4]}".lower()
    realpods.restricted_namespace(real_plane, name)
    realpods.model_store(real_plane, name, model_dir)
    yield name
    real_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply_sdd(plane, body: dict) -> None:
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))


def wait_condition(plane, ns: str, name: str, ctype: str, predicate, what: str, timeout: float) -> dict:
    def check():
        c = condition(get_object(plane, ns, "sdd", name), ctype)
        return c if c and predicate(c) else None

    try:
        return wait_for(check, timeout=timeout, interval=1, what=f"{name}: {what}")
    except Exception:
        print(plane.kubectl("get", "sdd,pods,events", "-n", ns, "-o", "wide", check=False).stdout)
        raise


def worker_pods(plane, ns: str, name: str) -> list[dict]:
    return [p for p in list_objects(plane, ns, "pods", f"specdecode.io/name={name}")
            if p["metadata"].get("labels", {}).get("specdecode.io/role") != "planner"]


def chat_through_service(plane, ns: str, name: str) -> dict:
    """One greedy chat completion through `kubectl port-forward service/<name>`."""
    with realpods.port_forward(plane, ns, name) as url:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                "temperature": 0}
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return {"request": body, "response": json.loads(resp.read())}


def test_the_operator_runs_as_a_pod_of_the_chart_on_its_service_account(real_plane):
    pods = list_objects(real_plane, SYSTEM_NS, "pods", f"app.kubernetes.io/instance={RELEASE}")
    assert len(pods) == 1, pods
    pod = pods[0]
    assert pod["spec"]["nodeName"] == realnode.NAME
    assert pod["spec"]["serviceAccountName"] == RELEASE
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert ready["Ready"] == "True"
    # It reached the API server through the kubernetes Service and logged in with its token.
    logs = real_plane.kubectl("logs", "-n", SYSTEM_NS, pod["metadata"]["name"]).stdout
    assert "login_via_client' succeeded" in logs or "Initial authentication has finished" in logs, logs[-2000:]


def test_an_sdd_on_the_real_node_answers_through_its_service_with_the_targets_greedy_output(
        real_plane, ns, model_dir):
    apply_sdd(real_plane, realpods.ngram_sdd("smollm2", ns))
    wait_condition(real_plane, ns, "smollm2", "Ready", lambda c: c["status"] == "True", "Ready", READY_TIMEOUT)

    planner = list_objects(real_plane, ns, "pods", "specdecode.io/name=smollm2,specdecode.io/role=planner")
    assert planner and all(p["spec"]["nodeName"] == realnode.NAME for p in planner)
    assert planner[-1]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    (worker,) = worker_pods(real_plane, ns, "smollm2")
    assert worker["spec"]["nodeName"] == realnode.NAME
    assert worker["spec"]["securityContext"]["runAsNonRoot"] is True
    assert node_processes(real_plane), "the pods' processes run outside the node's cgroup"

    record = chat_through_service(real_plane, ns, "smollm2")
    answer = record["response"]["choices"][0]["message"]["content"]
    assert answer == greedy_reply(model_dir, record["request"]["messages"], record["request"]["max_tokens"])

    logs = real_plane.kubectl("logs", "-n", ns, worker["metadata"]["name"]).stdout
    ready_line = next((line for line in logs.splitlines() if "ready: phases took" in line), "")
    for phase in ("load_weights", "alloc_memory_pool", "init_backends"):
        assert phase in ready_line, logs[-3000:]
    assert "this node declares SPECDECODE_DEVICE=cpu" in logs  # the operator asked for cuda


def test_a_deleted_worker_pod_is_replaced_and_ready_again(real_plane, ns):
    apply_sdd(real_plane, realpods.ngram_sdd("smollm2", ns))
    wait_condition(real_plane, ns, "smollm2", "Ready", lambda c: c["status"] == "True", "Ready", READY_TIMEOUT)
    (first,) = worker_pods(real_plane, ns, "smollm2")
    real_plane.kubectl("delete", "pod", "-n", ns, first["metadata"]["name"], "--wait=false")

    def replaced_and_ready():
        pods = [p for p in worker_pods(real_plane, ns, "smollm2")
                if p["metadata"]["uid"] != first["metadata"]["uid"] and not p["metadata"].get("deletionTimestamp")]
        ready = [p for p in pods if {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
                 .get("Ready") == "True"]
        return ready[0] if ready else None

    second = wait_for(replaced_and_ready, timeout=READY_TIMEOUT, interval=1, what="a new Ready worker pod")
    assert second["spec"]["nodeName"] == realnode.NAME
    wait_condition(real_plane, ns, "smollm2", "Ready", lambda c: c["status"] == "True", "Ready again", 60)


def test_a_plan_for_more_memory_than_the_node_gives_exits_3_and_says_so(real_plane, ns):
    # The user claims 16 GiB GPUs and asks for 200k KV tokens; the node gives each pod 4 GiB: the
    # plan fits on paper, and the worker, after loading, finds room for far fewer tokens.
    body = realpods.ngram_sdd("too-big", ns, gpu={"product": realnode.GPU_PRODUCT, "memoryGiB": 16},
                              serving={"contextLength": 2048, "maxRunningRequests": 4, "minKVTokens": 200_000})
    apply_sdd(real_plane, body)
    degraded = wait_condition(real_plane, ns, "too-big", "Degraded",
                              lambda c: c["status"] == "True" and c.get("reason") == "WorkerStartupFailed",
                              "WorkerStartupFailed", READY_TIMEOUT)
    assert "exited with code 3" in degraded["message"], degraded
    (worker,) = worker_pods(real_plane, ns, "too-big")
    status = worker["status"]["containerStatuses"][0]
    terminated = (status.get("lastState") or {}).get("terminated") or status["state"].get("terminated")
    assert terminated["exitCode"] == 3
    # The kubelet read the worker's termination message, and the condition carries it.
    assert terminated.get("message") and terminated["message"].strip().splitlines()[-1][:60] in degraded["message"]


def test_an_image_the_node_lacks_shows_its_pull_error_in_the_sdds_status(real_plane, ns):
    image = "ghcr.io/specdecode/worker:no-such-tag"
    apply_sdd(real_plane, realpods.ngram_sdd("no-image", ns, image=image))

    def pull_error():
        sdd = get_object(real_plane, ns, "sdd", "no-image") or {}
        for c in sdd.get("status", {}).get("conditions", []):
            text = (c.get("message") or "") + (c.get("reason") or "")
            if "ErrImagePull" in text or "ImagePullBackOff" in text:
                return c
        return None

    try:
        c = wait_for(pull_error, timeout=180, interval=1, what="an image pull error in the SDD's conditions")
    except Exception:
        print(real_plane.kubectl("get", "sdd,pods,events", "-n", ns, "-o", "wide", check=False).stdout)
        raise
    assert image in c["message"], c
    events = real_plane.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    assert "Failed" in events and image in events  # the kubelet's own pull failure, as users see it


# vLLM's CPU image is 6 GB and takes minutes to build and copy into the node, which a cold CI run
# cannot afford; `make test-vllm-node` runs this case (docs/development.md, "The real node").
RUN_VLLM = os.environ.get("SPECDECODE_VLLM_NODE") == "1"


@pytest.mark.skipif(not RUN_VLLM, reason="vLLM's CPU image stays out of make test: `make test-vllm-node` runs it")
def test_vllm_from_its_cpu_image_goes_ready_through_the_kv_gate_and_answers(real_plane, ns, model_dir, capsys):
    """runtime.engine vllm: the real planner pod prices vLLM's arithmetic, the worker pod runs vLLM's
    CPU build from the image made from the engine venv's pins, and the operator opens the pod's KV
    readiness gate only once vLLM's own report of its KV tokens equals the plan."""
    with capsys.disabled():
        image = podman.build_vllm_cpu_image()
        real_plane.node.import_image(image, [image], _say)
    runtime = {"engine": "vllm", "image": image, "extraArgs": ["--enforce-eager"]}  # no compiler in the image
    apply_sdd(real_plane, realpods.ngram_sdd("smol-vllm", ns, runtime=runtime))
    wait_condition(real_plane, ns, "smol-vllm", "Ready", lambda c: c["status"] == "True", "Ready", READY_TIMEOUT)

    sdd = get_object(real_plane, ns, "sdd", "smol-vllm")
    planned = sdd["status"]["plan"]["runtime"]
    assert planned["engine"] == "vllm" and planned["version"] == "0.32.0", planned
    (worker,) = worker_pods(real_plane, ns, "smol-vllm")
    assert worker["spec"]["nodeName"] == realnode.NAME
    container = worker["spec"]["containers"][0]
    assert container["image"] == image
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    kv, tokens = sdd["status"]["engineKV"], planned["reportedTokens"]
    assert kv["plannedTokens"] == tokens
    assert kv["pods"] == [{"name": worker["metadata"]["name"], "verified": True, "reportedTokens": tokens}]
    gate = {c["type"]: c["status"] for c in worker["status"]["conditions"]}
    assert gate["specdecode.io/kv-cache-verified"] == "True" and gate["Ready"] == "True", gate

    record = chat_through_service(real_plane, ns, "smol-vllm")
    answer = record["response"]["choices"][0]["message"]["content"]
    assert answer == greedy_reply(model_dir, record["request"]["messages"], record["request"]["max_tokens"])
