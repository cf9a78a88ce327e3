"""Speculative rounds under tensor parallelism through the speculator's graph runners (gloo on CPU,
the eager stand-ins of CUDA graphs): every rank captures the same graphs, rank 0 announces each
replay and the others stage the same inputs and replay the same graph, so at t = 2 (and 4) the
greedy output of EAGLE3 chains and trees and of MTP equals t = 1 and the target's own greedy
output. Each rank records the graphs it replays and any pass that ran outside them: every rank
replays the same sequence of graphs (batch size and width), and no draft step or verify pass runs
eagerly. The same over captured CUDA graphs and NCCL runs where 2 GPUs are visible."""

from __future__ import annotations

import functools
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.parallel.distributed import launch  # noqa: E402
from specdecode_worker.engine.engine import EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402
from tests.tp_helpers import CONTEXT, launches, tp_sizing  # noqa: E402

pytestmark = pytest.mark.slow  # one launch of t rank processes per t

HAS_DEEPSEEK = hasattr(transformers, "DeepseekV3ForCausalLM")
VOCAB = 8  # random drafts are accepted often enough that accepted chains run on every rank
K = 3
MAX_BS = 4
MODES = {"chain": dict(algorithm="EAGLE3", num_draft_tokens=K),
         "tree": dict(algorithm="EAGLE3", num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3),
         "mixed": dict(algorithm="EAGLE3", num_draft_tokens=K),  # per request: no drafting, 1 token, or K
         "mtp": dict(algorithm="MTP", num_draft_tokens=K)}
CASES = ["chain", "tree", "mixed"] + (["mtp"] if HAS_DEEPSEEK else [])
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
WALL_S = 300


# The NextN layer (seed 2) has drafts accepted on test_engine_mtp_tp's prompts.
MTP_PROMPTS = [[5, 1, 4, 2, 6, 7, 0], [2, 3, 2], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]]


def _prompts(mode: str):
    if mode == "mtp":
        return MTP_PROMPTS
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))] for _ in range(3)]


