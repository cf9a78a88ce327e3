"""benchmarks/gpu_serving.py runs: its tiny CPU mode goes through every step of the GPU run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from specdecode_worker.planner.plan import blas_workspace_bytes  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_serving.py"


@pytest.mark.slow
def test_tiny_run_reports_every_row(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_serving", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_serving", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "res.json"
    assert bench.main(["--tiny", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["startup"] == "ok" and 0 < res["allocated_kv_tokens"]
    assert 0 < res["planned_dynamic_bytes"] < (64 << 20) + blas_workspace_bytes("tiny")  # the tiny activations
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
    # The transformers peer, right after decode in the same run: the same work at each of its batches
    # (every request the requested length, the same tokens timed), ours / peer from the same rows.
    tiny = bench.TINY
    ours = {d["batch"]: d for d in res["decode"]}
    peer = res["peer"]
    assert [p["batch"] for p in peer] == list(tiny.peer_batches)
    for p in peer:
        b = p["batch"]
        assert p["generated"] == [tiny.new_tokens] * b and p["tokens"] == b * tiny.new_tokens
        assert p["decode_tokens"] == ours[b]["decode_tokens"] == b * (tiny.new_tokens - bench.ADMITTED_TOKENS)
        assert p["steps"] == ours[b]["steps"] and p["tok_s"] > 0 and p["warmup_s"] > 0
        assert p["ratio"] > 0 and p["ratio"] == pytest.approx(ours[b]["tok_s"] / p["tok_s"])
        # The same weights (the engine's loader) and prompts at fp32 with peaked logits: every greedy
        # token is ours (checked deterministic over repeated runs).
        assert p["same_tokens"] == p["tokens"]
        assert p["backend"] == "eager"  # --tiny: traced whole by dynamo, run eagerly (no C++ build)
    # Both bandwidth sources on every roofline row: the measured copy's, and the datasheet's (none for a CPU).
    assert res["bandwidth_GBps"] > 0 and res["spec_device"] is None and res["spec_bandwidth_GBps"] is None
    for r in res["decode"] + peer:
        assert r["roofline_tok_s"] > 0 and r["of_roofline"] == pytest.approx(r["tok_s"] / r["roofline_tok_s"])
        assert r["spec_roofline_tok_s"] is None and r["of_spec_roofline"] is None
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
    for label in ("multi-turn chat, EAGLE3, cache on", "datasheet bandwidth", "transformers peer batch 2",
                  "ours / peer", "no datasheet roofline",
                  "KV tokens planned / allocated", "dynamic bytes planned / measured", "decode batch 1",
                  "decode batch 1, one step", "step time at live length",
                  "EAGLE3 tree top-3, 3 steps, 6 nodes batch 1", "draft1b k=3 rate 0.5 batch 2",
                  "eagle3 k=2 rate 1.0 batch 1", "MTP (DeepSeek-V3 cut) k=3 batch 1", "MTP k=3 sweep, 2 requests",
                  *(f"dynamic peak {row}" for row in rows)):
        assert label in table
    assert bench.main(["--table", str(out)]) == 0  # a saved run's table, as device_check.sh prints it
    assert capsys.readouterr().out.strip() in table  # the same rows as the run printed


def test_roofline_rows_carry_both_bandwidth_sources(monkeypatch):
    """The datasheet's bandwidth by device name (whole words: a GH200 is no H200; a variant before
    its family), and a row's share of the roofline at the measured copy's and at the datasheet's."""
    spec = importlib.util.spec_from_file_location("gpu_serving", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_serving", bench)
    spec.loader.exec_module(bench)
    names = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12, "NVIDIA H100 NVL": 3.9e12,
             "NVIDIA H200": 4.8e12, "NVIDIA A100-SXM4-80GB": 2.039e12, "NVIDIA A100 80GB PCIe": 1.935e12,
             "NVIDIA A100-PCIE-40GB": 1.555e12, "NVIDIA GH200 480GB": None, "cpu": None}
    assert {name: bench.spec_bandwidth(name)[1] for name in names} == names
    assert bench.spec_bandwidth("NVIDIA H100 80GB HBM3")[0] == "H100 SXM"
    # Batch 2 at 1 GB/s measured and 2 GB/s datasheet; a step reads 1000 B of weights and 2 x 100 B of KV.
    s = bench.TINY
    res = {"decode_read_weight_bytes": 1000, "kv_bytes_per_token": 100 / (s.prompt + s.new_tokens / 2),
           "bandwidth_GBps": 1.0, "spec_bandwidth_GBps": 2.0}
    row = bench.add_roofline({"batch": 2, "tok_s": 1e6}, s, res)
    assert row["roofline_tok_s"] == pytest.approx(2 * 1e9 / 1200) and row["of_roofline"] == pytest.approx(0.6)
    assert row["spec_roofline_tok_s"] == pytest.approx(2 * 2e9 / 1200) and row["of_spec_roofline"] == pytest.approx(0.3)
    assert "60% of roofline" in bench.roofline_text(row) and "30% of" in bench.roofline_text(row)


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
