"""The hub model cache: the PVC and download Jobs it renders, progress from completed indexes, and
the reconciler driving them against an in-memory API (workers only once every model is cached)."""

from __future__ import annotations

import json

from specdecode_operator import conditions as c
from specdecode_operator import kube as k8s
from specdecode_operator import modelcache, models
from specdecode_operator.reconcile import Options, Reconciler
from specdecode_operator.spec import parse_spec
from specdecode_worker.contract import PlanSource
from tests.operator_helpers import (
    DRAFT_COMMIT, NS, OWNER, TARGET_COMMIT, Clock, FakeKube, example, hub_sources, make_plan, typed,
)

NAME = "llama-8b-eagle3"
TARGET_REPO = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT_REPO = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


def hub_body(cache, name=NAME):
    body = example()
    body["metadata"]["name"] = name
    body["spec"]["modelStore"] = {"hub": {"endpoint": "http://hub.local", "tokenSecret": {"name": "hf"},
                                          "cache": cache}}
    return body


# --- pure builders ----------------------------------------------------------------------------------

def test_parse_indexes():
    assert modelcache.parse_indexes("0-2,5,7-8") == {0, 1, 2, 5, 7, 8}
    assert modelcache.parse_indexes("") == set() and modelcache.parse_indexes(None) == set()


def test_created_claim_is_sized_from_the_plans_bytes_plus_a_margin():
    view = parse_spec(hub_body({"create": {"storageClassName": "fast", "accessMode": "ReadWriteOnce"}}))
    claim = modelcache.render_claim(view, typed(make_plan(sources=hub_sources())), OWNER)
    # 16_060_522_496 + 849_763_584 bytes = 16.9 GB; + 10 % = 18.6e9 B = 17.31 GiB -> 18Gi
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                             "resources": {"requests": {"storage": "18Gi"}}}
    assert claim["metadata"]["name"] == "llama-8b-eagle3-model-cache" == models.cache_claim(view)
    assert claim["metadata"]["ownerReferences"] == [OWNER]
    # small models: the margin is at least 1 GiB; a size the user gives wins
    assert modelcache.claim_size(100_000_000) == "2Gi" and modelcache.claim_size(0) == "1Gi"
    sized = parse_spec(hub_body({"create": {"size": "500Gi"}}))
    claim = modelcache.render_claim(sized, typed(make_plan(sources=hub_sources())), OWNER)
    assert claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and "storageClassName" not in claim["spec"]


def test_job_name_is_one_per_claim_repo_and_commit():
    a = modelcache.job_name("cache", TARGET_REPO, TARGET_COMMIT)
    assert a == modelcache.job_name("cache", TARGET_REPO, TARGET_COMMIT)
    others = {modelcache.job_name("other", TARGET_REPO, TARGET_COMMIT),
              modelcache.job_name("cache", DRAFT_REPO, TARGET_COMMIT),
              modelcache.job_name("cache", TARGET_REPO, DRAFT_COMMIT)}
    assert a not in others and len(others) == 3
    assert len(a) <= 63 and a.startswith("model-cache-")


def test_download_job_is_indexed_by_part_and_runs_fetch():
    view = parse_spec(hub_body({"claimName": "shared"}))
    src = typed(make_plan(sources=hub_sources())).sources.target
    pvc_owner = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": "shared", "uid": "pvc-1"}
    job = modelcache.render_job(view, "shared", src, pvc_owner)
    assert job["metadata"]["ownerReferences"] == [pvc_owner]  # lives as long as the files it wrote
    assert job["metadata"]["labels"]["specdecode.io/role"] == "model-cache"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["backoffLimitPerIndex"] == modelcache.BACKOFF_LIMIT_PER_INDEX
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert spec["template"]["metadata"]["labels"]["specdecode.io/role"] == "model-cache"
    (fetch,) = pod["containers"]
    assert fetch["args"] == ["fetch", "--repo", TARGET_REPO, "--commit", TARGET_COMMIT,
                             "--dest", f"/models/{TARGET_REPO}/{TARGET_COMMIT}", "--parts", "3", "--part", "env",
                             "--termination-log", "/dev/termination-log"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in fetch["env"]
    assert {"name": "HF_ENDPOINT", "value": "http://hub.local"} in fetch["env"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "shared"}} in pod["volumes"]
    assert {"name": "models", "mountPath": "/models"} in fetch["volumeMounts"]  # writable: it downloads


