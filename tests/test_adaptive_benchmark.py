"""benchmarks/adaptive_cpu.py's verdicts: adaptive against the better of none and fixed, run by run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.adaptive_cpu import verdicts  # noqa: E402


def row(kind, c, method, runs):
    return {"workload": kind, "concurrency": c, "method": method, "runs_tok_per_cpu_s": runs}


def test_adaptive_is_paired_with_the_better_method_of_its_own_repeat():
    rows = [row("mixed", 4, "none", [10.0, 20.0, 10.0]), row("mixed", 4, "NGRAM fixed k=4", [12.0, 10.0, 8.0]),
            row("mixed", 4, "NGRAM adaptive", [13.2, 19.0, 11.0]),
            row("open", 4, "none", [10.0, 10.0, 10.0]), row("open", 4, "NGRAM fixed k=4", [5.0, 5.0, 5.0]),
            row("open", 4, "NGRAM adaptive", [9.4, 9.5, 9.6])]
    by = {(v["workload"], v["family"]): v for v in verdicts(rows)}
    mixed, open_ = by[("mixed", "NGRAM")], by[("open", "NGRAM")]
    # Run by run: 13.2 / 12, 19 / 20, 11 / 10.
    assert (mixed["ratio"], mixed["low"], mixed["high"]) == pytest.approx((1.1, 0.95, 1.1))
    assert mixed["met"]  # above both, by the median
    assert open_["ratio"] == pytest.approx(0.95) and open_["met"]  # within 5%
    rows[-1] = row("open", 4, "NGRAM adaptive", [9.4, 9.4, 9.6])
    assert not {(v["workload"]): v for v in verdicts(rows)}["open"]["met"]


def test_a_single_run_per_point_tabulates():
    rows = [row("copy", 1, "none", [10.0]), row("copy", 1, "NGRAM fixed k=4", [20.0]),
            row("copy", 1, "NGRAM adaptive", [21.0])]
    assert verdicts(rows)[0]["ratio"] == pytest.approx(1.05)


class _Stepper:
    """Just what run_together drives: requests that finish after ``steps`` steps, and a log of who stepped."""

    def __init__(self, name: str, log: list[str], steps: int):
        from types import SimpleNamespace
        self.name, self.log, self.steps = name, log, steps
        self.policy = SimpleNamespace(trace=None)
        self.stats = SimpleNamespace(decode_steps=0, steps_without_speculation=0)
        self.reqs = []

    def submit(self, r):
        self.reqs.append(r)

    def step(self):
        self.log.append(self.name)
        self.stats.decode_steps += 1
        if self.stats.decode_steps >= self.steps:
            for r in self.reqs:
                r.done.set()


def _successions(log: list[str]) -> set[tuple[str, str]]:
    return {(a, b) for a, b in zip(log, log[1:]) if a != b}


def test_lockstep_turns_are_shuffled_so_no_method_always_follows_the_same_one():
    from benchmarks.adaptive_cpu import run_together

    names = ["none", "fixed", "adaptive"]
    log: list[str] = []
    run_together({n: _Stepper(n, log, 30) for n in names}, names, [[1, 2, 3]], 4)
    assert _successions(log) == {("none", "fixed"), ("fixed", "adaptive"), ("adaptive", "none")}  # a cycle
    log.clear()
    out = run_together({n: _Stepper(n, log, 30) for n in names}, names, [[1, 2, 3]], 4, seed=7)
    assert _successions(log) == {(a, b) for a in names for b in names if a != b}
    assert sorted(log) == sorted(names * 30) and set(out) == set(names)  # every method still took all its steps
    log2: list[str] = []
    run_together({n: _Stepper(n, log2, 30) for n in names}, names, [[1, 2, 3]], 4, seed=7)
    assert log2 == log  # seeded: the same turns again


def test_the_oracle_drafts_only_for_the_copy_prompts_and_is_paired_like_adaptive():
    from benchmarks.adaptive_cpu import copies, oracle_verdicts, run_together, workload_prompts

    prompts = workload_prompts("mixed", 4)
    assert copies("mixed", 4) == [p.startswith("Repeat") for p in prompts] == [True, False, True, False]
    assert copies("copy", 2) == [True, True] and copies("open", 2) == [False, False]
    log: list[str] = []
    steppers = {n: _Stepper(n, log, 2) for n in ("fixed", "oracle")}
    run_together(steppers, list(steppers), [[1], [2], [3], [4]], 4, may_draft={"oracle": copies("mixed", 4)})
    assert [r.speculative for r in steppers["oracle"].reqs] == [True, False, True, False]
    assert all(r.speculative for r in steppers["fixed"].reqs)
    rows = [row("mixed", 4, "none", [10.0, 20.0]), row("mixed", 4, "NGRAM fixed k=4", [12.0, 10.0]),
            row("mixed", 4, "NGRAM oracle", [15.0, 19.0]), row("mixed", 4, "NGRAM adaptive", [13.0, 20.0])]
    (v,) = oracle_verdicts(rows)
    assert (v["family"], v["ratio"], v["low"], v["high"]) == ("NGRAM", pytest.approx(1.1), pytest.approx(0.95),
                                                               pytest.approx(1.25))
