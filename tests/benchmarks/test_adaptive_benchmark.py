"""benchmarks/adaptive_cpu.py's verdicts (adaptive against the better of none and fixed, run by
run, ties set apart) and its lockstep runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.adaptive_cpu import print_table, run_together, verdicts  # noqa: E402


def row(kind, c, method, runs):
    return {"workload": kind, "concurrency": c, "method": method, "runs_tok_per_cpu_s": runs,
            "drafted": 0.5, "runs": len(runs)}


def test_adaptive_is_paired_with_the_better_method_of_its_own_repeat():
    rows = [row("ngram-copy", 4, "none", [10.0, 20.0, 10.0]), row("ngram-copy", 4, "fixed", [14.0, 25.0, 15.0]),
            row("ngram-copy", 4, "adaptive", [13.3, 26.0, 15.0]),
            row("slow-draft", 4, "none", [10.0, 10.0, 10.0]), row("slow-draft", 4, "fixed", [5.0, 5.0, 5.0]),
            row("slow-draft", 4, "adaptive", [9.4, 9.5, 9.6])]
    copy, slow = verdicts(rows)
    # Run by run: 13.3 / 14, 26 / 25, 15 / 15.
    assert (copy["better"], copy["tie"]) == ("fixed", False)
    assert (copy["ratio"], copy["low"], copy["high"]) == pytest.approx((1.0, 0.95, 1.04))
    assert copy["met"]
    assert (slow["better"], slow["lead"], slow["ratio"]) == ("none", 2.0, pytest.approx(0.95)) and slow["met"]
    rows[-1] = row("slow-draft", 4, "adaptive", [9.4, 9.4, 9.6])
    assert not verdicts(rows)[1]["met"]


def test_a_point_where_none_and_fixed_are_close_is_a_tie_whatever_adaptive_does():
    rows = [row("ngram-open", 1, "none", [10.0]), row("ngram-open", 1, "fixed", [11.0]),
            row("ngram-open", 1, "adaptive", [8.0])]
    (v,) = verdicts(rows)
    assert v["tie"] and v["met"] and v["ratio"] == pytest.approx(8 / 11)


def test_the_table_names_each_verdict(capsys):
    rows = [row("slow-draft", 1, "none", [10.0]), row("slow-draft", 1, "fixed", [2.0]),
            row("slow-draft", 1, "adaptive", [5.0])]
    print_table(rows)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("| slow-draft | 1 |") and "none (5.00x)" in line and "**missed**" in line


class _Stepper:
    """Just what run_together drives: requests that finish after ``steps`` steps, and a log of who stepped."""

    def __init__(self, name: str, log: list[str], steps: int):
        from types import SimpleNamespace
        self.name, self.log, self.steps = name, log, steps
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
