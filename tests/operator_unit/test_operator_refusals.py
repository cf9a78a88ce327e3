"""Which API errors are refusals of a child, and the reason each becomes."""

from __future__ import annotations

import pytest

from specdecode_operator import conditions as c
from specdecode_operator import observe, refusals


@pytest.mark.parametrize("status,message,reason", [
    # Pod Security admission (the API server's wording)
    (403, 'pods "p" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false',
     c.POD_SECURITY_REJECTED),
    # ResourceQuota admission: over the limit, or a quota that needs a field the pod lacks
    (403, 'pods "p" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=8, used: '
          'requests.nvidia.com/gpu=0, limited: requests.nvidia.com/gpu=4', c.QUOTA_EXCEEDED),
    (403, 'pods "p" is forbidden: failed quota: mem: must specify limits.memory for: planner', c.QUOTA_EXCEEDED),
    # a validating webhook, and RBAC: refusals that are neither
    (403, 'admission webhook "policy.example.com" denied the request: images must come from registry.example',
     c.CHILD_REJECTED),
    (403, 'pods is forbidden: User "system:serviceaccount:x:op" cannot create resource "pods"', c.CHILD_REJECTED),
    # validation and other client errors
    (422, 'Pod "p" is invalid: metadata.labels: Invalid value: "x-": a valid label must end with an '
          'alphanumeric character', c.CHILD_REJECTED),
    (400, "the server rejected our request", c.CHILD_REJECTED),
    (413, "request entity too large", c.CHILD_REJECTED),
    # transient: retried as errors, never shown as a refusal
    (409, 'pods "p" already exists', None),
    (429, "too many requests", None),
    (404, 'namespaces "gone" not found', None),
    (500, "etcdserver: leader changed", None),
    (503, "service unavailable", None),
])
def test_reason_of_each_api_error(status, message, reason):
    assert refusals.reason_for(status, message) == reason
    assert refusals.is_refusal(status) is (reason is not None)


def test_refusals_are_warnings():
    for reason in (c.POD_SECURITY_REJECTED, c.QUOTA_EXCEEDED, c.CHILD_REJECTED):
        assert c.is_bad(c.PLANNED, "False", reason) and c.is_bad(c.DEGRADED, "True", reason)


def test_replica_failure_messages_map_like_api_errors():
    psa = 'pods "w-1" is forbidden: violates PodSecurity "restricted:latest": seccompProfile'
    invalid = 'Pod "w-1" is invalid: spec.containers[0].resources.requests: Invalid value: "2": must be less than limit'
    assert refusals.reason_for_replica_failure(psa) == c.POD_SECURITY_REJECTED
    assert refusals.reason_for_replica_failure(invalid) == c.CHILD_REJECTED
    dep = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": psa}]}}
    obs = observe.observe(1, True, dep, [], None)
    assert obs.verdicts[c.DEGRADED] == c.Verdict("True", c.POD_SECURITY_REJECTED,
                                                 f"the worker pods cannot be created: {psa}")
    assert obs.verdicts[c.READY].reason == c.POD_SECURITY_REJECTED
    dep["status"]["conditions"][0]["status"] = "False"  # cleared once the pods are created
    assert observe.observe(1, True, dep, [], None).verdicts[c.DEGRADED].status == "False"


def test_backoff_doubles_and_is_capped():
    assert [refusals.retry_delay(n) for n in (1, 2, 3, 7, 8, 50)] == [5, 10, 20, 300, 300, 300]
