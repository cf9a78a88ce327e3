"""The layer's fused kernels (RMSNorm with the residual add, rotary embedding, SiLU x up) against
the torch ops they replace, under Triton's interpreter on CPU (compiled on a GPU): within a
rounding step in fp32 and bf16, for widths that are and are not powers of two."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.triton_interpreter import DEVICE  # noqa: E402

from specdecode_worker.engine.kernels import layer_kernels as lk  # noqa: E402




@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv(lk.LAYER_KERNELS_ENV, "triton")


def _close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:  # a reduction's order and an exp's last bit
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # bf16: the same roundings, each at most a step apart (a GPU rounds to nearest as torch
        # does; the interpreter's casts to bf16 truncate), and a step of an operand is an absolute
        # error where a sum cancels: a wrong formula is off by whole units, not by these
        steps = 2 if DEVICE == "cuda" else 4
        torch.testing.assert_close(got.float(), want.float(), atol=steps * 2 ** -8, rtol=steps * 2 ** -8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (3, 4096), (0, 64)])
def test_rms_norm_with_and_without_the_residual_add(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    assert lk.use_triton(x)
    _close(lk.rms_norm(x, w, 1e-5), lk.rms_norm_reference(x, w, 1e-5), dtype)
    normed, summed = lk.rms_norm(x, w, 1e-5, residual=r)
    _close(summed, x + r, dtype)
    _close(normed, lk.rms_norm_reference(x + r, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,kv_heads,d", [(1, 4, 2, 64), (5, 9, 3, 64), (3, 32, 8, 128), (0, 4, 2, 64)])
def test_rotary_matches_the_half_split_reference(dtype, n, heads, kv_heads, d):
    g = torch.Generator().manual_seed(n * heads + d)
    q = torch.randn(n, heads * d, generator=g).to(dtype).to(DEVICE).view(n, heads, d)  # a projection's view
    k = torch.randn(n, kv_heads, d, generator=g).to(dtype).to(DEVICE)
    angles = torch.rand(n, d // 2, generator=g) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype).to(DEVICE)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype).to(DEVICE)
    got_q, got_k = lk.apply_rotary(q, k, cos, sin)
    want_q, want_k = lk.rotary_reference(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,nope,d", [(1, 4, 16, 8), (5, 16, 128, 64), (0, 4, 16, 8)])
def test_interleaved_rotary_of_mla_views_matches_its_reference(dtype, n, heads, nope, d):
    """MLA's rope: q's rope part a view of each head (after its nope part), k the shared rope key
    after the latent in one projection's rows, pairs of neighbours rotated (DeepSeek-V3's layout)."""
    g = torch.Generator().manual_seed(n * heads + d)
    q = torch.randn(n, heads, nope + d, generator=g).to(dtype).to(DEVICE)[..., nope:]
    k = torch.randn(n, 32 + d, generator=g).to(dtype).to(DEVICE)[:, None, 32:]
    angles = torch.rand(n, d // 2, generator=g) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype).to(DEVICE)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype).to(DEVICE)
    got_q, got_k = lk.apply_rotary(q, k, cos, sin, interleaved=True)
    want_q, want_k = lk.rotary_interleaved_reference(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    if n:  # the layout is not the half-split one: a kernel rotating halves would fail the check above
        assert not torch.allclose(want_q.float(), lk.rotary_reference(q, k, cos, sin)[0].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (7, 1536), (3, 2050), (0, 8)])
def test_silu_mul(dtype, shape):
    g = torch.Generator().manual_seed(shape[1])
    gate = (3 * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)
    up = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    _close(lk.silu_mul(gate, up), lk.silu_mul_reference(gate, up), dtype)


def test_views_of_fused_projections_are_read_in_place():
    """q, k and v as views of one fused projection's output, gate and up as the halves of another's
    (rows wider than each part), and a 3-D gate keeps its shape."""
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, d, inter = 5, 4, 2, 64, 96
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    angles = torch.rand(n, d // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DEVICE), torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    for got, want in zip(lk.apply_rotary(q, k, cos, sin), lk.rotary_reference(q, k, cos, sin)):
        _close(got, want, torch.float32)
    gate_up = torch.randn(n, 2 * inter, generator=g).to(DEVICE)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    _close(lk.silu_mul(gate, up), lk.silu_mul_reference(gate, up), torch.float32)
    gate3, up3 = torch.randn(2, 3, 8, generator=g).to(DEVICE), torch.randn(2, 3, 8, generator=g).to(DEVICE)
    _close(lk.silu_mul(gate3, up3), lk.silu_mul_reference(gate3, up3), torch.float32)


def test_the_torch_choice_and_cpu_without_the_interpreter_use_the_reference(monkeypatch):
    x = torch.ones(2, 8, device=DEVICE)
    monkeypatch.setenv(lk.LAYER_KERNELS_ENV, "torch")
    assert not lk.use_triton(x)
    monkeypatch.setenv(lk.LAYER_KERNELS_ENV, "")
    assert lk.use_triton(x) == x.is_cuda
