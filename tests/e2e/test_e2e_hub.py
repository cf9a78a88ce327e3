"""Hub-stored models end to end on the real control plane, against a local hub process.

The hub (``python -m tests.hub_server``) serves model folders on 127.0.0.1 the way the Hugging Face
hub does and counts the bytes it sends; planner pods and the download Jobs' pods
(``specdecode.io/role: model-cache``) really run through the test runtime, so the planner reads
headers over HTTP and ``specdecode-worker fetch`` writes into the cache claim's folder. Worker pods
become Ready through KWOK; no worker process runs.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.chart_helpers import CHART, forbidden_lines, sa_kubeconfig
from devtools.checkpoints import write_model
from devtools.cluster.wait import wait_for
from tests.e2e_helpers import (
    DRAFT, ROOT, TARGET, Operator, apply, condition, example, free_port, get_object, list_objects, local_plan,
    phase_is, wait_sdd,
)
from devtools.tiny_models import write_tiny_model

pytestmark = pytest.mark.timeout(420)

TOKEN = "hf_e2eSecretToken0123456789abcdef"
TINY_TARGET, TINY_DRAFT = "acme/tiny-target", "acme/tiny-draft"
CACHE_ROLE = "specdecode.io/role=model-cache"


class HubProcess:
    """The local hub as a process on a fixed loopback port (so a restart keeps its URL)."""

    def __init__(self, root: Path, log: Path, token: str | None = None, throttle: float | None = None):
        self.root, self.log, self.token, self.throttle = root, log, token, throttle
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.commits: dict[str, str] = {}

    def start(self) -> "HubProcess":
        args = [sys.executable, "-m", "tests.hub_server", "--root", str(self.root), "--port", str(self.port)]
        if self.token:
            args += ["--token", self.token]
        if self.throttle:
            args += ["--throttle", str(self.throttle)]
        self.log.write_text("")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)

        def listening():
            assert self.proc.poll() is None, self.log.read_text()
            text = self.log.read_text()
            return "hub listening on" in text and text

        text = wait_for(listening, timeout=60, interval=0.2, what="local hub listening")
        self.commits = dict(re.findall(r"^repo (\S+) main ([0-9a-f]{40})$", text, re.M))
        return self

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/_stats", timeout=10) as r:
            return json.loads(r.read())

    def reset_stats(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/_stats/reset", method="POST"), timeout=10).read()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self) -> "HubProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def header_bytes(path: Path) -> int:
    """A safetensors file's length prefix plus its JSON header: what planning needs of it."""
    with path.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def weight_files(root: Path) -> dict[str, Path]:
    """``repo/path`` (the hub's per-file counter key) -> file, for every safetensors file."""
    return {f"{p.parent.parent.name}/{p.parent.name}/{p.name}": p for p in root.glob("*/*/*.safetensors")}


def tiny_models(root: Path) -> Path:
    """A 16 MB target and a 2 MB draft (same tokenizer): small enough to download in a test."""
    write_tiny_model(root / TINY_TARGET, "llama", seed=0, hidden_size=256, intermediate_size=1024,
                     num_hidden_layers=4)
    write_tiny_model(root / TINY_DRAFT, "llama", seed=1, hidden_size=128, intermediate_size=512, num_hidden_layers=2)
    return root


def tiny_sdd(name: str, hub: HubProcess, cache: dict | None, token: bool = True) -> dict:
    body = example()
    body["metadata"]["name"] = name
    spec = body["spec"]
    spec["target"] = {"model": TINY_TARGET, "dtype": "float32"}
    spec["draft"] = {"algorithm": "STANDALONE", "model": TINY_DRAFT, "numSteps": 3, "topK": 1, "numDraftTokens": 4}
    spec["serving"] = {"contextLength": 256, "maxRunningRequests": 4}
    hub_store: dict = {"endpoint": hub.url}
    if token:
        hub_store["tokenSecret"] = {"name": "hf-token", "key": "token"}
    if cache is not None:
        hub_store["cache"] = cache
    spec["modelStore"] = {"hub": hub_store}
    return body


def create_token_secret(cluster, namespace: str) -> None:
    cluster.kubectl("create", "secret", "generic", "hf-token", "-n", namespace, f"--from-literal=token={TOKEN}")


