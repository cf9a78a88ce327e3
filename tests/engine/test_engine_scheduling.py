"""Scheduling: chunked prefill, admission by held tokens plus estimated growth, retraction under pressure.

References are independent of the scheduling under test: transformers' greedy continuation for the
long prompts, and for the pressure tests (whose random prompts meet near-ties, logit margins of about
0.01, where transformers' cached and uncached passes disagree with each other) the plain engine with
whole-prompt prefill, one request at a time, on a pool where nothing is ever retracted.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import write_eagle_head  # noqa: E402
from tests.engine_helpers import engine, hf_greedy, run_all, tiny_models  # noqa: E402

CHUNK = 16
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 150) for _ in range(n)] for n in lengths]


LONG = _prompts([70, 9, 45])  # two prompts longer than a chunk, one shorter
PRESSURE = _prompts([20] * 6, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("scheduling")
    m = tiny_models(root)
    m["eagle"] = write_eagle_head(root / "eagle", m["target"], seed=1)
    return m


@pytest.fixture(scope="module")
def reference(models):
    """The target's own greedy continuation of each prompt, from transformers' generate."""
    return {tuple(p): out for p, out in zip(LONG, hf_greedy(models["target"], LONG, MAX_TOKENS))}


@pytest.fixture(scope="module")
def calm_reference(models):
    eng = engine(models["target"])
    return [run_all(eng, [Request(p, GREEDY)])[0].output_ids for p in PRESSURE]


def _pass_sizes(eng) -> list[int]:
    """Records the token count of every target forward pass (hooked on the target's module)."""
    sizes: list[int] = []
    eng.target_runner.model.register_forward_pre_hook(lambda _m, args: sizes.append(args[0].input_ids.numel()))
    return sizes


@pytest.mark.parametrize("algorithm,draft,kw", [
    ("NONE", None, {}),
    ("STANDALONE", "draft", dict(num_draft_tokens=3)),
    ("EAGLE", "eagle", dict(num_draft_tokens=3)),
])
def test_chunked_prefill_gives_the_unchunked_greedy_output(models, reference, algorithm, draft, kw):
    outputs = {}
    for chunk in (0, CHUNK):
        eng = engine(models["target"], algorithm, models[draft] if draft else None, chunked_prefill_size=chunk, **kw)
        sizes = _pass_sizes(eng)
        reqs = run_all(eng, [Request(p, GREEDY) for p in LONG])
        outputs[chunk] = [r.output_ids for r in reqs]
        assert eng.kv_usage()[0] == 0
        # Verify passes hold 3 requests x (k + 1) <= 12 tokens: only prefill can exceed a chunk.
        assert (max(sizes) <= CHUNK) == (chunk == CHUNK), sizes
    assert outputs[CHUNK] == outputs[0] == [reference[tuple(p)] for p in LONG]


def _pressured(models, algorithm, draft, params, tokens, **kw):
    """Six 20-token prompts on a pool of ``tokens`` slots; returns outputs and the engine."""
    eng = engine(models["target"], algorithm, models[draft] if draft else None, max_total_tokens=tokens,
                 chunked_prefill_size=CHUNK, **kw)
    reqs = run_all(eng, [Request(p, params) for p in PRESSURE])
    assert all(r.finish_reason == "length" and r.error is None for r in reqs)
    assert eng.kv_usage()[0] == 0 and eng.num_running == 0 and eng.num_waiting == 0
    return [r.output_ids for r in reqs], eng


@pytest.mark.parametrize("algorithm,draft,kw", [
    ("NONE", None, {}),
    ("STANDALONE", "draft", dict(num_draft_tokens=3)),
    ("EAGLE", "eagle", dict(num_draft_tokens=3)),
])
def test_retraction_under_pressure_loses_no_request_and_keeps_greedy_output(models, calm_reference, algorithm,
                                                                               draft, kw):
    # Six requests of 20 + 24 tokens (+ a round's slots) need about 290 slots at full length; 150
    # hold three. Admission at half the remaining output admits four, so some must be retracted.
    out, eng = _pressured(models, algorithm, draft, GREEDY, 150, **kw)
    assert eng.stats.retracted_requests > 0
    assert out == calm_reference


def test_retraction_keeps_seeded_sampling_where_it_stopped(models):
    """Recompute samples nothing: a retracted request's generator continues, so seeded output is
    the same as on a pool where nothing is retracted."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True)
    calm, calm_eng = _pressured(models, "NONE", None, params, 4096)
    pressed, eng = _pressured(models, "NONE", None, params, 150)
    assert calm_eng.stats.retracted_requests == 0 and eng.stats.retracted_requests > 0
    assert pressed == calm


def test_admission_by_estimate_admits_more_than_the_worst_case(models):
    """300 slots, requests of 10 prompt tokens and max_tokens 40, one slot per round (NONE).
    Worst case: 10 + 40 + 1 = 51 slots each, 5 admitted. Estimate (ratio 0.5): 10 + 20 + 1 = 31, 9."""
    prompts = _prompts([10] * 12, seed=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs, admitted, retracted = {}, {}, {}
    for ratio in (1.0, 0.5):
        eng = engine(models["target"], max_total_tokens=300, max_running_requests=16, new_token_ratio=ratio)
        reqs = [eng.submit(Request(p, params)) for p in prompts]
        eng.step()
        admitted[ratio] = eng.num_running
        while not all(r.done.is_set() for r in reqs):
            eng.step()
        outputs[ratio] = [r.output_ids for r in reqs]
        retracted[ratio] = eng.stats.retracted_requests
    assert admitted == {1.0: 5, 0.5: 9}
    assert retracted[1.0] == 0  # the worst-case reservation never runs short
    assert outputs[0.5] == outputs[1.0]
