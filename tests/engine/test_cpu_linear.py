"""oneDNN-packed linear layers on CPU against F.linear, the bytes they hold, and where they apply."""

from __future__ import annotations

import os
import subprocess
import sys

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


RSS_PROBE = """
import gc, torch
from specdecode_worker.engine.kernels.cpu_linear import PackedLinear
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
w = torch.randn(49152, 576).to(torch.bfloat16)  # SmolLM2's vocabulary x hidden
del PackedLinear(w, None).packed  # oneDNN's first-use work (its reorder's generated code), outside the count
gc.collect()
before = rss()
layer = PackedLinear(w, None)
gc.collect()
print(rss() - before, layer.nbytes, w.numel() * w.element_size())
"""


def test_a_packed_weight_takes_its_dense_bytes():
    """The plan prices a packed weight at its dense size; the kernel's own allocation (the RSS the
    packing adds, in a fresh process on one thread) must agree. The slack, 512 KiB, is the
    allocator's own bookkeeping, measured up to 360 KiB; padding either dimension to a 128-wide
    block would add 6 MiB here."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RSS_PROBE], capture_output=True, text=True, check=True,
                         env=env).stdout
    grown, counted, dense = map(int, out.split())
    assert counted == dense == 49152 * 576 * 2
    assert dense - 4096 <= grown <= dense + 512 * 1024, (grown, dense)


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
