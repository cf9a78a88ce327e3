"""benchmarks/policy_time.py runs and tabulates both algorithms (its numbers are in the docs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import policy_time  # noqa: E402


def test_policy_time_tabulates_both_algorithms(capsys):
    assert policy_time.main(["--rounds", "40", "--requests", "2", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["NGRAM", "STANDALONE"]
    assert all(len(r.split("|")) == 5 and all(float(c.split()[0]) > 0 for c in r.split("|")[2:-1]) for r in rows)
