"""DeepSeek-V3 served by the engine: logits equal transformers' DeepseekV3ForCausalLM, through the
latent (MLA) pool, for prefill and for decode steps; the pool's cell is the planner's MLA cell."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from specdecode_worker.engine.batch import Segment, alloc_positions, forward_segments  # noqa: E402
from specdecode_worker.engine.memory.mla_pool import MLATokenToKVPool  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.model_rules.model_config import load_shape  # noqa: E402

from devtools.deepseek_models import config_of, hf_greedy, quantize_fp8, write_tiny_deepseek  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 7, 130, 12, 88, 31, 2, 77, 50, 9, 140, 3, 66]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("ds") / "tiny-deepseek-v3", mtp=True)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _prefill_equals_transformers(runner, hf):
    """Prefill PROMPT on the engine's runner; its logits must equal the reference's to 1e-4.
    Returns the request's pool index, the engine's logits and the reference's."""
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    req = pool.alloc()
    alloc_positions(pool, alloc, req, 0, len(PROMPT))
    ours = forward_segments(runner, [Segment(req, PROMPT, 0)], last_only=False)
    ref = _reference_logits(hf, PROMPT)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=0), float((ours - ref).abs().max())
    return req, ours, ref


def test_tiny_config_exercises_grouped_routing_yarn_and_moe(model_dir):
    cfg = config_of(model_dir)
    assert cfg["n_group"] > cfg["topk_group"] > 0 and cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_interleave"] is True


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_prefill_and_decode_logits_equal_transformers(model_dir, hf, monkeypatch, kernels):
    """With the layer's elementwise work as torch ops and as the fused kernels (under Triton's
    interpreter here)."""
    from specdecode_worker.engine.kernels import layer_kernels

    monkeypatch.setenv(layer_kernels.LAYER_KERNELS_ENV, kernels)
    if kernels == "triton" and not layer_kernels.use_triton(torch.zeros(1)):
        pytest.skip("the fused kernels run on CPU under TRITON_INTERPRET=1 only")
    eng = engine(model_dir)
    runner = eng.target_runner
    req, ours, ref = _prefill_equals_transformers(runner, hf)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    # Decode: one token at a time over the cached latent, as the engine's decode batches run.
    ids = list(PROMPT)
    for step in range(6):
        nxt = int(ref[-1].argmax())
        alloc_positions(pool, alloc, req, len(ids), len(ids) + 1)
        row = forward_segments(runner, [Segment(req, [nxt], len(ids))], last_only=True)[0]
        ids.append(nxt)
        ref = _reference_logits(hf, ids)
        assert torch.allclose(row, ref[-1], atol=1e-4, rtol=0), (step, float((row - ref[-1]).abs().max()))


def test_greedy_generation_equals_transformers_for_a_batch(model_dir, hf):
    prompts = [PROMPT, PROMPT[:7], list(range(30, 45))]
    expected = []
    for p in prompts:
        expected.append(hf_greedy(hf, p, 12))
    eng = engine(model_dir)
    reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts])
    assert [r.output_ids for r in reqs] == expected


def test_pool_holds_the_planner_mla_cell(model_dir):
    eng = engine(model_dir)
    runner = eng.target_runner
    kv_pool = runner.token_to_kv_pool
    assert isinstance(kv_pool, MLATokenToKVPool)
    shape = load_shape(model_dir)
    # Hand count: 3 layers x (kv_lora_rank 16 + qk_rope_head_dim 8) x 4 bytes (float32).
    assert kv_pool.bytes_per_token() == 3 * (16 + 8) * 4 == shape.kv_bytes_per_token(1, 4)
    assert runner.kv_cell_bytes == kv_pool.bytes_per_token()


def test_target_skips_the_mtp_layer_weights(model_dir):
    eng = engine(model_dir)
    names = dict(eng.target_runner.model.named_parameters())
    assert not any(n.startswith("model.layers.3.") for n in names)


def test_fp8_block_quantized_weights_are_served_as_stored(model_dir, tmp_path):
    from specdecode_worker.engine.kernels.fp8_linear import FP8_DTYPE
    from specdecode_worker.planner.plan import PlanArgs
    from specdecode_worker.planner.plan_cli import make_plan

    fp8, dense = quantize_fp8(model_dir, tmp_path / "fp8", tmp_path / "dense")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    eng = engine(fp8, device_memory_bytes=1 << 30, context_len=64)
    runner = eng.target_runner
    attn = runner.model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == FP8_DTYPE and attn.q_b_proj.weight_scale_inv.dtype == torch.float32
    _prefill_equals_transformers(runner, hf)
    # Resident: fp8 weights and float32 scales, as the planner prices them from the headers.
    plan = make_plan(PlanArgs(target=str(fp8), algorithm="NGRAM", tp=1, gpu_memory_gib=1.0,
                              mem_fraction_static=0.9, context_length=64))
    assert plan["weights"]["targetBytes"] == runner.weight_bytes
    dense_runner = engine(dense, device_memory_bytes=1 << 30, context_len=64).target_runner
    assert runner.weight_bytes < dense_runner.weight_bytes


def test_other_quantization_is_refused_with_what_to_do(tmp_path):
    folder = write_tiny_deepseek(tmp_path / "awq", num_hidden_layers=2)
    cfg = config_of(folder)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="is not served; the worker serves fp8 e4m3 block-quantized"):
        engine(folder)


def test_planner_prices_the_weights_and_latent_cells_the_worker_holds(model_dir):
    from specdecode_worker.planner.plan import PlanArgs
    from specdecode_worker.planner.plan_cli import make_plan

    plan = make_plan(PlanArgs(target=str(model_dir), algorithm="NGRAM", tp=1, gpu_memory_gib=1.0,
                              mem_fraction_static=0.9, context_length=64))
    eng = engine(model_dir, device_memory_bytes=1 << 30, context_len=64)
    runner = eng.target_runner
    assert plan["weights"]["targetBytes"] == runner.weight_bytes  # the MTP layer is not the target's
    assert plan["kvCache"]["targetBytesPerToken"] == runner.token_to_kv_pool.bytes_per_token()
