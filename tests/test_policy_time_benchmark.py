"""benchmarks/policy_time.py runs and tabulates both algorithms (its numbers are the README's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import policy_time  # noqa: E402


def test_policy_time_tabulates_both_algorithms_and_the_context_lookup(capsys):
    assert policy_time.main(["--rounds", "40", "--requests", "2", "8", "--context", "512"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["NGRAM", "STANDALONE", "per round"]
    assert all(len(r.split("|")) == 5 for r in rows)
    assert "first lookup of a 512-token context" in out
