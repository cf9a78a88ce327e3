"""Launches and host syncs per decode layer and per round (benchmarks/launch_count.py), counted the
same way at a small width: the count depends on the structure, not the sizes. With the fused layer
kernels a Llama layer launches at most 12 kernels outside attention (9 today, its 4 matrix
products among them); as torch ops, 34. A round of any algorithm reads the host once. Counted,
not timed: on a GPU each launch costs a few microseconds however small its work, and each host
read waits for the device."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "launch_count.py"


SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    # The script turns the Triton backend on for its own process at import; in this one it must not
    # outlive these tests (every later engine would run interpreted Triton attention).
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location("launch_count", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["launch_count"] = module
    spec.loader.exec_module(module)
    module.models = module.write_round_models(
        tmp_path_factory.mktemp("launches"), {**module.LLAMA_8B_2_LAYERS, **SMALL},
        {**module.LLAMA_8B_2_LAYERS, **SMALL, "hidden_size": 64, "head_dim": 16})
    module.target = module.models["llama"]
    yield module
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def interpreted_triton():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts Triton launches under the interpreter (tests/conftest.py turns it on without a GPU)")


def test_fused_layer_kernels_launch_at_most_12_per_layer_outside_attention(bench, monkeypatch):
    monkeypatch.setenv("SPECDECODE_ATTENTION_BACKEND", "triton")
    torch_ops = bench.count(bench.target, "torch")
    fused = bench.count(bench.target, "triton")
    assert fused["layer_outside_attention"] <= 12 < torch_ops["layer_outside_attention"]
    # the same matrix products: q/k/v and gate/up as one each, o and down, in each of 2 layers, and the head
    assert fused["by_op"]["linear"] == torch_ops["by_op"]["linear"] == 4 * 2 + 1
    assert {"triton:_rms_norm_kernel", "triton:_rotary_kernel", "triton:_silu_mul_kernel"} <= set(fused["by_op"])
    assert fused["attention"] == torch_ops["attention"] == 4  # the K and V stores, split-KV decode and its reduction


@pytest.fixture(scope="module")
def rounds(bench):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_ATTENTION_BACKEND", "triton")
        return {case.name: bench.count_round(case, bench.models) for case in bench.ROUND_CASES}


@pytest.mark.slow
def test_every_round_reads_the_host_once(rounds):
    """One host read per round, the read-back of its results (``to_host``), whatever the algorithm;
    MTP's MoE layers route on the device (the expert kernel), so its round reads no more."""
    for name, r in rounds.items():
        assert r["host_reads"] == 1, (name, r["reads_by_site"])
        assert all("to_host" in site for site in r["reads_by_site"]), (name, r["reads_by_site"])
        # The round's inputs and slots in one copy each (its draft steps' with them); a tree's
        # accepted nodes move in one more.
        assert r["host_copies"] <= (3 if "tree" in name else 2), (name, r["copies_by_site"])


@pytest.mark.slow
def test_the_counter_sees_the_routed_moe_read_its_routing(bench, monkeypatch):
    """The check above can fail: with the experts' stacked weights taken away, MoE runs each chosen
    expert over its tokens, reading the routing back in every MoE layer of every pass."""
    from specdecode_worker.engine.models import deepseek_v3

    monkeypatch.setenv("SPECDECODE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(deepseek_v3.MoE, "stack_experts", lambda moe: False)
    mtp = next(c for c in bench.ROUND_CASES if c.algorithm == "MTP")
    r = bench.count_round(mtp, bench.models)
    moe_reads = sum(n for site, n in r["reads_by_site"].items() if site.startswith("deepseek_v3.py"))
    passes = len(r["target_passes"]) + len(r["draft_passes"])
    # per MoE pass: the unique experts (found, then listed) and each one's tokens
    assert moe_reads >= 3 * passes, r["reads_by_site"]


@pytest.mark.slow
def test_each_rounds_passes_and_launch_ceilings(rounds):
    k = 3
    plain = rounds["plain step"]
    assert len(plain["target_passes"]) == 1 and not plain["draft_passes"]
    for name in ("EAGLE3 chain", "EAGLE3 tree", "STANDALONE 1B", "MTP"):
        r = rounds[name]
        assert len(r["target_passes"]) == 1 and len(r["draft_passes"]) == k, (name, r)
        assert r["launches"] == sum(r["target_passes"]) + sum(r["draft_passes"]) + r["outside_passes"]
    for name in ("plain step", "EAGLE3 chain", "EAGLE3 tree", "STANDALONE 1B"):
        assert rounds[name]["target_layer_outside_attention"] <= 12, (name, rounds[name]["by_op"])
    # the 1B draft's steps run the fused kernels: a 2-layer step launches what the 2-layer target's does
    assert rounds["STANDALONE 1B"]["draft_passes"] == [plain["target_passes"][0]] * k
    # DeepSeek's MoE layer is torch ops around its kernels: its ceiling, until they are fused
    assert rounds["MTP"]["target_layer_outside_attention"] <= 64
    assert rounds["MTP"]["by_op"]["triton:_expert_gemv_kernel"] == 2 * (1 + k)  # gate/up and down, per MoE pass
