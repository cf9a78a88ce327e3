"""The prefix cache under every algorithm: the same requests, driven step by step the same way,
give the same tokens and the same accepted proposals with the cache on and off.

Equal outputs check the target's cached K/V; equal accepted counts check the draft's, since a
draft reading stale K/V proposes other tokens (greedy, the target alone decides the output).
The workload shares prefixes three ways: concurrent prompts with one system prompt, second turns
that extend a finished conversation, and a prompt that arrives while its prefix is still being
prefilled in chunks.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from tests.engine_helpers import engine, every_algorithm_models  # noqa: E402

NEW = 12
CHUNK = 16  # prefill chunk: the system prompt spans three


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return every_algorithm_models(tmp_path_factory.mktemp("prefix"))

CASES = {
    "NONE": ("small", None, {}),
    "STANDALONE": ("target", "draft", {}),
    "NGRAM": ("small", None, {}),
    "EAGLE": ("small", "eagle", dict(num_draft_tokens=3)),
    "EAGLE3-tree": ("small", "eagle3", dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)),
    "MTP": ("mtp", None, dict(num_draft_tokens=3)),
}


def _engine(models, case, cache: bool, **kw):
    target, draft, extra = CASES[case]
    return engine(models[target], case.split("-")[0], models[draft] if draft else None, max_running_requests=4,
                  chunked_prefill_size=CHUNK, prefix_cache=cache, **extra, **kw)


def _tokens(rng, n, vocab):
    return [rng.randrange(vocab) for _ in range(n)]


def _until_done(eng, reqs):
    while not all(r.done.is_set() for r in reqs):
        eng.step()


def _conversations(eng, params):
    """Three concurrent first turns under one system prompt, a late arrival while the first
    prompt is mid-prefill, then a second turn of each conversation. Returns every request."""
    vocab = eng.target_shape.vocab_size
    rng = random.Random(7)
    system = _tokens(rng, 40, vocab)
    first = [Request(system + _tokens(rng, 5, vocab), params(i)) for i in range(3)]
    for r in first:
        eng.submit(r)
    eng.step()  # the first chunk of the first prompt
    late = eng.submit(Request(system + _tokens(rng, 6, vocab), params(3)))
    _until_done(eng, first + [late])
    second = [Request(r.all_ids + _tokens(rng, 4, vocab), params(4 + i)) for i, r in enumerate(first)]
    for r in second:
        eng.submit(r)
    _until_done(eng, second)
    return first, late, second


def _greedy(_i):
    return SamplingParams(max_tokens=NEW, ignore_eos=True)


def _sampled(i):
    return SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.8, seed=100 + i)


def _assert_no_slot_held(eng):
    slots = eng.target_runner.slots
    assert slots.used() == slots.cached(), "every slot out of the allocator is in the cache"
    assert slots.cache.evictable == slots.cache.size, "no finished request still holds a cached position"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("params", [_greedy, _sampled], ids=["greedy", "sampled"])
def test_the_cache_changes_no_token_and_no_acceptance(models, case, params):
    on, off = _engine(models, case, True), _engine(models, case, False)
    with_cache, without = _conversations(on, params), _conversations(off, params)
    flat = lambda run: [run[0][0], run[0][1], run[0][2], run[1], *run[2]]  # noqa: E731
    assert [r.output_ids for r in flat(with_cache)] == [r.output_ids for r in flat(without)]
    assert [r.accepted_draft_tokens for r in flat(with_cache)] == [r.accepted_draft_tokens for r in flat(without)]
    assert [r.proposed_draft_tokens for r in flat(with_cache)] == [r.proposed_draft_tokens for r in flat(without)]

    first, late, second = with_cache
    assert late.cached_tokens >= 40 - 1, "the late prompt waited for the system prompt's prefill and reused it"
    for before, after in zip(first, second):
        # A head's K/V is cacheable up to its last drafting round; the target's up to the last token.
        assert after.cached_tokens >= len(before.prompt_ids), "the second turn reused the first turn"
    assert all(r.cached_tokens == 0 for r in flat(without))
    assert on.stats.cached_prompt_tokens == sum(r.cached_tokens for r in flat(with_cache))
    _assert_no_slot_held(on)
    assert off.kv_usage()[0] == 0


@pytest.mark.parametrize("case", ["STANDALONE", "EAGLE", "MTP"])
def test_eviction_under_pressure_loses_no_request_and_leaks_no_slot(models, case):
    """A pool of 160 slots for prompts of 40-60 tokens: the cache fills, is evicted, and requests
    are retracted; outputs equal the engine without a cache on a pool that never runs short."""
    vocab = 8 if CASES[case][0] == "small" else 100
    rng = random.Random(3)
    system = _tokens(rng, 36, vocab)
    prompts = [system + _tokens(rng, rng.randrange(4, 20), vocab) for _ in range(6)]
    prompts += [_tokens(rng, 44, vocab) for _ in range(3)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)

    def run(eng):
        reqs = [Request(p, params) for p in prompts]
        for r in reqs[:5]:
            eng.submit(r)
        _until_done(eng, reqs[:5])
        for r in reqs[5:]:
            eng.submit(r)
        _until_done(eng, reqs[5:])
        return reqs

    tight = _engine(models, case, True, max_total_tokens=160)
    roomy = _engine(models, case, False)
    got, want = run(tight), run(roomy)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert all(r.finish_reason == "length" for r in got)
    cache = tight.target_runner.slots.cache
    assert cache.evicted > 0, "the pool ran short: the cache must have been evicted"
    assert tight.stats.cached_prompt_tokens > 0
    _assert_no_slot_held(tight)
    assert tight.target_runner.slots.used() <= 160


def test_a_request_that_opts_out_neither_reuses_nor_leaves_kv(models):
    eng = _engine(models, "NONE", True)
    prompt = list(range(8)) * 5
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    private = eng.submit(Request(prompt, params, cache_prompt=False))
    _until_done(eng, [private])
    assert eng.target_runner.slots.cached() == 0 and eng.kv_usage()[0] == 0
    first = eng.submit(Request(prompt, params))
    _until_done(eng, [first])
    again = eng.submit(Request(prompt, params, cache_prompt=False))
    _until_done(eng, [again])
    assert (first.cached_tokens, again.cached_tokens) == (0, 0)
    assert again.output_ids == first.output_ids == private.output_ids
    reuse = eng.submit(Request(prompt, params))
    _until_done(eng, [reuse])
    assert reuse.cached_tokens == len(prompt) - 1, "a whole cached prompt: all but its last position"
    assert reuse.output_ids == first.output_ids


@pytest.mark.parametrize("case", ["EAGLE", "EAGLE3-tree", "MTP"])
def test_prompts_that_part_right_after_a_cached_prefix_draft_as_without_it(models, case):
    """A head's K/V at the last shared position read the next token, which differs from prompt to
    prompt: each prompt here parts from the cached ones right there, and a short prefix makes that
    position weigh in the head's attention."""
    vocab = 8 if CASES[case][0] == "small" else 100
    rng = random.Random(11)
    shared = _tokens(rng, 5, vocab)
    prompts = [shared + [t] + _tokens(rng, 3, vocab) for t in range(8)]

    def run(eng):
        done = []
        for i, p in enumerate(prompts):
            r = eng.submit(Request(p, _sampled(i)))
            _until_done(eng, [r])
            done.append(r)
        return done

    got, want = run(_engine(models, case, True)), run(_engine(models, case, False))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.accepted_draft_tokens for r in got] == [r.accepted_draft_tokens for r in want]
    # All but the last shared position: its head K/V read another prompt's next token.
    assert [r.cached_tokens for r in got[1:]] == [4] * 7


@pytest.mark.parametrize("case", ["NONE", "EAGLE"])
def test_samples_of_one_prompt_share_its_prefill(models, case):
    """n samples of one prompt, submitted together: the first prefills it, the others wait for its
    KV and reuse all of it but the last position; outputs equal those without the cache."""
    prompt = list(range(8)) * 6

    def run(eng):
        reqs = [eng.submit(Request(prompt, _sampled(i))) for i in range(3)]
        _until_done(eng, reqs)
        return reqs

    got, want = run(_engine(models, case, True)), run(_engine(models, case, False))
    assert [r.cached_tokens for r in got] == [0, len(prompt) - 1, len(prompt) - 1]
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
