"""The reconciler's reads from kopf's indexes (cache.py): what they answer, what goes to the API
server, and that a reconcile from the cache writes nothing it would not write after a fresh read."""

from __future__ import annotations

import copy
import json

from specdecode_operator import cache
from specdecode_operator import kube as k8s
from specdecode_operator.reconcile import Reconciler
from tests.operator_helpers import NS, Clock, FakeKube, example, make_plan


class FakeIndex(dict):
    """kopf's Index: key -> Store (an iterable of values)."""

    def put(self, key, value):
        self.setdefault(key, []).append(value)


class CountingKube(FakeKube):
    """FakeKube that counts reads, as Kube's request counter would."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def get(self, ref):
        self.reads.append(("get", ref.kind))
        return super().get(ref)

    def list(self, ref, label_selector=None):
        self.reads.append(("list", ref.kind))
        return super().list(ref, label_selector)


def indexes_from(kube: FakeKube) -> dict:
    """The four indexes as kopf's handlers (handlers.py) would fill them from ``kube``'s objects."""
    idx = {i: FakeIndex() for i in cache.INDEXES}
    for ref, obj in kube.objects.items():
        obj = copy.deepcopy(obj)
        if ref.kind == k8s.KIND:
            idx[cache.SDDS].put((ref.namespace, ref.name), obj)
        elif ref.kind == "Deployment":
            idx[cache.DEPLOYMENTS].put((ref.namespace, ref.name), obj)
        elif ref.kind == "Pod" and "specdecode.io/name" in obj["metadata"].get("labels", {}):
            idx[cache.PODS].put((ref.namespace, ref.name), obj)
            idx[cache.PODS_BY_OWNER].put((ref.namespace, obj["metadata"]["labels"]["specdecode.io/name"]), obj)
    return idx


def test_selectors_the_cache_can_answer():
    assert cache.parse_selector("a=b,c=d") == {"a": "b", "c": "d"}
    assert cache.parse_selector("a!=b") is None and cache.parse_selector("a in (b)") is None
    assert cache.trim({"metadata": {"name": "x", "managedFields": [1]}}) == {"metadata": {"name": "x"}}
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n", "containers": [{}]}, "status": {"phase": "Running"}}
    assert cache.trim_pod(pod) == {"metadata": {"name": "p"}, "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}
    dep = {"metadata": {"name": "d"}, "spec": {"replicas": 2, "template": {"metadata": {"annotations": {"a": "b"}},
                                                                            "spec": {"containers": [{}]}}}}
    assert cache.trim_deployment(dep)["spec"] == {"replicas": 2, "template": {"metadata": {"annotations": {"a": "b"}}}}


def test_reads_come_from_the_indexes_and_writes_go_to_the_api():
    api = CountingKube()
    api.put_sdd(example())
    c = cache.Cache()
    kube = cache.CachedKube(api, c)
    assert kube.get(k8s.sdd(NS, "llama-8b-eagle3")) is not None and api.reads == [("get", k8s.KIND)]  # unbound
    c.bind(indexes_from(api))
    api.reads.clear()
    assert kube.get(k8s.sdd(NS, "llama-8b-eagle3"))["metadata"]["name"] == "llama-8b-eagle3"
    assert kube.get(k8s.pods(NS, "nope")) is None and kube.get(k8s.deployment(NS, "nope")) is None
    assert kube.list(k8s.pods(NS), "specdecode.io/name=llama-8b-eagle3,specdecode.io/role=worker") == []
    assert api.reads == []
    kube.list(k8s.pods(NS), "batch.kubernetes.io/job-name=j")  # not by owner: the API server
    kube.list(k8s.NODES)
    with kube.read_through():
        kube.get(k8s.pods(NS, "nope"))
    assert api.reads == [("list", "Pod"), ("list", "Node"), ("get", "Pod")]


def test_an_sdd_written_is_read_as_written_until_the_watch_catches_up():
    api = FakeKube()
    api.put_sdd(example())
    c = cache.Cache()
    c.bind(indexes_from(api))
    kube = cache.CachedKube(api, c)
    sdd = kube.get(k8s.sdd(NS, "llama-8b-eagle3"))
    kube.write_status(sdd, {"phase": "Planning"})
    assert kube.get(k8s.sdd(NS, "llama-8b-eagle3"))["status"] == {"phase": "Planning"}  # the watch lags
    c.bind(indexes_from(api))  # the watch delivered it
    assert kube.get(k8s.sdd(NS, "llama-8b-eagle3"))["status"] == {"phase": "Planning"} and not c._written

    # an SDD deleted after the operator wrote it is gone, not kept alive by the write
    kube.write_status(kube.get(k8s.sdd(NS, "llama-8b-eagle3")), {"phase": "Ready"})
    del api.objects[k8s.sdd(NS, "llama-8b-eagle3")]
    c.bind(indexes_from(api))
    assert kube.get(k8s.sdd(NS, "llama-8b-eagle3")) is None


def test_a_reconcile_from_the_cache_reads_nothing_and_a_stale_one_retries_fresh():
    api = CountingKube()
    api.put_sdd(example())
    c = cache.Cache()
    kube = cache.CachedKube(api, c)
    r = Reconciler(kube, clock=Clock())
    c.bind(indexes_from(api))
    r.reconcile(NS, "llama-8b-eagle3", fresh=False)  # creates the planner pod, writes Planning
    api.finish_planner(0, json.dumps(make_plan()))
    c.bind(indexes_from(api))
    api.reads.clear()
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False, fresh=False)
    assert api.reads == []  # the nodes too: one list serves every SDD for 20 s
    assert api.sdd()["status"]["phase"] == "Deploying" and api.deployment() is not None

    # the watch lags behind a write (someone else's): the cached SDD is older than the API server's,
    # the status write conflicts, and the retry reads the SDD from the API server
    api.roll_out()
    stale = indexes_from(api)
    (cached,) = stale[cache.SDDS][(NS, "llama-8b-eagle3")]
    cached["metadata"]["resourceVersion"] = "1"
    c.bind(stale)
    c.forget(NS, "llama-8b-eagle3")
    api.reads.clear()
    r.reconcile(NS, "llama-8b-eagle3", force_apply=False, fresh=False)
    assert api.reads[0] == ("get", k8s.KIND) and api.sdd()["status"]["phase"] == "Ready"  # all through
