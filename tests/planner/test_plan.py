"""Plan arithmetic against hand computation (research notes §5), the fit search, the overrides,
the older accountings, the JSON contract and the device catalogue."""

import copy
import json
import math
import sys

import pytest

from specdecode_worker import devices
from specdecode_worker.contract import (
    GIB,
    MIB,
    PLAN_API_VERSION,
    MemoryPlan,
    kv_token_capacity,
    to_json,
    validate_plan,
)
from specdecode_worker.devices import GPU_PRODUCTS, product_memory_bytes, resolve_device_memory
from specdecode_worker.errors import InputError
from specdecode_worker.planner.plan import (
    Candidate,
    ForwardGeometry,
    PlanRequest,
    build_plan,
    default_serving_limits,
    dynamic_reserve_bytes,
    runtime_reserve_bytes,
)
H100 = 81_559 * MIB

# Llama-3.1-8B-Instruct + EAGLE3 head (see test_checkpoint for the byte counts)
LLAMA8B_W, EAGLE3_W = 16_060_522_496, 849_763_584
# Qwen2.5-7B-Instruct + Qwen2.5-0.5B-Instruct
QWEN7B_W, QWEN05B_W = 15_231_233_024, 988_065_536


# hidden, intermediate, heads, KV heads, head dims, vocabulary, bf16
LLAMA8B_GEOMETRY = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 128_256, 2)
EAGLE3_GEOMETRY = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 32_000, 2)


def request(**kw):
    base = dict(algorithm="EAGLE3", target_name="t", draft_name="d", gpu_memory_bytes=H100, gpu_total_bytes=H100,
                gpu_source="override", gpu_name="test", kv_cache_dtype="bfloat16", draft_num_layers=1,
                target_num_layers=32, target_vocab_size=128256, min_tokens=131072, context_length=131072,
                target_geometry=LLAMA8B_GEOMETRY, draft_geometry=EAGLE3_GEOMETRY)
    base.update(kw)
    return PlanRequest(**base)


