"""oneDNN-packed linear layers on CPU against F.linear, the bytes they hold, and where they apply."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.backends.mkldnn.is_available():
    pytest.skip("this torch has no oneDNN", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from specdecode_worker.engine.kernels.cpu_linear import PackedLinear, can_pack, pack, packed_bytes  # noqa: E402
from specdecode_worker.engine.parallel.parallel_layers import FusedLinear, RowParallelLinear  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(dtype, bias):
    torch.manual_seed(0)
    w = torch.randn(192, 128, dtype=dtype)
    b = torch.randn(192, dtype=dtype) if bias else None
    layer = PackedLinear(w, b)
    for shape in [(1, 128), (3, 128), (8, 128), (33, 128), (2, 5, 128)]:
        x = torch.randn(shape, dtype=dtype)
        ours = layer(x)
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert ours.shape == (*shape[:-1], 192) and ours.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(ours.double(), exact, rtol=0, atol=1e-4)
        else:  # bf16 keeps 8 bits: as close to the exact product as F.linear's own bf16 result is
            dense = F.linear(x, w, b).double()
            assert (ours.double() - exact).abs().max() <= 2 * (dense - exact).abs().max() + 1e-6


def test_only_aligned_plain_products_are_packed():
    aligned = nn.Linear(128, 64, bias=False)
    assert isinstance(pack(aligned), PackedLinear)
    for layer in [nn.Linear(100, 64), nn.Linear(64, 100), nn.Linear(128, 64).half()]:
        assert pack(layer) is layer  # padded blocks would hold more than the plan's bytes; fp16 is not packed
    row = RowParallelLinear(128, 64, bias=False)  # its product is followed by an all-reduce
    assert pack(row) is row
    assert not can_pack(torch.empty(64, 64, device="meta"))


def test_fused_layer_keeps_its_split_sizes():
    parts = [nn.Linear(64, 128, bias=False), nn.Linear(64, 64, bias=False)]
    fused = FusedLinear(parts)
    packed = pack(fused)
    assert isinstance(packed, PackedLinear) and packed.sizes == [128, 64]
    x = torch.randn(4, 64)
    a, b = packed(x).split(packed.sizes, dim=-1)
    torch.testing.assert_close(a, parts[0](x), rtol=0, atol=1e-5)
    torch.testing.assert_close(b, parts[1](x), rtol=0, atol=1e-5)


def allocated_by_packing(weight: torch.Tensor) -> int:
    """Bytes the packing allocated and kept, as torch's CPU allocator records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    kept = sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.key == "mkldnn::_reorder_linear_weight")
    del packed
    return kept


def test_a_packed_weight_takes_its_dense_bytes_and_an_unaligned_one_would_not():
    """The plan prices a packed weight at its dense size; the allocator's record of the packing
    must agree to the byte. An unaligned weight is padded to oneDNN's blocks, which is why it is
    left dense."""
    aligned = torch.randn(49152, 576).to(torch.bfloat16)  # SmolLM2's vocabulary x hidden
    assert PackedLinear(aligned, None).nbytes == allocated_by_packing(aligned) == 49152 * 576 * 2
    unaligned = torch.randn(49155, 577).to(torch.bfloat16)
    assert allocated_by_packing(unaligned) > 49155 * 577 * 2 and not can_pack(unaligned)


def test_smollm2_layers_are_packed_with_unchanged_weight_bytes(monkeypatch):
    from devtools import smollm2
    from specdecode_worker.engine.kernels.cpu_linear import PACKING_ENV
    from specdecode_worker.engine.model_runner import ModelRunner

    model_dir = smollm2.smollm2_dir_or_skip()
    runners = {}
    for packing in ("1", "0"):
        monkeypatch.setenv(PACKING_ENV, packing)
        runners[packing] = ModelRunner(model_dir, dtype="bfloat16")
        runners[packing].load_weights()
    packed, dense = runners["1"], runners["0"]
    layers = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 30 * 4  # qkv, o, gate_up, down in each of 30 layers
    assert packed_bytes(dense.model) == 0
    assert packed.weight_bytes == dense.weight_bytes  # the plan's weight term holds either way
    # the tied embedding and head stay one dense tensor
    assert packed.model.head_weight() is packed.model.model.embed_tokens.weight
    x = torch.randn(8, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        a = packed.model.model.layers[0].mlp(x).double()
        b = dense.model.model.layers[0].mlp(x).double()
    assert (a - b).abs().max() <= 0.02 * b.abs().max()
