"""MTP drafting under tensor parallelism (gloo on CPU): at t = 2 and 4 the greedy output of the
NextN chain equals t = 1 and the target's own greedy output, and every rank holds the MTP layer
bytes and the one-layer latent cell the planner prices per GPU (the decoder block sharded like a
target layer, ``eh_proj`` and the norms whole, the whole latent per rank)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from specdecode_worker.engine.engine import EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.planner.plan import PlanArgs  # noqa: E402
from specdecode_worker.planner.plan_cli import make_plan  # noqa: E402

from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402
from tests.tp_helpers import BUDGET_GIB, CONTEXT, FRACTION, launches, tp_sizing  # noqa: E402

pytestmark = pytest.mark.slow  # one launch of t rank processes per t

# A small vocabulary makes the random NextN layer agree with the target often enough that accepted
# chains (slot hand-over, the layer's own K/V kept) run on every rank, not only rejections.
VOCAB = 8
PROMPTS = [[5, 1, 4, 2, 6, 7, 0], [2, 3, 2], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]]
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
K = 3
WALL_S = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 4 heads, intermediate 96, moe_intermediate 32: the heads and every MLP split 2 and 4 ways.
    # Seed 2: the target's output varies and the NextN layer's drafts are sometimes accepted.
    return write_tiny_deepseek(tmp_path_factory.mktemp("mtp-tp") / "deepseek-mtp", seed=2, mtp=True,
                               vocab_size=VOCAB)


def _requests() -> list[Request]:
    return [Request(list(p), GREEDY) for p in PROMPTS]


def _describe(eng) -> dict:
    d = eng.draft_runner
    return {"target_weight_bytes": eng.target_runner.weight_bytes, "draft_weight_bytes": d.weight_bytes,
            "draft_kv_cell": d.token_to_kv_pool.bytes_per_token(), "draft_kv_cell_priced": d.kv_cell_bytes,
            "draft_tp": d.tp.size, "allocated_tokens": eng.target_runner.token_to_kv_pool_allocator.size}


def _lead(eng) -> dict:
    reqs = run_all(eng, _requests())
    return {**_describe(eng), "outputs": [r.output_ids for r in reqs], "accepted": eng.stats.accepted_tokens,
            "free_after": eng.kv_usage()[0]}


def _rank(kw: dict) -> dict:
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    return run_rank(EngineArgs(**kw), _lead, _describe)


@pytest.fixture(scope="module")
def single(model_dir):
    """t = 1 MTP output, and the target's own greedy output."""
    mtp = engine(model_dir, "MTP", num_draft_tokens=K, context_len=CONTEXT)
    return {"MTP": [r.output_ids for r in run_all(mtp, _requests())],
            "NONE": [r.output_ids for r in run_all(engine(model_dir, context_len=CONTEXT), _requests())],
            "accepted": mtp.stats.accepted_tokens}


@pytest.fixture(scope="module")
def tp_runs(model_dir):
    return launches(_rank, lambda tp: dict(target=str(model_dir), algorithm="MTP", **tp_sizing(tp),
                                           max_running_requests=3, num_draft_tokens=K), WALL_S)


@pytest.mark.parametrize("tp", [2, 4])
def test_mtp_greedy_output_equals_single_rank_and_the_target(single, tp_runs, tp):
    ranks = tp_runs(tp)
    assert len(ranks) == tp and all(r is not None for r in ranks)  # every follower was released
    assert single["MTP"] == single["NONE"]  # t = 1 is exact
    assert single["accepted"] > 0
    lead = ranks[0]
    assert lead["outputs"] == single["NONE"]
    assert lead["accepted"] > 0  # accepted drafts were committed on every rank
    assert lead["free_after"] == 0  # every slot, rejected drafts included, went back
    assert all(r["draft_tp"] == tp for r in ranks)  # the NextN layer is sharded, not replicated


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_holds_the_planned_mtp_bytes(model_dir, tp_runs, tp):
    plan = make_plan(PlanArgs(target=str(model_dir), algorithm="MTP", tp=tp, gpu_memory_gib=BUDGET_GIB[tp],
                              mem_fraction_static=FRACTION, context_length=CONTEXT))
    assert plan["fits"] and plan["tensorParallelSize"] == tp
    single_rank = make_plan(PlanArgs(target=str(model_dir), algorithm="MTP", tp=1, gpu_memory_gib=BUDGET_GIB[1],
                                     mem_fraction_static=FRACTION, context_length=CONTEXT))
    assert plan["weights"]["draftBytes"] < single_rank["weights"]["draftBytes"]  # the block is split
    for rank in tp_runs(tp):
        assert rank["draft_weight_bytes"] == plan["weights"]["draftBytes"]
        assert rank["target_weight_bytes"] == plan["weights"]["targetBytes"]
        assert rank["draft_kv_cell"] == rank["draft_kv_cell_priced"] == plan["kvCache"]["draftBytesPerToken"]
        assert rank["allocated_tokens"] == plan["kvCache"]["maxTotalNumTokens"]


def test_mtp_layer_bytes_by_hand(tp_runs):
    """float32, hidden 64, 4 heads, q_lora 24, kv_lora 16, rope 8, nope 16, v 16, 8 experts + 1
    shared of 32; per rank at t = 2 and 4: split matrices / t, the rest whole."""
    h, heads, ql, kl, rope, nope, v, e, m = 64, 4, 24, 16, 8, 16, 16, 8, 32
    whole = (2 * h * h + 3 * h  # eh_proj; enorm, hnorm, shared_head.norm
             + h * ql + ql + h * (kl + rope) + kl  # q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm
             + 2 * h  # input and post-attention norms
             + e * h + e)  # router and its score-correction bias
    split = ql * heads * (nope + rope) + kl * heads * (nope + v) + heads * v * h + (e + 1) * 3 * h * m
    for t in (2, 4):
        for rank in tp_runs(t):
            assert rank["draft_weight_bytes"] == 4 * (whole + split // t)
            assert rank["draft_kv_cell"] == 4 * (kl + rope)
