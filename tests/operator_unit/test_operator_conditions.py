"""Condition bookkeeping and status from children: each failure reason from the pod status that
causes it, lastTransitionTime only on flips, and one Event per transition."""

from __future__ import annotations

from specdecode_operator import conditions as c
from specdecode_operator import observe

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_last_transition_time_moves_only_when_status_flips():
    conds = c.set_condition([], c.PLANNED, c.Verdict("Unknown", c.PLANNING, "started"), 1, T0)
    same = c.set_condition(conds, c.PLANNED, c.Verdict("Unknown", c.PLANNING, "still running"), 2, T1)
    assert same[0]["lastTransitionTime"] == T0 and same[0]["message"] == "still running"
    assert same[0]["observedGeneration"] == 2
    flipped = c.set_condition(same, c.PLANNED, c.Verdict("True", c.PLAN_READY, "ok"), 2, T1)
    assert flipped[0]["lastTransitionTime"] == T1
    assert conds[0]["message"] == "started"  # inputs are not mutated


def test_setting_one_condition_keeps_the_others():
    conds = c.apply_verdicts([], {c.DEGRADED: c.Verdict("False", "AsExpected"),
                                  c.PLANNED: c.Verdict("True", c.PLAN_READY)}, 1, T0)
    assert [x["type"] for x in conds] == [c.PLANNED, c.DEGRADED]  # stable order
    conds = c.set_condition(conds, c.AVAILABLE, c.Verdict("True", "MinimumReplicasAvailable"), 1, T1)
    assert [x["type"] for x in conds] == [c.PLANNED, c.AVAILABLE, c.DEGRADED]
    assert c.get(conds, c.PLANNED)["lastTransitionTime"] == T0


def test_transitions_are_changes_of_status_or_reason():
    old = c.apply_verdicts([], {c.PLANNED: c.Verdict("Unknown", c.PLANNING, "a")}, 1, T0)
    msg_only = c.apply_verdicts(old, {c.PLANNED: c.Verdict("Unknown", c.PLANNING, "b")}, 1, T1)
    assert c.transitions(old, msg_only) == []
    failed = c.apply_verdicts(old, {c.PLANNED: c.Verdict("False", c.PLANNER_FAILED, "boom")}, 1, T1)
    (t,) = c.transitions(old, failed)
    assert (t.ctype, t.status, t.reason, t.warning) == (c.PLANNED, "False", c.PLANNER_FAILED, True)
    ok = c.apply_verdicts(failed, {c.PLANNED: c.Verdict("True", c.PLAN_READY, "ok")}, 1, T1)
    assert c.transitions(failed, ok)[0].warning is False
    # a rollout in progress or complete is Normal; only failure reasons are Warnings
    rolling = c.apply_verdicts([], {c.READY: c.Verdict("False", "RollingOut"),
                                    c.PROGRESSING: c.Verdict("False", "RolloutComplete"),
                                    c.DEGRADED: c.Verdict("True", c.UNSCHEDULABLE)}, 1, T0)
    assert {t.ctype: t.warning for t in c.transitions([], rolling)} == {
        c.READY: False, c.PROGRESSING: False, c.DEGRADED: True}


def test_phase():
    def ph(verdicts, ready=0, desired=1):
        return c.phase(c.apply_verdicts([], verdicts, 1, T0), ready, desired)

    assert c.phase([], 0, 1) == "Pending"
    assert ph({c.PLANNED: c.Verdict("Unknown", c.PLANNING)}) == "Planning"
    assert ph({c.PLANNED: c.Verdict("False", c.INSUFFICIENT_GPU_MEMORY)}) == "Failed"
    assert ph({c.PLANNED: c.Verdict("False", c.PLANNER_FAILED)}, ready=1) == "Degraded"  # old plan still serves
    planned = {c.PLANNED: c.Verdict("True", c.PLAN_READY)}
    as_expected = {c.DEGRADED: c.Verdict("False", "AsExpected")}
    assert ph(planned | {c.READY: c.Verdict("False", "RollingOut")} | as_expected) == "Deploying"
    assert ph(planned | {c.DEGRADED: c.Verdict("True", c.UNSCHEDULABLE)}) == "Degraded"
    assert ph(planned | {c.READY: c.Verdict("True", "Ready")} | as_expected, 1) == "Ready"


# --- observation ----------------------------------------------------------------------------------

def deployment(replicas=1, ready=1, updated=1, available=True, progressing_reason="NewReplicaSetAvailable"):
    return {"metadata": {"generation": 2}, "status": {
        "observedGeneration": 2, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
        "conditions": [{"type": "Available", "status": "True" if available else "False"},
                       {"type": "Progressing", "status": "True" if progressing_reason != "ProgressDeadlineExceeded"
                        else "False", "reason": progressing_reason, "message": "ReplicaSet x has timed out"}]}}


def pod(name="w-1", phase="Running", statuses=None, conditions=None):
    return {"metadata": {"name": name}, "status": {"phase": phase, "containerStatuses": statuses or [],
                                                   "conditions": conditions or []}}


