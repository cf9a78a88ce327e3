"""Phase 3's warm-up: planned against measured dynamic peak, in /plan, /metrics and the log.

CPU keeps no allocator peak, so the real measurement runs on CUDA only (test_engine_cuda.py);
here a reader is injected that reports a chosen peak, and the warm-up passes themselves run.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker import metrics  # noqa: E402
from specdecode_worker.engine import warmup  # noqa: E402

from tests.engine_helpers import engine, tiny_models  # noqa: E402

PLANNED = 5 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("warmup"))


class FakePeak:
    """Reports ``static + extra`` bytes and records what ran between reset and read."""

    def __init__(self, extra: int):
        self.extra, self.resets = extra, 0
        self.static = None

    def reset(self):
        self.resets += 1

    def peak(self):
        return self.static + self.extra


def _with_fake_peak(monkeypatch, extra: int) -> tuple[FakePeak, list]:
    fake, passes = FakePeak(extra), []
    monkeypatch.setattr(warmup, "peak_reader", lambda device: fake)
    real_static, real_forward = warmup.static_bytes, warmup.forward_segments

    def static(runners):
        fake.static = real_static(runners)
        return fake.static

    def forward(runner, segments, last_only):
        passes.append((runner.name, [len(s.tokens) for s in segments]))
        return real_forward(runner, segments, last_only)

    monkeypatch.setattr(warmup, "static_bytes", static)
    monkeypatch.setattr(warmup, "forward_segments", forward)
    return fake, passes


def _metric(eng, name: str, plan: dict | None = None) -> float | None:
    text = metrics.render(SimpleNamespace(engine=eng, plan=plan, latency=None)).decode()
    for line in text.splitlines():
        if line.startswith(f"specdecode_{name} "):
            return float(line.split()[1])
    return None


def test_cpu_reports_no_measurement_rather_than_a_guess(models):
    eng = engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=32)
    peak = eng.dynamic_peak
    assert peak.planned == PLANNED and peak.measured is None and "not measurable on cpu" in peak.note
    assert _metric(eng, "dynamic_bytes_measured") is None


def test_a_peak_above_plan_is_warned_with_both_numbers_and_exported(models, monkeypatch, caplog):
    fake, passes = _with_fake_peak(monkeypatch, PLANNED + 12345)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        eng = engine(models["target"], "STANDALONE", models["draft"], planned_dynamic_bytes=PLANNED,
                     chunked_prefill_size=48, cuda_graph_max_bs=3, num_draft_tokens=4)
    peak = eng.dynamic_peak
    assert fake.resets == 1
    assert (peak.planned, peak.measured) == (PLANNED, PLANNED + 12345) and peak.over_plan
    # The largest prefill chunk, then the largest graph batch at the verify width, target and draft.
    assert passes == [("target", [48]), ("draft", [48]), ("target", [5] * 3), ("draft", [5] * 3)]
    assert (peak.chunk_tokens, peak.batch, peak.width) == (48, 3, 5)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(PLANNED + 12345) in warned[0] and str(PLANNED) in warned[0]
    plan = {"reserve": {"dynamicBytes": PLANNED}}
    assert _metric(eng, "dynamic_bytes_measured", plan) == PLANNED + 12345
    assert _metric(eng, "dynamic_bytes_planned", plan) == PLANNED
    # The warm-up gave back every slot and request row it took.
    alloc, pool = eng.target_runner.token_to_kv_pool_allocator, eng.target_runner.req_to_token_pool
    assert alloc.available_size() == alloc.size and pool.available_size() == eng.args.max_running_requests


def test_a_peak_within_plan_logs_no_warning(models, monkeypatch, caplog):
    _with_fake_peak(monkeypatch, PLANNED - 1)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        eng = engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=16)
    assert eng.dynamic_peak.measured == PLANNED - 1 and not eng.dynamic_peak.over_plan
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_retraction_counter_is_exported(models):
    eng = engine(models["target"])
    eng.stats.retracted_requests = 3
    assert _metric(eng, "retractions_total") == 3


def test_running_out_of_memory_in_the_warm_up_is_a_start_up_error_saying_what_to_change(models, monkeypatch):
    from specdecode_worker.engine.engine import StartupError

    _with_fake_peak(monkeypatch, 0)

    def no_memory(runner, segments, last_only):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(warmup, "forward_segments", no_memory)
    with pytest.raises(StartupError) as failed:
        engine(models["target"], planned_dynamic_bytes=PLANNED, chunked_prefill_size=32)
    message = str(failed.value)
    assert "32 prompt tokens" in message and str(PLANNED) in message and "chunkedPrefillSize" in message
