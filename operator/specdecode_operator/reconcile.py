"""One level-based reconcile of a SpecDecodeDeployment: plan if the plan key changed, apply the
children, and write a status that follows them.

Every step is idempotent and reads the cluster rather than remembering, so a restarted operator
(or two triggers racing) converges to the same children and the same status.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from specdecode_worker.contract import GIB, PLAN_API_VERSION, PLAN_KIND, MemoryPlan

from . import conditions as c
from . import kube as k8s
from . import group, kvcheck, labels, modelcache, models, nodecapacity, observe, planner, refusals, workload
from .kube import ApiError, Kube, epoch, now_iso
from .spec import DEFAULT_MAX_TP, DEFAULT_WORKER_IMAGE, SpecView, parse_spec, plan_key, planner_pod_name

log = logging.getLogger(__name__)
# Status refresh while waiting on something no watch event reports (a planner backoff).
POLL_SECONDS = 30.0
# Status refresh while models download (progress in status.models); Job events also trigger one.
DOWNLOAD_POLL_SECONDS = 5.0
NODE_CACHE_SECONDS = 20.0


@dataclass
class Result:
    requeue_after: float | None = None
    status: dict[str, Any] | None = None
    gone: bool = False


@dataclass
class Options:
    default_image: str = DEFAULT_WORKER_IMAGE
    check_nodes: bool = True
    # The chart's worker NetworkPolicy admits only the serving port: a group gets a rank policy.
    rank_network_policy: bool = False


_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())




class Reconciler:
    def __init__(self, kube: Kube, options: Options | None = None, clock: Callable[[], float] = time.time,
                 fetch: Callable[[str], str | None] | None = None):
        self.kube = kube
        self.fetch = fetch or kvcheck.http_get
        self.options = options or Options()
        self.clock = clock
        self._nodes_forbidden = False
        self._nodes: tuple[float, list[dict[str, Any]]] | None = None
        # Refusals in a row per SDD, for the retry backoff (a restart starts it afresh).
        self._refusals: dict[tuple[str, str], int] = {}

    # --- entry point ----------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str, force_apply: bool = True) -> Result:
        """Reconcile the current object; retried on a status write conflict.

        ``force_apply=False`` (child events, requeues) skips re-applying children that were
        already applied for this generation and plan: status follows at a few reads per event.
        """
        with _lock(namespace, name):
            for _ in range(5):
                sdd = self.kube.get(k8s.sdd(namespace, name))
                if sdd is None or (sdd.get("metadata") or {}).get("deletionTimestamp"):
                    self._refusals.pop((namespace, name), None)
                    return Result(gone=True)  # deleted: garbage collection removes the children
                try:
                    return self._reconcile(sdd, force_apply)
                except ApiError as exc:
                    if exc.status != 409:
                        raise
                    log.debug("status conflict on %s/%s, retrying", namespace, name)
            return Result(requeue_after=1.0)

    def _reconcile(self, sdd: dict[str, Any], force_apply: bool = True) -> Result:
        view = parse_spec(sdd, self.options.default_image)
        key = plan_key(view)
        meta = sdd["metadata"]
        generation = int(meta.get("generation", 1))
        old_status = copy.deepcopy(sdd.get("status") or {})
        status = copy.deepcopy(old_status)
        verdicts: dict[str, c.Verdict] = {}
        owner = labels.owner_reference(sdd)
        requeue: float | None = None
        refused: c.Verdict | None = None

        # status.plan: the planner's plan with our bookkeeping (key, plannerPod), as the SDD shows it.
        current = status.get("plan") or {}
        record = current if current.get("key") == key else None
        if record is None:
            record, requeue = self._plan(view, key, owner, status, verdicts)
            if verdicts[c.PLANNED].reason in REFUSAL_REASONS:
                refused = verdicts[c.PLANNED]
        else:
            verdicts[c.PLANNED] = _planned_verdict(record, status.get("planner"))

        if record is not None and record.get("fits"):
            self._cleanup_planners(view, key)
            # Typed once, here: a plan that fits passed the contract when the planner wrote it (a misfit may not).
            plan = MemoryPlan.from_dict(_plan_body(record))
            tp = plan.tensor_parallel_size
            nodes = group.nodes_per_replica(plan)
            status["gpusPerReplica"] = tp
            if models.cache_claim(view):  # workers start only once every model is in the cache
                ready, wait = self._models(view, plan, owner, status)
                verdicts[c.MODELS_READY] = ready
                if ready.status != "True":
                    refused = ready if ready.reason in REFUSAL_REASONS else None
                    verdicts.update(self._waiting_for_models(view, status, ready))
                    return self._finish(sdd, view, status, old_status, verdicts, generation, refused, wait)
            else:
                status.pop("models", None)
            if nodes > 1 and not self.kube.serves(group.LWS_API_VERSION, group.LWS_KIND):
                # Nothing is applied: a ConfigMap and Service without their workload help no one.
                return self._finish(sdd, view, status, old_status, self._multi_node_unavailable(
                    view, status, tp, nodes), generation, None, requeue=POLL_SECONDS)
            dep = self._workload(view, nodes)
            if force_apply or not _applied(dep, key, generation):
                if nodes > 1:
                    children = group.render_children(view, plan, key, owner, generation,
                                                     rank_policy=self.options.rank_network_policy)
                else:
                    children = workload.render_children(view, plan, key, owner, generation)
                for child in children:
                    try:
                        applied = self.kube.apply(child)
                    except ApiError as exc:
                        refused = self._refusal(view, f"{child['kind']} {child['metadata']['name']}", exc)
                        break
                    if child["kind"] == "Deployment":
                        dep = applied
                    elif child["kind"] == group.LWS_KIND:
                        dep = group.as_deployment_status(applied)
                else:
                    if old_status.get("nodesPerReplica", 1) != nodes:  # one node <-> several: the other kind goes
                        self.kube.delete(k8s.deployment(view.namespace, view.name) if nodes > 1
                                         else group.leaderworkerset_ref(view.namespace, view.name))
                        if nodes == 1 and self.options.rank_network_policy:  # one pod has no rank traffic
                            self.kube.delete(group.rank_network_policy_ref(view.namespace, view.name))
            if refused is None:  # recorded once its workload is applied: a switch deletes the other kind
                status["nodesPerReplica"] = nodes
            obs = self._observe(view, key, tp, dep, nodes)
            verdicts.update(obs.verdicts)
            if plan.runtime is not None:
                verdicts.update(self._verify_kv(view, key, plan, status))
            if refused is not None:  # what exists still reports Available; the rest waits on the refusal
                verdicts[c.DEGRADED] = c.Verdict("True", refused.reason, refused.message)
                verdicts[c.READY] = refused
                verdicts[c.PROGRESSING] = c.Verdict("False", refused.reason, "the rollout is blocked: see Degraded")
            status.update(replicas=obs.replicas, readyReplicas=obs.ready_replicas,
                          updatedReplicas=obs.updated_replicas)
        else:  # planning, or the plan does not fit: nothing new is applied
            if record is not None:
                self._cleanup_planners(view, key)
            verdicts.update(self._previous_workers(view, status, verdicts[c.PLANNED]))

        return self._finish(sdd, view, status, old_status, verdicts, generation, refused, requeue)

    def _finish(self, sdd: dict[str, Any], view: SpecView, status: dict[str, Any], old_status: dict[str, Any],
                verdicts: dict[str, c.Verdict], generation: int, refused: c.Verdict | None,
                requeue: float | None) -> Result:
        """Conditions, phase and Events from the verdicts; the status written when it changed."""
        meta = sdd["metadata"]
        now = now_iso()
        conds = c.apply_verdicts(list(old_status.get("conditions") or []), verdicts, generation, now)
        if not models.cache_claim(view):  # no cache (any more): nothing is downloaded ahead of the pods
            conds = [x for x in conds if x.get("type") != c.MODELS_READY]
        status["conditions"] = conds
        status["observedGeneration"] = generation
        status["selector"] = labels.selector_string(view.name)
        status.setdefault("replicas", 0)
        status.setdefault("readyReplicas", 0)
        status["phase"] = c.phase(conds, status.get("readyReplicas", 0), view.replicas)
        if status != old_status:
            self.kube.write_status(sdd, status)
            posted: set[str] = set()
            for t in c.transitions(list(old_status.get("conditions") or []), conds):
                log.log(logging.WARNING if t.warning else logging.INFO, "%s/%s %s=%s reason=%s: %s",
                        meta["namespace"], meta["name"], t.ctype, t.status, t.reason, t.message)
                if t.reason not in posted:  # one cause moving several conditions is one Event
                    posted.add(t.reason)
                    self.kube.event(sdd, t.reason, f"{t.ctype}={t.status}: {t.message}", t.warning)
        if refused is None:
            self._refusals.pop((view.namespace, view.name), None)
        else:
            requeue = refusals.retry_delay(self._refusals[(view.namespace, view.name)])
        if requeue is None and status["phase"] in ("Planning", "Deploying"):
            requeue = POLL_SECONDS
        return Result(requeue_after=requeue, status=status)

    # --- planning -------------------------------------------------------------------------------

    def _plan(self, view: SpecView, key: str, owner: dict[str, Any], status: dict[str, Any],
              verdicts: dict[str, c.Verdict]) -> tuple[dict[str, Any] | None, float | None]:
        """Drive the planner pod one step. Returns (status.plan or None, requeue delay)."""
        name = planner_pod_name(view, key)
        pod_ref = k8s.pods(view.namespace, name)
        tracker = status.get("planner") or {}
        if tracker.get("key") != key:
            tracker = {"key": key, "attempts": 0}
        tracker["pod"] = name
        status["planner"] = tracker
        pod = self.kube.get(pod_ref)
        if pod is None:
            try:
                self._create_planner(view, key, owner, pod_ref, tracker)
            except ApiError as exc:
                verdicts[c.PLANNED] = self._refusal(view, f"planner pod {name}", exc)
                return None, None
            verdicts[c.PLANNED] = c.Verdict("Unknown", c.PLANNING, _with_note(f"planner pod {name} started", tracker))
            return None, POLL_SECONDS
        outcome = planner.read_outcome(pod)
        if outcome.state == "fits" and view.hub:  # workers pin the commits the plan read
            try:
                models.sources(view, MemoryPlan.from_dict(outcome.plan))
            except ValueError as exc:
                outcome = dataclasses.replace(outcome, state="failed", message=str(exc))
        if outcome.state in ("pending", "running"):
            verdicts[c.PLANNED] = c.Verdict("Unknown", c.PLANNING, f"{name}: {outcome.message}")
            return None, POLL_SECONDS
        if outcome.state in ("fits", "misfit"):
            record = dict(outcome.plan or {})
            record.pop("apiVersion", None)
            record.pop("kind", None)
            record["key"] = key
            record["plannerPod"] = name
            status["plan"] = record
            tracker["attempts"] = 0
            tracker.pop("failedPodUID", None)
            verdicts[c.PLANNED] = _planned_verdict(record, tracker)
            return record, None
        # failed: count each failed pod once (by uid), back off, then run it again
        uid = (pod.get("metadata") or {}).get("uid")
        if tracker.get("failedPodUID") != uid:
            tracker["attempts"] = int(tracker.get("attempts", 0)) + 1
            tracker["failedPodUID"] = uid
        attempts = tracker["attempts"]
        delay = planner.retry_delay(attempts)
        finished = epoch(outcome.finished_at) or epoch((pod.get("metadata") or {}).get("creationTimestamp"))
        wait = (finished or self.clock()) + delay - self.clock()
        if wait <= 0:
            self.kube.delete(pod_ref)
            try:
                self._create_planner(view, key, owner, pod_ref, tracker)
            except ApiError as exc:
                if exc.status != 409:  # 409: the old pod is still terminating, next time
                    verdicts[c.PLANNED] = self._refusal(view, f"planner pod {name}", exc)
                    return None, None
            wait = POLL_SECONDS
            message = f"{outcome.message} (attempt {attempts} failed; planner pod restarted)"
        else:
            message = f"{outcome.message} (attempt {attempts} failed; retrying in {int(wait + 0.999)}s)"
        verdicts[c.PLANNED] = c.Verdict("False", c.PLANNER_FAILED, message)
        return None, max(wait, 1.0)

    def _create_planner(self, view: SpecView, key: str, owner: dict[str, Any], pod_ref: k8s.Ref,
                        tracker: dict[str, Any]) -> dict[str, Any]:
        """The planner pod, told the GPUs per node (recorded in ``tracker``, i.e. status.planner)."""
        per_node = self._gpus_per_node(view)
        tracker.update(gpusPerNode=per_node.count, gpusPerNodeFrom=per_node.source)
        if per_node.note:
            tracker["gpusPerNodeMessage"] = per_node.note
        else:
            tracker.pop("gpusPerNodeMessage", None)
        body = planner.render_planner_pod(view, key, owner, per_node.planner_flag)
        try:
            created = self.kube.create(body)
            log.info("%s/%s planner pod %s created for plan key %s", view.namespace, view.name,
                     body["metadata"]["name"], key)
            return created
        except ApiError as exc:
            if exc.status == 409:  # created by an earlier run of this reconcile
                return self.kube.get(pod_ref) or body
            raise

    def _refusal(self, view: SpecView, what: str, exc: ApiError) -> c.Verdict:
        """The verdict for a child the API server refused; re-raises what is not a refusal."""
        reason = refusals.reason_for(exc.status, exc.message)
        if reason is None:
            raise exc
        key = (view.namespace, view.name)
        self._refusals[key] = self._refusals.get(key, 0) + 1
        log.warning("%s/%s: %s refused (%s): %s", view.namespace, view.name, what, exc.status, exc.message)
        return c.Verdict("False", reason, f"{what} was refused by the API server: {exc.message}")

    def _cleanup_planners(self, view: SpecView, key: str) -> None:
        """Planner pods of earlier plan keys; the current one stays for `kubectl logs`."""
        pods = self.kube.list(k8s.pods(view.namespace),
                              f"{labels.NAME}={view.name},{labels.ROLE}={labels.ROLE_PLANNER}")
        for pod in pods:
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get(labels.PLAN_KEY) != key:
                self.kube.delete(k8s.pods(view.namespace, meta["name"]))

    # --- the hub model cache ---------------------------------------------------------------------

    def _models(self, view: SpecView, plan: MemoryPlan, owner: dict[str, Any],
                status: dict[str, Any]) -> tuple[c.Verdict, float | None]:
        """Drive the cache one step: its PVC, one download Job per model, their progress in
        status.models. Returns ModelsReady and when to look again."""
        claim_name = models.cache_claim(view)
        try:
            sources = modelcache.unique_sources(view, plan)
        except ValueError as exc:
            return c.Verdict("False", c.MODEL_DOWNLOAD_FAILED, str(exc)), POLL_SECONDS
        claim = self.kube.get(k8s.claim(view.namespace, claim_name))
        if claim is None and not view.hub_cache.create:
            return modelcache.claim_not_found(view, claim_name), POLL_SECONDS
        if claim is None:
            try:
                claim = self._create(modelcache.render_claim(view, plan, owner), k8s.claim(view.namespace, claim_name))
            except ApiError as exc:
                return self._refusal(view, f"PVC {claim_name}", exc), None
        previous = {(m.get("repo"), m.get("commit")): m for m in status.get("models") or []}
        entries, items, wait = [], [], DOWNLOAD_POLL_SECONDS
        for src in sources:
            name = modelcache.job_name(claim_name, src.repo, src.commit)
            ref = k8s.job(view.namespace, name)
            job = self.kube.get(ref)
            if job is None:
                try:
                    job = self._create(modelcache.render_job(view, claim_name, src, modelcache.claim_owner(claim)), ref)
                except ApiError as exc:
                    return self._refusal(view, f"download Job {name}", exc), None
            pods = [] if job is None or modelcache.job_complete(job) else self.kube.list(k8s.pods(view.namespace),
                                                                   f"{modelcache.JOB_NAME_LABEL}={name}")
            item = modelcache.progress(src, job, pods, name)
            retry = modelcache.next_retry(previous.get((src.repo, src.commit)) or {}, job, self.clock())
            if retry.wait is not None:  # out of retries per part: after the backoff, a new Job
                if retry.wait <= 0:
                    self.kube.delete(ref)
                    log.info("%s/%s download Job %s failed %d time(s); created again", view.namespace, view.name,
                             name, retry.attempts)
                    note = "download Job restarted"
                else:
                    note = f"retrying in {int(retry.wait + 0.999)}s"
                item = dataclasses.replace(item, message=f"{item.message} (attempt {retry.attempts} failed; {note})")
                wait = min(wait, max(retry.wait, 1.0))
            items.append(item)
            entries.append(item.as_status() | retry.as_status())
        status["models"] = entries
        ready = modelcache.verdict(items, claim_name)
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

    def _waiting_for_models(self, view: SpecView, status: dict[str, Any], ready: c.Verdict) -> dict[str, c.Verdict]:
        """While models download no worker of this plan is created; workers of an earlier plan keep serving."""
        verdicts = self._previous_workers(view, status, ready)
        downloading = ready.reason == c.DOWNLOADING
        verdicts[c.PROGRESSING] = c.Verdict("True" if downloading else "False", ready.reason,
                                            "downloading the models into the cache: " + ready.message if downloading
                                            else "the rollout waits for the models: see ModelsReady")
        if not downloading:
            verdicts[c.DEGRADED] = c.Verdict("True", ready.reason, ready.message)
        return verdicts

    # --- workers --------------------------------------------------------------------------------

    def _worker_pods(self, view: SpecView) -> list[dict[str, Any]]:
        return self.kube.list(k8s.pods(view.namespace), labels.selector_string(view.name))

    def _previous_workers(self, view: SpecView, status: dict[str, Any],
                          planned: c.Verdict) -> dict[str, c.Verdict]:
        """Without a plan for the current spec, workers of an earlier plan may still serve: report
        them (Available, Degraded) while Ready and Progressing say why the spec is not rolled out."""
        dep = self.kube.get(k8s.deployment(view.namespace, view.name))
        verdicts: dict[str, c.Verdict] = {}
        if dep is not None:
            obs = observe.observe(view.replicas, False, dep, self._worker_pods(view), None)
            verdicts = {k: v for k, v in obs.verdicts.items() if k in (c.AVAILABLE, c.DEGRADED)}
            status.update(replicas=obs.replicas, readyReplicas=obs.ready_replicas, updatedReplicas=0)
            planning = planned.status == "Unknown"
            verdicts[c.PROGRESSING] = c.Verdict("True" if planning else "False", planned.reason,
                                                "making a new plan; the workers keep the previous one" if planning
                                                else "no new plan to roll out: see Planned")
        else:
            status.update(replicas=0, readyReplicas=0, updatedReplicas=0)
        verdicts[c.READY] = c.Verdict("False", planned.reason, planned.message)
        return verdicts

    def _workload(self, view: SpecView, nodes: int) -> dict[str, Any] | None:
        """The Deployment, or for a replica over several nodes the LWS in a Deployment's shape."""
        if nodes == 1:
            return self.kube.get(k8s.deployment(view.namespace, view.name))
        return group.as_deployment_status(self.kube.get(group.leaderworkerset_ref(view.namespace, view.name)))

    def _multi_node_unavailable(self, view: SpecView, status: dict[str, Any], tp: int,
                                nodes: int) -> dict[str, c.Verdict]:
        problem = c.Verdict("False", c.MULTI_NODE_UNAVAILABLE, (
            f"the plan spreads each replica's {tp} GPUs over {nodes} nodes, which runs as a LeaderWorkerSet "
            f"group, but the cluster does not serve {group.LWS_API_VERSION} (CRD {group.LWS_CRD}): "
            f"{group.INSTALL_HINT}; or keep replicas on one node: {_one_node_hint(tp, status.get('planner'))}"))
        verdicts = {c.PLANNED: _planned_verdict(status["plan"], status.get("planner")),
                    **self._previous_workers(view, status, problem)}
        verdicts[c.DEGRADED] = c.Verdict("True", problem.reason, problem.message)
        verdicts[c.PROGRESSING] = c.Verdict("False", problem.reason, "the rollout is blocked: see Degraded")
        return verdicts

    def _observe(self, view: SpecView, key: str, tp: int, dep: dict[str, Any] | None,
                 nodes: int = 1) -> observe.Observation:
        pods = self._worker_pods(view)
        template_key = ((((dep or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}) \
            .get("annotations", {}).get(labels.PLAN_KEY)
        capacity = observe.capacity_verdict(tp, view.gpu_max_per_replica, self._node_gpus(view), view.gpu_product,
                                            nodes)
        return observe.observe(view.replicas, template_key == key, dep, pods, capacity)

    def _verify_kv(self, view: SpecView, key: str, plan: MemoryPlan,
                   status: dict[str, Any]) -> dict[str, c.Verdict]:
        """Set each new vllm/sglang pod's readiness gate from the engine's own KV report, record
        planned and reported tokens per pod in status.engineKV, and say when one fell short."""
        rt = plan.runtime
        pods = [p for p in self._worker_pods(view)
                if ((p.get("metadata") or {}).get("annotations") or {}).get(labels.PLAN_KEY) == key]
        for pod in pods:
            if not kvcheck.needs_check(pod):
                continue
            url = kvcheck.report_url(pod, rt.engine, workload.HTTP_PORT)
            body = self.fetch(url) if url else None
            reported = None if body is None else kvcheck.reported_tokens(rt.engine, body)
            if reported is None:  # not serving its report yet: the next poll asks again
                continue
            condition = kvcheck.gate_condition(kvcheck.check(pod, plan, reported), now_iso())
            pod = self.kube.set_pod_condition(pod, condition) or pod
            pods = [pod if p["metadata"]["name"] == pod["metadata"]["name"] else p for p in pods]
        records = [r for r in map(kvcheck.recorded, pods) if r]
        status["engineKV"] = {"engine": rt.engine, "version": rt.version,
                              "plannedTokens": rt.reported_tokens, "pods": records}
        short = [r for r in records if not r["verified"]]
        if not short:
            return {}
        worst = min(short, key=lambda r: r["reportedTokens"] or 0)
        pod = next(p for p in pods if p["metadata"]["name"] == worst["name"])
        message = kvcheck.check(pod, plan, worst["reportedTokens"] or 0).message()
        problem = c.Verdict("True", c.KV_CACHE_BELOW_PLAN, message)
        return {c.DEGRADED: problem, c.READY: c.Verdict("False", c.KV_CACHE_BELOW_PLAN, message)}

    def _node_gpus(self, view: SpecView) -> int | None:
        nodes, _ = self._readable_nodes()
        return None if nodes is None else observe.max_node_gpus(nodes, view.gpu_product)

    def _gpus_per_node(self, view: SpecView) -> nodecapacity.GpusPerNode:
        if view.gpu_per_node is not None:  # no need to read nodes
            return nodecapacity.gpus_per_node(view.gpu_per_node, view.gpu_product, None)
        nodes, why_not = self._readable_nodes()
        return nodecapacity.gpus_per_node(None, view.gpu_product, nodes, why_not)

    def _readable_nodes(self) -> tuple[list[dict[str, Any]] | None, str]:
        """The nodes, or None and why they are not read."""
        if not self.options.check_nodes:
            return None, "the operator runs with --no-node-check"
        if not self._nodes_forbidden:
            try:
                return self._list_nodes(), ""
            except ApiError as exc:
                if exc.status != 403:
                    raise
                # A namespaced install without node access: the scheduler reports misfits instead.
                log.info("nodes are not readable; GPUs per node come from gpu.perNode or the default, and "
                         "PlanExceedsNodeGPUs is left to the scheduler's messages")
                self._nodes_forbidden = True
        return None, "the operator may not list nodes: the chart's rbac.readNodes grants it"

    def _list_nodes(self) -> list[dict[str, Any]]:
        """Nodes change rarely; one list serves every SDD for a while."""
        now = self.clock()
        if self._nodes is None or now - self._nodes[0] > NODE_CACHE_SECONDS:
            self._nodes = (now, self.kube.list(k8s.NODES))
        return self._nodes[1]


def _one_node_hint(tp: int, tracker: dict[str, Any] | None) -> str:
    """What keeps a replica of ``tp`` GPUs on one node, given the GPUs per node it was planned for."""
    if tp > DEFAULT_MAX_TP:
        return f"gpu.maxPerReplica {DEFAULT_MAX_TP} or less"
    per_node = (tracker or {}).get("gpusPerNode")
    planned_for = f" (planned for {per_node} GPUs per node, from {(tracker or {}).get('gpusPerNodeFrom')})" \
        if per_node else ""
    return f"nodes with {tp} GPUs of gpu.product{planned_for}, or a gpu.product with more memory per GPU"


REFUSAL_REASONS = frozenset({c.POD_SECURITY_REJECTED, c.QUOTA_EXCEEDED, c.CHILD_REJECTED})


def _applied(dep: dict[str, Any] | None, key: str, generation: int) -> bool:
    """Whether the Deployment was rendered from this plan and this SDD generation."""
    ann = ((dep or {}).get("metadata") or {}).get("annotations") or {}
    return ann.get(labels.PLAN_KEY) == key and ann.get(labels.GENERATION) == str(generation)


def _plan_body(record: dict[str, Any]) -> dict[str, Any]:
    """The MemoryPlan as the planner wrote it (what the worker's --plan reads) from status.plan."""
    body = {k: v for k, v in record.items() if k not in ("key", "plannerPod")}
    return {"apiVersion": PLAN_API_VERSION, "kind": PLAN_KIND, **body}


def _planned_verdict(record: dict[str, Any], tracker: dict[str, Any] | None = None) -> c.Verdict:
    """Planned from status.plan, with where its GPUs per node came from (``status.planner``).

    Read from the dict: a misfit plan's numbers may be out of the contract's range.
    """
    if (tracker or {}).get("key") != record.get("key"):
        tracker = None
    if record.get("fits"):
        return c.Verdict("True", c.PLAN_READY, _with_note(record.get("message", "plan ready"), tracker))
    short = record.get("shortfallBytes", 0)
    return c.Verdict("False", c.INSUFFICIENT_GPU_MEMORY, _with_note(
        f"{in_spec_terms(record.get('message', 'the models do not fit'))} (short by {short / GIB:.2f} GiB "
        f"= {short} bytes per GPU)", tracker))


def _with_note(message: str, tracker: dict[str, Any] | None) -> str:
    note = (tracker or {}).get("gpusPerNodeMessage")
    return f"{message}; {note}" if note else message


# The planner speaks in CLI flags; a user of the SDD changes spec fields.
_FLAG_TO_FIELD = (
    ("--kv-cache-dtype ", "spec.serving.kvCacheDtype: "),
    ("--mem-fraction-static ", "spec.serving.memFractionStatic: "),
    ("--context-length", "spec.serving.contextLength"),
    ("--min-kv-tokens", "spec.serving.minKVTokens"),
    ("--max-running-requests", "spec.serving.maxRunningRequests"),
    ("--gpu-memory-gib", "spec.gpu.memoryGiB"),
    ("--tp ", "tensor parallelism "),
)


def in_spec_terms(message: str) -> str:
    for flag, field in _FLAG_TO_FIELD:
        message = message.replace(flag, field)
    return message
