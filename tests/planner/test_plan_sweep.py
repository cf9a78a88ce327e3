"""benchmarks/plan_sweep.py: plan, then start, every case; its CPU run goes through every step of
the GPU run, and a start that fails or measures above its plan fails the sweep."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_sweep.py"


@pytest.fixture
def sweep(monkeypatch):
    spec = importlib.util.spec_from_file_location("plan_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_sweep", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tiny_sweep_starts_every_algorithm_under_its_plan(sweep, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert sweep.main(["--tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["algorithm"] for r in rows} == {"NONE", "STANDALONE", "EAGLE", "EAGLE3", "MTP"}
    for r in rows:
        assert r["started"] and r["planned"] > 0 and r["graph_bs"] > 0
        assert r["allocated"] is None and r["reserved"] is None  # CPU keeps no allocator peak: none invented
        assert r["tokens_allocated"] <= r["tokens_planned"]
    # An EAGLE head is priced in the target's dtype, as the worker runs it: the plan's cell is the worker's.
    head = next(r for r in rows if r["algorithm"] == "EAGLE3")
    assert head["tokens_planned"] - head["tokens_allocated"] < 0.001 * head["tokens_planned"]
    table = capsys.readouterr().out
    assert "| tiny Llama + EAGLE3 head | EAGLE3 | 128 |" in table and "failed" not in table
    assert sweep.main(["--table", str(out)]) == 0


def test_a_failed_start_or_a_view_above_plan_fails_the_sweep(sweep, tmp_path, monkeypatch, capsys):
    def above(case, models, device, cpu_gib, weights=None):
        return {"case": case.name, "algorithm": case.algorithm, "context": case.context, "planned": 100,
                "allocated": 90, "reserved": 130, "driver": None, "over": ["reserved"], "started": True, "seconds": 0}

    failing = sweep.Case("MTP without a NextN layer", "tiny", "MTP", 256)
    row = sweep.start(failing, sweep.write_models(tmp_path, tiny=True), "cpu", 2.0)
    assert not row["started"] and "num_nextn_predict_layers" in row["error"] and sweep.failed(row)
    monkeypatch.setattr(sweep, "start", above)
    assert sweep.main(["--tiny", "--only", "tiny Llama"]) == 1
    assert "**above plan** (reserved)" in capsys.readouterr().out
