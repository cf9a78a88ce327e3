"""The kopf layer's scheduling (when an SDD is reconciled again) and the command line."""

from __future__ import annotations

import time

from specdecode_operator import handlers, main
from specdecode_operator.reconcile import Result


class StubReconciler:
    def __init__(self, results):
        self.results = list(results)
        self.calls = []

    def reconcile(self, namespace, name, force_apply=True):
        self.calls.append((namespace, name))
        r = self.results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


def test_requeue_times_follow_the_reconcile_result():
    ctl = handlers.Controller(StubReconciler([Result(requeue_after=7), Result(), Result(gone=True),
                                              RuntimeError("api down")]))
    t0 = time.time()
    ctl.reconcile("ns", "a")
    assert 6 <= ctl.due[("ns", "a")] - t0 <= 8
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] - t0 >= handlers.RESYNC_SECONDS - 1  # periodic resync even when idle
    ctl.reconcile("ns", "a")
    assert ("ns", "a") not in ctl.due  # deleted: forgotten
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] - time.time() <= 10  # an error is retried soon, not dropped


def test_child_events_coalesce_and_are_not_lost_during_a_reconcile():
    stub = StubReconciler([Result()])
    ctl = handlers.Controller(stub)
    ctl.poke("ns", "a")
    first = ctl.due[("ns", "a")]
    ctl.poke("ns", "a", delay=5)
    assert ctl.due[("ns", "a")] == first  # the earliest wins; a burst is one reconcile

    # a poke that lands while the reconcile runs makes the next one come soon
    def reconcile_with_event(ns, name, force_apply=True):
        ctl.poke(ns, name)
        return Result()

    stub.reconcile = reconcile_with_event
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] - time.time() < 1


def test_command_line():
    args = main.parse_args(["--namespace", "a", "--namespace", "b", "--worker-image", "w:1", "--no-node-check"])
    assert args.namespace == ["a", "b"] and args.worker_image == "w:1" and args.no_node_check
    assert main.parse_args([]).namespace == [] and main.parse_args([]).log_format == "json"
