"""Speculative decoding against the target's own greedy output, and the sampling distribution."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.speculation.reference import ngram_match, ngram_propose  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from tests.engine_helpers import engine, hf_greedy, noisy_copy, run_all, tiny_models  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22], list(range(30, 60))]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def reference(models):
    """The target's own greedy continuation, from transformers' generate."""
    return hf_greedy(models["target"], PROMPTS, 40)


def _greedy(eng):
    return [r.output_ids for r in run_all(eng, [Request(p, GREEDY) for p in PROMPTS])]


def test_plain_decoding_equals_transformers_greedy(models, reference):
    assert _greedy(engine(models["target"])) == reference


def test_standalone_random_draft_is_exact(models, reference):
    eng = engine(models["target"], "STANDALONE", models["draft"])
    assert _greedy(eng) == reference
    assert eng.stats.proposed_tokens > 0
    assert eng.kv_usage()[0] == 0  # every slot, rejected ones included, went back


def test_standalone_copy_of_target_accepts_everything(models, reference):
    eng = engine(models["target"], "STANDALONE", models["copy"])
    assert _greedy(eng) == reference
    assert eng.stats.proposed_tokens > 0
    assert eng.stats.accepted_tokens == eng.stats.proposed_tokens  # acceptance 1.0


def test_ngram_is_exact_and_accepts_on_repetition(models, reference):
    eng = engine(models["target"], "NGRAM")
    assert _greedy(eng) == reference
    assert eng.stats.accepted_tokens > 0


@pytest.mark.parametrize("ngram_min", [2, 4])
def test_ngram_drafts_only_from_suffixes_of_ngram_min_tokens(models, reference, ngram_min):
    """A shorter match proposes nothing; the output is still the target's greedy."""
    eng = engine(models["target"], "NGRAM", ngram_min=ngram_min)
    spec, matched = eng.speculator, []
    real = spec.look_ahead

    def recorded(reqs, caps):
        lookup = real(reqs, caps)
        matched.extend(zip(lookup.proposals, lookup.classes))
        return lookup

    spec.look_ahead = recorded
    assert _greedy(eng) == reference
    assert all(n >= ngram_min for proposal, n in matched if proposal), matched
    assert all(not proposal for proposal, n in matched if n < ngram_min)
    assert any(proposal for proposal, _ in matched) and eng.stats.accepted_tokens > 0


def test_ngram_min_above_ngram_max_is_refused():
    from specdecode_worker.serving import serve_cli

    args = serve_cli.parser().parse_args(["--target", "/models/t", "--algorithm", "NGRAM", "--device", "cpu",
                                          "--device-memory-gib", "1", "--ngram-min", "5", "--ngram-max", "4"])
    with pytest.raises(InputError, match="--ngram-min 5: must be at most --ngram-max 4"):
        serve_cli.resolve(args)


@pytest.fixture(scope="module")
def partly_right(models, tmp_path_factory):
    """The target with a little noise in every weight: it agrees with the target often, not always."""
    return noisy_copy(models["target"], tmp_path_factory.mktemp("noisy") / "draft", scale=0.1)


@pytest.mark.parametrize("k", [1, 4, 7])
def test_standalone_partly_right_draft_is_exact(models, reference, partly_right, k):
    """Partial accepts over many rounds, with the draft's cache catching up after each, for three
    requests decoded together: the output is still transformers' greedy output."""
    eng = engine(models["target"], "STANDALONE", partly_right, num_draft_tokens=k)
    assert _greedy(eng) == reference
    stats = eng.stats
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    if k > 1:  # some rounds accepted part of the proposals: neither none nor all
        assert any(0 < n < k for n in stats.accept_lengths), stats.accept_lengths
    assert eng.kv_usage()[0] == 0


@pytest.mark.parametrize("k", [1, 7])
def test_draft_length_does_not_change_output(models, reference, k):
    eng = engine(models["target"], "STANDALONE", models["draft"], num_draft_tokens=k)
    assert _greedy(eng) == reference


def test_more_requests_than_batch_slots_queue_and_finish(models, reference):
    eng = engine(models["target"], "STANDALONE", models["copy"], max_running_requests=2)
    reqs = run_all(eng, [Request(p, GREEDY) for p in PROMPTS * 2])
    assert [r.output_ids for r in reqs] == reference * 2


def test_request_that_never_fits_is_refused_without_harming_others(models, reference):
    # 300 slots: room for one request at a time, never for a 400-token one.
    eng = engine(models["target"], "STANDALONE", models["draft"], device_memory_bytes=64 << 20,
                   max_total_tokens=300, context_len=512)
    running = [Request(PROMPTS[0], GREEDY)]
    eng.submit(running[0])
    eng.step()
    with pytest.raises(InputError, match="KV slots"):
        eng.submit(Request(list(range(4, 104)) * 4, SamplingParams(max_tokens=8)))
    with pytest.raises(InputError, match="context length"):
        eng.submit(Request([5] * 500, SamplingParams(max_tokens=20)))
    while not running[0].done.is_set():
        eng.step()
    assert running[0].output_ids == reference[0]


def test_ngram_lookup_takes_the_latest_longest_match():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 4, 7, 1, 2], k=2) == [4, 7]
    assert ngram_propose([5, 1, 2, 3, 6, 6, 1, 2, 3], k=3) == [6, 6, 1]
    assert ngram_propose([1, 2, 3], k=2) == []
    # The class of a proposal: the length of the suffix it matched (0: none).
    assert ngram_match([1, 2, 3, 9, 1, 2, 4, 7, 1, 2], k=2) == ([4, 7], 2)
    assert ngram_match([5, 1, 2, 3, 6, 6, 1, 2, 3], k=3, max_n=2) == ([6, 6, 1], 2)
    assert ngram_match([7, 8, 9, 1, 2, 3, 4, 8], k=4) == ([9, 1, 2, 3], 1)
    assert ngram_match([1, 2, 3], k=2) == ([], 0)
