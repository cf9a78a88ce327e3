"""EAGLE and EAGLE3 heads under tensor parallelism (gloo on CPU): at t = 2 and 4 the greedy output
of chain and tree drafting equals t = 1, and every rank holds the head bytes and KV cell the
planner prices per GPU (the head sharded with the target, ``fc`` and norms whole)."""

from __future__ import annotations

import functools
import json
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.planner import plan_cli  # noqa: E402
from specdecode_worker.engine.engine import EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import write_eagle3_head, write_eagle_head  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402
from tests.tp_helpers import BUDGET_GIB, CONTEXT, FRACTION, launches, tp_sizing  # noqa: E402

pytestmark = pytest.mark.slow  # one launch of t rank processes per t

# A small vocabulary makes random heads agree with the target often enough that accepted chains
# and tree paths (slot remapping, feature hand-over) run on every rank, not only rejections.
VOCAB = 8
DRAFT_VOCAB = 4  # EAGLE3's own lm_head: 4 rows split 2 and 4 ways
MODES = {"chain": dict(num_draft_tokens=3),
         "tree": dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3),
         "mixed": dict(num_draft_tokens=3)}  # chains; per request: no drafting, 1 token, or 3
HEADS = {"eagle": "EAGLE", "eagle3": "EAGLE3"}
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
WALL_S = 300


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))] for _ in range(4)]