def chart_credentials(cluster, namespace: str, tmp_path: Path) -> dict:
    """The chart's ServiceAccount, Role and RoleBinding for ``namespace`` (namespace scope, no node
    access), applied; returns the environment of an operator holding only that account's token."""
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    out = cluster.helm("template", "sdo", str(CHART), "-n", namespace, "--kube-version", version,
                       "--set", "watch.scope=namespace",
                       "--set", f"watch.namespaces={{{namespace}}}", "--set", "rbac.readNodes=false").stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding"}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    kubeconfig = sa_kubeconfig(cluster, namespace, "sdo-specdecode-operator", tmp_path / "sa.kubeconfig")
    return dict(cluster.env, KUBECONFIG=str(kubeconfig))


def models_ready(sdd) -> dict:
    return condition(sdd, "ModelsReady") or {}


def model_cache_jobs(cluster, namespace):
    return list_objects(cluster, namespace, "jobs", CACHE_ROLE)


# --- tests ----------------------------------------------------------------------------------------

def test_hub_store_plans_from_headers_without_downloading_weights(cluster, crd, namespace, tmp_path):
    root = tmp_path / "hub"
    write_model(root / TARGET, "llama-3.1-8b-instruct")
    write_model(root / DRAFT, "eagle3-llama-3.1-8b")
    weights = weight_files(root)
    weight_bytes = sum(p.stat().st_size for p in weights.values())
    with HubProcess(root, Path(cluster.logs_dir) / f"hub-{namespace}.log") as hub:
        op = Operator(cluster, namespace).start()
        try:
            apply(cluster, namespace, example(modelStore={"hub": {"endpoint": hub.url}}))
            sdd = wait_sdd(cluster, namespace, "llama-8b-eagle3", phase_is("Ready"), "Ready", timeout=180)
        finally:
            op.stop()
            print(f"--- operator log (tail) ---\n{op.tail(60)}")
        stats = hub.stats()

    # the plan is the one the same files give from a folder, and it names the commits it read
    plan = sdd["status"]["plan"]
    expected = local_plan(root, "--draft", str(root / DRAFT), "--algorithm", "EAGLE3", "--tp", "auto",
                          "--gpu-product", "NVIDIA-H100-80GB-HBM3", "--context-length", "8192",
                          "--min-kv-tokens", "65536", "--max-running-requests", "64")
    for k in ("weights", "kvCache", "tensorParallelSize", "memFractionStatic"):
        assert plan[k] == expected[k], k
    for role, repo in (("target", TARGET), ("draft", DRAFT)):
        src = plan["sources"][role]
        assert (src["repo"], src["commit"]) == (repo, hub.commits[repo])
        assert src["bytes"] == sum(p.stat().st_size for p in (root / repo).iterdir() if p.is_file())
        assert sum(src["partBytes"]) == src["bytes"]

    # no weights were sent: each safetensors file gave at most its header and the client's first range read
    per_file = {k: v for k, v in stats["files"].items() if k in weights}
    assert per_file, stats
    for key, sent in per_file.items():
        assert sent <= max(header_bytes(weights[key]), 100_001), (key, sent)
    print(f"planning {weight_bytes / 1e9:.1f} GB of weights from the hub: {stats['bytesSent']} bytes sent "
          f"in {stats['requests']} requests")
    assert stats["bytesSent"] < weight_bytes / 10_000

    # the planner pod mounted nothing and fetched nothing first; workers pin the plan's commits
    planner = get_object(cluster, namespace, "pod", plan["plannerPod"])
    assert "initContainers" not in planner["spec"]
    assert all("persistentVolumeClaim" not in v for v in planner["spec"]["volumes"])
    pod = get_object(cluster, namespace, "deployment", "llama-8b-eagle3")["spec"]["template"]["spec"]
    target_dir = f"/models/{TARGET}/{hub.commits[TARGET]}"
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-target", "fetch-draft"]
    assert target_dir in pod["initContainers"][0]["args"] and target_dir in pod["containers"][0]["args"]