def eagle3_candidates(tp):
    # per GPU, as test_checkpoint establishes for tp=1; divided evenly here (the fit search only needs monotone terms)
    return Candidate(tp, LLAMA8B_W // tp, EAGLE3_W // tp, 131_072 // tp, 4_096 // tp)


def test_kv_token_capacity_formula_and_clamp():
    assert kv_token_capacity(100_000, 0.5, 10_000, 5_000, 1_000, 300, 34) == math.floor((50_000 - 16_000) / 334)
    assert kv_token_capacity(100_000, 0.1, 10_000, 5_000, 1_000, 300, 34) == 0
    with pytest.raises(ValueError):
        kv_token_capacity(100_000, 0.5, 0, 0, 0, 0, 0)


def test_notes_worked_examples_by_hand():
    g = 79 * GIB  # the notes' pre-load memory on an H100
    # §5.1: Llama-3.1-8B + EAGLE3 after the fix, f = 0.835, draft bytes without the vocab maps, no runtime term
    assert kv_token_capacity(g, 0.835, LLAMA8B_W, 849_379_328, 0, 131_072, 4_096) == 398_907
    # before the fix: target-only at f = 0.810
    assert kv_token_capacity(g, 0.810, LLAMA8B_W, 0, 0, 131_072, 0) == 401_674
    # §5.2: Qwen 7B + 0.5B standalone, exact draft cell vs SGLang's layer-ratio cell
    assert kv_token_capacity(g, 0.835, QWEN7B_W, QWEN05B_W, 0, 57_344, 12_288) == 784_267
    assert kv_token_capacity(g, 0.835, QWEN7B_W, QWEN05B_W, 0, 106_496, 0) == 512_789
    assert int(57_344 * (1 + 24 / 28)) == 106_496


def test_golden_eagle3_plan_with_runtime_reserve():
    g = 79 * GIB
    plan = build_plan(request(gpu_memory_bytes=g, mem_fraction_static=0.835), eagle3_candidates, [1])
    kv = plan["kvCache"]
    # (79 GiB x 0.835 - 16,060,522,496 - 849,763,584 - 1 GiB) / (131,072 + 4,096)
    assert kv["maxTotalNumTokens"] == 390_960
    assert plan["reserve"]["runtimeBytes"] == GIB
    assert plan["fits"] and plan["shortfallBytes"] == 0
    # same geometry: SGLang's scaled cell prices the EAGLE3 layer exactly
    assert plan["layerRatio"] == {"maxTotalNumTokens": 390_960, "bytesPerToken": 135_168}
    # target-only: (79 GiB x 0.835 - W_t - 1 GiB) / 131,072, then the draft on top
    legacy = math.floor((g * 0.835 - LLAMA8B_W - GIB) / 131_072)
    assert plan["legacy"]["maxTotalNumTokens"] == legacy == 409_661
    dyn = plan["reserve"]["dynamicBytes"]
    assert plan["legacy"]["peakBytes"] == LLAMA8B_W + EAGLE3_W + GIB + legacy * 135_168 + dyn
    validate_plan(plan)


def test_standalone_draft_priced_with_its_own_geometry_beats_layer_ratio():
    g = 79 * GIB
    req = request(algorithm="STANDALONE", gpu_memory_bytes=g, mem_fraction_static=0.835, draft_num_layers=24,
                  target_num_layers=28, target_vocab_size=152064, min_tokens=32768, context_length=32768)
    plan = build_plan(req, {1: Candidate(1, QWEN7B_W, QWEN05B_W, 57_344, 12_288)}, [1])
    ours = plan["kvCache"]["maxTotalNumTokens"]
    ratio = plan["layerRatio"]["maxTotalNumTokens"]
    assert ours == math.floor((g * 0.835 - QWEN7B_W - QWEN05B_W - GIB) / 69_632) == 768_846
    assert ratio == math.floor((g * 0.835 - QWEN7B_W - QWEN05B_W - GIB) / 106_496) == 502_707
    assert plan["layerRatio"]["bytesPerToken"] == 106_496
    assert ours / ratio > 1.5  # the layer-ratio cell leaves a third of the capacity unused


def test_default_fraction_from_the_dynamic_reserve_by_hand():
    plan = build_plan(request(), eagle3_candidates, [1, 2, 4, 8])
    # Llama-3.1-8B per token at a layer's peak, bf16: 3 x 4096 (residual, normed, output)
    # + 32 x 128 + 8 x 256 (q, k, v) + 32 x 128 (attention output) + 3 x 14,336 (gate, up, product)
    token = 2 * (3 * 4096 + 32 * 128 + 8 * 256 + 32 * 128 + 3 * 14_336)
    assert token == LLAMA8B_GEOMETRY.token_bytes(1) == EAGLE3_GEOMETRY.token_bytes(1) == 131_072
    # H100 tiers: chunk 8192, graph bs 256 = max running; verify rows 256 x 4. Eager pass: the larger
    # of the chunk's activations and one sampling block with every filter on (40 bytes per row and
    # vocabulary entry; 256 MiB hold 13 requests of 4 rows, or 52 single rows), the distributions
    # the verify rows drew from (fp32), the verify batch's logits (bf16 + fp32), the chunk's three
    # EAGLE3 feature hiddens.
    assert 2**28 // (40 * 4 * 128_256) == 13 and 2**28 // (40 * 128_256) == 52
    assert 52 * 128_256 * 40 < 8192 * token
    # The pass also holds split-KV partials (fp32, 128 values and a log-sum-exp per row, head and
    # split) where requests bring at most 64 / 4 = 16 new tokens: most at 256 such requests (4,096
    # rows, whole within the chunk), 1 split each (256 x 8 KV heads fill 2 x 160 SMs).
    eager = 8192 * token + 4096 * 32 * 129 * 4
    eager += 1024 * 128_256 * 4 + 1024 * 128_256 * (2 + 4) + 8192 * 3 * 4096 * 2
    # The target's graphs up to batch 256, sized by the verify graphs (1024 rows: activations, logits,
    # split-KV partials of 1 split at batch 256, where rows x splits peak; three feature hiddens per
    # row), the head's extend graphs (1024 rows of activations and staged features, logits of each
    # request's last row over its 32,000-entry vocabulary, partials as the verify graphs') and its
    # draft-step graphs (activations, logits, split-KV partials of 16 splits).
    verify_partials = 1024 * 32 * 129 * 4
    graphs = 1024 * token + 1024 * 128_256 * 6 + verify_partials + 1024 * 3 * 4096 * 2
    graphs += 1024 * (token + 3 * 4096 * 2) + 256 * 32_000 * 6 + verify_partials
    graphs += 256 * token + 256 * 32_000 * 6 + 256 * 32 * 16 * 129 * 4
    dyn = math.ceil(1.25 * (eager + graphs))
    assert dyn == 4_995_153_920
    # Plus cuBLAS's four workspaces (two threads; the default, graph warm-up and capture streams),
    # at Hopper's 32 MiB for a GPU the catalogue does not name.
    blas = 4 * 4096 * 8 * 1024
    assert plan["reserve"]["blasWorkspaceBytes"] == blas == 134_217_728
    assert plan["reserve"]["dynamicBytes"] == dyn + blas
    assert plan["memFractionStatic"] == math.floor((1 - (dyn + blas) / H100) * 1000) / 1000 == 0.94
    assert plan["tensorParallelSize"] == 1 and plan["minTensorParallelSize"] == 1


def test_serving_tiers_and_reserves():
    assert default_serving_limits(15_360 * MIB, 1) == (2048, 8)  # T4
    assert default_serving_limits(23_034 * MIB, 1) == (2048, 24)  # L4
    assert default_serving_limits(46_068 * MIB, 4) == (4096, 160)  # L40S
    assert default_serving_limits(H100, 1) == (8192, 256)
    assert default_serving_limits(143_771 * MIB, 8) == (8192, 512)  # H200
    assert default_serving_limits(183_359 * MIB, 8) == (16384, 512)  # B200
    assert runtime_reserve_bytes(1) == GIB and runtime_reserve_bytes(8) == 2 * GIB
    tiny = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 4)
    token = 4 * (3 * 64 + 4 * 16 + 2 * 32 + 4 * 16 + 3 * 128)
    decode_graph = 8 * token + 8 * 1000 * 8 + 8 * 4 * 16 * 17 * 4
    # Split-KV partials of passes of few new tokens per request: fp32, 16 values and a log-sum-exp
    # per row, head and split. These batches are far from filling 2 x 160 SMs with 2 KV heads, so
    # every request takes 16 splits (one more for a tree's nodes; none here).
    partial = 4 * 17 * 4
    eager_partials = 4 * 32 * 16 * partial  # 4 requests of up to 64 / 2 = 32 new tokens
    # 8 requests x 4 rows with their partials, sharing the decode pool
    verify_graph = 8 * 4 * token + 8 * 4 * 1000 * 8 + 8 * 4 * 16 * partial
    assert tiny.token_bytes(1) == token and verify_graph > decode_graph
    # NGRAM: no draft; the verify batch (4 x 4 rows) is smaller than the chunk, and samples in one
    # block (40 B per row and vocabulary entry) beside the fp32 distributions its rows drew from
    assert dynamic_reserve_bytes("NGRAM", tiny, None, 1, 512, 8, 4) == math.ceil(
        1.25 * (max(512 * token + eager_partials, 16 * 1000 * 40) + 16 * 1000 * 4 + 16 * 1000 * 8 + verify_graph))
    # STANDALONE: a larger draft (4 KV heads of 32) sets the chunk's activations and partials (4
    # requests of up to 64 tokens), and has its own graph pool: decode steps, and first steps over
    # two tokens with the last one's logits, whose partials peak at 7 requests (14 rows x 12 splits)
    big = ForwardGeometry(128, 512, 4, 4, 32, 32, 1000, 4)
    big_partial = 4 * 33 * 4
    first_step = 16 * big.token_bytes(1) + 8 * 1000 * 8 + 14 * 12 * big_partial
    assert dynamic_reserve_bytes("STANDALONE", tiny, big, 1, 512, 8, 4, verify_tokens=5) == math.ceil(
        1.25 * (max(512 * big.token_bytes(1) + 4 * 64 * 16 * big_partial, 20 * 1000 * 40) + 20 * 1000 * (4 + 8)
                + tiny.verify_pool_bytes(8, 5, 1) + big.graph_pool_bytes(8, 1) + first_step))
    # EAGLE3: the target's verify graphs (returning 3 x hidden features per row), the head's extend
    # graphs (4 rows per request with their staged features, the last row's logits, partials as the
    # verify graphs') and its draft-step graphs
    extend_graph = 8 * 4 * (token + 3 * 64 * 4) + 8 * 1000 * 8 + 8 * 4 * 16 * partial
    assert dynamic_reserve_bytes("EAGLE3", tiny, tiny, 1, 512, 8, 4) == math.ceil(
        1.25 * (max(512 * token + eager_partials, 16 * 1000 * 40) + 16 * 1000 * (4 + 8) + 512 * 3 * 64 * 4
                + verify_graph + 32 * 3 * 64 * 4 + extend_graph + decode_graph))
    # tensor parallelism shards heads and the MLP, not the hidden stream
    assert LLAMA8B_GEOMETRY.token_bytes(8) == 2 * (3 * 4096 + 4 * 128 + 1 * 256 + 4 * 128 + 3 * 1792)