def _requests(mode: str) -> list[Request]:
    """In "mixed", two requests never draft (rounds where no request drafts are plain target
    steps) and one drafts a single token, so the head catches up over skipped tokens."""
    if mode != "mixed":
        return [Request(p, GREEDY) for p in _prompts()]
    long = SamplingParams(max_tokens=32, ignore_eos=True)  # outlives the drafting requests
    caps = [dict(params=long, speculative=False), dict(params=long, speculative=False),
            dict(params=GREEDY, max_draft_tokens=1), dict(params=GREEDY)]
    return [Request(p, **c) for p, c in zip(_prompts(), caps)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-tp")
    # Head seed 7: the draft vocabulary {0, 3, 4, 7} holds the ids the target repeats, so drafts are accepted.
    # 6 layers: the EAGLE3 default reads the states entering layers 2, 3 and 3. 4 heads, 2 KV heads,
    # intermediate 128: at t = 4 each rank holds one query head and one (replicated) KV head.
    target = write_tiny_model(root / "target", "llama", seed=0, weight_scale=3.0, vocab_size=VOCAB,
                              num_hidden_layers=6)
    return {"target": target, "eagle": write_eagle_head(root / "eagle", target, seed=1),
            "eagle3": write_eagle3_head(root / "eagle3", target, draft_vocab=DRAFT_VOCAB, seed=7)}


def _engine_kw(models, tp: int, head: str, mode: str) -> dict:
    return dict(target=str(models["target"]), draft=str(models[head]), algorithm=HEADS[head], **tp_sizing(tp),
                max_running_requests=3, **MODES[mode])


def _describe(eng) -> dict:
    d = eng.draft_runner
    return {"target_weight_bytes": eng.target_runner.weight_bytes, "draft_weight_bytes": d.weight_bytes,
            "draft_kv_cell": d.kv_cell_bytes, "draft_tp": d.tp.size,
            "draft_kv_heads": d.token_to_kv_pool.k_buffer[0].shape[1],
            "draft_kv_pool_bytes": d.token_to_kv_pool.nbytes(),
            "allocated_tokens": eng.target_runner.token_to_kv_pool_allocator.size}


def _lead(eng, mode: str) -> dict:
    reqs = run_all(eng, _requests(mode))
    return {**_describe(eng), "outputs": [r.output_ids for r in reqs], "accepted": eng.stats.accepted_tokens}


def _rank(engine_kws: dict) -> dict:
    """Inside each rank process: per case one engine through its phases, then lead or follow."""
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    return {case: run_rank(EngineArgs(**kw), functools.partial(_lead, mode=case[1]), _describe)
            for case, kw in engine_kws.items()}


CASES = [(h, m) for h in HEADS for m in ("chain", "tree")] + [("eagle3", "mixed")]


@pytest.fixture(scope="module")
def single(models):
    """t = 1 greedy output per (head, mode), in this process, and the target's own greedy output."""
    out = {case: [r.output_ids for r in run_all(engine(models["target"], HEADS[case[0]], models[case[0]],
                                                       context_len=CONTEXT, **MODES[case[1]]),
                                                _requests(case[1]))]
           for case in CASES}
    for mode in MODES:
        out[("NONE", mode)] = [r.output_ids for r in run_all(engine(models["target"], context_len=CONTEXT),
                                                             _requests(mode))]
    return out


@pytest.fixture(scope="module")
def tp_runs(models):
    return launches(_rank, lambda tp: {case: _engine_kw(models, tp, *case) for case in CASES}, WALL_S)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("head,mode", CASES)
def test_greedy_output_equals_single_rank(single, tp_runs, tp, head, mode):
    ranks = tp_runs(tp)
    assert len(ranks) == tp and all(r is not None for r in ranks)  # every follower was released
    lead = ranks[0][(head, mode)]
    assert single[(head, mode)] == single[("NONE", mode)]  # t = 1 is exact, so t = tp is compared to the target too
    assert lead["outputs"] == single[(head, mode)]
    assert lead["accepted"] > 0  # accepted drafts were committed on every rank
    assert all(r[(head, mode)]["draft_tp"] == tp for r in ranks)  # the head is sharded, not replicated


def _plan(models, head: str, tp: int, capsys) -> dict:
    argv = ["--target", str(models["target"]), "--algorithm", HEADS[head], "--draft", str(models[head]),
            "--gpu-memory-gib", str(BUDGET_GIB[tp]), "--mem-fraction-static", str(FRACTION),
            "--context-length", str(CONTEXT), "--tp", str(tp)]
    assert plan_cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("head", list(HEADS))
def test_every_rank_holds_the_planned_head_bytes(models, tp_runs, capsys, tp, head):
    plan = _plan(models, head, tp, capsys)
    assert plan["tensorParallelSize"] == tp
    for rank in tp_runs(tp):
        info = rank[(head, "chain")]
        assert info["draft_weight_bytes"] == plan["weights"]["draftBytes"]
        assert info["target_weight_bytes"] == plan["weights"]["targetBytes"]
        assert info["draft_kv_cell"] == plan["kvCache"]["draftBytesPerToken"]
        assert info["draft_kv_pool_bytes"] == (info["allocated_tokens"] + 1) * info["draft_kv_cell"]


def test_head_bytes_by_hand(tp_runs):
    """float32, hidden 64, intermediate 128, 4 heads of 16, 2 KV heads; per rank at t = 2 and 4."""
    h, i, d = 64, 128, 16

    def layer(in_dim: int, t: int) -> int:  # q, o, mlp split t ways; k, v max(1, 2 // t) heads; 1 norm
        kv = max(1, 2 // t)
        return (in_dim * 4 * d + 4 * d * h + 3 * h * i) // t + 2 * kv * d * in_dim + h

    for t in (2, 4):
        eagle = 2 * h * h + h + layer(h, t)  # fc and its bias whole; no input norm on layer 0
        # fc (3H) whole; 2 more norms in the layer, the final norm; lm_head rows split; d2t (int64), t2d (bool)
        eagle3 = 3 * h * h + layer(2 * h, t) + 3 * h + DRAFT_VOCAB * h // t
        for rank in tp_runs(t):
            assert rank[("eagle", "chain")]["draft_weight_bytes"] == 4 * eagle
            assert rank[("eagle3", "chain")]["draft_weight_bytes"] == 4 * eagle3 + 8 * DRAFT_VOCAB + VOCAB
            assert rank[("eagle3", "chain")]["draft_kv_heads"] == max(1, 2 // t)
