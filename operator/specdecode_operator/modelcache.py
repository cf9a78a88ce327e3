"""The hub model cache: its PVC, one download Job per (claim, repo, commit), and their progress.

Pure functions, and ``ModelCacheDriver``, which creates what they render and reads what they
interpret, one step per reconcile.

- The cache PVC is the user's (``cache.claimName``) or one the operator creates (``cache.create``),
  sized from the plan's bytes plus a margin.
- A model is downloaded once per cache: the Job's name is a hash of (claim, repo, commit), so every
  SDD that uses the same cache and commit finds the same Job. The Job is owned by the PVC, not by an
  SDD: it lives as long as the files it wrote, and its completion is the record that they are there.
- The Job is Indexed: index i downloads part i of the model's files (the planner computed the same
  split, ``plan.sources.<role>.partBytes``), so progress is the bytes of the completed indexes.
  Parts are many (up to one per file, at most 32: a 141 GB model moves in ~4.4 GB steps) and at
  most ``MAX_PARALLEL_DOWNLOADS`` of them run at once, so progress is fine-grained without
  opening more connections to the hub than 8 pods do.
  A failed index is retried by the Job controller with its own backoff (``backoffLimitPerIndex``);
  a Job that failed for good is deleted and created again after the operator's backoff.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from specdecode_worker.contract import GIB, MemoryPlan, PlanSource

from . import conditions as c
from . import kube as k8s
from . import labels, models, podsecurity
from .kube import ApiError, Kube, epoch
from .refusals import RefusalBook
from .spec import MODELS_MOUNT, SpecView

log = logging.getLogger(__name__)

ROLE_MODEL_CACHE = "model-cache"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
REPO_ANNOTATION = "specdecode.io/repo"
COMMIT_ANNOTATION = "specdecode.io/commit"
CLAIM_ANNOTATION = "specdecode.io/claim"
# Pod failures per part before the Job gives up on it (the Job controller waits 10 s doubling between them).
BACKOFF_LIMIT_PER_INDEX = 4
# A created cache holds the plan's files plus this share (hub metadata, partial files of a retry),
# and at least one GiB more.
SIZE_MARGIN = 0.10
# Download pods of one model at once: parallel streams speed a download up to the hub's and the
# volume's bandwidth; more pods only add scheduling and hub load.
MAX_PARALLEL_DOWNLOADS = 8
MIN_MARGIN_BYTES = GIB
FIRST_RETRY_SECONDS = 30.0
MAX_RETRY_SECONDS = 600.0
# Status refresh while models download (progress in status.models); Job events also trigger one.
DOWNLOAD_POLL_SECONDS = 5.0
# Status refresh while the cache cannot start (no PVC yet, a plan without its commits): no watch reports a PVC.
POLL_SECONDS = 30.0

PENDING, DOWNLOADING, DOWNLOADED, FAILED = "Pending", "Downloading", "Downloaded", "Failed"


# --- the cache claim --------------------------------------------------------------------------------

def unique_sources(view: SpecView, plan: MemoryPlan) -> list[PlanSource]:
    """The plan's hub sources, one per (repo, commit): a draft that is the target is one download."""
    seen: dict[tuple[str, str], PlanSource] = {}
    for src in models.sources(view, plan).values():
        seen.setdefault((src.repo, src.commit), src)
    return list(seen.values())


def claim_size(total_bytes: int) -> str:
    """A created cache's size: the files, plus 10 % and at least 1 GiB, in whole GiB."""
    margin = max(int(total_bytes * SIZE_MARGIN), MIN_MARGIN_BYTES)
    return f"{math.ceil((total_bytes + margin) / GIB)}Gi"