def test_mla_and_mtp_reserve_by_hand():
    # DeepSeek-V3 at t = 8, bf16: 16 heads per GPU; absorbed MLA prices five latent-wide (512 + 64)
    # tensors per head (q, rope part, absorbed query, its concatenation, attended latent), the
    # lifted output (v_head_dim 128), the latent row twice; the dense MLP's 18,432 split 8 ways.
    ds = ForwardGeometry(7168, 18_432, 128, 128, 56, 128, 129_280, 2, kv_lora_rank=512, qk_rope_head_dim=64)
    assert ds.token_bytes(8) == 2 * (3 * 7168 + 16 * (5 * 576 + 128) + 2 * 576 + 3 * 2304) == 155_392
    # split-KV partials hold the 512-wide latent (plus one log-sum-exp) per head and split
    assert ds.decode_workspace_bytes(8, 8) == 8 * 16 * 16 * 513 * 4 == 4_202_496
    # MTP: the target's decode and verify graphs share a pool (the larger), the verify graphs also
    # return one hidden per row, and the NextN layer, sharded with the target, has draft-step graphs.
    tiny = ForwardGeometry(64, 96, 4, 4, 16, 16, 160, 4, kv_lora_rank=16, qk_rope_head_dim=8)
    token = 4 * (3 * 64 + 2 * (5 * 24 + 16) + 2 * 24 + 3 * 48)  # t = 2: two heads, MLP halves
    assert tiny.token_bytes(2) == token == 2624
    # float32 logits gathered over 2 ranks: an 80-column shard, the 2 gathered and their
    # concatenation live together, 5 x 80 x 4 = 1,600 bytes per row (more than 160 x 4 + 160 x 4)
    logit_row = 5 * 80 * 4
    decode_graph = 8 * token + 8 * logit_row + 8 * 2 * 16 * 17 * 4
    verify_graph = 8 * 4 * token + 8 * 4 * logit_row
    # the chunk (larger than the verify rows' sampling), their fp32 distributions, the verify logits,
    # the chunk's hiddens
    assert 512 * token > 32 * 160 * 40
    eager = 512 * token + 32 * 160 * 4 + 32 * logit_row + 512 * 64 * 4
    # the NextN layer's extend graphs: 4 rows per request with the target's hidden staged, the last
    # row's logits (MLA attention has no split-KV partials here)
    extend_graph = 8 * 4 * (token + 64 * 4) + 8 * logit_row
    graphs = verify_graph + 32 * 64 * 4 + extend_graph + decode_graph
    assert dynamic_reserve_bytes("MTP", tiny, tiny, 2, 512, 8, 8) == math.ceil(1.25 * (eager + graphs)) == 2_307_200


