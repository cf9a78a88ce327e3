"""fp8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): pool sizes against the planner, logits
against the full-precision cache, exact speculation, and the serve CLI's flag."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.planner import plan_cli  # noqa: E402
from specdecode_worker.serving import serve_cli  # noqa: E402
from specdecode_worker.engine.batch import Segment, alloc_positions, forward_segments  # noqa: E402
from specdecode_worker.engine.model_runner import ModelRunner  # noqa: E402
from specdecode_worker.engine.memory.pools import MemoryPoolConfig  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402
from devtools.tiny_models import VOCAB_SIZE, write_tiny_model  # noqa: E402

from specdecode_worker.contract import GIB  # noqa: E402
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22], list(range(30, 60))]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("fp8kv"))


def _plan(capsys, models, kv_cache_dtype):
    argv = ["--target", str(models["target"]), "--algorithm", "STANDALONE", "--draft", str(models["draft"]),
            "--gpu-memory-gib", "1.1", "--mem-fraction-static", "0.95", "--context-length", "64",
            "--kv-cache-dtype", kv_cache_dtype]
    assert plan_cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _engine_for(plan, models, kv_cache_dtype):
    return engine(models["target"], "STANDALONE", models["draft"], device_memory_bytes=int(1.1 * GIB),
                  mem_fraction_static=0.95, runtime_bytes=plan["reserve"]["runtimeBytes"], context_len=64,
                  kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv", sorted(FP8))
def test_fp8_pools_hold_exactly_the_planned_tokens(models, capsys, kv):
    plan = _plan(capsys, models, kv)
    auto_plan = _plan(capsys, models, "auto")
    # Hand count at one byte per element: target 2 layers x 2 KV heads x (16 + 16) = 128;
    # draft 1 layer x 1 KV head x (16 + 16) = 32.
    assert (plan["kvCache"]["targetBytesPerToken"], plan["kvCache"]["draftBytesPerToken"]) == (128, 32)
    assert plan["kvCache"]["dtype"] == kv

    eng = _engine_for(plan, models, kv)
    t, d = eng.target_runner, eng.draft_runner
    for runner in (t, d):
        pool = runner.token_to_kv_pool
        assert {b.dtype for b in pool.k_buffer + pool.v_buffer} == {FP8[kv]}
        assert all(b.element_size() == 1 for b in pool.k_buffer + pool.v_buffer)
    assert t.token_to_kv_pool.bytes_per_token() == plan["kvCache"]["targetBytesPerToken"]
    assert d.token_to_kv_pool.bytes_per_token() == plan["kvCache"]["draftBytesPerToken"]
    planned = plan["kvCache"]["maxTotalNumTokens"]
    assert eng.memory_profile.max_total_num_tokens == planned
    assert t.token_to_kv_pool_allocator.size == planned
    assert t.token_to_kv_pool.nbytes() == (planned + 1) * 128  # plus the padding slot 0
    assert d.token_to_kv_pool.nbytes() == (planned + 1) * 32
    assert eng.memory_profile.kv_dtype == str(FP8[kv]).replace("torch.", "")
    # A quarter of float32's cell: the same KV budget holds four times the tokens (bfloat16
    # checkpoints on a GPU get twice), up to the rounding of the planner's integer division.
    assert auto_plan["kvCache"]["targetBytesPerToken"] == 512
    assert abs(planned - 4 * auto_plan["kvCache"]["maxTotalNumTokens"]) <= 4


def _prefill_then_decode_logits(path, ids, kv_cache_dtype):
    """Logits of every position: prefill of the first half, then one decode step per token."""
    runner = ModelRunner(path, device="cpu", kv_cache_dtype=kv_cache_dtype)
    runner.load_weights()
    runner.alloc_memory_pool(MemoryPoolConfig(max_total_num_tokens=128, max_running_requests=2, context_len=64))
    runner.init_backends()
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    idx = pool.alloc()
    alloc_positions(pool, alloc, idx, 0, len(ids))
    half = len(ids) // 2
    rows = [forward_segments(runner, [Segment(idx, ids[:half], 0)], last_only=False)]
    for p in range(half, len(ids)):
        rows.append(forward_segments(runner, [Segment(idx, ids[p:p + 1], p)], last_only=True))
    return torch.cat(rows)


# Rounding to fp8 changes each cached K/V element by at most half an ULP: 2**-4 relative with
# e4m3's 3-bit mantissa, 2**-3 with e5m2's 2 bits (these tiny K/V are far from the formats'
# range limits). The logits' relative error (L2 over the vocabulary) is held to that same
# per-element bound: errors of the order of one rounding pass, not growing through the layers
# (measured here: 4.0% for e4m3, 9.7% for e5m2). A cache that stored garbage, or upcast
# wrongly, misses by orders of magnitude.
REL_TOL = {"fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}
# A random tiny model has many near-ties (median top-2 margin ~0.08 logits), where any rounding
# may flip the argmax. Top-1 must agree wherever the reference margin is at least 0.1 logits
# (under 2% of the logits' norm of ~6): far below the 0.75 that the L2 tolerance alone would
# allow, so this is a check of its own.
CONFIDENT_MARGIN = 0.1


@pytest.mark.parametrize("kv", sorted(FP8))
def test_fp8_cache_logits_stay_close_to_the_full_precision_cache(models, kv):
    ids = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _prefill_then_decode_logits(models["target"], ids, None)
    got = _prefill_then_decode_logits(models["target"], ids, kv)
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max().item() < REL_TOL[kv], rel.max().item()
    assert rel.max().item() > 0  # the cache really is fp8: a lossless store would be identical
    top2 = ref.topk(2, dim=-1).values
    confident = top2[:, 0] - top2[:, 1] >= CONFIDENT_MARGIN
    assert confident.sum().item() >= len(ids) // 3
    assert torch.equal(got.argmax(-1)[confident], ref.argmax(-1)[confident])


def _greedy(eng):
    return [r.output_ids for r in run_all(eng, [Request(p, GREEDY) for p in PROMPTS])]


@pytest.mark.parametrize("kv", sorted(FP8))
def test_speculation_over_an_fp8_cache_equals_its_own_greedy(models, kv):
    plain = _greedy(engine(models["target"], kv_cache_dtype=kv))
    eng = engine(models["target"], "STANDALONE", models["draft"], kv_cache_dtype=kv)
    assert _greedy(eng) == plain
    assert eng.stats.proposed_tokens > 0
    copy = engine(models["target"], "STANDALONE", models["copy"], kv_cache_dtype=kv)
    assert _greedy(copy) == plain
    assert copy.stats.accepted_tokens == copy.stats.proposed_tokens  # same model, same fp8 cache
    ngram = engine(models["target"], "NGRAM", kv_cache_dtype=kv)
    assert _greedy(ngram) == plain


def test_eagle3_tree_over_an_fp8_cache_equals_its_own_greedy(tmp_path):
    target = write_tiny_model(tmp_path / "target", "llama", seed=0, weight_scale=3.0, vocab_size=8, num_hidden_layers=6)
    head = write_eagle3_head(tmp_path / "eagle3", target, draft_vocab=6, seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(8) for _ in range(rng.randrange(3, 12))] for _ in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine(target, kv_cache_dtype="fp8_e4m3")
    want = [r.output_ids for r in run_all(plain, [Request(p, params) for p in prompts])]
    eng = engine(target, "EAGLE3", head, kv_cache_dtype="fp8_e4m3", num_draft_tokens=6,
                   speculative_num_steps=3, speculative_eagle_topk=3)
    assert eng.draft_runner.token_to_kv_pool.k_buffer[0].dtype == torch.float8_e4m3fn
    assert [r.output_ids for r in run_all(eng, [Request(p, params) for p in prompts])] == want
    assert eng.stats.accepted_tokens > 0


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_serve_cli_plans_and_sizes_with_the_kv_dtype(models, kv):
    args = serve_cli.parser().parse_args(["--target", str(models["target"]), "--device", "cpu",
                                          "--device-memory-gib", "1.1", "--mem-fraction-static", "0.95",
                                          "--context-length", "64", "--kv-cache-dtype", kv])
    engine_args, plan = serve_cli.resolve(args)
    assert engine_args.kv_cache_dtype == kv
    assert plan.kv_cache.dtype == (kv if kv != "auto" else "float32")
    assert plan.kv_cache.target_bytes_per_token == (512 if kv == "auto" else 128)


@pytest.mark.parametrize("value", ["int8", "fp8", "float16", "FP8_E4M3"])
def test_serve_cli_refuses_other_kv_dtypes_with_exit_2(models, capsys, value):
    code = serve_cli.main(["--target", str(models["target"]), "--device", "cpu", "--device-memory-gib", "1",
                           "--kv-cache-dtype", value])
    assert code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8_e4m3" in err


def test_a_pinned_plan_decides_the_kv_dtype_and_a_contradicting_flag_is_refused(models, capsys, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(_plan(capsys, models, "fp8_e5m2")))
    base = ["--target", str(models["target"]), "--draft", str(models["draft"]), "--algorithm", "STANDALONE",
            "--device", "cpu", "--plan", str(plan_file)]
    assert serve_cli.resolve(serve_cli.parser().parse_args(base))[0].kv_cache_dtype == "fp8_e5m2"
    flagged = serve_cli.parser().parse_args(base + ["--kv-cache-dtype", "fp8_e5m2"])
    assert serve_cli.resolve(flagged)[0].kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(InputError, match="sized for a fp8_e5m2 KV cache; give --kv-cache-dtype fp8_e5m2"):
        serve_cli.resolve(serve_cli.parser().parse_args(base + ["--kv-cache-dtype", "auto"]))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_stores_saturate_beyond_the_formats_range(dtype):
    """A K/V value beyond the fp8 format's range is stored as its largest finite value, in the MHA
    and the MLA pools alike; values in range are stored as a plain cast stores them. A plain cast
    gives infinity for e5m2 here, and NaN for e4m3 on CUDA (torch's CPU cast to e4m3 saturates)."""
    from specdecode_worker.engine.memory.mla_pool import MLATokenToKVPool
    from specdecode_worker.engine.memory.pools import MHATokenToKVPool

    limit = torch.finfo(dtype).max  # 448 for e4m3, 57344 for e5m2
    values = torch.tensor([0.5, -3.0, 1e3, -1e3, 1e6, -1e6], dtype=torch.bfloat16)
    want = torch.tensor([0.5, -3.0, min(1e3, limit), -min(1e3, limit), limit, -limit]).to(dtype).float()
    if dtype == torch.float8_e5m2:
        assert not torch.isfinite(values.to(dtype).float()).all()  # what a plain cast would store
    mha = MHATokenToKVPool(4, 1, 1, 6, 6, dtype, "cpu")
    loc = torch.tensor([2])
    mha.set_kv(0, loc, values.view(1, 1, 6), -values.view(1, 1, 6))
    assert torch.equal(mha.k_buffer[0][2, 0].float(), want) and torch.equal(mha.v_buffer[0][2, 0].float(), -want)
    mla = MLATokenToKVPool(4, 1, 4, 2, dtype, "cpu")
    mla.set_kv(0, loc, values.view(1, 1, 6), None)
    assert torch.equal(mla.k_buffer[0][2, 0].float(), want)
