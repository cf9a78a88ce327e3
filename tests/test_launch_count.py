"""Launches per decode layer (benchmarks/launch_count.py), counted the same way at a small width:
the count depends on the layer's structure, not its sizes. With the fused layer kernels a layer
launches at most 12 kernels outside attention (9 today, its 4 matrix products among them); as
torch ops, 34. Counted, not timed: on a GPU each launch costs a few microseconds however small its work."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_count.py"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    # The script turns the Triton backend on for its own process at import; in this one it must not
    # outlive these tests (every later engine would run interpreted Triton attention).
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location("launch_count", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["launch_count"] = module
    spec.loader.exec_module(module)
    shape = {**module.LLAMA_8B_2_LAYERS, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    module.target = module.write_random_llama(tmp_path_factory.mktemp("launches") / "llama", **shape)
    yield module
    os.environ.clear()
    os.environ.update(saved)


def test_fused_layer_kernels_launch_at_most_12_per_layer_outside_attention(bench, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts Triton launches under the interpreter (tests/conftest.py turns it on without a GPU)")
    monkeypatch.setenv("SPECDECODE_ATTENTION_BACKEND", "triton")
    torch_ops = bench.count(bench.target, "torch")
    fused = bench.count(bench.target, "triton")
    assert fused["layer_outside_attention"] <= 12 < torch_ops["layer_outside_attention"]
    # the same matrix products: q/k/v and gate/up as one each, o and down, in each of 2 layers, and the head
    assert fused["by_op"]["linear"] == torch_ops["by_op"]["linear"] == 4 * 2 + 1
    assert {"triton:_rms_norm_kernel", "triton:_rotary_kernel", "triton:_silu_mul_kernel"} <= set(fused["by_op"])
    assert fused["attention"] == torch_ops["attention"] == 4  # the K and V stores, split-KV decode and its reduction