def test_many_parts_run_a_few_at_a_time():
    view = parse_spec(hub_body({"claimName": "shared"}))
    parts = [4_400_000_000] * 32  # a 141 GB model in 32 parts
    src = typed(make_plan(sources=hub_sources(target_parts=parts))).sources.target
    spec = modelcache.render_job(view, "shared", src, {})["spec"]
    assert (spec["completions"], spec["parallelism"]) == (32, modelcache.MAX_PARALLEL_DOWNLOADS) == (32, 8)
    (fetch,) = spec["template"]["spec"]["containers"]
    assert fetch["args"][fetch["args"].index("--parts") + 1] == "32"


def _job(completed="", conditions=()):
    return {"metadata": {"name": "j", "uid": "job-1"},
            "status": {"completedIndexes": completed, "conditions": [dict(type=t, status="True", **kw)
                                                                     for t, kw in conditions]}}


def _failed_pod(index, message, finished="2026-01-01T00:01:00Z"):
    return {"metadata": {"annotations": {modelcache.COMPLETION_INDEX: str(index)}},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "fetch", "state": {"terminated": {
                "exitCode": 1, "reason": "Error", "message": message, "finishedAt": finished}}}]}}


def test_progress_is_the_bytes_of_the_completed_parts():
    src = PlanSource(repo=TARGET_REPO, revision="main", commit=TARGET_COMMIT, bytes=100, part_bytes=[10, 20, 30, 40])
    assert modelcache.progress(src, None, [], "j").state == modelcache.PENDING
    p = modelcache.progress(src, _job("1,3"), [], "j")
    assert (p.bytes_done, p.bytes_total, p.state) == (60, 100, modelcache.DOWNLOADING)
    p = modelcache.progress(src, _job("0-3", [("Complete", {})]), [], "j")
    assert (p.bytes_done, p.state) == (100, modelcache.DOWNLOADED)
    assert p.as_status() == {"repo": TARGET_REPO, "commit": TARGET_COMMIT, "bytesDone": 100, "bytesTotal": 100,
                             "state": "Downloaded", "job": "j"}


def test_progress_of_a_job_with_another_split_counts_its_parts_as_equal_shares():
    # a Job an older plan of the same commit made with 8 parts; this plan splits the files in 32
    src = PlanSource(repo=TARGET_REPO, revision="main", commit=TARGET_COMMIT, bytes=3200, part_bytes=[100] * 32)
    job = _job("0-1")
    job["spec"] = {"completions": 8}
    p = modelcache.progress(src, job, [], "j")
    assert (p.bytes_done, p.state) == (800, modelcache.DOWNLOADING)  # 2 of 8 parts
    job["spec"] = {"completions": 32}
    assert modelcache.progress(src, job, [], "j").bytes_done == 200  # the same split: its own bytes


def test_a_failed_part_carries_the_latest_message_of_a_missing_index():
    src = PlanSource(repo=TARGET_REPO, revision="main", commit=TARGET_COMMIT, bytes=30, part_bytes=[10, 20])
    pods = [_failed_pod(0, "old failure, part 0 since done", "2026-01-01T00:05:00Z"),
            _failed_pod(1, "404: revision not found", "2026-01-01T00:01:00Z"),
            _failed_pod(1, "404 again: revision not found", "2026-01-01T00:02:00Z")]
    p = modelcache.progress(src, _job("0"), pods, "j")
    assert (p.state, p.bytes_done, p.message) == (modelcache.FAILED, 10,
                                                  "404 again: revision not found (the part is retried)")
    # once the Job gave up, the message is the pod's alone (the operator adds its own retry note)
    p = modelcache.progress(src, _job("0", [("Failed", {"message": "Job has failed indexes"})]), pods, "j")
    assert p.message == "404 again: revision not found"
    # a Job that gave up without a pod message still fails, with the Job's own
    p = modelcache.progress(src, _job("", [("Failed", {"message": "Job has failed indexes"})]), [], "j")
    assert (p.state, p.message) == (modelcache.FAILED, "Job has failed indexes")