def test_cache_is_filled_once_shared_and_survives_replicas_and_restarts_without_the_token_leaking(
        cluster, crd, namespace, tmp_path):
    root = tiny_models(tmp_path / "hub")
    create_token_secret(cluster, namespace)
    name, claim = "tiny-hub", "tiny-hub-model-cache"
    env = chart_credentials(cluster, namespace, tmp_path)  # the chart's RBAC covers the cache's PVC and Jobs
    with HubProcess(root, Path(cluster.logs_dir) / f"hub-{namespace}.log", token=TOKEN) as hub:
        op = Operator(cluster, namespace, "--no-node-check", env=env).start()
        try:
            apply(cluster, namespace, tiny_sdd(name, hub, {"create": {}}))
            sdd = wait_sdd(cluster, namespace, name, phase_is("Ready"), "Ready after the download", timeout=240)
            after_download = hub.stats()

            ready = models_ready(sdd)
            assert (ready["status"], ready["reason"]) == ("True", "Downloaded")
            models = {m["repo"]: m for m in sdd["status"]["models"]}
            assert set(models) == {TINY_TARGET, TINY_DRAFT}
            for repo, m in models.items():
                assert (m["state"], m["commit"]) == ("Downloaded", hub.commits[repo])
                assert m["bytesDone"] == m["bytesTotal"] == sdd["status"]["plan"]["sources"][
                    "target" if repo == TINY_TARGET else "draft"]["bytes"]
            # the cache holds exactly the hub's files at <owner>/<name>/<commit>
            folder = Path(cluster.pvc_root) / namespace / claim
            for repo in (TINY_TARGET, TINY_DRAFT):
                src = root / repo
                names = sorted(p.name for p in src.iterdir() if p.is_file())
                cached = folder / repo / hub.commits[repo]
                assert sorted(p.name for p in cached.iterdir() if p.is_file()) == names
                match, mismatch, errors = filecmp.cmpfiles(src, cached, names, shallow=False)
                assert (mismatch, errors) == ([], []), (mismatch, errors)
            # each weight file crossed the wire once (plus the planner's header read)
            for key, path in weight_files(root).items():
                sent = after_download["files"][key]
                assert path.stat().st_size <= sent <= path.stat().st_size + max(header_bytes(path), 100_001), key
            pvc = get_object(cluster, namespace, "pvc", claim)
            assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
            assert pvc["metadata"]["ownerReferences"][0]["uid"] == sdd["metadata"]["uid"]
            jobs = model_cache_jobs(cluster, namespace)
            assert len(jobs) == 2
            assert all(j["metadata"]["ownerReferences"][0]["kind"] == "PersistentVolumeClaim" for j in jobs)
            pod = get_object(cluster, namespace, "deployment", name)["spec"]["template"]["spec"]
            assert "initContainers" not in pod
            assert {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} \
                in pod["volumes"]
            assert f"/models/{TINY_TARGET}/{hub.commits[TINY_TARGET]}" in pod["containers"][0]["args"]
            table = cluster.kubectl("get", "sdd", name, "-n", namespace).stdout
            assert "MODELS" in table and "in PVC tiny-hub-model-cache" in table

            # two replicas and a worker restart: not one request reaches the hub, no download pod runs again
            hub.reset_stats()
            download_pods = {p["metadata"]["uid"] for p in list_objects(cluster, namespace, "pods", CACHE_ROLE)}
            cluster.kubectl("scale", "sdd", name, "-n", namespace, "--replicas=2")
            wait_sdd(cluster, namespace, name, lambda s: s["status"].get("readyReplicas") == 2, "2 ready replicas")
            workers = f"specdecode.io/name={name},specdecode.io/role=worker"
            (first, _) = list_objects(cluster, namespace, "pods", workers)
            cluster.kubectl("delete", "pod", first["metadata"]["name"], "-n", namespace, "--wait=true")
            wait_for(lambda: len([p for p in list_objects(cluster, namespace, "pods", workers)
                                  if p["metadata"]["uid"] != first["metadata"]["uid"]
                                  and p.get("status", {}).get("phase") == "Running"]) == 2,
                     timeout=60, what="the deleted worker replaced")
            wait_sdd(cluster, namespace, name, lambda s: s["status"].get("readyReplicas") == 2
                     and s["status"]["phase"] == "Ready", "Ready with 2 replicas again")
            assert hub.stats()["requests"] == 0
            assert {p["metadata"]["uid"] for p in list_objects(cluster, namespace, "pods", CACHE_ROLE)} == download_pods

            # a deleted download Job is created again and finds its files complete: no weight byte is sent
            job = models[TINY_TARGET]["job"]
            old_uid = get_object(cluster, namespace, "job", job)["metadata"]["uid"]
            cluster.kubectl("delete", "job", job, "-n", namespace, "--wait=true")

            def rerun_complete():
                again = get_object(cluster, namespace, "job", job) or {"metadata": {}}
                return again["metadata"].get("uid") not in (None, old_uid) and any(
                    c["type"] == "Complete" and c["status"] == "True" for c in again.get("status", {}).get(
                        "conditions", []))

            wait_for(rerun_complete, timeout=120, interval=0.5, what="the download Job created again and complete")
            wait_sdd(cluster, namespace, name, lambda s: models_ready(s).get("status") == "True"
                     and s["status"]["phase"] == "Ready", "Downloaded and Ready again")
            rerun = hub.stats()
            assert rerun["requests"] > 0  # the fetch did ask the hub what the commit holds
            assert not any(key in rerun["files"] for key in weight_files(root)), rerun["files"]

            # a second SDD on the same cache plans (headers only) and shares the downloads
            apply(cluster, namespace, tiny_sdd("tiny-hub-two", hub, {"claimName": claim}))
            second = wait_sdd(cluster, namespace, "tiny-hub-two", phase_is("Ready"), "second SDD Ready", timeout=180)
            assert [m["job"] for m in second["status"]["models"]] == [m["job"] for m in sdd["status"]["models"]]
            assert len(model_cache_jobs(cluster, namespace)) == 2
            for key, path in weight_files(root).items():
                assert hub.stats()["files"].get(key, 0) <= max(header_bytes(path), 100_001), key
        finally:
            op.stop()
            print(f"--- operator log (tail) ---\n{op.tail(60)}")

    refused = [line for line in forbidden_lines(op) if "namespaces" not in line.lower()
               and "customresourcedefinitions" not in line.lower()]  # kopf's discovery falls back by design
    assert not refused, "\n".join(refused[:5])
    # the token went only through the Secret: not in the operator's log, Events, status or any spec,
    # nor in the planner's and download pods' output
    assert TOKEN not in op.log.read_text()
    for kind in ("events", "sdd", "pods", "jobs", "deployments", "configmaps", "pvc"):
        out = cluster.kubectl("get", kind, "-n", namespace, "-o", "json").stdout
        assert TOKEN not in out, kind
    for log in (Path(cluster.logs_dir) / "pods").glob(f"{namespace}.*.log"):
        assert TOKEN not in log.read_text(errors="replace"), log.name
    jobs = model_cache_jobs(cluster, namespace)
    env = jobs[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in env


def test_progress_shows_in_status_during_a_throttled_download(cluster, crd, namespace, tmp_path):
    root = tiny_models(tmp_path / "hub")
    name = "tiny-slow"
    seen: list[tuple[str, str, int, int, bool, str]] = []
    # 18 MB at 1.5 MB/s: about 12 s of downloading
    with HubProcess(root, Path(cluster.logs_dir) / f"hub-{namespace}.log", throttle=1_500_000) as hub:
        op = Operator(cluster, namespace).start()
        try:
            apply(cluster, namespace, tiny_sdd(name, hub, {"create": {}}, token=False))

            def done():
                # the Deployment is read first: one that exists while the status still says Downloading is a bug
                deployed = get_object(cluster, namespace, "deployment", name) is not None
                sdd = get_object(cluster, namespace, "sdd", name) or {}
                ready = models_ready(sdd)
                if ready:
                    models = sdd["status"].get("models") or []
                    table = cluster.kubectl("get", "sdd", name, "-n", namespace).stdout \
                        if ready["reason"] == "Downloading" else ""
                    seen.append((ready["reason"], ready["message"], sum(m["bytesDone"] for m in models),
                                 sum(m["bytesTotal"] for m in models), deployed, table))
                return ready.get("status") == "True" and sdd["status"]["phase"] == "Ready"

            wait_for(done, timeout=300, interval=0.3, what=f"{name}: downloaded and Ready")
        finally:
            op.stop()
            print(f"--- operator log (tail) ---\n{op.tail(60)}")
    downloading = [s for s in seen if s[0] == "Downloading"]
    assert downloading, seen
    partial = [s for s in downloading if 0 < s[2] < s[3]]
    assert partial, downloading  # bytes done between none and all, while it ran
    reason, message, done_bytes, total, deployed, _ = partial[-1]
    pct = 100 * done_bytes // total
    assert message == f"{done_bytes / 1e6:.1f} / {total / 1e6:.1f} MB ({pct}%)"
    # the Models column of `kubectl get sdd` (read just after the status, so maybe a later message)
    assert any(re.search(r"\s\d+\.\d / \d+\.\d MB \(\d+%\)\s", s[5]) for s in downloading), \
        [s[5] for s in downloading]
    assert not any(s[4] for s in downloading)  # no workload before every model is in the cache
    print(f"progress seen: {[s[1] for s in downloading]}")


def test_a_commit_the_hub_no_longer_has_is_model_download_failed(cluster, crd, namespace, tmp_path):
    root = tiny_models(tmp_path / "hub")
    name, claim = "tiny-gone", "late-cache"
    log = Path(cluster.logs_dir) / f"hub-{namespace}.log"
    hub = HubProcess(root, log).start()
    op = Operator(cluster, namespace).start()
    try:
        apply(cluster, namespace, tiny_sdd(name, hub, {"claimName": claim}, token=False))
        sdd = wait_sdd(cluster, namespace, name, lambda s: models_ready(s).get("reason") == "CacheClaimNotFound",
                       "planned, waiting for its cache claim", timeout=180)
        assert f"PVC {claim}" in models_ready(sdd)["message"] and sdd["status"]["phase"] == "Failed"
        planned = sdd["status"]["plan"]["sources"]["target"]["commit"]

        # the branch is rewritten (new file times, a new commit) and the planned commit is gone
        hub.stop()
        later = time.time() + 60
        for path in root.rglob("*"):
            os.utime(path, (later, later))
        hub.start()
        assert hub.commits[TINY_TARGET] != planned
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        sdd = wait_sdd(cluster, namespace, name, lambda s: models_ready(s).get("reason") == "ModelDownloadFailed",
                       "ModelDownloadFailed", timeout=180)
    finally:
        op.stop()
        hub.stop()
        print(f"--- operator log (tail) ---\n{op.tail(60)}")
    failed = models_ready(sdd)
    assert failed["status"] == "False" and planned[:12] in failed["message"]
    assert "not found" in failed["message"].lower(), failed["message"]
    assert sdd["status"]["phase"] == "Failed" and condition(sdd, "Degraded")["reason"] == "ModelDownloadFailed"
    assert get_object(cluster, namespace, "deployment", name) is None
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                                        f"involvedObject.name={name}", "-o", "json").stdout)["items"]
    assert any(e["reason"] == "ModelDownloadFailed" and e["type"] == "Warning" for e in events)
    print(f"ModelDownloadFailed: {failed['message']}")