def test_auto_tp_picks_the_smallest_size_that_holds_the_floor():
    # 70B on 80 GB GPUs: 141 GB of weights cannot fit on 1 or 2
    def cand(tp):
        return Candidate(tp, 141_107_412_992 // tp, 0, 327_680 // tp, 0)

    req = request(algorithm="NGRAM", draft_name=None, draft_num_layers=0, target_num_layers=80)
    plan = build_plan(req, cand, [1, 2, 4, 8])
    assert plan["tensorParallelSize"] == 4 and plan["fits"]
    assert plan["weights"]["targetBytes"] == 141_107_412_992 // 4
    forced = build_plan(request(algorithm="NGRAM", draft_name=None, tp=2, target_num_layers=80), cand, [1, 2, 4, 8])
    assert not forced["fits"] and forced["minTensorParallelSize"] == 4
    assert "fits with --tp 4" in forced["message"]


def test_misfit_reports_shortfall_and_the_smallest_fraction_that_fits():
    l4 = 23_034 * MIB
    # a 32k-token prefill chunk: its activations are what leave too little for the floor on one L4
    req = request(gpu_memory_bytes=l4, gpu_total_bytes=l4, tp=1, min_tokens=32768, context_length=32768,
                  chunked_prefill_size=32768)
    plan = build_plan(req, eagle3_candidates, [1, 2, 4, 8])
    assert not plan["fits"] and plan["minTensorParallelSize"] == 2
    f = plan["memFractionStatic"]
    budget = l4 * f - LLAMA8B_W - EAGLE3_W - GIB
    assert plan["shortfallBytes"] == math.ceil(32768 * 135_168 - budget)
    min_f = plan["minMemFractionStatic"]
    assert min_f == math.ceil((32768 * 135_168 + LLAMA8B_W + EAGLE3_W + GIB) / l4 * 1000) / 1000 == 0.928
    assert f < min_f < 1
    assert build_plan(request(gpu_memory_bytes=l4, gpu_total_bytes=l4, tp=1, min_tokens=32768,
                              mem_fraction_static=min_f), eagle3_candidates, [1])["fits"]
    assert not build_plan(request(gpu_memory_bytes=l4, gpu_total_bytes=l4, tp=1, min_tokens=32768,
                                  mem_fraction_static=min_f - 0.001), eagle3_candidates, [1])["fits"]
    assert "--mem-fraction-static 0.928" in plan["message"]
    validate_plan(plan)


def test_nothing_fits_plans_the_largest_size_and_says_so():
    req = request(gpu_memory_bytes=4 * GIB, gpu_total_bytes=4 * GIB)
    plan = build_plan(req, eagle3_candidates, [1, 2, 4, 8])
    assert not plan["fits"] and plan["tensorParallelSize"] == 8 and plan["minTensorParallelSize"] is None
    assert "no tensor-parallel size up to 8 fits" in plan["message"]


def test_gpu_smaller_than_the_dynamic_reserve_still_gives_a_valid_plan():
    plan = build_plan(request(gpu_memory_bytes=256 * MIB, gpu_total_bytes=256 * MIB), eagle3_candidates, [1])
    assert plan["reserve"]["dynamicBytes"] > 256 * MIB
    assert not plan["fits"] and plan["kvCache"]["maxTotalNumTokens"] == 0 and plan["memFractionStatic"] == 0.001
    validate_plan(plan)


def test_max_total_tokens_caps_the_pools_and_keeps_the_identity():
    plan = build_plan(request(max_total_tokens=200_000), eagle3_candidates, [1])
    assert plan["kvCache"]["maxTotalNumTokens"] == 200_000
    assert plan["memFractionStatic"] < build_plan(request(), eagle3_candidates, [1])["memFractionStatic"]
    validate_plan(plan)
    uncapped = build_plan(request(max_total_tokens=10_000_000), eagle3_candidates, [1])
    default = build_plan(request(), eagle3_candidates, [1])
    assert uncapped["kvCache"]["maxTotalNumTokens"] == default["kvCache"]["maxTotalNumTokens"]


def test_kv_cache_memory_sets_the_budget_directly():
    plan = build_plan(request(kv_cache_memory_bytes=20 * GIB), eagle3_candidates, [1])
    assert plan["kvCache"]["maxTotalNumTokens"] == 20 * GIB // 135_168 == 158_875
    assert plan["memFractionStatic"] == pytest.approx((20 * GIB + LLAMA8B_W + EAGLE3_W + GIB) / H100)
    validate_plan(plan)
    # a budget that eats the dynamic reserve does not fit
    greedy = build_plan(request(kv_cache_memory_bytes=62 * GIB), eagle3_candidates, [1])
    assert not greedy["fits"] and greedy["shortfallBytes"] > 0


def test_ngram_has_no_draft_pool():
    req = request(algorithm="NGRAM", draft_name=None, draft_num_layers=0)
    plan = build_plan(req, lambda tp: Candidate(tp, LLAMA8B_W, 0, 131_072, 0), [1])
    assert plan["kvCache"]["draftBytesPerToken"] == 0 and plan["weights"]["draftBytes"] == 0
    assert plan["layerRatio"]["bytesPerToken"] == 131_072
    assert plan["legacy"]["maxTotalNumTokens"] == plan["kvCache"]["maxTotalNumTokens"]


def test_compact_json_stays_under_the_termination_log_limit():
    plan = build_plan(request(gpu_memory_bytes=8 * GIB, target_name="x" * 200, draft_name="y" * 200),
                      eagle3_candidates, [1, 2, 4, 8])
    assert len(to_json(plan).encode()) < 4096
    huge = build_plan(request(target_name="x" * 1500, draft_name="y" * 1500, gpu_name="z" * 500),
                      eagle3_candidates, [1])
    assert len(to_json(huge).encode()) < 4096
    assert len(huge["target"]) == 128 and huge["target"].endswith("...")
    validate_plan(huge)
    assert json.loads(to_json(plan)) == plan


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.pop("fits"), "missing required key 'fits'"),
        (lambda p: p["kvCache"].pop("draftNumLayers"), "missing required key 'kvCache.draftNumLayers'"),
        (lambda p: p["weights"].__setitem__("targetBytes", 1.5), "key 'weights.targetBytes' must be int"),
        (lambda p: p.__setitem__("tensorParallelSize", True), "key 'tensorParallelSize' must be int"),
        (lambda p: p.__setitem__("shortfallBytes", -1), "must be a non-negative integer"),
        (lambda p: p.__setitem__("apiVersion", "v1"), f"apiVersion must be '{PLAN_API_VERSION}'"),
        (lambda p: p.__setitem__("kind", "Plan"), "kind must be 'MemoryPlan'"),
        (lambda p: p.__setitem__("algorithm", "MEDUSA"), "algorithm must be one of"),
        (lambda p: p["kvCache"].__setitem__("maxTotalNumTokens", p["kvCache"]["maxTotalNumTokens"] + 2),
         "kvCache.maxTotalNumTokens is"),
        (lambda p: p.__setitem__("message", "m" * 5000), "over the 4096-byte limit"),
    ],
)
def test_validate_plan_rejects_what_breaks_the_contract(mutate, message):
    plan = build_plan(request(), eagle3_candidates, [1])
    validate_plan(copy.deepcopy(plan))
    mutate(plan)
    with pytest.raises(ValueError, match=message):
        validate_plan(plan)