def render_claim(view: SpecView, plan: MemoryPlan, owner: dict[str, Any]) -> dict[str, Any]:
    """The PVC ``cache.create`` asks for; owned by the SDD, so it goes when the SDD goes."""
    cache = view.hub_cache
    assert cache is not None and cache.create
    size = cache.size or claim_size(sum(s.bytes for s in unique_sources(view, plan)))
    spec: dict[str, Any] = {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": size}}}
    if cache.storage_class:
        spec["storageClassName"] = cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": models.cache_claim(view),
            "namespace": view.namespace,
            "labels": labels.common(view.name, ROLE_MODEL_CACHE),
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


def claim_owner(claim: dict[str, Any]) -> dict[str, Any]:
    """An owner reference to the cache PVC (not a controller: the PVC controls nothing)."""
    meta = claim["metadata"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": meta["name"], "uid": meta["uid"]}


# --- the download Job ---------------------------------------------------------------------------------

def job_name(claim: str, repo: str, commit: str) -> str:
    """The same name for every SDD that downloads this commit into this cache."""
    digest = hashlib.sha256(f"{claim}\0{repo}\0{commit}".encode()).hexdigest()[:12]
    return f"model-cache-{digest}"


def parts(src: PlanSource) -> int:
    return max(1, len(src.part_bytes))


def render_job(view: SpecView, claim: str, src: PlanSource, owner: dict[str, Any]) -> dict[str, Any]:
    """The Indexed Job that downloads one model into the cache, one part per index."""
    n = parts(src)
    pod_labels = labels.common(view.name, ROLE_MODEL_CACHE)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed part is a new pod: the Job controller counts and backs off
        "enableServiceLinks": False,
        "containers": [{
            "name": "fetch",
            "image": view.image,
            "imagePullPolicy": view.image_pull_policy,
            "command": ["specdecode-worker"],
            "args": models.fetch_args(src.repo, src.commit, n),
            "env": models.hub_env(view),
            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
            "volumeMounts": [{"name": models.VOLUME, "mountPath": MODELS_MOUNT}],
            # The hub's error (401, 404, disk full) is the pod's termination message.
            "terminationMessagePath": models.TERMINATION_LOG,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": [{"name": models.VOLUME, "persistentVolumeClaim": {"claimName": claim}}],
    }
    for k in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "serviceAccountName"):
        if view.pod.get(k):
            spec[k] = view.pod[k]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(claim, src.repo, src.commit),
            "namespace": view.namespace,
            "labels": pod_labels,
            "annotations": {REPO_ANNOTATION: src.repo, COMMIT_ANNOTATION: src.commit, CLAIM_ANNOTATION: claim},
            "ownerReferences": [owner],
        },
        "spec": {
            "completionMode": "Indexed",
            "completions": n,
            "parallelism": min(n, MAX_PARALLEL_DOWNLOADS),
            "backoffLimitPerIndex": BACKOFF_LIMIT_PER_INDEX,
            "template": {"metadata": {"labels": pod_labels},
                         "spec": podsecurity.restrict(spec, view.pod.get("securityContext"))},
        },
    }


# --- progress -------------------------------------------------------------------------------------------

def parse_indexes(text: str | None) -> set[int]:
    """A Job's ``completedIndexes`` / ``failedIndexes``: "0-2,5" -> {0, 1, 2, 5}."""
    out: set[int] = set()
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        lo, _, hi = item.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class Progress:
    repo: str
    commit: str
    bytes_done: int
    bytes_total: int
    state: str
    job: str
    message: str = ""

    def as_status(self) -> dict[str, Any]:
        out = {"repo": self.repo, "commit": self.commit, "bytesDone": self.bytes_done,
               "bytesTotal": self.bytes_total, "state": self.state, "job": self.job}
        if self.message:
            out["message"] = self.message
        return out


