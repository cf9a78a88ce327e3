"""Our paged forward pass against transformers' forward on the same random checkpoints."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.batch import Segment, alloc_positions, forward_segments  # noqa: E402
from specdecode_worker.engine.model_runner import ModelRunner  # noqa: E402
from specdecode_worker.engine.memory.pools import MemoryPoolConfig  # noqa: E402

from devtools.tiny_models import VOCAB_SIZE, write_tiny_model  # noqa: E402

# float32 on CPU: the two implementations differ only in summation order, measured < 1e-6
# against logits of magnitude ~2; 1e-4 leaves room for other BLAS builds.
ATOL = 1e-4


def _ready_runner(path):
    runner = ModelRunner(path, device="cpu")
    runner.load_weights()
    runner.alloc_memory_pool(MemoryPoolConfig(max_total_num_tokens=128, max_running_requests=4, context_len=64))
    runner.init_backends()
    return runner


def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_paged_forward_equals_transformers(tmp_path, monkeypatch, arch, kernels):
    """With the layer's elementwise work as torch ops, and as the fused kernels a GPU runs (here
    under Triton's interpreter, which conftest turns on without a GPU)."""
    from specdecode_worker.engine.kernels import layer_kernels

    monkeypatch.setenv(layer_kernels.LAYER_KERNELS_ENV, kernels)
    if kernels == "triton" and not layer_kernels.use_triton(torch.zeros(1)):
        pytest.skip("the fused kernels run on CPU under TRITON_INTERPRET=1 only")
    path = write_tiny_model(tmp_path / arch, arch, weight_scale=3.0)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, VOCAB_SIZE, (30,), generator=g).tolist()
    b = torch.randint(0, VOCAB_SIZE, (20,), generator=g).tolist()
    ref_a, ref_b = _hf_logits(path, a), _hf_logits(path, b)

    r = _ready_runner(path)
    pool, alloc = r.req_to_token_pool, r.token_to_kv_pool_allocator
    ia, ib = pool.alloc(), pool.alloc()
    alloc_positions(pool, alloc, ia, 0, 30)
    alloc_positions(pool, alloc, ib, 0, 20)
    # Two requests batched through prefill, a mixed extend, then single-token decode steps.
    l1 = forward_segments(r, [Segment(ia, a[:25], 0), Segment(ib, b[:12], 0)], last_only=False)
    l2 = forward_segments(r, [Segment(ia, a[25:28], 25), Segment(ib, b[12:20], 12)], last_only=False)
    l3 = forward_segments(r, [Segment(ia, a[28:29], 28), Segment(ib, b[19:20], 19)], last_only=True)
    l4 = forward_segments(r, [Segment(ia, a[29:30], 29)], last_only=True)
    got_a = torch.cat([l1[:25], l2[:3], l3[:1], l4])
    got_b = torch.cat([l1[25:], l2[3:]])
    torch.testing.assert_close(got_a, ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, ref_b, atol=ATOL, rtol=0)
    # The decode step of b re-ran position 19 over a cache that already held it: same logits.
    torch.testing.assert_close(l3[1], ref_b[19], atol=ATOL, rtol=0)


def test_mistral_sliding_window_is_applied(tmp_path):
    """With the window smaller than the sequence, the late logits differ from full attention."""
    ids = list(range(4, 34))
    windowed = _hf_logits(write_tiny_model(tmp_path / "w", "mistral", sliding_window=8), ids)
    full = _hf_logits(write_tiny_model(tmp_path / "f", "mistral", sliding_window=None), ids)
    assert not torch.allclose(windowed[-1], full[-1], atol=1e-3)
    r = _ready_runner(tmp_path / "w")
    idx = r.req_to_token_pool.alloc()
    alloc_positions(r.req_to_token_pool, r.token_to_kv_pool_allocator, idx, 0, len(ids))
    ours = forward_segments(r, [Segment(idx, ids, 0)], last_only=False)
    torch.testing.assert_close(ours, windowed, atol=ATOL, rtol=0)