def _requests(mode: str):
    """In "mixed", one request never drafts (rounds where nobody drafts are plain target steps),
    one drafts a single token: the verify graph pads their rows, the head catches up."""
    if mode != "mixed":
        return [Request(list(p), GREEDY) for p in _prompts(mode)]
    long = SamplingParams(max_tokens=24, ignore_eos=True)  # outlives the drafting requests
    caps = [dict(params=long, speculative=False), dict(params=GREEDY, max_draft_tokens=1), dict(params=GREEDY)]
    return [Request(list(p), **c) for p, c in zip(_prompts(mode), caps)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs-tp")
    # As in test_engine_eagle_tp: 6 layers, 4 heads, 2 KV heads, a head whose drafts are accepted.
    target = write_tiny_model(root / "target", "llama", seed=0, weight_scale=3.0, vocab_size=VOCAB,
                              num_hidden_layers=6)
    found = {"target": target, "eagle3": write_eagle3_head(root / "eagle3", target, draft_vocab=4, seed=7)}
    if HAS_DEEPSEEK:
        from devtools.deepseek_models import write_tiny_deepseek

        found["deepseek"] = write_tiny_deepseek(root / "deepseek-mtp", seed=2, mtp=True, vocab_size=VOCAB)
    return found


def _model_kw(models, mode: str) -> dict:
    if mode == "mtp":
        return dict(target=str(models["deepseek"]), **MODES[mode])
    return dict(target=str(models["target"]), draft=str(models["eagle3"]), **MODES[mode])


# ---- inside each rank process --------------------------------------------------------------------

_seen: dict[str, list] = {"graphs": [], "eager": []}


def _record_passes() -> None:
    """Record every graph replay (model, width, batch) and every pass the speculator runs outside a graph."""
    from specdecode_worker.engine.cuda_graph import GraphRunner, in_graph_pass
    from specdecode_worker.engine.speculation.head_passes import HeadPasses

    replay, target_pass, draft_pass = GraphRunner.replay, HeadPasses._target_pass, HeadPasses._draft_pass

    def recorded_replay(self, fb, *extras):
        model = "draft" if self.extras else "target"  # a head step takes the features as an extra input
        _seen["graphs"].append((model, self.tokens_per_req, fb.batch_size))
        return replay(self, fb, *extras)

    def recorded_target(self, fb, backend, rows):
        if not in_graph_pass():  # a prefill: one logit row per request; a verify pass: every row
            _seen["eager"].append(("target", rows.numel() == fb.input_ids.numel()))
        return target_pass(self, fb, backend, rows)

    def recorded_draft(self, fb, backend, hidden, from_target, rows):
        if not in_graph_pass():  # the head's extend reads target features; its own steps do not
            _seen["eager"].append(("draft", not from_target))
        return draft_pass(self, fb, backend, hidden, from_target, rows)

    GraphRunner.replay = recorded_replay
    HeadPasses._target_pass = recorded_target
    HeadPasses._draft_pass = recorded_draft


def _capture(eng) -> None:
    if eng.device.type == "cpu":  # a CUDA engine captured its graphs in phase 3
        eng.speculator.capture_graphs(MAX_BS, eager=True)
    _seen["graphs"].clear()
    _seen["eager"].clear()


def _report(eng) -> dict:
    return {"graphs": list(_seen["graphs"]), "eager": list(_seen["eager"]), "tp": eng.draft_runner.tp.size}


def _lead(eng, mode: str) -> dict:
    reqs = run_all(eng, _requests(mode))
    return {**_report(eng), "outputs": [r.output_ids for r in reqs], "accepted": eng.stats.accepted_tokens}


def _rank(engine_kws: dict) -> dict:
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    _record_passes()
    return {mode: run_rank(EngineArgs(**kw), functools.partial(_lead, mode=mode), _report, prepare=_capture)
            for mode, kw in engine_kws.items()}


# ---- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(models):
    """t = 1 through the same graph stand-ins, and the target's own greedy output."""
    out = {}
    for mode in CASES:
        kw = _model_kw(models, mode)
        target = kw.pop("target")
        eng = engine(target, kw.pop("algorithm"), kw.pop("draft", None), context_len=CONTEXT,
                     max_running_requests=MAX_BS, **kw)
        eng.speculator.capture_graphs(MAX_BS, eager=True)
        out[mode] = [r.output_ids for r in run_all(eng, _requests(mode))]
        out[(mode, "NONE")] = [r.output_ids for r in run_all(engine(target, context_len=CONTEXT), _requests(mode))]
    return out


@pytest.fixture(scope="module")
def tp_runs(models):
    return launches(_rank, lambda tp: {mode: dict(_model_kw(models, mode), **tp_sizing(tp), max_running_requests=MAX_BS)
                                       for mode in CASES}, WALL_S)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mode", CASES)
def test_rounds_under_tp_replay_the_same_graphs_and_keep_greedy_output(single, tp_runs, tp, mode):
    ranks = [r[mode] for r in tp_runs(tp)]
    assert len(ranks) == tp and all(r is not None and r["tp"] == tp for r in ranks)  # sharded, released
    lead = ranks[0]
    assert single[mode] == single[(mode, "NONE")]  # t = 1 through graphs is exact
    assert lead["outputs"] == single[mode]
    assert lead["accepted"] > 0  # accepted drafts were committed on every rank
    graphs = {(model, width) for model, width, _ in lead["graphs"]}
    verify = MODES[mode]["num_draft_tokens"] + 1
    draft_step = MODES[mode].get("speculative_eagle_topk", 1)
    assert ("target", verify) in graphs and ("draft", draft_step) in graphs  # verify passes, draft steps
    if mode == "mixed":
        assert ("target", 1) in graphs  # rounds where nobody drafts: the plain target step's graph
    for r in ranks:
        assert r["graphs"] == lead["graphs"]  # every rank: the same graph, batch bucket and order
        # Outside graphs only prefill (last rows) and the head's extend over target features.
        assert ("target", True) not in r["eager"] and ("draft", True) not in r["eager"]
        assert ("target", False) in r["eager"] and ("draft", False) in r["eager"]


CUDA = dict(device="cuda", device_memory_bytes=None, max_total_tokens=4096, cuda_graph_max_bs=MAX_BS,
            max_running_requests=MAX_BS, context_len=CONTEXT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL inside captured graphs)")
def test_captured_graphs_over_nccl_keep_greedy_output(models):
    """t = 2 on two GPUs: every rank captures the speculator's CUDA graphs in phase 3, and rank 0's
    rounds replay them on both ranks; greedy output equals t = 1 on one GPU with its graphs."""
    kws = {mode: dict(_model_kw(models, mode), **CUDA) for mode in CASES}
    ranks = launch(2, _rank, (kws,), device="cuda", wall_timeout_s=WALL_S)
    for mode, kw in kws.items():
        kw = dict(kw)
        eng = engine(kw.pop("target"), kw.pop("algorithm"), kw.pop("draft", None), **kw)
        single = [r.output_ids for r in run_all(eng, _requests(mode))]
        lead = ranks[0][mode]
        assert lead["outputs"] == single
        verify = MODES[mode]["num_draft_tokens"] + 1
        assert ("target", verify) in {(model, width) for model, width, _ in lead["graphs"]}
        assert all(r[mode]["graphs"] == lead["graphs"] for r in ranks)
        assert all(("target", True) not in r[mode]["eager"] for r in ranks)


# ---- phase 3's warm-up under tensor parallelism, through the graphs ----------------------------

class _ReportedPeak:
    """CPU keeps no allocator peak: a reader that reports one, so the warm-up runs as on a GPU."""

    def reset(self):
        pass

    def peak(self):
        return 1 << 40

    reserved_peak = peak


def _rank_warming_up(engine_kws: dict) -> dict:
    """As on a GPU: the speculator's graphs (eager stand-ins here) exist before the warm-up, which
    rank 0 runs through them while the other ranks replay its announcements."""
    from specdecode_worker.engine import warmup
    from specdecode_worker.engine.engine import Engine
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    _record_passes()
    warmup.peak_reader = lambda device: _ReportedPeak()
    make = Engine._make_speculator

    def make_with_graphs(self):
        spec = make(self)
        spec.capture_graphs(MAX_BS, eager=True)
        return spec

    Engine._make_speculator = make_with_graphs
    warm: dict[str, list] = {}

    def keep_warm_up(eng, mode):
        warm[mode] = list(_seen["graphs"])
        _seen["graphs"].clear()
        _seen["eager"].clear()

    def lead(eng, mode):
        return {**_lead(eng, mode), "warm_up": warm[mode], "peak": eng.dynamic_peak.measured}

    def report(eng, mode):
        return {**_report(eng), "warm_up": warm[mode]}

    return {mode: run_rank(EngineArgs(**kw), functools.partial(lead, mode=mode), functools.partial(report, mode=mode),
                           prepare=functools.partial(keep_warm_up, mode=mode))
            for mode, kw in engine_kws.items()}


@pytest.mark.parametrize("mode", ["chain", "tree"] + (["mtp"] if HAS_DEEPSEEK else []))
def test_warm_up_under_tp_replays_the_same_graphs_on_every_rank(single, models, mode):
    """Phase 3's warm-up at t = 2 runs its full round through the speculator's graphs on every rank
    (the followers replay rank 0's announced graphs until it releases them), and serving after it is
    exact."""
    kw = dict(_model_kw(models, mode), **tp_sizing(2), max_running_requests=MAX_BS, cuda_graph_max_bs=MAX_BS)
    ranks = [r[mode] for r in launch(2, _rank_warming_up, ({mode: kw},), wall_timeout_s=WALL_S)]
    lead = ranks[0]
    assert lead["peak"] is not None  # the warm-up ran (and measured) on rank 0
    verify = MODES[mode]["num_draft_tokens"] + 1
    assert ("target", verify, MAX_BS) in lead["warm_up"]  # its full round: the largest batch's verify graph
    assert all(r["warm_up"] == lead["warm_up"] for r in ranks)
    assert lead["outputs"] == single[mode]
    assert all(r["graphs"] == lead["graphs"] for r in ranks)