def test_invalid_hub_caches_are_refused_by_the_api_server(cluster, crd, namespace):
    body = example(modelStore={"hub": {"cache": {"claimName": "a", "create": {}}}})
    r = apply(cluster, namespace, body, check=False)
    assert r.returncode != 0 and "set exactly one of modelStore.hub.cache.claimName" in r.stderr, r.stderr
    body = example(modelStore={"hub": {"cache": {"create": {"accessMode": "ReadOnlyMany"}}}})
    r = apply(cluster, namespace, body, check=False)
    assert r.returncode != 0 and "Unsupported value: \"ReadOnlyMany\"" in r.stderr, r.stderr
    cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(ROOT / "examples" / "hub-cache.yaml"))


def test_a_hub_that_wants_a_token_refuses_the_planner_until_the_secret_is_named(cluster, crd, namespace, tmp_path):
    root = tiny_models(tmp_path / "hub")
    name = "tiny-gated"
    with HubProcess(root, Path(cluster.logs_dir) / f"hub-{namespace}.log", token=TOKEN) as hub:
        op = Operator(cluster, namespace).start()
        try:
            apply(cluster, namespace, tiny_sdd(name, hub, None, token=False))
            sdd = wait_sdd(cluster, namespace, name, lambda s: (condition(s, "Planned") or {}).get("reason")
                           == "PlannerFailed", "PlannerFailed without a token", timeout=180)
            message = condition(sdd, "Planned")["message"]
            assert "401" in message and "modelStore.hub.tokenSecret" in message, message
            # naming the Secret is not a new plan: the planner's next retry carries the token
            create_token_secret(cluster, namespace)
            apply(cluster, namespace, tiny_sdd(name, hub, None, token=True))
            sdd = wait_sdd(cluster, namespace, name, phase_is("Ready"), "Ready with the token", timeout=180)
            assert sdd["status"]["plan"]["sources"]["target"]["commit"] == hub.commits[TINY_TARGET]
        finally:
            op.stop()
            print(f"--- operator log (tail) ---\n{op.tail(60)}")
    assert TOKEN not in op.log.read_text()
