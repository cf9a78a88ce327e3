"""The kopf layer's scheduling (when an SDD is reconciled again) and the command line."""

from __future__ import annotations

import asyncio

from specdecode_operator import handlers, main
from specdecode_operator.reconcile import Result


class StubReconciler:
    def __init__(self, results):
        self.results = list(results)
        self.calls = []

    def reconcile(self, namespace, name, force_apply=True, fresh=True):
        self.calls.append((namespace, name, force_apply, fresh))
        r = self.results.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_requeue_times_follow_the_reconcile_result():
    clock = Clock()
    ctl = handlers.Controller(StubReconciler([Result(requeue_after=7), Result(), Result(gone=True)]), clock=clock)
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] == clock.t + 7
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] == clock.t + handlers.RESYNC_SECONDS  # periodic resync even when idle
    ctl.reconcile("ns", "a")
    assert ("ns", "a") not in ctl.due  # deleted: forgotten


def test_errors_are_retried_with_a_backoff_that_resets_on_success():
    clock = Clock()
    stub = StubReconciler([RuntimeError("api down")] * 10 + [Result(requeue_after=7), RuntimeError("again")])
    ctl = handlers.Controller(stub, clock=clock)
    delays = []
    for _ in range(10):
        ctl.reconcile("ns", "a")  # never dropped: always due again
        delays.append(ctl.due[("ns", "a")] - clock.t)
    assert delays == [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    ctl.reconcile("ns", "a")
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] - clock.t == 2


def test_due_follows_the_clock():
    clock = Clock()
    ctl = handlers.Controller(StubReconciler([Result(requeue_after=7)]), clock=clock)
    ctl.reconcile("ns", "a")
    ctl.poke("ns", "b", delay=3)
    assert ctl.due_now() == []
    clock.t += 3
    assert ctl.due_now() == [("ns", "b")]
    clock.t += 4
    ctl.running.add(("ns", "b"))  # already being reconciled: not started twice
    assert ctl.due_now() == [("ns", "a")]


def test_child_events_coalesce_and_are_not_lost_during_a_reconcile():
    clock = Clock()
    stub = StubReconciler([Result()])
    ctl = handlers.Controller(stub, clock=clock)
    ctl.poke("ns", "a")
    first = ctl.due[("ns", "a")]
    ctl.poke("ns", "a", delay=5)
    assert ctl.due[("ns", "a")] == first  # the earliest wins; a burst is one reconcile

    # a poke that lands while the reconcile runs makes the next one come soon
    def reconcile_with_event(ns, name, force_apply=True, fresh=True):
        ctl.poke(ns, name)
        return Result()

    stub.reconcile = reconcile_with_event
    ctl.reconcile("ns", "a")
    assert ctl.due[("ns", "a")] == clock.t + 0.5


def test_child_events_reach_the_owner_by_label():
    clock = Clock()
    handlers.CONTROLLER = handlers.Controller(StubReconciler([]), clock=clock)
    try:
        asyncio.run(handlers.pod_event(namespace="ns", meta={"labels": {"specdecode.io/name": "sdd-1"}}))
        asyncio.run(handlers.deployment_event(namespace="ns", meta={"labels": {}}))
        asyncio.run(handlers.leaderworkerset_event(namespace="ns2", meta={"labels": {"specdecode.io/name": "sdd-2"}}))
        assert list(handlers.CONTROLLER.due) == [("ns", "sdd-1"), ("ns2", "sdd-2")]
    finally:
        handlers.CONTROLLER = None


def run_due_once(ctl) -> None:
    """One pass of the requeue loop: every SDD due now is reconciled."""

    async def loop_once():
        stopped = asyncio.Event()
        task = asyncio.ensure_future(ctl.requeue_loop(stopped))
        await asyncio.sleep(0.05)
        stopped.set()
        await task

    asyncio.run(loop_once())


def test_command_line():
    args = main.parse_args(["--namespace", "a", "--namespace", "b", "--worker-image", "w:1", "--no-node-check"])
    assert args.namespace == ["a", "b"] and args.worker_image == "w:1" and args.no_node_check
    assert main.parse_args([]).namespace == [] and main.parse_args([]).log_format == "json"


def test_child_events_reconcile_from_the_cache_and_the_resync_reads_through():
    clock = Clock()
    stub = StubReconciler([Result(requeue_after=30), Result(), Result(), RuntimeError("api down"), Result()])
    ctl = handlers.Controller(stub, clock=clock)
    ctl.reconcile("ns", "a", True)  # a kopf create: re-apply, from the cache
    assert stub.calls[-1] == ("ns", "a", True, False) and ("ns", "a") not in ctl.full

    def run_due():
        run_due_once(ctl)
        ctl.pool.shutdown(wait=True)
        ctl.pool = handlers.ThreadPoolExecutor(max_workers=1)

    clock.t += 30  # the planning poll: light
    run_due()
    assert stub.calls[-1] == ("ns", "a", False, False) and ("ns", "a") in ctl.full  # next: the resync
    clock.t += handlers.RESYNC_SECONDS
    run_due()
    assert stub.calls[-1] == ("ns", "a", True, True)  # the resync re-applies and reads through
    clock.t += handlers.RESYNC_SECONDS
    run_due()  # fails
    assert ("ns", "a") in ctl.repair
    clock.t += handlers.ERROR_RETRY_SECONDS
    run_due()
    assert stub.calls[-1] == ("ns", "a", True, True)  # a retry after an error reads through


def test_a_child_event_before_the_retry_does_not_cancel_its_reapply():
    """A reconcile fails mid-apply (the API server went away); a child event pokes the SDD before
    the retry is due. The retry still re-applies the children and reads through: were it a light
    refresh, the child the failed apply never made would stay missing until the resync."""
    clock = Clock()
    stub = StubReconciler([RuntimeError("connection refused"), Result(requeue_after=30), Result(requeue_after=30)])
    ctl = handlers.Controller(stub, clock=clock, workers=1)
    ctl.reconcile("ns", "a", True)  # fails
    ctl.poke("ns", "a")  # the Deployment it did apply changes

    clock.t += 1
    run_due_once(ctl)
    assert stub.calls[-1] == ("ns", "a", True, True) and ("ns", "a") not in ctl.repair
    ctl.poke("ns", "a")  # after a successful full one, a child event is light again
    clock.t += 1
    run_due_once(ctl)
    ctl.pool.shutdown(wait=True)
    assert stub.calls[-1] == ("ns", "a", False, False)


def test_a_child_event_before_the_resync_stays_light():
    """The resync is due (full) and a child event comes first: that reconcile only refreshes status
    (an apply then could wait on a webhook the change is about); the resync comes after it."""
    clock = Clock()
    stub = StubReconciler([Result(), Result(), Result()])
    ctl = handlers.Controller(stub, clock=clock, workers=1)
    ctl.reconcile("ns", "a", True)
    assert ("ns", "a") in ctl.full  # the resync is next
    ctl.poke("ns", "a")

    clock.t += 1
    run_due_once(ctl)
    ctl.pool.shutdown(wait=True)
    assert stub.calls[-1] == ("ns", "a", False, False) and ("ns", "a") in ctl.full
