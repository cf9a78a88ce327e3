"""The Triton MLA kernels (engine/kernels/triton_mla.py) against the torch-native backend over the latent pool.

DeepSeek-like dims scaled down: kv_lora_rank 64, rope 16, 4 to 20 query heads (20 leaves a partial
block of 16 heads). Without a GPU the kernels run under Triton's interpreter (tests/conftest.py and
tests/engine/test_triton_attention.py say how it is switched on); with one they run compiled.
"""

from __future__ import annotations

import pytest
from specdecode_worker.engine.kernels import triton_mla as tm  # noqa: E402
from specdecode_worker.engine.kernels.attention import TorchNativeAttnBackend  # noqa: E402
from specdecode_worker.engine.forward_batch import ForwardBatch  # noqa: E402
from specdecode_worker.engine.memory.mla_pool import MLATokenToKVPool  # noqa: E402
from specdecode_worker.engine.memory.pools import ReqToTokenPool  # noqa: E402

from tests.triton_interpreter import (  # noqa: E402, F401
    CUDA, DEVICE, E4M3_ON_DEVICE, assert_capture_makes_its_own_metadata, paged_batch, poison_dead_slots, torch, triton,
)

POOL, CTX = 520, 80
RANK, ROPE = 64, 16
WIDTH = RANK + ROPE
SCALE = 0.7 * (32 + ROPE) ** -0.5  # any softmax scale: DeepSeek's carries YaRN's mscale^2


