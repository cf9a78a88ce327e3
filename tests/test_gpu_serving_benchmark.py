"""benchmarks/gpu_serving.py runs: its tiny CPU mode goes through every step of the GPU run."""

from __future__ import annotations

import importlib.util
import json
import os
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

    from specdecode_worker.engine.speculation import mtp_runner

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
    rows = ["EAGLE3 chain", "STANDALONE draft1b k=3", "MTP", "EAGLE3 eagle3 k=2", "STANDALONE draft1b k=2",
            "EAGLE3 tree"]
    assert [p["row"] for p in res["peaks"]] == rows
    assert all(p["planned"] > 0 and p["measured"] is None for p in res["peaks"])
    assert res["errors"] == {}
    assert [d["batch"] for d in res["decode"]] == list(bench.TINY.batches)
    assert all(d["decode_tokens"] > 0 and d["roofline_tok_s"] > 0 for d in res["decode"])
    assert res["decode_profile"]["per_step"] > 0  # on CPU: operators per step (the code path, no number)
    # Controlled drafts: every draft, k, rate and batch against the plain engine, output the target's own.
    spec = res["spec"]
    assert sorted((r["draft"], r["k"], r["rate"], r["batch"]) for r in spec) == sorted(
        (d, k, a, b) for d in ("eagle3", "draft1b") for k in bench.TINY.draft_ks for a in bench.TINY.acceptances
        for b in bench.TINY.spec_batches)
    assert all(r["same_output"] for r in spec)
    # Batch 1 runs several requests one after another; every row reports its realised acceptance.
    assert all(r["requests"] == (bench.SEQUENCE if r["batch"] == 1 else r["batch"]) for r in spec)
    # At rate 1 every proposal is the target's token, past the request's end too: every round accepts
    # its whole chain, and the realised acceptance is 1; a lower rate realises less.
    by = {(r["draft"], r["k"], r["rate"], r["batch"]): r for r in spec}
    for (draft, k, rate, b), r in by.items():
        if rate == 1.0:
            assert r["accept_len"] == k and r["realised"] == 1.0
            assert r["realised"] > by[(draft, k, 0.5, b)]["realised"] > 0
    # EAGLE3 drafting trees: the greedy output is the plain engine's on the same prompts.
    tree = res["eagle3_tree"]
    assert tree["same_output"] and tree["batch"] == bench.TINY.spec_batches[0] and tree["tok_s"] > 0
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
    # The multi-turn chat workload: cache off and on per algorithm, later turns served from the cache.
    prefix = res["prefix"]
    assert [r["config"] for r in prefix] == ["NONE, cache off", "NONE, cache on", "EAGLE3, cache off",
                                             "EAGLE3, cache on"]
    assert all(r["hit_rate"] == 0 for r in prefix[::2]) and all(r["hit_rate"] > 0.5 for r in prefix[1::2])
    assert all(r["same_output"] for r in prefix[1::2])
    table = capsys.readouterr().out
    for label in ("multi-turn chat, EAGLE3, cache on",
                  "KV tokens planned / allocated", "dynamic bytes planned / measured", "decode batch 1",
                  "decode batch 1, one step", "step time at live length",
                  "EAGLE3 tree top-3, 3 steps, 6 nodes batch 1", "draft1b k=3 rate 0.5 batch 2",
                  "eagle3 k=2 rate 1.0 batch 1", "MTP (DeepSeek-V3 cut) k=3 batch 1", "MTP k=3 sweep, 2 requests",
                  *(f"dynamic peak {row}" for row in rows)):
        assert label in table
    assert bench.main(["--table", str(out)]) == 0  # a saved run's table, as device_check.sh prints it
    assert capsys.readouterr().out.strip() in table  # the same rows as the run printed


def test_a_failing_phase_is_reported_and_the_rest_still_run(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_serving", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_serving", bench)
    spec.loader.exec_module(bench)

    def out_of_memory(*args):
        raise RuntimeError("Triton Error [CUDA]: out of memory")

    monkeypatch.setattr(bench, "startup_phase", out_of_memory)
    out = tmp_path / "res.json"
    assert bench.main(["--tiny", "--json", str(out), "--phases", "startup,tree"]) == 1
    res = json.loads(out.read_text())
    assert res["errors"]["startup"].startswith("RuntimeError: Triton Error [CUDA]: out of memory")
    assert res["startup"].startswith("failed: RuntimeError")
    assert res["eagle3_tree"]["same_output"]  # the phase after it ran
    assert "decode" not in res  # not asked for: the baseline ran, its rows did not
    assert "FAILED startup" in bench.table(res)


@pytest.mark.slow
def test_device_check_script_runs_its_cpu_path(tmp_path):
    """benchmarks/device_check.sh --tiny: the GPU run's script end to end on CPU (the CUDA tests
    are collected and skip), so a typo cannot cost a GPU run."""
    import subprocess

    script = SCRIPT.parent / "device_check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "BENCH_PHASES": "startup"}
    done = subprocess.run(["bash", str(script), "--tiny", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = (tmp_path / "results.md").read_text()
    assert "| start-up (8B + EAGLE3, planner defaults) | ok |" in results
    assert "eagle3 k=3 rate 1.0 batch 1" in results and "realised acceptance 1.000" in results
    assert "| tiny DeepSeek-V3 + NextN | MTP | 256 |" in results  # the plan sweep's table
    assert "skipped" in results.splitlines()[-1]  # the CUDA tests' summary line


def test_a_controlled_draft_proposes_the_continuation_at_its_rate():
    """Each proposal is the target's token at that position with probability ``rate``, another
    token otherwise: the same again for the same request and position, drawn anew for another
    request of the same prompt."""
    from types import SimpleNamespace

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from controlled_draft import AcceptanceControl
    finally:
        sys.path.remove(str(SCRIPT.parent))
    prompt, out = [5, 6, 7], list(range(100, 400))
    control = AcceptanceControl.__new__(AcceptanceControl)  # the token rule alone, no speculator
    control.continuations, control.vocab_size, control.seed = {tuple(prompt): out}, 1000, 0
    req = SimpleNamespace(rid=1, prompt_ids=prompt, output_ids=out[:10])
    control.rate = 1.0
    assert [control.token(req, s) for s in range(5)] == out[10:15]
    control.rate = 0.0
    assert all(control.token(req, s) != out[10 + s] for s in range(200))
    control.rate = 0.8

    def hits(rid):
        return [control.token(SimpleNamespace(rid=rid, prompt_ids=prompt, output_ids=out[:n]), 0) == out[n]
                for n in range(250)]

    assert 0.7 < sum(hits(1)) / 250 < 0.9
    assert hits(1) == hits(1)  # the same request's draws again
    assert hits(2) != hits(1) and 0.7 < sum(hits(2)) / 250 < 0.9  # another request, the same prompt: drawn anew
