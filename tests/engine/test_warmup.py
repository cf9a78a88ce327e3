"""Phase 3's warm-up: every pass the plan prices runs once at the plan's maxima, through the
speculator serving uses, and leaves nothing behind; planned against measured dynamic peak in
/plan, /metrics and the log; running out of memory in any pass is a start-up error (exit 3).

CPU keeps no allocator peak, so the real measurement runs on CUDA only (test_engine_cuda.py);
here a reader is injected that reports a chosen peak, and the warm-up's passes themselves run,
counted at the models' forward entry points, the samplers and the acceptance functions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.serving import metrics, server  # noqa: E402
from specdecode_worker.contract import ExitCode  # noqa: E402
from specdecode_worker.engine import warmup  # noqa: E402
from specdecode_worker.engine.sampler import batch_sampling  # noqa: E402
from specdecode_worker.engine.speculation import head_speculator, verify  # noqa: E402
from specdecode_worker.engine.speculation.head_passes import HeadPasses  # noqa: E402
from specdecode_worker.engine.engine import StartupError  # noqa: E402
from specdecode_worker.engine.model_runner import ModelRunner  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from devtools.eagle_heads import write_eagle3_head, write_eagle_head  # noqa: E402
from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402

PLANNED = 5 << 20
K, CHUNK, BATCH, GRAPH_BS, CONTEXT = 4, 48, 5, 3, 256
TREE = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)
# algorithm case -> (engine algorithm, draft model key, extra engine arguments)
CASES = {
    "NONE": ("NONE", None, {}),
    "STANDALONE": ("STANDALONE", "draft", {}),
    "NGRAM": ("NGRAM", None, {}),
    "EAGLE-chain": ("EAGLE", "eagle", {}),
    "EAGLE3-chain": ("EAGLE3", "eagle3", {}),
    "EAGLE3-tree": ("EAGLE3", "eagle3", TREE),
    "MTP": ("MTP", None, {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    out = tiny_models(root)
    out["eagle"] = write_eagle_head(root / "eagle", out["target"], seed=1)
    out["eagle3"] = write_eagle3_head(root / "eagle3", out["target"], draft_vocab=6, seed=3, aux_layer_ids=[0, 1, 1])
    out["deepseek"] = write_tiny_deepseek(root / "tiny-deepseek-mtp", mtp=True)
    return out


def _engine(models, case: str, **kw):
    algorithm, draft, extra = CASES[case]
    target = models["deepseek" if case == "MTP" else "target"]
    args = dict(context_len=CONTEXT, chunked_prefill_size=CHUNK, max_running_requests=BATCH,
                cuda_graph_max_bs=GRAPH_BS, num_draft_tokens=K)
    args.update(extra)
    args.update(kw)
    return engine(target, algorithm, models[draft] if draft else None, **args)


class FakePeak:
    """Reports ``static + extra`` bytes allocated at most and ``static + reserved`` reserved (default:
    ``extra``), and ``free_bytes`` free on the device; checks that the global RNG is untouched."""

    def __init__(self, extra: int, reserved: int | None = None, free_bytes: int = 0):
        self.extra, self.resets = extra, 0
        self.reserved = extra if reserved is None else reserved
        self.free_bytes = free_bytes
        self.static = None
        self.active = False

    def reset(self):
        self.resets += 1
        self.active = True
        self.rng = torch.get_rng_state()

    def peak(self):
        self.active = False
        assert torch.equal(self.rng, torch.get_rng_state()), "the warm-up drew from the global RNG"
        return self.static + self.extra

    def reserved_peak(self):
        return self.static + self.reserved

    def free(self):
        return self.free_bytes


class Passes:
    """Counts, while the warm-up runs, every forward entry point, sampler and acceptance call."""

    def __init__(self, fake: FakePeak):
        self.fake, self.calls = fake, []

    def record(self, *call):
        if self.fake.active:
            self.calls.append(call)

    def of(self, kind: str, who: str | None = None) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind and (who is None or c[1] == who)]


def _instrument(monkeypatch, extra: int = 0, **views) -> tuple[FakePeak, Passes]:
    fake = FakePeak(extra, **views)
    passes = Passes(fake)
    monkeypatch.setattr(warmup, "peak_reader", lambda device: fake)
    real_static = warmup.static_bytes

    def static(runners):
        fake.static = real_static(runners)
        return fake.static

    monkeypatch.setattr(warmup, "static_bytes", static)
    real_forward, real_target, real_draft = ModelRunner.forward, HeadPasses.run_target, HeadPasses.run_draft

    def forward(self, fb, last_only):
        passes.record("forward", self.name, fb.input_ids.numel(), len(fb.extend_lens), last_only)
        return real_forward(self, fb, last_only)

    def target(self, fb, backend, last_only=False, rows=None):
        passes.record("target", backend, fb.input_ids.numel(), len(fb.extend_lens), last_only)
        return real_target(self, fb, backend, last_only, rows)

    def draft(self, fb, backend, hidden, from_target, rows):
        passes.record("draft", backend, fb.input_ids.numel(), len(fb.extend_lens), hidden.shape[0])
        return real_draft(self, fb, backend, hidden, from_target, rows)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    monkeypatch.setattr(HeadPasses, "run_target", target)
    monkeypatch.setattr(HeadPasses, "run_draft", draft)
    real_probs, real_chains, real_trees = batch_sampling.batch_probs, verify.verify_chains, \
        head_speculator.accept_trees

    def probs(logits, params):
        passes.record("sample", logits.shape[0], all(p.top_k and p.top_p < 1 and not p.greedy for p in params))
        return real_probs(logits, params)

    def chains(draft, draft_probs, target, lengths, params, u):
        passes.record("accept", "chain", draft.shape[0], target.shape[1])
        return real_chains(draft, draft_probs, target, lengths, params, u)

    def trees(trees, shape, valid, logits, params, u):
        passes.record("accept", "tree", valid.shape[0], valid.shape[1])
        return real_trees(trees, shape, valid, logits, params, u)

    monkeypatch.setattr(batch_sampling, "batch_probs", probs)
    monkeypatch.setattr(verify, "verify_chains", chains)
    monkeypatch.setattr(head_speculator, "accept_trees", trees)
    return fake, passes


def _plan_reserving(dynamic_bytes: int):
    """A plan whose dynamic reserve is ``dynamic_bytes`` (what /metrics and /plan report as planned)."""
    from tests.operator_helpers import make_plan, typed

    plan = typed(make_plan())
    return dataclasses.replace(plan, reserve=dataclasses.replace(plan.reserve, dynamic_bytes=dynamic_bytes))


def _metric(eng, name: str, plan=None) -> float | None:
    text = metrics.render(SimpleNamespace(engine=eng, plan=plan, latency=None)).decode()
    for line in text.splitlines():
        if line.startswith(f"specdecode_{name} "):
            return float(line.split()[1])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_warm_up_runs_every_pass_the_plan_prices_at_its_maxima(models, monkeypatch, case):
    fake, passes = _instrument(monkeypatch, PLANNED - 1)
    eng = _engine(models, case, planned_dynamic_bytes=PLANNED)
    peak, spec = eng.dynamic_peak, eng.speculator
    assert fake.resets == 1 and peak.measured == PLANNED - 1 and not peak.over_plan
    assert eng.stats.phase_seconds["warm_up"] > 0  # its start-up cost, in /metrics and /plan
    prompt = CONTEXT - 1  # the longest prompt serving admits, in chunks
    tree = case == "EAGLE3-tree"
    width = TREE["num_draft_tokens"] + 1 if tree else 1 if case == "NONE" else K + 1
    assert (peak.prompt_tokens, peak.chunk_tokens, peak.batch, peak.width) == (prompt, CHUNK, BATCH, width)
    eagle = case.startswith("EAGLE") or case == "MTP"
    # Target prefill: the long prompt in chunk-sized passes, then the round's short prompts.
    prefill = [c for c in (passes.of("target", "target") if eagle else passes.of("forward", "target")) if c[4]]
    assert max(c[2] for c in prefill) == CHUNK
    # Short prompts for the round: two periods of k + 1 tokens after n of them (NGRAM's lookup).
    short = getattr(spec, "ngram_max", 0) + 2 * (spec.k + 1)
    assert sum(c[2] for c in prefill) == prompt + BATCH * short
    # The full round: the verify pass (or a plain decode step) of every request at its width.
    if eagle:
        verify = passes.of("target", "target_tree" if tree else "target")
        verify = [c for c in verify if not c[4]]
    else:
        verify = [c for c in passes.of("forward", "target") if not c[4] or case == "NONE"]
    assert (BATCH * width, BATCH) in [(c[2], c[3]) for c in verify]
    # Sampling with every filter on, at the verify width, and acceptance of every request.
    samples = passes.of("sample")
    assert samples and all(c[2] for c in samples)
    if case != "NONE":
        if not tree:  # a tree's acceptance samples inside accept_trees
            assert max(c[1] for c in samples) >= BATCH * width
        accept = passes.of("accept", "tree" if tree else "chain")
        assert (BATCH, width) in [(c[2], c[3]) for c in accept]
    # The draft: catch-up over the long prompt in chunks (EAGLE/MTP reading the features), then steps.
    if case == "STANDALONE":
        draft = passes.of("forward", "draft")
        assert max(c[2] for c in draft) == CHUNK
        assert sum(c[2] for c in draft if c[3] == 1) >= prompt  # the long prompt's catch-up, alone
        assert [c[3] for c in draft].count(BATCH) >= K - 1  # one token per request per step
    elif eagle:
        draft = passes.of("draft")
        extends = [c for c in draft if c[1] == "draft" and c[2] == CHUNK]
        assert extends and all(c[4] == c[2] for c in extends)  # one target feature per token
        assert sum(c[2] for c in draft if c[1] == "draft" and c[3] == 1) >= prompt  # the long prompt's catch-up
        if tree:
            steps = [c for c in passes.of("draft", "draft_tree") if c[3] == BATCH]
            assert len(steps) == TREE["speculative_num_steps"] - 1
            assert all(c[2] == BATCH * TREE["speculative_eagle_topk"] for c in steps)
        else:
            steps = [c for c in draft if (c[2], c[3]) == (BATCH, BATCH)]
            assert len(steps) >= K - 1
    else:
        assert not passes.of("forward", "draft") and not passes.of("draft")
    # Reported in the DynamicPeak note and /plan.
    assert len(peak.passes) >= 2 and all(p in peak.note for p in peak.passes)
    assert f"{BATCH} requests x {width} tokens" in peak.note
    assert peak.as_dict()["passes"] == list(peak.passes)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_warm_up_leaves_pools_counters_and_outputs_as_a_fresh_engine_has_them(models, monkeypatch, case):
    fresh = _engine(models, case)  # on cpu: no reader, so no warm-up
    assert fresh.dynamic_peak.measured is None
    _instrument(monkeypatch)
    warmed = _engine(models, case, planned_dynamic_bytes=PLANNED)
    assert warmed.dynamic_peak.measured is not None
    for eng in (fresh, warmed):
        pool, alloc = eng.target_runner.req_to_token_pool, eng.target_runner.token_to_kv_pool_allocator
        assert alloc.available_size() == alloc.size and pool.available_size() == BATCH
    f_pool, w_pool = fresh.target_runner.req_to_token_pool, warmed.target_runner.req_to_token_pool
    assert f_pool.free_rows() == w_pool.free_rows() and torch.equal(f_pool.req_to_token, w_pool.req_to_token)
    assert torch.equal(fresh.target_runner.token_to_kv_pool_allocator.free_slots(),
                       warmed.target_runner.token_to_kv_pool_allocator.free_slots())
    for name in warmup.SPECULATOR_COUNTERS:
        assert getattr(fresh.speculator, name, None) == getattr(warmed.speculator, name, None)
    assert getattr(warmed.speculator, "_features", {}) == {}
    assert warmed.stats.decode_steps == 0 and warmed.stats.generated_tokens == 0
    prompts = [[5, 17, 42, 8, 99, 23, 4, 61, 7], [20, 21, 22, 20, 21, 22], list(range(30, 50))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = [[r.output_ids for r in run_all(eng, [Request(p, params) for p in prompts])] for eng in (fresh, warmed)]
    assert outs[0] == outs[1]


def _oom_when(monkeypatch, cls, name: str, hit):
    real = getattr(cls, name)

    def fail(*args, **kw):
        if hit(*args, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kw)

    monkeypatch.setattr(cls, name, fail)


OOM_CASES = {
    # case, where the memory runs out, words the message names, what it says to lower
    "target prefill": ("STANDALONE", lambda mp: _oom_when(
        mp, ModelRunner, "forward",
        lambda self, fb, last_only: self.name == "target" and fb.input_ids.numel() == CHUNK),
        "target prefill", "chunkedPrefillSize"),
    "head catch-up": ("EAGLE3-chain", lambda mp: _oom_when(
        mp, HeadPasses, "run_draft", lambda self, fb, backend, *a: fb.input_ids.numel() == CHUNK),
        "EAGLE head catch-up", "chunkedPrefillSize"),
    "draft chain steps": ("STANDALONE", lambda mp: _oom_when(
        mp, ModelRunner, "forward", lambda self, fb, last_only: self.name == "draft" and len(fb.extend_lens) == BATCH),
        "draft model chain steps", "cudaGraphMaxBs"),
    "draft tree steps": ("EAGLE3-tree", lambda mp: _oom_when(
        mp, HeadPasses, "run_draft",
        lambda self, fb, backend, *a: backend == "draft_tree" and len(fb.extend_lens) == BATCH),
        "EAGLE head tree steps", "cudaGraphMaxBs"),
    "NextN layer steps": ("MTP", lambda mp: _oom_when(
        mp, HeadPasses, "run_draft", lambda self, fb, backend, *a: len(fb.extend_lens) == BATCH),
        "NextN layer chain steps", "cudaGraphMaxBs"),
    "verify": ("NGRAM", lambda mp: _oom_when(
        mp, ModelRunner, "forward", lambda self, fb, last_only: fb.input_ids.numel() == BATCH * (K + 1)),
        "verify", "maxRunningRequests"),
    "sampling": ("EAGLE-chain", lambda mp: mp.setattr(batch_sampling, "batch_probs", _no_memory_at(BATCH * (K + 1))),
                 "sampling (temperature, top-k, top-p) and acceptance", "cudaGraphMaxBs"),
}


def _no_memory_at(rows: int):
    real = batch_sampling.batch_probs

    def probs(logits, params):
        if logits.shape[0] >= rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(logits, params)

    return probs


@pytest.mark.parametrize("where", list(OOM_CASES))
def test_running_out_of_memory_in_any_warm_up_pass_is_the_exit_3_start_up_error(models, monkeypatch, where):
    case, inject, names, lower = OOM_CASES[where]
    _instrument(monkeypatch)
    inject(monkeypatch)
    with pytest.raises(StartupError) as failed:
        _engine(models, case, planned_dynamic_bytes=PLANNED)
    message = str(failed.value)
    assert "ran out of device memory" in message and names in message, message
    assert lower in message and str(PLANNED) in message and "--mem-fraction-static" in message
    assert ExitCode.DOES_NOT_FIT == 3  # what serve_cli makes of a StartupError


@pytest.mark.parametrize("error", ["Triton Error [CUDA]: out of memory", "an unrelated kernel fault"])
def test_a_kernel_launch_without_memory_is_the_same_start_up_error(models, monkeypatch, error):
    """Triton raises a plain RuntimeError when the driver cannot give a launch its memory (on an
    H200 the long prompt's first extend launch, with 0.40 GiB free): that is running out of memory
    too; any other RuntimeError is a fault and propagates as it is."""
    _instrument(monkeypatch)
    real = ModelRunner.forward

    def launch(self, fb, last_only=False):
        if self.name == "target" and fb.input_ids.numel() == CHUNK:
            raise RuntimeError(error)
        return real(self, fb, last_only)

    monkeypatch.setattr(ModelRunner, "forward", launch)
    expected = StartupError if "out of memory" in error else RuntimeError
    with pytest.raises(expected) as failed:
        _engine(models, "NGRAM", planned_dynamic_bytes=PLANNED)
    if expected is StartupError:
        assert "ran out of device memory in: target prefill" in str(failed.value)
        assert "chunkedPrefillSize" in str(failed.value) and error in str(failed.value)
    else:
        assert type(failed.value) is RuntimeError and str(failed.value) == error


def test_a_failed_warm_up_gives_back_every_slot_and_row(models, monkeypatch):
    eng = _engine(models, "EAGLE3-tree")
    pool, alloc = eng.target_runner.req_to_token_pool, eng.target_runner.token_to_kv_pool_allocator
    rows, slots, table = pool.free_rows(), alloc.free_slots(), pool.req_to_token.clone()
    _instrument(monkeypatch)
    _oom_when(monkeypatch, HeadPasses, "run_target",
              lambda self, fb, backend, *a, **kw: backend == "target_tree" and len(fb.extend_lens) == BATCH)
    with pytest.raises(warmup.WarmUpOutOfMemory, match="tree verify"):
        warmup.warm_up(eng.speculator, eng.model_runners(), PLANNED, CHUNK, BATCH)
    assert pool.free_rows() == rows and torch.equal(alloc.free_slots(), slots)
    assert torch.equal(pool.req_to_token, table) and eng.speculator._features == {}


def test_cpu_reports_no_measurement_rather_than_a_guess(models):
    eng = engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=32)
    peak = eng.dynamic_peak
    assert peak.planned == PLANNED and peak.measured is None and "not measurable on cpu" in peak.note
    assert _metric(eng, "dynamic_bytes_measured") is None


def test_a_peak_above_plan_is_warned_with_both_numbers_and_exported(models, monkeypatch, caplog):
    fake, _ = _instrument(monkeypatch, PLANNED + 12345)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        eng = _engine(models, "STANDALONE", planned_dynamic_bytes=PLANNED)
    peak = eng.dynamic_peak
    assert fake.resets == 1
    assert (peak.planned, peak.measured) == (PLANNED, PLANNED + 12345) and peak.over_plan
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(PLANNED + 12345) in warned[0] and str(PLANNED) in warned[0]
    plan = _plan_reserving(PLANNED)
    assert _metric(eng, "dynamic_bytes_measured", plan) == PLANNED + 12345
    assert _metric(eng, "dynamic_bytes_planned", plan) == PLANNED


def test_a_peak_within_plan_logs_no_warning(models, monkeypatch, caplog):
    _instrument(monkeypatch, PLANNED - 1)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        eng = engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=16)
    assert eng.dynamic_peak.measured == PLANNED - 1 and not eng.dynamic_peak.over_plan
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # /plan shows planned against measured, and what the warm-up ran.
    http = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(
        engine=eng, plan=_plan_reserving(PLANNED)))))
    dynamic = asyncio.run(server.plan(http))["dynamicBytes"]
    assert (dynamic["planned"], dynamic["measured"]) == (PLANNED, PLANNED - 1)
    assert dynamic["passes"] == list(eng.dynamic_peak.passes) and "decode" in dynamic["passes"][-1]
    assert dynamic["note"] == eng.dynamic_peak.note



def test_reserved_bytes_above_plan_are_over_plan_even_with_allocated_bytes_within(models, monkeypatch, caplog):
    """The allocator's reserved peak (its slack and the graph pools) is checked against the plan
    too: allocated within plan and reserved above it is a warning naming the reserved view, and
    both are in /metrics and /plan."""
    _instrument(monkeypatch, PLANNED - 1, reserved=PLANNED + 7)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        eng = engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=16)
    peak = eng.dynamic_peak
    assert (peak.measured, peak.reserved, peak.driver) == (PLANNED - 1, PLANNED + 7, None)
    assert peak.over() == ["reserved"] and peak.over_plan
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"reserved {PLANNED + 7}" in warned[0] and "as reserved:" in warned[0]
    plan = _plan_reserving(PLANNED)
    assert _metric(eng, "dynamic_bytes_reserved", plan) == PLANNED + 7
    assert _metric(eng, "dynamic_bytes_driver", plan) is None  # no device budget on CPU: no driver view
    http = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(engine=eng, plan=plan))))
    dynamic = asyncio.run(server.plan(http))["dynamicBytes"]
    assert (dynamic["measured"], dynamic["reserved"]) == (PLANNED - 1, PLANNED + 7)


def test_the_driver_view_is_what_the_device_lost_beyond_weights_pools_and_runtime(models, monkeypatch):
    """With the free memory before start-up (the plan's G) and the runtime phase 2 measured, the
    driver's view is G less what is free after the warm-up, less weights, pools and runtime."""
    eng = engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=16)
    fake, _ = _instrument(monkeypatch, 100, free_bytes=1 << 30)
    static = warmup.static_bytes(eng.model_runners())
    device, runtime = (1 << 30) + static + (3 << 20) + PLANNED + 5, 3 << 20
    peak = warmup.warm_up(eng.speculator, eng.model_runners(), PLANNED, 16, 2, device, runtime)
    assert (peak.measured, peak.reserved, peak.driver) == (100, 100, PLANNED + 5)
    assert peak.over() == ["driver"]


def test_the_retraction_counter_is_exported(models):
    eng = engine(models["target"])
    eng.stats.retracted_requests = 3
    assert _metric(eng, "retractions_total") == 3