def _condition(job: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype and cond.get("status") == "True":
            return cond
    return None


def job_complete(job: dict[str, Any]) -> bool:
    return _condition(job, "Complete") is not None


def job_failed(job: dict[str, Any]) -> dict[str, Any] | None:
    """The Job's Failed condition once it gave up (an index out of retries), else None."""
    return _condition(job, "Failed")


def failure_message(pods: list[dict[str, Any]], completed: set[int]) -> str | None:
    """The termination message of the latest failed pod of a part that is still missing."""
    latest: tuple[str, str] | None = None
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Failed":
            continue
        index = ((pod.get("metadata") or {}).get("annotations") or {}).get(COMPLETION_INDEX)
        if index is not None and index.isdigit() and int(index) in completed:
            continue
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term:
                text = (term.get("message") or "").strip() or f"exit code {term.get('exitCode')} ({term.get('reason')})"
                when = term.get("finishedAt") or ""
                if latest is None or when >= latest[0]:
                    latest = (when, text)
        if latest is None and status.get("reason"):  # evicted, deadline: no container ever terminated
            latest = ("", f"{status.get('reason')}: {status.get('message', '')}".strip(": "))
    return None if latest is None else latest[1]


def progress(src: PlanSource, job: dict[str, Any] | None, pods: list[dict[str, Any]], name: str) -> Progress:
    """Bytes done (the completed parts), and the state: Pending (no Job yet), Downloading,
    Downloaded, or Failed (a part's pod failed: the hub's message; the Job retries it)."""
    part_bytes, total = src.part_bytes, src.bytes  # the contract checked that the parts add up
    base = dict(repo=src.repo, commit=src.commit, bytes_total=total, job=name)
    if job is None:
        return Progress(bytes_done=0, state=PENDING, **base)
    st = job.get("status") or {}
    done_parts = parse_indexes(st.get("completedIndexes"))
    completions = int((job.get("spec") or {}).get("completions") or len(part_bytes))
    if completions == len(part_bytes):
        done = sum(b for i, b in enumerate(part_bytes) if i in done_parts)
    else:  # a Job another plan made with another split (an older planner): parts of about equal bytes
        done = total * len(done_parts) // completions
    if job_complete(job):
        return Progress(bytes_done=total, state=DOWNLOADED, **base)
    message = failure_message(pods, done_parts)
    gave_up = job_failed(job)
    if gave_up is not None:
        return Progress(bytes_done=done, state=FAILED,
                        message=message or gave_up.get("message", "the download Job failed"), **base)
    if message is not None:  # the Job controller runs the part again after its backoff
        return Progress(bytes_done=done, state=FAILED, message=f"{message} (the part is retried)", **base)
    return Progress(bytes_done=done, state=DOWNLOADING, **base)


_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def _unit(total: int) -> tuple[float, str]:
    """Decimal units, as a hub lists file sizes: GB for real models, smaller for tiny ones."""
    return next(((scale, name) for scale, name in _UNITS if total >= scale), (1.0, "B"))


def size(n: int) -> str:
    scale, name = _unit(n)
    return f"{n / scale:.1f} {name}"


def summary(items: list[Progress]) -> str:
    """ "31.2 / 141.1 GB (22%)" over every model (the percentage rounds down: 100 % means done)."""
    done = sum(p.bytes_done for p in items)
    total = sum(p.bytes_total for p in items)
    pct = 100 if total == 0 else (100 * done) // total
    scale, name = _unit(total)
    return f"{done / scale:.1f} / {total / scale:.1f} {name} ({pct}%)"


@dataclass(frozen=True)
class Retry:
    """Download Jobs that failed for good, and when the current failed one is replaced."""

    attempts: int = 0
    failed_job_uid: str | None = None
    wait: float | None = None  # seconds until the failed Job is replaced (<= 0: now); None: it has not failed

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attempts": self.attempts} if self.attempts else {}
        if self.failed_job_uid:
            out["failedJobUID"] = self.failed_job_uid
        return out


def next_retry(previous: dict[str, Any], job: dict[str, Any] | None, now: float) -> Retry:
    """The retry bookkeeping of one model, from its previous status entry and its Job: each failed
    Job counts once (by uid), and is replaced ``retry_delay(attempts)`` after it failed."""
    attempts = int(previous.get("attempts", 0))
    failed = job_failed(job) if job is not None else None
    if failed is None:
        return Retry(attempts)
    uid = (job.get("metadata") or {}).get("uid")
    if previous.get("failedJobUID") != uid:
        attempts += 1
    since = epoch(failed.get("lastTransitionTime")) or now
    return Retry(attempts, uid, since + retry_delay(attempts) - now)


def retry_delay(attempts: int) -> float:
    """The operator's wait before it recreates a Job that failed for good: 30 s doubling to 10 min."""
    return min(FIRST_RETRY_SECONDS * 2 ** max(attempts - 1, 0), MAX_RETRY_SECONDS)


def verdict(items: list[Progress], claim: str) -> c.Verdict:
    """ModelsReady: Downloaded once every model is in the cache; a failure names the model and
    carries the hub's message; otherwise the bytes so far."""
    failed = [p for p in items if p.state == FAILED]
    if failed:
        why = "; ".join(f"{p.repo}@{p.commit[:12]}: {p.message}" for p in failed)
        return c.Verdict("False", c.MODEL_DOWNLOAD_FAILED, f"{why} ({summary(items)} downloaded)")
    if all(p.state == DOWNLOADED for p in items):
        total = sum(p.bytes_total for p in items)
        return c.Verdict("True", c.DOWNLOADED, f"{size(total)} in PVC {claim}")
    return c.Verdict("False", c.DOWNLOADING, summary(items))


def claim_not_found(view: SpecView, claim: str) -> c.Verdict:
    return c.Verdict("False", c.CACHE_CLAIM_NOT_FOUND, (
        f"PVC {claim} (spec.modelStore.hub.cache.claimName) does not exist in namespace {view.namespace}: "
        "create it (ReadWriteMany, or ReadWriteOnce with every pod on one node), or set cache.create "
        "for the operator to make one"))


def waiting_verdicts(ready: c.Verdict, previous: dict[str, c.Verdict]) -> dict[str, c.Verdict]:
    """While models download no worker of this plan is created; workers of an earlier plan keep
    serving (``previous``: what they report). Progressing says which, Degraded a download stuck."""
    verdicts = dict(previous)
    downloading = ready.reason == c.DOWNLOADING
    verdicts[c.PROGRESSING] = c.Verdict("True" if downloading else "False", ready.reason,
                                        "downloading the models into the cache: " + ready.message if downloading
                                        else "the rollout waits for the models: see ModelsReady")
    if not downloading:
        verdicts[c.DEGRADED] = c.Verdict("True", ready.reason, ready.message)
    return verdicts


# --- the driver ----------------------------------------------------------------------------------------

class ModelCacheDriver:
    """Creates the cache PVC and one download Job per model, and reads their progress into
    status.models; what exists already is read, not created again, so a step is idempotent."""

    def __init__(self, kube: Kube, refusals: RefusalBook, clock: Callable[[], float] = time.time):
        self.kube = kube
        self.refusals = refusals
        self.clock = clock

    def step(self, view: SpecView, plan: MemoryPlan, owner: dict[str, Any],
             status: dict[str, Any]) -> tuple[c.Verdict, float | None]:
        """Drive the cache one step: its PVC, one download Job per model, their progress in
        status.models. Returns ModelsReady and when to look again."""
        claim_name = models.cache_claim(view)
        try:
            sources = unique_sources(view, plan)
        except ValueError as exc:
            return c.Verdict("False", c.MODEL_DOWNLOAD_FAILED, str(exc)), POLL_SECONDS
        claim = self.kube.get(k8s.claim(view.namespace, claim_name))
        if claim is None and not view.hub_cache.create:
            return claim_not_found(view, claim_name), POLL_SECONDS
        if claim is None:
            try:
                claim = self._create(render_claim(view, plan, owner), k8s.claim(view.namespace, claim_name))
            except ApiError as exc:
                return self.refusals.verdict(view, f"PVC {claim_name}", exc), None
        previous = {(m.get("repo"), m.get("commit")): m for m in status.get("models") or []}
        entries, items, wait = [], [], DOWNLOAD_POLL_SECONDS
        for src in sources:
            name = job_name(claim_name, src.repo, src.commit)
            ref = k8s.job(view.namespace, name)
            job = self.kube.get(ref)
            if job is None:
                try:
                    job = self._create(render_job(view, claim_name, src, claim_owner(claim)), ref)
                except ApiError as exc:
                    return self.refusals.verdict(view, f"download Job {name}", exc), None
            pods = [] if job is None or job_complete(job) else self.kube.list(k8s.pods(view.namespace),
                                                                             f"{JOB_NAME_LABEL}={name}")
            item = progress(src, job, pods, name)
            retry = next_retry(previous.get((src.repo, src.commit)) or {}, job, self.clock())
            if retry.wait is not None:  # out of retries per part: after the backoff, a new Job
                if retry.wait <= 0:
                    self.kube.delete(ref)
                    log.info("%s/%s download Job %s failed %d time(s); created again", view.namespace, view.name,
                             name, retry.attempts)
                    note = "download Job restarted"
                else:
                    note = f"retrying in {int(retry.wait + 0.999)}s"
                item = replace(item, message=f"{item.message} (attempt {retry.attempts} failed; {note})")
                wait = min(wait, max(retry.wait, 1.0))
            items.append(item)
            entries.append(item.as_status() | retry.as_status())
        status["models"] = entries
        ready = verdict(items, claim_name)
        return ready, (None if ready.status == "True" else wait)

    def _create(self, body: dict[str, Any], ref: k8s.Ref) -> dict[str, Any] | None:
        """Create ``body``; one that exists already (an earlier reconcile, another SDD) is read instead."""
        try:
            created = self.kube.create(body)
            log.info("%s %s/%s created", body["kind"], ref.namespace, ref.name)
            return created
        except ApiError as exc:
            if exc.status == 409:  # exists, or still terminating after a delete: next time
                return self.kube.get(ref)
            raise