def test_identity_tolerates_one_token():
    plan = build_plan(request(), eagle3_candidates, [1])
    plan["kvCache"]["maxTotalNumTokens"] += 1
    validate_plan(plan)


def test_typed_plan_reads_every_section_and_keeps_the_document():
    plan = build_plan(request(), eagle3_candidates, [1])
    typed = MemoryPlan.from_dict(plan)
    assert typed.document is plan and typed.fits is True and typed.algorithm == "EAGLE3"
    assert typed.tensor_parallel_size == 1 and typed.gpu_memory_bytes == H100
    assert typed.weights.target_bytes == LLAMA8B_W and typed.weights.draft_bytes == EAGLE3_W
    assert typed.kv_cache.max_total_num_tokens == plan["kvCache"]["maxTotalNumTokens"]
    assert typed.kv_cache.dtype == "bfloat16" and typed.kv_cache.context_length == 131072
    assert typed.reserve.runtime_bytes == GIB and typed.gpu.name == "test"
    assert typed.min_tensor_parallel_size == 1 and typed.draft == "d"
    # Optional keys may be missing or null; required ones may not.
    del plan["kvCache"]["dtype"], plan["gpu"]
    plan["draft"] = None
    sparse = MemoryPlan.from_dict(plan)
    assert sparse.kv_cache.dtype is None and sparse.gpu is None and sparse.draft is None
    plan["message"] = None
    with pytest.raises(ValueError, match="key 'message' must be str, got None"):
        MemoryPlan.from_dict(plan)
    with pytest.raises(ValueError, match="missing required key 'reserve.runtimeBytes'"):
        MemoryPlan.from_dict({**plan, "message": "m", "reserve": 5})


