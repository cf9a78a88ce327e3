"""Half-precision CPU attention as two batched products, against torch's fused attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from specdecode_worker.engine.kernels.attention import (  # noqa: E402
    GROUPED_PRODUCTS_MAX_SCORES,
    gather,
    grouped_products,
    grouped_products_serve,
)


def fused_reference(q, keys, vals, allowed, scaling):
    """torch's scaled_dot_product_attention in float64: q [B, n, H, D], keys/vals [B, S, Hkv, D]."""
    o = F.scaled_dot_product_attention(
        q.double().transpose(1, 2), keys.double().transpose(1, 2), vals.double().transpose(1, 2),
        attn_mask=allowed[:, None], scale=scaling, enable_gqa=True,
    )
    return o.transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("queries", [1, 4])
def test_grouped_products_equal_fused_attention(heads, kv_heads, queries):
    torch.manual_seed(0)
    b, s, d = 3, 37, 64
    q = torch.randn(b, queries, heads, d, dtype=torch.bfloat16)
    keys = torch.randn(b, s, kv_heads, d, dtype=torch.bfloat16)
    vals = torch.randn(b, s, kv_heads, d, dtype=torch.bfloat16)
    lengths = torch.tensor([37, 20, 5])  # each request's own keys; the rest is padding
    k_pos = torch.arange(s)
    q_pos = lengths[:, None] - queries + torch.arange(queries)[None]  # the last queries, causal
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]
    ours = grouped_products(q, keys, vals, ~allowed[:, None, None], 0.125)
    exact = fused_reference(q, keys, vals, allowed, 0.125)
    assert ours.shape == (b, queries, heads, d) and ours.dtype == torch.bfloat16
    # within bf16's rounding of the scores and of the output (values of order 1: steps of 2^-7)
    assert (ours.double() - exact).abs().max() < 0.03
    bf16_fused = fused_reference(q, keys, vals, allowed, 0.125).to(torch.bfloat16).double()
    assert (ours.double() - exact).abs().mean() < 4 * (bf16_fused - exact).abs().mean() + 2e-3


def test_grouped_products_serve_batches_in_half_precision_on_cpu_only_and_bounded():
    q = torch.empty(8, 9, 64, dtype=torch.bfloat16)
    assert grouped_products_serve(q, 8, 1, 512)
    assert not grouped_products_serve(q, 1, 1, 512)  # one request: the fused kernel measured faster
    assert not grouped_products_serve(q.float(), 8, 1, 512)  # float32: the fused kernel is faster there
    assert 8 * 9 * 512 * 2048 > GROUPED_PRODUCTS_MAX_SCORES and not grouped_products_serve(q, 8, 512, 2048)


def run_backend(dtype, prefix_lens, new_lens, sliding_window=None, seed=0):
    """A layer's attention over a paged pool for requests that hold ``prefix_lens`` cached tokens
    and bring ``new_lens`` new ones, laid out as the engine lays them out."""
    from specdecode_worker.engine.forward_batch import ForwardBatch
    from specdecode_worker.engine.kernels.attention import TorchNativeAttnBackend
    from specdecode_worker.engine.memory.pools import MHATokenToKVPool, ReqToTokenPool

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = 6, 2, 32
    req_pool = ReqToTokenPool(4, 64, "cpu")
    kv_pool = MHATokenToKVPool(256, 1, kv_heads, d, d, dtype, "cpu")
    perm = torch.randperm(255, generator=g) + 1  # scattered slots, as a used pool hands them out
    rows, positions, locs, next_slot = [], [], [], 0
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens)):
        slots = perm[next_slot:next_slot + p + n]
        next_slot += p + n
        req_pool.req_to_token[i, :p + n] = slots
        kv_pool.set_kv(0, slots[:p], torch.randn(p, kv_heads, d, generator=g).to(dtype),
                       torch.randn(p, kv_heads, d, generator=g).to(dtype))
        rows.append(i)
        positions += list(range(p, p + n))
        locs.append(slots[p:])
    total = sum(new_lens)
    fb = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64), positions=torch.tensor(positions),
        out_cache_loc=torch.cat(locs), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix_lens, new_lens)]), extend_lens=list(new_lens),
        seq_lens_cpu=[p + n for p, n in zip(prefix_lens, new_lens)],
    )
    q = torch.randn(total, heads, d, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, d, generator=g).to(dtype)
    backend = TorchNativeAttnBackend(req_pool, kv_pool, sliding_window)
    return backend.forward(q, k, v, 0, fb, d ** -0.5)


@pytest.mark.parametrize("new_lens", [[4, 1, 3], [1, 1, 1], [4, 4, 4]])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_batched_pass_equals_request_by_request(monkeypatch, new_lens, sliding_window):
    """Verification, extend and decode batches in bf16 go through the batched products; the
    request-by-request loop over torch's fused kernel (forced by a zero bound) is the reference,
    and the float32 run of the same batch bounds both."""
    from specdecode_worker.engine.kernels import attention

    prefix = [10, 25, 3]
    batched = run_backend(torch.bfloat16, prefix, new_lens, sliding_window)
    monkeypatch.setattr(attention, "GROUPED_PRODUCTS_MAX_SCORES", 0)
    looped = run_backend(torch.bfloat16, prefix, new_lens, sliding_window)
    exact = run_backend(torch.float32, prefix, new_lens, sliding_window).double()
    assert batched.shape == looped.shape == (sum(new_lens), 6, 32)
    assert (batched.double() - exact).abs().max() < 0.03
    assert (batched.double() - exact).abs().mean() < 2 * (looped.double() - exact).abs().mean() + 1e-3


def test_gather_equals_advanced_indexing():
    buf = torch.randn(100, 3, 8)
    slots = torch.randint(0, 100, (4, 7))
    assert torch.equal(gather(buf, slots), buf[slots])
    assert torch.equal(gather(buf, slots[0]), buf[slots[0]])
