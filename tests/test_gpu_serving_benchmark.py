"""benchmarks/gpu_serving.py runs: its tiny CPU mode goes through every step of the GPU run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_serving.py"


@pytest.mark.slow
def test_tiny_run_reports_every_row(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_serving", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_serving", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    from specdecode_worker.engine import model_runner

    from specdecode_worker.engine import mtp_runner

    original, original_mtp = model_runner.load_safetensors, mtp_runner.load_safetensors
    out = tmp_path / "res.json"
    assert bench.main(["--tiny", "--json", str(out)]) == 0
    assert model_runner.load_safetensors is original  # the random loaders are undone
    assert mtp_runner.load_safetensors is original_mtp
    res = json.loads(out.read_text())
    assert res["startup"] == "ok" and 0 < res["allocated_kv_tokens"]
    assert 0 < res["planned_dynamic_bytes"] < 64 << 20
    # Phase 3's warm-up: the plan's number next to no measurement on CPU (none is invented).
    assert res["warmup"]["planned"] == res["planned_dynamic_bytes"] and res["warmup"]["measured"] is None
    # ... and for every engine row, each with its own plan.
    rows = ["EAGLE3 chain", "EAGLE3 tree", "STANDALONE copy", "STANDALONE perturbed", "STANDALONE draft1b", "MTP"]
    assert [p["row"] for p in res["peaks"]] == rows
    assert all(p["planned"] > 0 and p["measured"] is None for p in res["peaks"])
    assert [d["batch"] for d in res["decode"]] == list(bench.TINY.batches)
    assert all(d["decode_tokens"] > 0 and d["roofline_tok_s"] > 0 for d in res["decode"])
    # EAGLE3 drafting trees: the greedy output is the plain engine's on the same prompts.
    tree = res["eagle3_tree"]
    assert tree["same_output"] and tree["batch"] == bench.TINY.spec_batches[0] and tree["tok_s"] > 0
    spec_rows = {r["draft"]: r for r in res["spec"]}
    # A copy of the target proposes exactly what the target picks: every draft token is accepted,
    # and the output is the plain engine's.
    assert spec_rows["copy"]["acceptance"] == 1.0 and spec_rows["copy"]["same_output"]
    assert all(r["same_output"] for r in res["spec"])  # greedy speculative output is the target's own
    # MTP on the DeepSeek-shaped model: the NextN layer drafted (k per round, some accepted) and the
    # greedy output is the plain engine's on the same prompt.
    mtp = res["mtp"]
    assert mtp["same_output"] and mtp["batch"] == 1 and mtp["k"] == bench.TINY.k
    assert 0 < mtp["acceptance"] <= 1 and mtp["decode_tokens"] > 0
    assert mtp["tok_s"] > 0 and mtp["baseline_tok_s"] > 0
    assert mtp["speedup"] == pytest.approx(mtp["tok_s"] / mtp["baseline_tok_s"])
    # The load-aware sweep: none, fixed and adaptive at every concurrency, greedy output the plain engine's.
    sweep = res["mtp_sweep"]
    assert sorted((r["method"], r["concurrency"]) for r in sweep) == sorted(
        (m, c) for m in ("none", "fixed", "adaptive") for c in bench.TINY.sweep_batches)
    assert all(r["same_output"] and r["tok_s"] > 0 for r in sweep)
    assert all(r["drafting_rounds"] == 1.0 for r in sweep if r["method"] == "fixed")
    table = capsys.readouterr().out
    for label in ("KV tokens planned / allocated", "dynamic bytes planned / measured", "decode batch 1",
                  "step time at live length", "EAGLE3 tree top-3, 3 steps, 6 nodes batch 2",
                  "STANDALONE perturbed k=3 batch 2",
                  "MTP (DeepSeek-V3 cut) k=3 batch 1", "MTP k=3 sweep, 2 requests",
                  *(f"dynamic peak {row}" for row in rows)):
        assert label in table
