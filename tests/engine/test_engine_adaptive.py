"""The adaptive speculation policy inside the engine: greedy output never changes, whatever draft
lengths it picks; sampling stays exact when the draft length changes from round to round; a
request can turn drafting off or cap it."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.speculation.reference import ngram_match  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from devtools.eagle_heads import write_copying_eagle_head  # noqa: E402
from tests.policy_helpers import linear_cost  # noqa: E402
from tests.engine_helpers import (  # noqa: E402
    CHI2_CRIT, chi_square, engine, hf_greedy, noisy_copy, run_all, second_token_case, second_token_counts,
    tiny_models,
)
from devtools.tiny_models import write_tiny_model  # noqa: E402

# Repetitive prompts (NGRAM finds matches) next to ones without any repetition.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22], list(range(30, 60)), [3, 9, 3, 9, 3, 9, 3]]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    found = tiny_models(root)
    found["noisy"] = noisy_copy(found["target"], root / "noisy", scale=0.3)
    return found


@pytest.fixture(scope="module")
def reference(models):
    """The target's own greedy continuation, from transformers' generate."""
    return hf_greedy(models["target"], PROMPTS, 40)


def acceptance_driven(eng, probe_every: int = 4):
    """Pin the cost model to 'each verify token costs half a step' so the lengths follow acceptance
    (measured timings would make the test depend on the machine), and probe often."""
    eng.policy.cost = linear_cost(eng.policy.max_draft, plain=0.5, per_request=0.5, per_draft_token=0.5, per_pass=0.1)
    eng.policy.probe_every, eng.policy.probe_budget = probe_every, 1.0
    return eng


def greedy(eng, prompts=PROMPTS, **fields):
    return [r.output_ids for r in run_all(eng, [Request(p, GREEDY, **fields) for p in prompts])]


@pytest.mark.parametrize("algorithm, draft", [("NGRAM", None), ("STANDALONE", "noisy")])
def test_adaptive_fixed_and_none_give_the_same_greedy_output(models, reference, algorithm, draft):
    draft_dir = models[draft] if draft else None
    plain = engine(models["target"])
    fixed = engine(models["target"], algorithm, draft_dir, spec_policy="fixed")
    adaptive = acceptance_driven(engine(models["target"], algorithm, draft_dir, spec_policy="adaptive"))
    assert greedy(plain) == reference
    assert greedy(fixed) == reference
    assert greedy(adaptive) == reference
    # The fixed policy drafts all it can every round (K; an n-gram lookup's whole proposal, at most
    # K); the adaptive one really varied the length, down to 0.
    asked = fixed.stats.draft_lengths
    if algorithm == "NGRAM":
        assert sum(k * n for k, n in asked.items()) == fixed.stats.proposed_tokens and asked[4] > 0, asked
    else:
        assert set(asked) == {4}
    lengths = adaptive.stats.draft_lengths
    assert lengths[0] > 0 and len(lengths) >= 2, lengths
    assert 0 < adaptive.stats.steps_without_speculation < adaptive.stats.decode_steps
    assert adaptive.kv_usage()[0] == 0  # every slot, drafted or not, went back


@pytest.fixture(scope="module")
def eagle_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive-eagle")
    target = write_tiny_model(root / "target", "llama", seed=0, weight_scale=3.0, vocab_size=64, num_hidden_layers=6)
    return {"target": target, "head": write_copying_eagle_head(root / "head", target, seed=1)}


@pytest.mark.parametrize("tree", [dict(), dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)])
def test_eagle_skips_rounds_and_catches_up_exactly(eagle_models, tree):
    """Rounds without drafting are plain target steps whose features wait for the head: the
    next drafting round's extend covers every skipped token, and greedy output is the target's."""
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
    plain = greedy(engine(eagle_models["target"], max_running_requests=4), prompts)
    kw = {"num_draft_tokens": 4, "max_running_requests": 4, **tree}
    eng = engine(eagle_models["target"], "EAGLE", eagle_models["head"], spec_policy="adaptive", **kw)
    skips = iter(rng.random() < 0.4 for _ in range(10_000))
    # Lengths drawn at random per round and request, with whole rounds of none.
    eng.policy.draft_lengths = lambda rids, caps, **_: [0] * len(caps) if next(skips) else \
        [rng.randrange(0, c + 1) for c in caps]
    assert greedy(eng, prompts) == plain
    assert eng.stats.steps_without_speculation > 0 and eng.stats.accepted_tokens > 0
    assert eng.kv_usage()[0] == 0


def test_standalone_draft_cache_catches_up_after_rounds_without_drafting(models, reference):
    """A copy of the target as draft accepts everything only if its cache holds every committed
    token: with random lengths, 0 included, acceptance must stay exactly 1."""
    eng = engine(models["target"], "STANDALONE", models["copy"], spec_policy="adaptive")
    rng = random.Random(2)
    eng.policy.draft_lengths = lambda rids, caps, **_: [rng.choice([0, 0, c]) if c else 0 for c in caps]
    assert greedy(eng) == reference
    assert eng.stats.draft_lengths[0] > 0 and eng.stats.draft_lengths[4] > 0
    assert eng.stats.accepted_tokens == eng.stats.proposed_tokens > 0


def test_a_standalone_request_that_never_drafts_costs_no_draft_prefill(models, reference):
    """The draft model caches a prompt only when its request first drafts: requests with
    ``speculative: false`` leave the draft's token count at 0, and next to a drafting request they
    add nothing to what that request alone costs the draft."""
    eng = engine(models["target"], "STANDALONE", models["copy"], spec_policy="fixed")
    off = [Request(p, GREEDY, speculative=False) for p in PROMPTS]
    run_all(eng, off)
    assert [r.output_ids for r in off] == reference
    assert eng.speculator.draft_tokens == 0 and eng.stats.proposed_tokens == 0

    alone = engine(models["target"], "STANDALONE", models["copy"], spec_policy="fixed")
    run_all(alone, [Request(PROMPTS[2], GREEDY)])
    mixed = engine(models["target"], "STANDALONE", models["copy"], spec_policy="fixed")
    reqs = [Request(PROMPTS[0], GREEDY, speculative=False), Request(PROMPTS[2], GREEDY),
            Request(PROMPTS[3], GREEDY, speculative=False)]
    run_all(mixed, reqs)
    assert [r.output_ids for r in reqs] == [reference[0], reference[2], reference[3]]
    assert mixed.speculator.draft_tokens == alone.speculator.draft_tokens > len(PROMPTS[2])


def test_standalone_draft_catches_up_a_prompt_in_chunks(models, reference, monkeypatch):
    """A request that first drafts after many rounds has its draft cache built in passes of at
    most chunkedPrefillSize tokens, and the copy draft still accepts everything."""
    from specdecode_worker.engine.speculation import standalone

    eng = engine(models["target"], "STANDALONE", models["copy"], spec_policy="adaptive", chunked_prefill_size=8)
    widths, forward = [], standalone.forward_segments

    def counting(runner, segments, *a, **kw):
        if runner is eng.draft_runner:
            widths.append(sum(len(s.tokens) for s in segments))
        return forward(runner, segments, *a, **kw)

    monkeypatch.setattr(standalone, "forward_segments", counting)
    rounds = iter(range(10_000))
    eng.policy.draft_lengths = lambda rids, caps, **_: [c if next(rounds) >= 40 else 0 for c in caps]
    assert greedy(eng) == reference
    assert widths and max(widths) <= 8 and widths.count(8) >= 4, widths
    assert eng.stats.accepted_tokens == eng.stats.proposed_tokens > 0


def test_a_request_can_turn_drafting_off_or_cap_it(models, reference):
    eng = engine(models["target"], "NGRAM", spec_policy="fixed")
    reqs = [Request(PROMPTS[0], GREEDY, speculative=False), Request(PROMPTS[3], GREEDY, max_draft_tokens=1),
            Request(PROMPTS[3], GREEDY)]
    run_all(eng, reqs)
    assert [r.output_ids for r in reqs] == [reference[0], reference[3], reference[3]]
    assert reqs[0].proposed_draft_tokens == 0
    assert 0 < reqs[1].proposed_draft_tokens <= reqs[1].verify_rounds
    assert reqs[2].proposed_draft_tokens > reqs[2].verify_rounds
    with pytest.raises(InputError, match="max_draft_tokens"):
        eng.submit(Request(PROMPTS[1], GREEDY, max_draft_tokens=-1))


def test_unknown_policy_is_refused(models):
    with pytest.raises(InputError, match="--spec-policy"):
        engine(models["target"], "NGRAM", spec_policy="sometimes")


@pytest.mark.slow
def test_sampling_stays_exact_when_the_draft_length_changes(tmp_path):
    """Second sampled token of a STANDALONE engine whose draft length is drawn at random for every
    request and round (0 included) vs the exact marginal from transformers."""
    target, draft, prompt, exact, draft_marginal = second_token_case(tmp_path)
    eng = engine(target, "STANDALONE", draft, num_draft_tokens=3, max_running_requests=64, spec_policy="adaptive")
    rng = random.Random(1)
    eng.policy.draft_lengths = lambda rids, caps, **_: [rng.randrange(0, c + 1) for c in caps]
    counts = second_token_counts(eng, prompt)
    assert set(eng.stats.draft_lengths) == {0, 1, 2, 3}
    assert 0 < eng.stats.accepted_tokens < eng.stats.proposed_tokens
    assert chi_square(counts, exact) < CHI2_CRIT[7]
    assert chi_square(counts, draft_marginal) > CHI2_CRIT[7]


def test_an_undrafted_lookup_is_scored_against_the_token_the_round_committed(models, reference):
    """NGRAM held at k = 0 in every round: each round's lookup is still scored, and the verdicts
    are those a replay of the lookup over transformers' greedy output gives (its first token
    against the next one), with the matched suffix's length as the class."""
    eng = engine(models["target"], "NGRAM", spec_policy="adaptive")
    eng.policy.draft_lengths = lambda rids, caps, **kw: [0] * len(rids)
    scored: list[tuple[bool, int]] = []
    score = eng.policy.score

    def record(kept, classes):
        scored.extend(zip(kept, classes))
        score(kept, classes)

    eng.policy.score = record
    reqs = [Request(p, GREEDY) for p in PROMPTS]
    run_all(eng, reqs)
    k, max_n = eng.speculator.k, eng.speculator.ngram_max
    expected = []
    for r, prompt, out in zip(reqs, PROMPTS, reference):
        assert r.output_ids == out
        for i in range(1, len(out)):  # the first token comes from the prefill, each later one from a round
            proposal, n = ngram_match(prompt + out[:i], k, max_n)
            if proposal:
                expected.append((proposal[0] == out[i], n))
    assert sorted(scored) == sorted(expected)
    assert any(kept for kept, _ in scored) and not all(kept for kept, _ in scored)
