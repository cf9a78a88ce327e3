"""Phase 3's warm-up under tensor parallelism on CPU (gloo): rank 0 runs it, announcing every pass
as a round does, the other ranks replay them on their shards until it releases them, and every
engine then serves what a single rank serves. CPU keeps no allocator peak: each rank process
installs a reader that reports one, so the warm-up runs as it does on GPUs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.contract import GIB  # noqa: E402
from specdecode_worker.engine.parallel.distributed import launch  # noqa: E402
from specdecode_worker.engine.engine import EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.planner.plan import runtime_reserve_bytes  # noqa: E402

from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # one launch of two rank processes

VOCAB = 8
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [6, 7, 6], [2, 4, 6, 0, 1, 3, 5, 7, 2, 4]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
CONTEXT, TP, PEAK = 64, 2, 1 << 40
TREE = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)
CASES = {"STANDALONE": ("STANDALONE", "draft", dict(num_draft_tokens=3)),
         "EAGLE3-chain": ("EAGLE3", "eagle3", dict(num_draft_tokens=3)),
         "EAGLE3-tree": ("EAGLE3", "eagle3", TREE),
         "MTP": ("MTP", None, dict(num_draft_tokens=3))}


class ReportedPeak:
    """An allocator peak for CPU: always ``PEAK`` bytes."""

    def reset(self):
        pass

    def peak(self):
        return PEAK

    reserved_peak = peak


def _lead(eng) -> dict:
    reqs = run_all(eng, [Request(list(p), GREEDY) for p in PROMPTS])
    return {"outputs": [r.output_ids for r in reqs], "peak": eng.dynamic_peak.as_dict()}


def _report(eng) -> dict:
    return {"peak": eng.dynamic_peak.as_dict()}


def _rank(kws: dict) -> dict:
    from specdecode_worker.engine import warmup
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    warmup.peak_reader = lambda device: ReportedPeak()
    return {case: run_rank(EngineArgs(**kw), _lead, _report) for case, kw in kws.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup-tp")
    target = write_tiny_model(root / "target", "llama", seed=0, weight_scale=3.0, vocab_size=VOCAB,
                              num_hidden_layers=6)
    return {"target": target, "draft": write_tiny_model(root / "draft", "llama", seed=5, vocab_size=VOCAB),
            "eagle3": write_eagle3_head(root / "eagle3", target, draft_vocab=4, seed=7),
            "deepseek": write_tiny_deepseek(root / "deepseek-mtp", seed=2, mtp=True, vocab_size=VOCAB)}


def _kwargs(models, case: str, tp: int) -> dict:
    algorithm, draft, extra = CASES[case]
    target = models["deepseek" if algorithm == "MTP" else "target"]
    return dict(target=str(target), draft=str(models[draft]) if draft else None, algorithm=algorithm,
                device_memory_bytes=int((1.2 + 0.25 * (tp - 1)) * GIB), mem_fraction_static=0.95,
                runtime_bytes=runtime_reserve_bytes(tp), context_len=CONTEXT, max_running_requests=3,
                chunked_prefill_size=16, planned_dynamic_bytes=PEAK, **extra)


@pytest.fixture(scope="module")
def ranks(models):
    return launch(TP, _rank, ({case: _kwargs(models, case, TP) for case in CASES},), wall_timeout_s=300)


@pytest.mark.parametrize("case", list(CASES))
def test_rank_0_warms_up_the_sharded_engine_and_every_rank_serves_as_one_does(models, ranks, case):
    leader, follower = ranks[0][case], ranks[1][case]
    peak = leader["peak"]
    assert peak["measured"] is not None and peak["prompt_tokens"] == CONTEXT - 1 and peak["chunk_tokens"] == 16
    assert peak["batch"] == 3 and any("catch-up" in p for p in peak["passes"])
    assert follower["peak"]["measured"] is None and "rank 0" in follower["peak"]["note"]
    # The warm-up left nothing behind: the sharded engine serves the single-rank greedy output.
    single = _kwargs(models, case, 1)  # on cpu no warm-up runs here: nothing to leave behind
    one = engine(single.pop("target"), single.pop("algorithm"), single.pop("draft"), **single)
    want = [r.output_ids for r in run_all(one, [Request(list(p), GREEDY) for p in PROMPTS])]
    assert leader["outputs"] == want
