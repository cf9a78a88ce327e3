"""The Triton backend on a real GPU: bf16 at real head sizes, CUDA-graph capture and replay at
other context lengths, and start-up at contextLength 8192 with the planner's graph batch; the MLA
kernels at DeepSeek-V3's sizes (latent 512 + rope 64, 128 heads, bf16 and fp8 latent cache).

Skipped where no CUDA device is visible (CI has none); run on a GPU machine with
`python -m pytest tests/gpu/test_triton_cuda.py`.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from specdecode_worker.engine.kernels.attention import TorchNativeAttnBackend  # noqa: E402
from specdecode_worker.engine.forward_batch import ForwardBatch  # noqa: E402
from specdecode_worker.engine.memory.pools import MHATokenToKVPool, ReqToTokenPool  # noqa: E402

CTX = 8192
D = 128


def _setup(batch: int, kv_heads: int, group: int, pool: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    req_pool = ReqToTokenPool(batch + 1, CTX, "cuda")
    kv = MHATokenToKVPool(pool, 1, kv_heads, D, D, dtype, "cuda")
    kv.k_buffer[0].copy_(torch.randn(pool + 1, kv_heads, D, device="cuda", generator=g).to(dtype))
    kv.v_buffer[0].copy_(torch.randn(pool + 1, kv_heads, D, device="cuda", generator=g).to(dtype))
    slots = torch.randperm(pool, device="cuda", generator=g) + 1
    for r in range(batch + 1):
        req_pool.req_to_token[r] = slots[(r * CTX) % (pool - CTX) : (r * CTX) % (pool - CTX) + CTX]
    q = torch.randn(batch, kv_heads * group, D, device="cuda", generator=g).to(dtype)
    return req_pool, kv, q


def _decode_batch(seq_lens: list[int]) -> ForwardBatch:
    b = len(seq_lens)
    reqs = torch.arange(1, b + 1, device="cuda")
    return ForwardBatch(input_ids=torch.zeros(b, dtype=torch.int64, device="cuda"),
                        positions=torch.tensor(seq_lens, device="cuda") - 1,
                        out_cache_loc=torch.zeros(b, dtype=torch.int64, device="cuda"), req_pool_indices=reqs,
                        seq_lens=torch.tensor(seq_lens, device="cuda"), extend_lens=[1] * b, seq_lens_cpu=seq_lens)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_bf16_decode_at_real_sizes_matches_torch_native(group):
    from specdecode_worker.engine.kernels.triton_attention import decode_attention

    req_pool, kv, q = _setup(6, 8 // group if group < 8 else 1, group, 3 * CTX)
    fb = _decode_batch([1, 100, 1000, 4097, 7000, 8192])
    want = TorchNativeAttnBackend(req_pool, kv, None)._decode(q, kv.k_buffer[0], kv.v_buffer[0], fb, D ** -0.5)
    got = decode_attention(q, kv.k_buffer[0], kv.v_buffer[0], req_pool.req_to_token, fb.req_pool_indices,
                           fb.seq_lens, D ** -0.5, None, 16)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_one_captured_graph_serves_every_context_length():
    """Captured at length 16, replayed at 8192: the kernels read seq_lens at replay."""
    from specdecode_worker.engine.kernels.triton_backend import TritonAttnBackend

    req_pool, kv, q = _setup(4, 2, 4, 3 * CTX)
    backend = TritonAttnBackend(req_pool, kv, None)
    fb = _decode_batch([16, 16, 16, 16])
    k_new = torch.zeros(4, 2, D, device="cuda", dtype=torch.bfloat16)
    static_q = q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(static_q, k_new, k_new, 0, fb, D ** -0.5)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(static_q, k_new, k_new, 0, fb, D ** -0.5)
    reference = TorchNativeAttnBackend(req_pool, kv, None)
    for lengths in ([16, 16, 16, 16], [1, 300, 5000, 8192], [8192] * 4):
        fb.seq_lens.copy_(torch.tensor(lengths, device="cuda"))
        fb.positions.copy_(fb.seq_lens - 1)
        graph.replay()
        fb.seq_lens_cpu = lengths
        want = reference._decode(static_q, kv.k_buffer[0], kv.v_buffer[0], fb, D ** -0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_engine_starts_at_context_8192_with_the_planners_graph_batch(tmp_path):
    """The plan's default cudaGraphMaxBs for this GPU is captured at contextLength 8192, and the
    caching allocator's peak beyond weights and pools stays within the plan's reserves."""
    from specdecode_worker.serving import serve_cli
    from specdecode_worker.engine.request import Request, SamplingParams
    from specdecode_worker.engine.engine import Engine

    from devtools.tiny_models import write_tiny_model

    target = write_tiny_model(tmp_path / "t", "llama", seed=0, hidden_size=512, intermediate_size=1024,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                              max_position_embeddings=8192)
    engine_args, plan = serve_cli.resolve(serve_cli.parser().parse_args(
        ["--target", str(target), "--algorithm", "NONE", "--device", "cuda", "--context-length", "8192"]))
    torch.cuda.reset_peak_memory_stats()
    eng = Engine(engine_args)
    eng.init_model_worker()
    runner = eng.target_runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.max_bs == plan.reserve.cuda_graph_max_bs
    reqs = [Request(list(range(5, 5 + n)), SamplingParams(max_tokens=8, ignore_eos=True)) for n in (3, 700, 4000)]
    for r in reqs:
        eng.submit(r)
    while not all(r.done.is_set() for r in reqs):
        eng.step()
    static = runner.weight_bytes + runner.token_to_kv_pool.nbytes() + runner.req_to_token_pool.nbytes()
    reserve = plan.reserve
    measured = torch.cuda.max_memory_reserved() - static
    print(f"dynamic bytes: planned {reserve.dynamic_bytes}, measured {measured} (cuBLAS workspaces included, "
          f"which the runtime reserve of {reserve.runtime_bytes} covers)")
    # The allocator's peak stays inside what the plan leaves beyond weights and pools.
    assert measured <= reserve.dynamic_bytes + reserve.runtime_bytes
    # Phase 3's warm-up (largest chunk, largest graph batch) measured its own peak against the plan.
    peak = eng.dynamic_peak
    print(f"warm-up: planned {peak.planned}, measured {peak.measured} ({peak.note})")
    assert peak.planned == reserve.dynamic_bytes and peak.measured is not None
    assert peak.measured <= peak.planned


# ---- MLA (DeepSeek-V3's absorbed attention over the latent pool) at its real sizes -------------------
MLA_RANK, MLA_ROPE, MLA_HEADS = 512, 64, 128


def _mla_setup(seq_lens: list[int], extend_lens: list[int], kv_dtype=torch.bfloat16, seed: int = 0):
    from specdecode_worker.engine.memory.mla_pool import MLATokenToKVPool

    g = torch.Generator(device="cuda").manual_seed(seed)
    pool = 3 * CTX
    req_pool = ReqToTokenPool(len(seq_lens) + 1, CTX, "cuda")
    kv = MLATokenToKVPool(pool, 1, MLA_RANK, MLA_ROPE, kv_dtype, "cuda")
    kv.k_buffer[0].copy_(torch.randn(pool + 1, 1, MLA_RANK + MLA_ROPE, device="cuda", generator=g).to(kv_dtype))
    slots = torch.randperm(pool, device="cuda", generator=g) + 1
    positions, locs = [], []
    for r, (s, n) in enumerate(zip(seq_lens, extend_lens), start=1):
        start = (r * CTX) % (pool - CTX)
        req_pool.req_to_token[r] = slots[start : start + CTX]
        positions += list(range(s - n, s))
        locs.append(req_pool.req_to_token[r, s - n : s])
    b, n = len(seq_lens), sum(extend_lens)
    fb = ForwardBatch(input_ids=torch.zeros(n, dtype=torch.int64, device="cuda"),
                      positions=torch.tensor(positions, device="cuda"), out_cache_loc=torch.cat(locs),
                      req_pool_indices=torch.arange(1, b + 1, device="cuda"),
                      seq_lens=torch.tensor(seq_lens, device="cuda"), extend_lens=extend_lens, seq_lens_cpu=seq_lens)
    q = torch.randn(n, MLA_HEADS, MLA_RANK + MLA_ROPE, device="cuda", generator=g).to(torch.bfloat16)
    latent = torch.randn(n, 1, MLA_RANK + MLA_ROPE, device="cuda", generator=g).to(torch.bfloat16)
    return req_pool, kv, fb, q, latent


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("extend", [False, True])
def test_mla_kernels_at_deepseek_sizes_match_torch_native(kv_dtype, extend):
    from specdecode_worker.engine.kernels.triton_mla import TritonMLABackend

    if kv_dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton has no e4m3 before sm_89")
    seq_lens = [1, 100, 1000, 4097, 8192] if not extend else [300, 2048, 8192, 17]
    extend_lens = [1] * 5 if not extend else [300, 1000, 4, 4]  # a prompt, a prompt over a prefix, verify
    req_pool, kv, fb, q, latent = _mla_setup(seq_lens, extend_lens, kv_dtype)
    scale = 0.1352
    want = TorchNativeAttnBackend(req_pool, kv, None).forward(q, latent, latent[..., :MLA_RANK], 0, fb, scale)
    got = TritonMLABackend(req_pool, kv).forward(q, latent, latent[..., :MLA_RANK], 0, fb, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_one_captured_mla_graph_serves_every_context_length():
    """Decode captured at length 16, replayed at lengths up to 8192 (seq_lens read at replay)."""
    from specdecode_worker.engine.kernels.triton_mla import TritonMLABackend

    req_pool, kv, fb, q, latent = _mla_setup([16] * 4, [1] * 4)
    backend = TritonMLABackend(req_pool, kv)
    fb.out_cache_loc.zero_()  # the new rows go to the padding slot: the pool stays as set up
    latent.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, latent, latent[..., :MLA_RANK], 0, fb, 0.1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, latent, latent[..., :MLA_RANK], 0, fb, 0.1)
    reference = TorchNativeAttnBackend(req_pool, kv, None)
    for lengths in ([16] * 4, [1, 300, 5000, 8192], [8192] * 4):
        fb.seq_lens.copy_(torch.tensor(lengths, device="cuda"))
        fb.positions.copy_(fb.seq_lens - 1)
        graph.replay()
        fb.seq_lens_cpu = lengths
        want = reference._decode(q, kv.k_buffer[0], kv.v_buffer[0], fb, 0.1)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_mla_verify_graphs_replay_right_after_their_warm_up_tensors_are_reused():
    """Verify graphs captured as an MTP deployment captures them (largest batch first, each after
    a warm-up pass, then the smaller ones): no graph may read a tensor of its warm-up, freed once
    the next size replaced it. Replayed after the allocator has handed memory out again, a real
    batch of three chains matches torch-native attention."""
    from specdecode_worker.engine.cuda_graph import GraphRunner
    from specdecode_worker.engine.kernels.triton_mla import TritonMLABackend

    width, W = 4, MLA_RANK + MLA_ROPE
    req_pool, kv, fb, q, latent = _mla_setup([300, 2048, 17], [width] * 3)
    backend = TritonMLABackend(req_pool, kv)

    def verify(batch, rows, q_flat, latent_flat):
        rows_latent = latent_flat.view(-1, 1, W)
        return backend.forward(q_flat.view(-1, MLA_HEADS, W), rows_latent, rows_latent[..., :MLA_RANK], 0, batch, 0.1)

    graphs = GraphRunner(verify, 4, "cuda", width, extra_widths=(MLA_HEADS * W, W), extra_dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    litter = [torch.full((n,), 1 << 40, dtype=torch.int64, device="cuda") for n in (3, 4, 5, 8, 16) for _ in range(64)]
    got = graphs.replay(fb, q.reshape(len(q), -1), latent.reshape(len(q), -1))[0]
    want = TorchNativeAttnBackend(req_pool, kv, None).forward(q, latent, latent[..., :MLA_RANK], 0, fb, 0.1)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    del litter


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_kernel_at_deepseek_sizes_matches_the_routed_moe(fp8):
    """The graphs' MoE paths at the benchmark's DeepSeek-V3 cut (hidden 7168, 64 experts of 2048,
    8 per token, bf16 compute; bf16 or the release's fp8 128 x 128 block-quantized weights): the
    expert kernel over stacked weights (8 and 56 pairs) and every expert."""
    transformers = pytest.importorskip("transformers")
    from specdecode_worker.engine.parallel.distributed import SINGLE
    from specdecode_worker.engine.models.deepseek_v3 import Linears, MoE

    from devtools.deepseek_models import TINY

    quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    config = transformers.DeepseekV3Config(**{**TINY, "hidden_size": 7168, "moe_intermediate_size": 2048,
                                              "n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 8,
                                              "topk_group": 4, **(quant if fp8 else {})})
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(config, Linears(config, SINGLE))
    for name, p in moe.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            p.copy_(torch.randn(p.shape, device="cuda").to(p.dtype))
        elif name.endswith("weight_scale_inv"):
            p.copy_(torch.rand(p.shape, device="cuda") * 0.02 + 0.01)
        else:
            p.data = torch.randn(p.shape, device="cuda", dtype=torch.bfloat16) * 0.02
    assert moe.stack_experts()
    for tokens in (1, 7):
        x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
        experts, weights = moe.gate(x)
        routed = moe.routed(x, experts, weights).float()
        for got in (moe.chosen_experts(x, experts, weights), moe.every_expert(x, experts, weights)):
            torch.testing.assert_close(got.float(), routed, atol=2e-2, rtol=2e-2)