def _pools(kv_dtype=torch.float32, seed: int = 0, num_reqs: int = 5):
    """A one-layer latent pool with random rows everywhere; each request's positions on shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(num_reqs + 1, CTX, DEVICE)
    kv = MLATokenToKVPool(POOL, 1, RANK, ROPE, kv_dtype, DEVICE)
    kv.k_buffer[0].copy_(torch.randn(POOL + 1, 1, WIDTH, generator=g).to(DEVICE, kv_dtype))
    slots = torch.randperm(POOL, generator=g) + 1
    for r in range(num_reqs + 1):
        req_pool.req_to_token[r] = slots[r * CTX : (r + 1) * CTX]
    return req_pool, kv, g


def _inputs(n: int, heads: int, g):
    q = torch.randn(n, heads, WIDTH, generator=g).to(DEVICE)
    latent = torch.randn(n, 1, WIDTH, generator=g).to(DEVICE)
    return q, latent, latent[..., :RANK]


def _compare(heads, seq_lens, extend_lens, kv_dtype=torch.float32, seed=0, atol=2e-5):
    req_pool, kv, g = _pools(kv_dtype, seed)
    fb = paged_batch(req_pool, seq_lens, extend_lens, list(range(1, len(seq_lens) + 1)))
    q, k, v = _inputs(sum(extend_lens), heads, g)
    want = TorchNativeAttnBackend(req_pool, kv, None).forward(q, k, v, 0, fb, SCALE)
    got = tm.TritonMLABackend(req_pool, kv).forward(q, k, v, 0, fb, SCALE)
    assert got.shape == (sum(extend_lens), heads, RANK)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    return got


@pytest.mark.skipif(CUDA, reason="with a GPU the kernels are compiled for it")
def test_kernels_run_under_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (tm._mla_decode_partial_kernel, tm._mla_extend_kernel):
        assert isinstance(kernel, InterpretedFunction)


@pytest.mark.parametrize("heads", [4, 20])
def test_decode_mixed_lengths(heads):
    # Lengths below, at and above one 64-key block, split over several programs and reduced; 20
    # heads span two head blocks, the second partial.
    _compare(heads, seq_lens=[1, 7, 64, 65, 80], extend_lens=[1] * 5)


def test_decode_splits_cover_every_key_whatever_their_number():
    req_pool, kv, g = _pools(seed=1)
    fb = paged_batch(req_pool, [3, 79, 40], [1, 1, 1], [1, 2, 3])
    q, _, _ = _inputs(3, 16, g)
    buf = kv.k_buffer[0]
    want = TorchNativeAttnBackend(req_pool, kv, None)._decode(q, buf, kv.v_buffer[0], fb, SCALE)
    for splits in (1, 3, 16):
        got = tm.mla_decode(q, buf, RANK, req_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, SCALE, splits)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_reads_only_live_slots():
    # Poison every slot outside the requests' live positions: a read of one would show as NaN.
    req_pool, kv, g = _pools(seed=2)
    seq_lens, reqs = [7, 30], [1, 2]
    poison_dead_slots(req_pool, reqs, seq_lens, kv.k_buffer[0])
    fb = paged_batch(req_pool, seq_lens, [1, 1], reqs)
    q, _, _ = _inputs(2, 8, g)
    out = tm.mla_decode(q, kv.k_buffer[0], RANK, req_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, SCALE, 4)
    assert torch.isfinite(out).all()
    ext = tm.mla_extend(q, kv.k_buffer[0], RANK, req_pool.req_to_token, fb.req_pool_indices,
                        torch.tensor([0, 1], device=DEVICE), torch.tensor([1, 1], device=DEVICE), fb.seq_lens,
                        fb.positions, 1, SCALE)
    assert torch.isfinite(ext).all()
    torch.testing.assert_close(ext, out, atol=2e-5, rtol=2e-5)  # the extend kernel agrees on one-token rows


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_latent_pools_are_upcast_inside_the_kernels(kv_dtype):
    if kv_dtype == torch.float8_e4m3fn and not E4M3_ON_DEVICE:
        pytest.skip("Triton has no e4m3 before sm_89 (the engine keeps torch-native there)")
    _compare(8, seq_lens=[9, 70], extend_lens=[1, 1], kv_dtype=kv_dtype)
    _compare(8, seq_lens=[9, 70], extend_lens=[9, 4], kv_dtype=kv_dtype)


@pytest.mark.parametrize("heads", [4, 16])
def test_extend_prefill_over_a_prefix_and_chain_verify_in_one_launch(heads):
    # A whole prompt, a prompt over a prefix (across 64-key blocks), and two verify rows of k + 1 = 4.
    _compare(heads, seq_lens=[20, 75, 33, 7], extend_lens=[20, 60, 4, 4], seed=3)


def test_uniform_verify_batch():
    out = _compare(4, seq_lens=[12, 50, 79], extend_lens=[4, 4, 4], seed=4)
    assert out.shape == (12, 4, RANK)


def test_half_precision_queries():
    if CUDA:  # bf16 on a GPU; the interpreter's numpy has no bf16 dot, so fp16 there
        dtype = torch.bfloat16
    else:
        dtype = torch.float16
    req_pool, kv, g = _pools(dtype, seed=5)
    fb = paged_batch(req_pool, [33, 5], [1, 1], [1, 2])
    q, k, v = (x.to(dtype) for x in _inputs(2, 4, g))
    want = TorchNativeAttnBackend(req_pool, kv, None).forward(q, k, v, 0, fb, SCALE)
    got = tm.TritonMLABackend(req_pool, kv).forward(q, k, v, 0, fb, SCALE)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_splits_and_workspace_follow_head_blocks():
    assert tm.head_blocks(128) == 8 and tm.head_blocks(20) == 2 and tm.head_blocks(4) == 1
    backend = tm.TritonMLABackend(*_pools()[:2])
    # 8 programs per request per split at 128 heads: 16 splits at batch 1 on 132 SMs, 1 at batch 64.
    backend.num_sms = 132
    assert backend.num_splits(1, 128) == 16 and backend.num_splits(64, 128) == 1
    assert tm.mla_decode_workspace_bytes(2, 128, 512, 3) == 2 * 128 * 3 * 513 * 4


def test_the_backend_choice_gives_mla_pools_the_mla_kernels(monkeypatch):
    from specdecode_worker.engine.kernels.attention import ATTENTION_BACKEND_ENV, make_attn_backend
    from specdecode_worker.engine.memory.pools import MHATokenToKVPool
    from specdecode_worker.engine.kernels.triton_backend import TritonAttnBackend

    req_pool, kv, _ = _pools()
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(make_attn_backend(req_pool, kv, None), tm.TritonMLABackend)
    mha = MHATokenToKVPool(8, 1, 2, 16, 16, torch.float32, DEVICE)
    assert isinstance(make_attn_backend(req_pool, mha, None), TritonAttnBackend)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch_native")
    assert isinstance(make_attn_backend(req_pool, kv, None), TorchNativeAttnBackend)


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="tests/gpu/test_engine_cuda.py runs the engine on a GPU")
def test_deepseek_with_mtp_gives_the_same_greedy_output_on_both_backends(tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 target with its NextN layer drafting: prefill, MTP extend, chain steps and
    k + 1 verification on the MLA kernels, through the speculator's graph buffers, MoE on the
    paths a graph captures (the expert kernel over stacked weights, every expert). The graphed
    batches keep the host-side lengths they were captured with, as a replayed CUDA graph does, so
    the output also shows that the Triton path reads lengths on the device only."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from specdecode_worker.engine.kernels.attention import ATTENTION_BACKEND_ENV
    from specdecode_worker.engine.cuda_graph import GraphInputs
    from specdecode_worker.engine.request import Request, SamplingParams

    from devtools.deepseek_models import record_static_moe, write_tiny_deepseek
    from tests.engine_helpers import engine, run_all

    model = write_tiny_deepseek(tmp_path / "ds", mtp=True)
    prompts = [[5, 9, 40, 7, 7, 12, 3 + 60], [17, 4], [90, 91, 92, 11]]

    def outputs(backend: str, graphs: bool = False):
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, backend)
        eng = engine(model, "MTP", max_running_requests=4, context_len=64, num_draft_tokens=2)
        kernels = {type(eng.target_runner.backend).__name__, type(eng.draft_runner.backend).__name__}
        assert kernels == {"TritonMLABackend" if backend == "triton" else "TorchNativeAttnBackend"}
        if graphs:
            eng.speculator.capture_graphs(4, eager=True)
        reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts])
        return [r.output_ids for r in reqs]

    want = outputs("torch_native")
    stage = GraphInputs.stage

    def stage_keeping_captured_lengths(self, fb, bs):
        stage(self, fb, bs)
        self.batch(bs).seq_lens_cpu[:] = [self.tokens_per_req] * bs  # what the capture saw

    monkeypatch.setattr(GraphInputs, "stage", stage_keeping_captured_lengths)
    paths = record_static_moe(monkeypatch)
    assert outputs("triton", graphs=True) == want
    assert set(paths) == {"chosen_experts", "every_expert"}


def test_padded_chain_batch_gives_the_ragged_rows():
    """A verify batch of mixed lengths padded to one width (what the verify graphs replay,
    batch.padded_chain_batch): its real rows equal the ragged batch's on both backends, and its
    padding rows write only the pad slot."""
    from specdecode_worker.engine.batch import PAD_SLOT, padded_chain_batch

    req_pool, kv, g = _pools(seed=4)
    starts, lengths, reqs, width = [7, 60, 30], [1, 4, 2], [1, 3, 5], 4
    ragged = paged_batch(req_pool, [s + n for s, n in zip(starts, lengths)], lengths, reqs)
    q, k, v = _inputs(sum(lengths), 16, g)
    want = TorchNativeAttnBackend(req_pool, kv, None).forward(q, k, v, 0, ragged, SCALE)
    fb, _ = padded_chain_batch(req_pool, reqs, starts, torch.zeros(3, width, dtype=torch.int64, device=DEVICE),
                               lengths, width)
    real = torch.tensor([i * width + j for i, m in enumerate(lengths) for j in range(m)], device=DEVICE)
    q_p, k_p = _inputs(len(reqs) * width, 16, g)[:2]
    q_p[real], k_p[real] = q, k
    before = kv.k_buffer[0].clone()
    for backend in (TorchNativeAttnBackend(req_pool, kv, None), tm.TritonMLABackend(req_pool, kv)):
        got = backend.forward(q_p, k_p, k_p[..., :RANK], 0, fb, SCALE)
        torch.testing.assert_close(got[real], want, atol=2e-5, rtol=2e-5)
    changed = (kv.k_buffer[0] != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [PAD_SLOT]


def test_a_graph_capture_makes_its_own_extend_metadata(monkeypatch):
    """As for the MHA kernels: an MTP verify graph captured after its warm-up computes the batch's
    metadata itself rather than reading the warm-up's tensors, freed once another batch replaces
    them."""
    req_pool, kv, g = _pools()
    fb = paged_batch(req_pool, [12, 50, 79], [4, 4, 4], [1, 2, 3])
    q, k, v = _inputs(12, 4, g)
    assert_capture_makes_its_own_metadata(monkeypatch, tm, "mla_extend", 5, tm.TritonMLABackend(req_pool, kv),
                                          q, k, v, fb, SCALE)


def test_a_tree_batch_is_refused_rather_than_attended_without_its_mask():
    from specdecode_worker.engine.kernels.tree_attention import TreeForwardBatch

    req_pool, kv, g = _pools()
    fb = paged_batch(req_pool, [12], [2], [1])
    tree = TreeForwardBatch(
        **{name: getattr(fb, name) for name in ForwardBatch.__dataclass_fields__},
        prefix_lens=torch.tensor([10], device=DEVICE), key_slots=fb.out_cache_loc[None],
        key_positions=fb.positions[None], mask=torch.ones(1, 2, 2, dtype=torch.int8, device=DEVICE),
        prefix_lens_cpu=[10],
    )
    q, k, v = _inputs(2, 4, g)
    with pytest.raises(NotImplementedError, match="tree-masked"):
        tm.TritonMLABackend(req_pool, kv).forward(q, k, v, 0, tree, SCALE)
