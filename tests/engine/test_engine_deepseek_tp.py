"""DeepSeek-V3 under tensor parallelism on CPU (gloo): t = 2 gives the single-rank greedy output and
each rank holds the weight and latent-cell bytes the planner predicts per GPU (dense and fp8)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from specdecode_worker.engine.parallel.distributed import launch  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import EngineArgs  # noqa: E402
from specdecode_worker.planner.plan import PlanArgs, runtime_reserve_bytes  # noqa: E402
from specdecode_worker.planner.plan_cli import make_plan  # noqa: E402

from devtools.deepseek_models import quantize_fp8, write_tiny_deepseek  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402

from specdecode_worker.contract import GIB  # noqa: E402
PROMPTS = [[5, 17, 42, 8, 99, 23, 4], list(range(30, 45))]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
BUDGET_GIB, FRACTION, CONTEXT = 1.45, 0.95, 64


def _lead(eng) -> dict:
    reqs = run_all(eng, [Request(list(p), GREEDY) for p in PROMPTS])
    return {**_describe(eng), "outputs": [r.output_ids for r in reqs], "proposed": eng.stats.proposed_tokens}


def _describe(eng) -> dict:
    t = eng.target_runner
    d = eng.draft_runner
    return {"target_weight_bytes": t.weight_bytes, "target_kv_cell": t.token_to_kv_pool.bytes_per_token(),
            "allocated_tokens": t.token_to_kv_pool_allocator.size,
            "draft_weight_bytes": d.weight_bytes if d else 0,
            "draft_kv_cell": d.token_to_kv_pool.bytes_per_token() if d else 0}


def _rank(kws: dict) -> dict:
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    return {name: run_rank(EngineArgs(**kw), _lead, _describe) for name, kw in kws.items()}


def _kw(folder, algorithm: str) -> dict:
    return dict(target=str(folder), algorithm=algorithm, device_memory_bytes=int(BUDGET_GIB * GIB),
                mem_fraction_static=FRACTION, runtime_bytes=runtime_reserve_bytes(2), context_len=CONTEXT,
                max_running_requests=4, num_draft_tokens=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds-tp")
    dense = write_tiny_deepseek(root / "dense", mtp=True)
    fp8, _ = quantize_fp8(dense, root / "fp8", root / "fp8-dequantized")
    return {"dense": dense, "fp8": fp8}


@pytest.fixture(scope="module")
def ranks(models):
    kws = {name: _kw(folder, "NONE") for name, folder in models.items()}
    return launch(2, _rank, (kws,), wall_timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "fp8"])
def test_tp2_equals_single_rank_and_the_plan(models, ranks, name):
    single = engine(models[name], context_len=CONTEXT)
    expected = [r.output_ids for r in run_all(single, [Request(list(p), GREEDY) for p in PROMPTS])]
    assert ranks[0][name]["outputs"] == expected
    plan = make_plan(PlanArgs(target=str(models[name]), algorithm="NGRAM", tp=2, gpu_memory_gib=BUDGET_GIB,
                              mem_fraction_static=FRACTION, context_length=CONTEXT))
    for rank in ranks:
        info = rank[name]
        assert info["target_weight_bytes"] == plan["weights"]["targetBytes"]
        assert info["target_kv_cell"] == plan["kvCache"]["targetBytesPerToken"]  # the whole latent per rank
        assert info["allocated_tokens"] == plan["kvCache"]["maxTotalNumTokens"]
    assert ranks[0][name]["target_weight_bytes"] < single.target_runner.weight_bytes