def test_retry_bookkeeping_counts_each_failed_job_once_and_backs_off():
    t0 = 1767225660.0  # 2026-01-01T00:01:00Z, when the Job failed
    failed = _job("", [("Failed", {"lastTransitionTime": "2026-01-01T00:01:00Z"})])
    assert modelcache.next_retry({}, _job("0"), t0) == modelcache.Retry(0)
    first = modelcache.next_retry({}, failed, t0 + 10)
    assert (first.attempts, first.failed_job_uid, first.wait) == (1, "job-1", 20.0)  # 30 s after it failed
    entry = first.as_status()
    assert entry == {"attempts": 1, "failedJobUID": "job-1"}
    assert modelcache.next_retry(entry, failed, t0 + 31).wait == -1.0  # the same Job: still attempt 1, due
    again = dict(failed, metadata={"uid": "job-2"})
    second = modelcache.next_retry(entry, again, t0)
    assert (second.attempts, second.wait) == (2, 60.0)
    # a Job that succeeds later keeps the count, so a status shows how often it failed
    assert modelcache.next_retry(second.as_status(), _job("0", [("Complete", {})]), t0).as_status() == {"attempts": 2}
    assert [modelcache.retry_delay(n) for n in (1, 2, 3, 6, 10)] == [30, 60, 120, 600, 600]


def test_models_ready_verdicts_and_the_summary():
    def item(done, total, state, message=""):
        return modelcache.Progress(TARGET_REPO, TARGET_COMMIT, done, total, state, "j", message)

    assert modelcache.summary([item(31_200_000_000, 141_100_000_000, "Downloading")]) == "31.2 / 141.1 GB (22%)"
    v = modelcache.verdict([item(31_200_000_000, 140_000_000_000, "Downloading"),
                            item(0, 1_100_000_000, "Pending")], "cache")
    assert (v.status, v.reason, v.message) == ("False", c.DOWNLOADING, "31.2 / 141.1 GB (22%)")
    v = modelcache.verdict([item(5, 5, "Downloaded"), item(1_000_000_000, 1_000_000_000, "Downloaded")], "cache")
    assert (v.status, v.reason, v.message) == ("True", c.DOWNLOADED, "1.0 GB in PVC cache")
    v = modelcache.verdict([item(5, 10, "Failed", "401: set modelStore.hub.tokenSecret")], "cache")
    assert (v.status, v.reason) == ("False", c.MODEL_DOWNLOAD_FAILED)
    assert v.message.startswith(f"{TARGET_REPO}@{TARGET_COMMIT[:12]}: 401: set modelStore.hub.tokenSecret")
    # 99.99 % is not done; tiny models are counted in smaller units
    assert modelcache.summary([item(9_999, 10_000, "Downloading")]) == "10.0 / 10.0 kB (99%)"
    assert modelcache.summary([item(2_500_000, 9_600_000, "Downloading")]) == "2.5 / 9.6 MB (26%)"
    assert modelcache.size(512) == "512.0 B"


# --- the reconciler ---------------------------------------------------------------------------------

def reconciler(kube, clock=None):
    return Reconciler(kube, Options(default_image="img:1"), clock=clock or Clock())


def cond(sdd, ctype):
    return c.get(sdd["status"]["conditions"], ctype)


def planned(kube, body, sources=None, clock=None):
    """Reconcile ``body`` through a finished hub planner."""
    kube.put_sdd(body)
    r = reconciler(kube, clock)
    r.reconcile(NS, body["metadata"]["name"])
    (pod,) = [p for p in kube.pods("planner") if p["metadata"]["labels"]["specdecode.io/name"]
              == body["metadata"]["name"]]
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [{"name": "planner", "state": {"terminated": {
        "exitCode": 0, "message": json.dumps(make_plan(sources=sources or hub_sources())),
        "finishedAt": "2026-01-01T00:00:10Z"}}}]}
    r.reconcile(NS, body["metadata"]["name"])
    return r


def jobs(kube):
    return {o["metadata"]["annotations"][modelcache.REPO_ANNOTATION]: o for r, o in kube.objects.items()
            if r.kind == "Job"}


def set_job(kube, job, **status):
    kube.objects[k8s.job(NS, job["metadata"]["name"])]["status"] = status


