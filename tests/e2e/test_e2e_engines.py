"""vLLM as the worker runtime, end to end on the real control plane: `kubectl apply` of an SDD with
runtime.engine vllm, the real planner pod prices it in vLLM's arithmetic, the operator renders the
engine's own command, that command runs here with vLLM 0.32's CPU build on SmolLM2-135M-Instruct
(tests/engine_pods.py), and the operator compares vLLM's own report of its KV tokens with the plan.

Also what the API server refuses before anything is planned: flags the operator owns in
runtime.extraArgs, and an EAGLE tree on an engine that does not verify trees.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from devtools.cluster.wait import wait_for
from tests.e2e_helpers import apply, condition, get_object, list_objects, phase_is, wait_sdd
from tests.engine_pods import EnginePod, engine_venv

pytestmark = pytest.mark.timeout(900)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def vllm_venv():
    return engine_venv("vllm")


@pytest.fixture
def smol_store(cluster, namespace):
    """The `models` claim holding SmolLM2-135M-Instruct (hard links to the converted copy)."""
    import os
    import shutil

    from devtools import smollm2

    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
    dst = cluster.pvc_root / namespace / "models" / MODEL
    dst.mkdir(parents=True)
    for f in smollm2.smollm2_dir().iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)
    return dst


def sdd(name, algorithm, *extra_args, draft=None):
    spec = {
        "target": {"model": MODEL, "dtype": "bfloat16"},
        "draft": {"algorithm": algorithm, "numSteps": 3, **({"model": draft} if draft else {})},
        "serving": {"contextLength": 2048, "maxRunningRequests": 8},
        # Plans for a 4 GiB GPU: about 1.7 GB of KV, which vLLM's CPU build allocates in host memory.
        "gpu": {"memoryGiB": 4},
        "modelStore": {"pvc": {"claimName": "models"}},
        "resources": {"cpu": "1"},
        # A user's flag for vLLM's CPU build: no torch.compile, so it starts in under a minute.
        "runtime": {"engine": "vllm", "extraArgs": ["--enforce-eager", *extra_args]},
    }
    if algorithm == "NGRAM":
        spec["draft"] = {"algorithm": "NGRAM", "numDraftTokens": 3}
    return {"apiVersion": "specdecode.io/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": name}, "spec": spec}


def worker_pod(cluster, namespace, name):
    def found():
        pods = list_objects(cluster, namespace, "pods", f"specdecode.io/name={name},specdecode.io/role=worker")
        ready = [p for p in pods if any(c["type"] == "ContainersReady" and c["status"] == "True"
                                        for c in p.get("status", {}).get("conditions", []))]
        return ready[0] if ready else None

    return wait_for(found, timeout=180, interval=1, what=f"{name}: a worker pod with its containers ready")


def gate(pod):
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == "specdecode.io/kv-cache-verified"),
                None)


def vllm_tokens(engine: EnginePod) -> int:
    info = next(line for line in engine.get("/metrics").splitlines() if line.startswith("vllm:cache_config_info{"))
    return int(re.search(r'kv_cache_size_tokens="(\d+)"', info).group(1))


def serve(cluster, namespace, tmp_path, venv, body, change=None):
    """Apply the SDD, run the rendered worker command with vLLM once the pod exists, announce its IP."""
    apply(cluster, namespace, body)
    name = body["metadata"]["name"]
    pod = worker_pod(cluster, namespace, name)
    assert gate(pod) is None and condition(pod, "Ready")["status"] == "False"  # held back by the gate
    engine = EnginePod(cluster, pod, venv, tmp_path, change).start()
    engine.announce()
    return engine


def test_vllm_serves_what_was_planned(cluster, namespace, smol_store, operator, vllm_venv, tmp_path):
    """NGRAM, then a draft model (SmolLM2 as its own draft): vLLM reports the plan's tokens exactly,
    the pod becomes Ready through the gate, and an OpenAI client gets an answer."""
    import openai

    for name, algorithm, draft in (("smol-ngram", "NGRAM", None), ("smol-draft", "STANDALONE", MODEL)):
        engine = serve(cluster, namespace, tmp_path, vllm_venv, sdd(name, algorithm, draft=draft))
        try:
            sdd_obj = wait_sdd(cluster, namespace, name, phase_is("Ready"), "Ready through the KV gate", timeout=120)
            plan, kv = sdd_obj["status"]["plan"], sdd_obj["status"]["engineKV"]
            planned = plan["runtime"]["reportedTokens"]
            assert plan["runtime"]["engine"] == "vllm" and plan["runtime"]["version"] == "0.32.0"
            assert vllm_tokens(engine) == planned  # vLLM's own report, to the token
            assert kv["plannedTokens"] == planned and kv["pods"] == [
                {"name": kv["pods"][0]["name"], "verified": True, "reportedTokens": planned}]
            assert condition(sdd_obj, "Ready")["status"] == "True"
            client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="none")
            out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                            temperature=0)
            assert out.choices[0].text.strip(), out
            if algorithm == "STANDALONE":  # the draft really proposed and was accepted
                metrics = engine.get("/metrics")
                accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)", metrics,
                                     re.MULTILINE)
                assert accepted and float(accepted.group(1)) > 0, metrics[-2000:]
            table = cluster.kubectl("get", "sdd", name, "-n", namespace).stdout
            assert "vllm" in table.splitlines()[1]
        finally:
            engine.stop()
        cluster.kubectl("delete", "sdd", name, "-n", namespace, "--wait=false")


def test_an_engine_that_sized_less_is_caught(cluster, namespace, smol_store, operator, vllm_venv, tmp_path):
    """vLLM started with half the planned KV budget (as an engine whose arithmetic drifted would
    size): the gate stays closed, and the SDD says both numbers."""
    body = sdd("smol-short", "NGRAM")
    apply(cluster, namespace, body)
    priced = wait_sdd(cluster, namespace, "smol-short",
                      lambda s: (s.get("status", {}).get("plan") or {}).get("runtime"), "planned", timeout=120)
    planned = priced["status"]["plan"]["runtime"]
    half = str(planned["kvCacheMemoryBytes"] // 2)
    engine = serve(cluster, namespace, tmp_path, vllm_venv, body, change={"--kv-cache-memory-bytes": half})
    try:
        got = vllm_tokens(engine)
        assert got < planned["reportedTokens"]
        sdd_obj = wait_sdd(cluster, namespace, "smol-short",
                           lambda s: (condition(s, "Degraded") or {}).get("reason") == "KVCacheBelowPlan",
                           "KVCacheBelowPlan", timeout=120)
        message = condition(sdd_obj, "Degraded")["message"]
        assert str(got) in message and str(planned["reportedTokens"]) in message
        assert sdd_obj["status"]["phase"] != "Ready" and sdd_obj["status"]["readyReplicas"] == 0
        assert sdd_obj["status"]["engineKV"]["pods"][0] == {
            "name": sdd_obj["status"]["engineKV"]["pods"][0]["name"], "verified": False, "reportedTokens": got}
        (pod,) = list_objects(cluster, namespace, "pods", "specdecode.io/name=smol-short,specdecode.io/role=worker")
        assert gate(pod)["status"] == "False" and condition(pod, "Ready")["status"] == "False"
        events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        assert any(e["reason"] == "KVCacheBelowPlan" and e["type"] == "Warning" for e in events)
    finally:
        engine.stop()


@pytest.mark.parametrize("args, flag", [
    (["--kv-cache-memory-bytes=1000"], "--kv-cache-memory-bytes"),
    (["--enforce-eager", "--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
    (["--speculative-config={}"], "--speculative-config"),
    (["-tp", "2"], "-tp"),
])
def test_owned_flags_are_refused_by_the_api_server(cluster, namespace, crd, args, flag):
    body = sdd("refused", "NGRAM")
    body["spec"]["runtime"]["extraArgs"] = args
    out = apply(cluster, namespace, body, check=False)
    assert out.returncode != 0 and f"runtime.extraArgs may not set {flag}:" in out.stderr, out.stderr


def test_trees_only_on_specdecode(cluster, namespace, crd):
    body = sdd("tree", "EAGLE3", draft="d")
    body["spec"]["draft"].update(topK=4, numDraftTokens=8)
    out = apply(cluster, namespace, body, check=False)
    assert out.returncode != 0 and "only runtime.engine specdecode verifies" in out.stderr, out.stderr
    body["spec"]["runtime"] = {"engine": "specdecode"}
    assert apply(cluster, namespace, body, check=False).returncode == 0
    assert get_object(cluster, namespace, "sdd", "tree")["spec"]["runtime"]["engine"] == "specdecode"
