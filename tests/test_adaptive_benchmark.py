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