def test_cache_is_created_then_filled_by_one_job_per_model_before_any_worker():
    kube = FakeKube()
    r = planned(kube, hub_body({"create": {}}))
    sdd = kube.sdd()
    claim = kube.get(k8s.claim(NS, "llama-8b-eagle3-model-cache"))
    assert claim["spec"]["resources"]["requests"]["storage"] == "18Gi"
    found = jobs(kube)
    assert set(found) == {TARGET_REPO, DRAFT_REPO}
    assert found[TARGET_REPO]["metadata"]["ownerReferences"][0]["uid"] == claim["metadata"]["uid"]
    assert kube.deployment() is None  # no worker before the models are in the cache
    ready = cond(sdd, c.MODELS_READY)
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "Downloading", "0.0 / 16.9 GB (0%)")
    assert sdd["status"]["phase"] == "Deploying" and cond(sdd, c.PROGRESSING)["reason"] == "Downloading"
    assert sdd["status"]["gpusPerReplica"] == 1  # the plan's size shows while it downloads
    assert [m["state"] for m in sdd["status"]["models"]] == ["Downloading", "Downloading"]

    # two of the target's three parts done: 11.0 of 16.9 GB
    set_job(kube, found[TARGET_REPO], completedIndexes="0-1")
    res = r.reconcile(NS, NAME)
    sdd = kube.sdd()
    target = next(m for m in sdd["status"]["models"] if m["repo"] == TARGET_REPO)
    assert (target["bytesDone"], target["bytesTotal"], target["commit"]) == \
        (11_000_000_000, 16_060_522_496, TARGET_COMMIT)
    assert cond(sdd, c.MODELS_READY)["message"] == "11.0 / 16.9 GB (65%)"
    assert res.requeue_after is not None and res.requeue_after <= 5 and kube.deployment() is None

    for job in found.values():
        set_job(kube, job, completedIndexes="0-2", conditions=[{"type": "Complete", "status": "True"}])
    r.reconcile(NS, NAME)
    sdd = kube.sdd()
    assert (cond(sdd, c.MODELS_READY)["status"], cond(sdd, c.MODELS_READY)["reason"]) == ("True", "Downloaded")
    assert all(m["state"] == "Downloaded" and m["bytesDone"] == m["bytesTotal"] for m in sdd["status"]["models"])
    pod = kube.deployment()["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "llama-8b-eagle3-model-cache",
                                                        "readOnly": True}} in pod["volumes"]
    assert f"/models/{TARGET_REPO}/{TARGET_COMMIT}" in pod["containers"][0]["args"]
    reasons = [e[0] for e in kube.events]
    assert "Downloading" in reasons and "Downloaded" in reasons
    created = list(kube.created)
    r.reconcile(NS, NAME)  # steady state: nothing new
    assert kube.created == created


def test_two_deployments_on_one_cache_share_its_download_jobs():
    kube = FakeKube()
    kube.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "shared", "namespace": NS},
                 "spec": {}})
    planned(kube, hub_body({"claimName": "shared"}))
    planned(kube, hub_body({"claimName": "shared"}, name="second"))
    assert len(jobs(kube)) == 2
    assert [m["job"] for m in kube.sdd()["status"]["models"]] == \
        [m["job"] for m in kube.sdd("second")["status"]["models"]]


def test_missing_cache_claim_says_what_to_change_then_proceeds_once_it_exists():
    kube = FakeKube()
    r = planned(kube, hub_body({"claimName": "nope"}))
    sdd = kube.sdd()
    ready = cond(sdd, c.MODELS_READY)
    assert (ready["status"], ready["reason"]) == ("False", c.CACHE_CLAIM_NOT_FOUND)
    assert "PVC nope" in ready["message"] and "cache.create" in ready["message"]
    assert sdd["status"]["phase"] == "Failed" and not jobs(kube)
    kube.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "nope", "namespace": NS},
                 "spec": {}})
    r.reconcile(NS, NAME)
    assert len(jobs(kube)) == 2 and cond(kube.sdd(), c.MODELS_READY)["reason"] == c.DOWNLOADING


def _fail_pod(kube, job, message):
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{job['metadata']['name']}-0-x", "namespace": NS,
        "labels": {modelcache.JOB_NAME_LABEL: job["metadata"]["name"], "specdecode.io/role": "model-cache"},
        "annotations": {modelcache.COMPLETION_INDEX: "0"}}})
    pod = kube.objects[k8s.pods(NS, f"{job['metadata']['name']}-0-x")]
    pod["status"] = _failed_pod(0, message)["status"]


