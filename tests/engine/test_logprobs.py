"""Log-probabilities of the emitted tokens equal those of transformers' forward pass over the same
tokens, for every algorithm: a speculative round reports what the target alone reports."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.sampler.logprobs import token_logprobs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from devtools.tiny_models import write_tiny_model  # noqa: E402
from devtools.eagle_heads import write_eagle3_head, write_eagle_head  # noqa: E402
from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [4, 0, 7, 7, 2, 1, 3, 6, 5, 0, 1]]
TOP = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    found = tiny_models(root / "pair")
    # A small vocabulary: random heads and lookups get proposals accepted, so accepted tokens'
    # rows are read as well as the target's own next token's.
    small = write_tiny_model(root / "small", "llama", seed=0, weight_scale=3.0, vocab_size=8, num_hidden_layers=6)
    found.update(small=small, eagle=write_eagle_head(root / "eagle", small, seed=1),
                 eagle3=write_eagle3_head(root / "eagle3", small, draft_vocab=6, seed=3))
    return found


def reference(model_dir, prompt: list[int], output: list[int], top: int) -> list[tuple[float, list[int], list[float]]]:
    """transformers: each output token's log-probability under the logits that predict it, and the
    ``top`` most likely tokens there."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)], dim=-1)
    values, ids = logp.topk(top, dim=-1)
    return [(logp[i, t].item(), ids[i].tolist(), values[i].tolist()) for i, t in enumerate(output)]


CASES = {
    "NONE": ("target", None, {}),
    "STANDALONE": ("target", "copy", {}),  # a copy of the target: every proposal accepted
    "NGRAM": ("small", None, {}),
    "EAGLE": ("small", "eagle", dict(num_draft_tokens=3)),
    "EAGLE3-tree": ("small", "eagle3", dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)),
}


@pytest.mark.parametrize("case", list(CASES) + ["EAGLE-graphs", "EAGLE3-tree-graphs"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_targets_forward_pass(models, case, temperature):
    target, draft, kw = CASES[case.removesuffix("-graphs")]
    algorithm = case.split("-")[0]
    eng = engine(models[target], algorithm, models[draft] if draft else None, max_running_requests=3, **kw)
    if case.endswith("-graphs"):  # verify rows padded per request, as CUDA graphs lay them out (eager stand-ins)
        eng.speculator.capture_graphs(3, eager=True)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True, logprobs=TOP)
    reqs = run_all(eng, [Request(p, params) for p in PROMPTS])
    if algorithm != "NONE":
        assert eng.stats.accepted_tokens > 0, "accepted proposals' rows are read too"
    for r in reqs:
        assert [lp.token for lp in r.output_logprobs] == r.output_ids
        expected = reference(models[target], r.prompt_ids, r.output_ids, TOP)
        for got, (logprob, top_ids, top_values) in zip(r.output_logprobs, expected):
            assert got.logprob == pytest.approx(logprob, abs=1e-4)
            assert [t for t, _ in got.top] == top_ids
            assert [v for _, v in got.top] == pytest.approx(top_values, abs=1e-4)


@pytest.mark.parametrize("case", ["STANDALONE", "NGRAM", "EAGLE"])
def test_rounds_where_nobody_drafts_report_logprobs_too(models, case):
    """Every other round drafts nothing (as the adaptive policy decides under load): those plain
    steps report each token's log-probability as a verify pass does."""
    target, draft, kw = CASES[case]
    eng = engine(models[target], case, models[draft] if draft else None, max_running_requests=3, **kw)
    real, rounds = eng.speculator.decode_round, []

    def every_other_round_plain(reqs, draft_lengths=None, lookup=None):
        rounds.append(len(rounds) % 2)
        return real(reqs, [0] * len(reqs), None) if rounds[-1] else real(reqs, draft_lengths, lookup)

    eng.speculator.decode_round = every_other_round_plain
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=TOP)
    reqs = run_all(eng, [Request(p, params) for p in PROMPTS])
    assert 1 in rounds and 0 in rounds
    for r in reqs:
        assert [lp.token for lp in r.output_logprobs] == r.output_ids
        expected = reference(models[target], r.prompt_ids, r.output_ids, TOP)
        for got, (logprob, _, _) in zip(r.output_logprobs, expected):
            assert got.logprob == pytest.approx(logprob, abs=1e-4)


def test_mtp_logprobs_equal_the_targets_forward_pass(tmp_path):
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from devtools.deepseek_models import write_tiny_deepseek

    model_dir = write_tiny_deepseek(tmp_path / "tiny-deepseek-v3-mtp", mtp=True)
    eng = engine(model_dir, "MTP", num_draft_tokens=2, speculative_num_steps=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1)
    reqs = run_all(eng, [Request(p, params) for p in ([5, 17, 42, 8], [20, 21, 22])])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for r in reqs:
        with torch.no_grad():
            logits = hf(torch.tensor([r.prompt_ids + r.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits[len(r.prompt_ids) - 1: -1], dim=-1)
        expected = [logp[i, t].item() for i, t in enumerate(r.output_ids)]
        assert [lp.logprob for lp in r.output_logprobs] == pytest.approx(expected, abs=1e-4)


def test_without_logprobs_nothing_is_kept(models):
    eng = engine(models["target"], "STANDALONE", models["draft"])
    (r,) = run_all(eng, [Request(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))])
    assert len(r.output_ids) == 6 and r.output_logprobs == []


def test_logprobs_stop_with_the_output_at_max_tokens(models):
    """A round that verified more tokens than max_tokens keeps the log-probabilities of the kept ones."""
    eng = engine(models["target"], "STANDALONE", models["copy"], num_draft_tokens=4)
    (r,) = run_all(eng, [Request(PROMPTS[2], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))])
    assert len(r.output_ids) == 3 and [lp.token for lp in r.output_logprobs] == r.output_ids
    assert all(lp.top == () for lp in r.output_logprobs)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_a_bad_top_logprobs_count_is_refused(bad):
    with pytest.raises(InputError, match="logprobs"):
        SamplingParams(logprobs=bad).validate()


def test_token_logprobs_reads_the_rows_it_is_given():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    (first, second) = token_logprobs(logits, [[1, 0], []], [[0, 2], []], [2, 0])
    assert second == []
    expected = torch.log_softmax(logits, dim=-1)
    assert [lp.logprob for lp in first] == pytest.approx([expected[1, 0].item(), expected[0, 2].item()])
    assert [t for t, _ in first[0].top] == [0, 1] and [t for t, _ in first[1].top] == [2, 1]


@pytest.mark.parametrize("case", ["NONE", "STANDALONE", "EAGLE"])
def test_prompt_logprobs_equal_the_forward_pass_across_prefill_chunks(models, case):
    """Prefill in chunks of 3 tokens: each prompt token after the first is scored by the row before
    it, whichever chunk holds that row."""
    target, draft, kw = CASES[case]
    eng = engine(models[target], case, models[draft] if draft else None, max_running_requests=3,
                 chunked_prefill_size=3, **kw)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=TOP)
    reqs = run_all(eng, [Request(p, params) for p in PROMPTS])
    for r, prompt in zip(reqs, PROMPTS):
        expected = reference(models[target], prompt[:1], prompt[1:], TOP)
        assert [e.token for e in r.prompt_token_logprobs] == prompt[1:]
        for got, (value, ids, values) in zip(r.prompt_token_logprobs, expected):
            assert got.logprob == pytest.approx(value, abs=1e-4)
            assert [t for t, _ in got.top] == ids and [v for _, v in got.top] == pytest.approx(values, abs=1e-4)
    assert eng.kv_usage()[0] == 0