def test_plan_module_imports_no_torch():
    import subprocess

    code = ("import sys, specdecode_worker.planner.plan, specdecode_worker.planner.plan_cli, "
            "specdecode_worker.model_rules.checkpoint, specdecode_worker.devices, "
            "specdecode_worker.model_rules.model_config, specdecode_worker.contract; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- devices ------------------------------------------------------------------------------------

def test_catalogue_covers_the_products_the_operator_schedules():
    for label, mib in [("NVIDIA-H100-80GB-HBM3", 81_559), ("NVIDIA-H200", 143_771), ("NVIDIA-A100-SXM4-80GB", 81_920),
                       ("NVIDIA-A100-SXM4-40GB", 40_960), ("NVIDIA-L4", 23_034), ("NVIDIA-L40S", 46_068),
                       ("NVIDIA-A10G", 23_028), ("NVIDIA-B200", 183_359)]:
        # usable = total minus the 615 MiB an idle H200 showed reserved by the driver
        assert product_memory_bytes(label) == (mib - 615) * MIB
        assert GPU_PRODUCTS[label] == mib
    assert product_memory_bytes("NVIDIA H100 80GB HBM3") == (81_559 - 615) * MIB  # pynvml's spelling
    assert product_memory_bytes("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb") is None


def test_device_memory_order_gpu_then_override_then_catalogue(monkeypatch):
    monkeypatch.setattr(devices, "nvml_memory", lambda: None)
    assert resolve_device_memory(40.0, "NVIDIA-H200").free_bytes == 40 * GIB
    cat = resolve_device_memory(None, "NVIDIA-L4")
    assert (cat.total_bytes, cat.free_bytes, cat.source) == (23_034 * MIB, (23_034 - 615) * MIB, "catalogue")
    with pytest.raises(InputError, match="--gpu-product: unknown GPU product 'NVIDIA-X1'"):
        resolve_device_memory(None, "NVIDIA-X1")
    with pytest.raises(InputError, match="no GPU visible: give the GPU with --gpu-product"):
        resolve_device_memory(None, None)
    seen = devices.DeviceMemory(total_bytes=80 * GIB, free_bytes=70 * GIB, source="nvml", name="NVIDIA H100")
    monkeypatch.setattr(devices, "nvml_memory", lambda: seen)
    got = resolve_device_memory(40.0, "NVIDIA-L4")
    assert got is seen and got.used_bytes == 10 * GIB


def test_hidden_gpus_are_not_probed(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.nvml_memory() is None


def test_cublas_workspaces_by_hand_per_gpu():
    """PyTorch's default cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp): 4096 KiB x 8
    on sm_90, else 4096 KiB x 2 + 16 KiB x 8; the worker runs matmuls on four (handle, stream) pairs."""
    from specdecode_worker.devices import blas_workspace_bytes as one

    hopper, other = 4096 * 1024 * 8, 4096 * 1024 * 2 + 16 * 1024 * 8
    assert (hopper, other) == (33_554_432, 8_519_680)
    for name in ("NVIDIA-H100-80GB-HBM3", "NVIDIA H200", "NVIDIA-H200-NVL"):  # labels and pynvml's names
        assert one(name) == hopper
    for name in ("NVIDIA-A100-SXM4-80GB", "NVIDIA-L4", "NVIDIA-B200", "Tesla-T4"):
        assert one(name) == other
    assert one("80 GiB") == one("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb") == hopper  # unknown: the larger
    l4 = build_plan(request(gpu_name="NVIDIA-L4"), eagle3_candidates, [1, 2, 4, 8])
    h100 = build_plan(request(gpu_name="NVIDIA-H100-80GB-HBM3"), eagle3_candidates, [1, 2, 4, 8])
    assert l4["reserve"]["blasWorkspaceBytes"] == 4 * other and h100["reserve"]["blasWorkspaceBytes"] == 4 * hopper
    assert h100["reserve"]["dynamicBytes"] - l4["reserve"]["dynamicBytes"] == 4 * (hopper - other)
