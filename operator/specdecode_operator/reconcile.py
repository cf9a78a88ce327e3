"""One level-based reconcile of a SpecDecodeDeployment: plan if the plan key changed, apply the
children, and write a status that follows them.

The drivers of what runs ahead of the workers live with what they render: the planner pod
(planner.PlannerDriver), the hub model cache (modelcache.ModelCacheDriver) and the nodes' GPUs
(nodecapacity.NodeCapacity); refused children are counted in one refusals.RefusalBook.

Every step is idempotent and reads the cluster rather than remembering, so a restarted operator
(or two triggers racing) converges to the same children and the same status.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from specdecode_worker.contract import MemoryPlan

from . import conditions as c
from . import kube as k8s
from . import group, kvcheck, labels, modelcache, models, nodecapacity, observe, planner, refusals, workload
from .kube import ApiError, Kube, now_iso
from .spec import DEFAULT_WORKER_IMAGE, SpecView, parse_spec, plan_key

log = logging.getLogger(__name__)
# Status refresh while planning or deploying, or waiting on a CRD: no watch event reports all of it.
POLL_SECONDS = 30.0


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
        self.refusals = refusals.RefusalBook()
        self.node_capacity = nodecapacity.NodeCapacity(kube, self.options.check_nodes, clock)
        self.planner_driver = planner.PlannerDriver(kube, self.node_capacity, self.refusals, clock)
        self.cache_driver = modelcache.ModelCacheDriver(kube, self.refusals, clock)

    # --- entry point ----------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str, force_apply: bool = True, fresh: bool = True) -> Result:
        """Reconcile the current object; retried on a status write conflict.

        ``force_apply=False`` (child events, requeues) skips re-applying children that were
        already applied for this generation and plan: status follows the children at no request
        unless it changed.
        ``fresh=False`` lets a client with a cache (cache.CachedKube) answer reads from kopf's
        watches; a retry after a conflict always reads through to the API server.
        """
        with _lock(namespace, name):
            for attempt in range(5):
                with self._reads(fresh or attempt > 0):
                    sdd = self.kube.get(k8s.sdd(namespace, name))
                    if sdd is None or (sdd.get("metadata") or {}).get("deletionTimestamp"):
                        self.refusals.forget(namespace, name)
                        return Result(gone=True)  # deleted: garbage collection removes the children
                    try:
                        return self._reconcile(sdd, force_apply)
                    except ApiError as exc:
                        if exc.status != 409:
                            raise
                        log.debug("status conflict on %s/%s, retrying", namespace, name)
            return Result(requeue_after=1.0)

    def _reads(self, fresh: bool) -> Any:
        """Reads through to the API server, where the client has a cache to bypass."""
        through = getattr(self.kube, "read_through", None)
        return through() if fresh and through is not None else contextlib.nullcontext()

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
            record, verdicts[c.PLANNED], requeue = self.planner_driver.step(view, key, owner, status)
            if verdicts[c.PLANNED].reason in refusals.REASONS:
                refused = verdicts[c.PLANNED]
        else:
            verdicts[c.PLANNED] = planner.planned_verdict(record, status.get("planner"))

        if record is not None and record.get("fits"):
            self.planner_driver.cleanup(view, key)
            # Typed once, here: a plan that fits passed the contract when the planner wrote it (a misfit may not).
            plan = MemoryPlan.from_dict(planner.plan_body(record))
            tp = plan.tensor_parallel_size
            nodes = group.nodes_per_replica(plan)
            status["gpusPerReplica"] = tp
            if models.cache_claim(view):  # workers start only once every model is in the cache
                ready, wait = self.cache_driver.step(view, plan, owner, status)
                verdicts[c.MODELS_READY] = ready
                if ready.status != "True":
                    refused = ready if ready.reason in refusals.REASONS else None
                    verdicts.update(modelcache.waiting_verdicts(ready, self._previous_workers(view, status, ready)))
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
                        refused = self.refusals.verdict(view, f"{child['kind']} {child['metadata']['name']}", exc)
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
            if plan.runtime is not None:  # vllm / sglang: the engine's own KV report against the plan
                pods = [p for p in self._worker_pods(view)
                        if ((p.get("metadata") or {}).get("annotations") or {}).get(labels.PLAN_KEY) == key]
                verdicts.update(kvcheck.verify(self.kube, self.fetch, pods, plan, status))
            if refused is not None:  # what exists still reports Available; the rest waits on the refusal
                verdicts[c.DEGRADED] = c.Verdict("True", refused.reason, refused.message)
                verdicts[c.READY] = refused
                verdicts[c.PROGRESSING] = c.Verdict("False", refused.reason, "the rollout is blocked: see Degraded")
            status.update(replicas=obs.replicas, readyReplicas=obs.ready_replicas,
                          updatedReplicas=obs.updated_replicas)
        else:  # planning, or the plan does not fit: nothing new is applied
            if record is not None:
                self.planner_driver.cleanup(view, key)
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
            changes = c.transitions(list(old_status.get("conditions") or []), conds)
            for t in changes:
                log.log(logging.WARNING if t.warning else logging.INFO, "%s/%s %s=%s reason=%s: %s",
                        meta["namespace"], meta["name"], t.ctype, t.status, t.reason, t.message)
            for reason, message, warning in c.events(changes):  # one per Warning, one Normal
                self.kube.event(sdd, reason, message, warning)
        if refused is None:
            self.refusals.forget(view.namespace, view.name)
        else:
            requeue = self.refusals.retry_delay(view.namespace, view.name)
        if requeue is None and status["phase"] in ("Planning", "Deploying"):
            requeue = POLL_SECONDS
        return Result(requeue_after=requeue, status=status)

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
            f"{group.INSTALL_HINT}; or keep replicas on one node: {planner.one_node_hint(tp, status.get('planner'))}"))
        verdicts = {c.PLANNED: planner.planned_verdict(status["plan"], status.get("planner")),
                    **self._previous_workers(view, status, problem)}
        verdicts[c.DEGRADED] = c.Verdict("True", problem.reason, problem.message)
        verdicts[c.PROGRESSING] = c.Verdict("False", problem.reason, "the rollout is blocked: see Degraded")
        return verdicts

    def _observe(self, view: SpecView, key: str, tp: int, dep: dict[str, Any] | None,
                 nodes: int = 1) -> observe.Observation:
        pods = self._worker_pods(view)
        template_key = ((((dep or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}) \
            .get("annotations", {}).get(labels.PLAN_KEY)
        capacity = observe.capacity_verdict(tp, view.gpu_max_per_replica, self.node_capacity.max_gpus(view),
                                            view.gpu_product, nodes)
        return observe.observe(view.replicas, template_key == key, dep, pods, capacity)


def _applied(dep: dict[str, Any] | None, key: str, generation: int) -> bool:
    """Whether the Deployment was rendered from this plan and this SDD generation."""
    ann = ((dep or {}).get("metadata") or {}).get("annotations") or {}
    return ann.get(labels.PLAN_KEY) == key and ann.get(labels.GENERATION) == str(generation)