def test_a_failed_download_is_model_download_failed_with_the_hubs_message_and_retried_with_backoff():
    kube, clock = FakeKube(), Clock()
    r = planned(kube, hub_body({"create": {}}), clock=clock)
    target = jobs(kube)[TARGET_REPO]
    _fail_pod(kube, target, "404 Not Found: revision 1111111 of meta-llama/Llama-3.1-8B-Instruct: name a revision "
                            "that exists")
    r.reconcile(NS, NAME)
    sdd = kube.sdd()
    failed = cond(sdd, c.MODELS_READY)
    assert (failed["status"], failed["reason"]) == ("False", c.MODEL_DOWNLOAD_FAILED)
    assert "404 Not Found: revision 1111111" in failed["message"]
    assert sdd["status"]["phase"] == "Failed" and cond(sdd, c.DEGRADED)["reason"] == c.MODEL_DOWNLOAD_FAILED
    assert ("ModelDownloadFailed", True) in [(e[0], e[2]) for e in kube.events]  # a Warning event
    assert next(m for m in sdd["status"]["models"] if m["repo"] == TARGET_REPO)["state"] == "Failed"

    # the Job controller gave up on the part: the operator recreates the Job after its own backoff
    set_job(kube, target, conditions=[{"type": "Failed", "status": "True", "message": "Job has failed indexes",
                                       "lastTransitionTime": "2026-01-01T00:01:00Z"}])
    clock.t += 60
    res = r.reconcile(NS, NAME)
    assert "attempt 1 failed; retrying in 30s" in cond(kube.sdd(), c.MODELS_READY)["message"]
    assert 1 <= res.requeue_after <= 30 and target["metadata"]["name"] not in kube.deleted
    r.reconcile(NS, NAME)  # the same failed Job counts once
    assert next(m for m in kube.sdd()["status"]["models"] if m["repo"] == TARGET_REPO)["attempts"] == 1
    clock.t += 31
    r.reconcile(NS, NAME)
    assert target["metadata"]["name"] in kube.deleted and TARGET_REPO not in jobs(kube)
    r.reconcile(NS, NAME)
    assert kube.created.count(target["metadata"]["name"]) == 2  # the same name, a new Job


def test_a_hub_plan_without_commits_is_a_planner_failure():
    kube = FakeKube()
    kube.put_sdd(hub_body({"create": {}}))
    r = reconciler(kube)
    r.reconcile(NS, NAME)
    kube.finish_planner(0, json.dumps(make_plan()))
    r.reconcile(NS, NAME)
    planned_cond = cond(kube.sdd(), c.PLANNED)
    assert planned_cond["reason"] == c.PLANNER_FAILED and "no hub commit" in planned_cond["message"]
    assert not jobs(kube) and kube.deployment() is None


def test_a_pvc_store_has_no_models_ready():
    kube = FakeKube()
    kube.put_sdd(example())
    r = reconciler(kube)
    r.reconcile(NS, NAME)
    kube.finish_planner(0, json.dumps(make_plan()))
    r.reconcile(NS, NAME)
    assert cond(kube.sdd(), c.MODELS_READY) is None and "models" not in kube.sdd()["status"]
    assert kube.deployment() is not None


def test_a_hub_store_without_a_cache_downloads_in_each_pod_and_has_no_jobs():
    body = hub_body({})
    del body["spec"]["modelStore"]["hub"]["cache"]
    kube = FakeKube()
    planned(kube, body)
    assert cond(kube.sdd(), c.MODELS_READY) is None and not jobs(kube)
    assert [i["name"] for i in kube.deployment()["spec"]["template"]["spec"]["initContainers"]] == \
        ["fetch-target", "fetch-draft"]


def test_download_progress_is_exported_as_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from specdecode_operator.metrics import StatusBook, render

    book = StatusBook()
    book.record(NS, NAME, {"models": [{"repo": TARGET_REPO, "commit": TARGET_COMMIT, "bytesDone": 11_000_000_000,
                                       "bytesTotal": 16_060_522_496, "state": "Downloading", "job": "j"}]})
    book.record(NS, "pvc-store", {"phase": "Ready"})
    samples = {(s.name, s.labels.get("sdd")): (s.value, s.labels) for fam in text_string_to_metric_families(
        render(book)) for s in fam.samples}
    value, labels = samples[("specdecode_sdd_model_downloaded_bytes", NAME)]
    assert value == 11_000_000_000 and labels == {"namespace": NS, "sdd": NAME, "repo": TARGET_REPO,
                                                   "commit": TARGET_COMMIT}
    assert samples[("specdecode_sdd_model_bytes", NAME)][0] == 16_060_522_496
    assert ("specdecode_sdd_model_bytes", "pvc-store") not in samples
