"""The Triton expert kernel (engine/kernels/triton_moe.py) on fp8 e4m3 weights, both ways it reads them:
converted by Triton (sm_89 and later) and decoded from their bytes with integer ops (before sm_89,
where Triton has no e4m3 type). The decoding is checked on every e4m3 value against torch's own
conversion. Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py and
tests/engine/test_triton_attention.py say how it is switched on); with one, compiled.
"""

from __future__ import annotations

import pytest
from specdecode_worker.engine.kernels import triton_moe  # noqa: E402

from tests.triton_interpreter import CUDA, DEVICE, torch  # noqa: E402, F401


@pytest.fixture(params=["converted", "decoded"])
def e4m3_path(request, monkeypatch):
    if request.param == "converted" and CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts e4m3 on sm_89 and later only")
    monkeypatch.setattr(triton_moe, "native_e4m3", lambda device: request.param == "converted")
    return request.param


def test_every_e4m3_value_is_read_exactly(e4m3_path):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but NaN
    weights = codes.view(torch.float8_e4m3fn).reshape(1, -1, 1).to(DEVICE)  # one expert, [OUT, K = 1]
    one = torch.ones((1, 1), dtype=torch.float32, device=DEVICE)
    got = triton_moe.expert_gemv(one, weights, torch.zeros(1, dtype=torch.int64, device=DEVICE), 1)
    want = weights[0, :, 0].float()
    assert torch.equal(got[0], want), (codes[got[0] != want], got[0][got[0] != want], want[got[0] != want])


def test_block_scaled_experts_match_dequantized_weights(e4m3_path):
    g = torch.Generator().manual_seed(0)
    experts, out, k, block = 4, 64, 96, (32, 32)
    weights = torch.randn(experts, out, k, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(experts, out // block[0], k // block[1], generator=g) + 0.5
    x = torch.randn(3, k, generator=g)
    ids = torch.tensor([3, 0, 3, 1, 2, 0])  # two experts per token
    got = triton_moe.expert_gemv(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), 2, scales.to(DEVICE), block)
    dequant = weights.float() * scales.repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    want = torch.stack([dequant[e] @ x[p // 2] for p, e in enumerate(ids.tolist())])
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("experts,groups,topk_group,top_k,normalise", [
    (8, 4, 2, 2, True),  # the tiny test model's
    (64, 8, 4, 8, True),  # the benchmarks' cut
    (256, 8, 4, 8, True),  # DeepSeek-V3's
    (24, 4, 3, 6, False),  # groups of 6 and 6 chosen: not powers of two; weights not normalised
])
def test_grouped_topk_matches_the_routers_torch_ops(experts, groups, topk_group, top_k, normalise):
    """The routing kernel against the router's own torch ops (transformers' DeepSeek-V3 routing): the
    same experts chosen for every token, the same weights, each expert's weight by its id."""
    from types import SimpleNamespace

    from specdecode_worker.engine.models.deepseek_v3 import Router

    config = SimpleNamespace(n_routed_experts=experts, num_experts_per_tok=top_k, n_group=groups,
                             topk_group=topk_group, norm_topk_prob=normalise, routed_scaling_factor=2.5,
                             hidden_size=16)
    router = Router(config)
    g = torch.Generator().manual_seed(experts + top_k)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.rand(experts, generator=g) * 0.5)
    logits = (torch.randn(33, experts, generator=g) * 2).to(DEVICE)
    router = router.to(DEVICE)
    want_ids, want_w = router.route(logits)
    got_ids, got_w = triton_moe.grouped_topk(logits, router.e_score_correction_bias, groups, topk_group, top_k,
                                             normalise, 2.5)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32 and got_ids.shape == (33, top_k)
    order_got, order_want = got_ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order_got.values, order_want.values)  # the same experts, in any order
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               atol=1e-6, rtol=1e-6)
    # best first: the bias-steered choice never rises along a row
    choice = torch.sigmoid(logits) + router.e_score_correction_bias
    assert (choice.gather(1, got_ids).diff(dim=-1) <= 0).all()