def test_all_ready():
    obs = observe.observe(1, True, deployment(), [pod()], None)
    v = obs.verdicts
    assert v[c.AVAILABLE].status == "True" and v[c.READY].status == "True"
    assert v[c.PROGRESSING] == c.Verdict("False", "RolloutComplete", "1 of 1 replicas ready on the current plan")
    assert v[c.DEGRADED].status == "False"
    assert (obs.replicas, obs.ready_replicas, obs.updated_replicas) == (1, 1, 1)


def test_rollout_pending_when_template_is_stale_or_scaling():
    assert observe.observe(1, False, deployment(), [pod()], None).verdicts[c.PROGRESSING].status == "True"
    scaling = observe.observe(3, True, deployment(replicas=3, ready=1, updated=3), [pod()], None).verdicts
    assert scaling[c.PROGRESSING].reason == "RollingOut" and scaling[c.READY].status == "False"
    assert scaling[c.AVAILABLE].status == "True"
    assert scaling[c.DEGRADED].status == "False"


def test_unschedulable_carries_the_scheduler_message():
    msg = "0/3 nodes are available: 2 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's node affinity/selector."
    p = pod(phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": msg}])
    v = observe.observe(1, True, deployment(ready=0, available=False), [p], None).verdicts
    assert v[c.DEGRADED].reason == c.UNSCHEDULABLE and msg in v[c.DEGRADED].message
    assert v[c.READY].reason == c.UNSCHEDULABLE and v[c.AVAILABLE].status == "False"


def test_oom_killed_beats_crash_loop():
    statuses = [{"name": "worker", "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
    v = observe.observe(1, True, deployment(ready=0, available=False), [pod(statuses=statuses)], None).verdicts
    assert v[c.DEGRADED].reason == c.WORKER_OOM_KILLED and "restarts: 3" in v[c.DEGRADED].message


def test_startup_failure_shows_the_workers_message():
    msg = "KV shortfall: the plan needs 392091 tokens but only 120000 fit in the memory found after loading weights"
    statuses = [{"name": "worker", "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": {"exitCode": 4, "reason": "Error", "message": msg}}}]
    v = observe.observe(1, True, deployment(ready=0, available=False), [pod(statuses=statuses)], None).verdicts
    assert v[c.DEGRADED].reason == c.WORKER_STARTUP_FAILED and msg in v[c.DEGRADED].message
    statuses[0]["lastState"]["terminated"]["exitCode"] = 3  # the serve CLI's "below the plan" exit
    v = observe.observe(1, True, deployment(ready=0, available=False), [pod(statuses=statuses)], None).verdicts
    assert "refused to serve: the memory it found" in v[c.DEGRADED].message and msg in v[c.DEGRADED].message


def test_image_pull_errors_are_startup_failures():
    statuses = [{"name": "worker", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "not found"}}}]
    v = observe.observe(1, True, deployment(ready=0, available=False), [pod(statuses=statuses)], None).verdicts
    assert v[c.DEGRADED].reason == c.WORKER_STARTUP_FAILED and "ImagePullBackOff" in v[c.DEGRADED].message


def test_progress_deadline_is_pods_not_ready():
    dep = deployment(ready=0, available=False, progressing_reason="ProgressDeadlineExceeded")
    v = observe.observe(1, True, dep, [pod()], None).verdicts
    assert v[c.DEGRADED].reason == c.PODS_NOT_READY and "timed out" in v[c.DEGRADED].message


def test_terminating_pods_are_ignored():
    statuses = [{"name": "worker", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}]
    old = pod(statuses=statuses)
    old["metadata"]["deletionTimestamp"] = T0
    assert observe.observe(1, True, deployment(), [old, pod("w-2")], None).verdicts[c.DEGRADED].status == "False"


def _node(name, product, gpus, unschedulable=False):
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": product}},
            "spec": {"unschedulable": unschedulable}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def test_node_capacity():
    nodes = [_node("a", "NVIDIA-H100-80GB-HBM3", 8), _node("b", "NVIDIA-L4", 1), _node("c", "NVIDIA-L4", 4, True)]
    assert observe.max_node_gpus(nodes, "NVIDIA-L4") == 1
    assert observe.max_node_gpus(nodes, None) == 8
    assert observe.max_node_gpus(nodes, "NVIDIA-B200") is None  # none yet: an autoscaler may add one
    assert observe.capacity_verdict(2, None, 1, "NVIDIA-L4").reason == c.PLAN_EXCEEDS_NODE_GPUS
    assert observe.capacity_verdict(2, None, None, "NVIDIA-B200") is None
    assert observe.capacity_verdict(8, 4, 8, None).reason == c.PLAN_EXCEEDS_NODE_GPUS
    assert observe.capacity_verdict(2, 2, 8, None) is None
    v = observe.observe(1, True, deployment(ready=0, available=False), [pod()],
                        observe.capacity_verdict(2, None, 1, "NVIDIA-L4")).verdicts
    assert v[c.DEGRADED].reason == c.PLAN_EXCEEDS_NODE_GPUS and "most nodes labelled" in v[c.DEGRADED].message
