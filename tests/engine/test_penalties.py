"""Presence, frequency and repetition penalties under speculation: greedy output equals the target
alone with the same penalties, step by step over transformers' forward pass, with transformers'
own RepetitionPenaltyLogitsProcessor and vLLM's presence and frequency definitions."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.sampler.penalties import chain_extra, penalise, tree_extra  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from tests.engine_helpers import engine, every_algorithm_models, run_all  # noqa: E402

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [4, 0, 7, 7, 2, 1, 3, 6, 5, 0, 1]]
NEW = 14
EOS = 3  # the tiny models' eos_token_id


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return every_algorithm_models(tmp_path_factory.mktemp("penalties"))

CASES = {
    "NONE": ("small", None, {}),
    "STANDALONE": ("target", "copy", {}),
    "NGRAM": ("small", None, {}),
    "EAGLE": ("small", "eagle", dict(num_draft_tokens=3)),
    "EAGLE3-tree": ("small", "eagle3", dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)),
    "MTP": ("mtp", None, dict(num_draft_tokens=3)),  # the target's own NextN layer drafts
}


def reference(model_dir, prompt: list[int], presence: float, frequency: float, repetition: float,
              bias: dict[int, float] | None = None, min_tokens: int = 0) -> list[int]:
    """The target alone, one token at a time: its last logits, biased (EOS barred before
    ``min_tokens``), penalised, argmax (no EOS rule: the requests ignore EOS)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    repeated = transformers.RepetitionPenaltyLogitsProcessor(repetition)
    out: list[int] = []
    for _ in range(NEW):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            scores = hf(ids).logits[:, -1].float()
        for token, value in (bias or {}).items():
            scores[0, token] += value
        if len(out) < min_tokens:
            scores[0, EOS] = float("-inf")
        scores = repeated(ids, scores)[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=scores.shape[0]).float()
        scores = scores - frequency * counts - presence * (counts > 0).float()
        out.append(int(scores.argmax()))
    return out


def _base(case: str) -> str:
    return case.removesuffix("-graphs").removesuffix("-plain")


def _outputs(models, case, **penalties):
    target, draft, kw = CASES[_base(case)]
    eng = engine(models[target], case.split("-")[0], models[draft] if draft else None, max_running_requests=3, **kw)
    if case.endswith("-graphs"):  # verify rows padded per request, as CUDA graphs lay them out (eager stand-ins)
        eng.speculator.capture_graphs(3, eager=True)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, **penalties)
    # "-plain": requests that never draft, so EAGLE runs its plain rounds
    reqs = [Request(p, params, eos_token_ids=frozenset({EOS}), speculative=not case.endswith("-plain"))
            for p in PROMPTS]
    return [r.output_ids for r in run_all(eng, reqs)], eng


@pytest.mark.parametrize("case", list(CASES))
def test_repetition_penalty_equals_transformers_rule(models, case):
    got, eng = _outputs(models, case, repetition_penalty=1.5)
    assert got == [reference(models[CASES[case][0]], p, 0.0, 0.0, 1.5) for p in PROMPTS]
    plain, _ = _outputs(models, case)
    assert plain != got, "the penalty changed the output: the comparison above is not the unpenalised one"
    if case not in ("NONE", "MTP"):  # a random NextN layer's proposals are never accepted
        assert eng.stats.accepted_tokens > 0, "accepted proposals were penalised by their own rows"


@pytest.mark.parametrize("case", list(CASES) + ["EAGLE-graphs", "EAGLE3-tree-graphs", "EAGLE-plain"])
def test_presence_and_frequency_penalties_equal_the_target_alone(models, case):
    got, _ = _outputs(models, case, presence_penalty=0.6, frequency_penalty=0.9)
    target = models[CASES[_base(case)][0]]
    assert got == [reference(target, p, 0.6, 0.9, 1.0) for p in PROMPTS]


@pytest.mark.parametrize("case", list(CASES) + ["EAGLE3-tree-graphs"])
def test_logit_bias_and_min_tokens_equal_the_target_alone(models, case):
    """EOS is pushed up by a bias yet barred for the first 5 tokens; another token is pushed down."""
    bias = {EOS: 8.0, 6: -5.0, 5: 1.5}
    got, eng = _outputs(models, case, logit_bias=tuple(bias.items()), min_tokens=5, frequency_penalty=0.3)
    target = models[CASES[_base(case)][0]]
    assert got == [reference(target, p, 0.0, 0.3, 1.0, bias, 5) for p in PROMPTS]
    assert all(EOS not in out[:5] and EOS in out for out in got), "the floor held and the bias then showed"


def test_sampling_with_penalties_runs_and_leaves_no_slot(models):
    target, draft, kw = CASES["EAGLE3-tree"]
    eng = engine(models[target], "EAGLE3", models[draft], max_running_requests=3, **kw)
    params = SamplingParams(max_tokens=NEW, temperature=0.9, seed=5, ignore_eos=True, presence_penalty=1.0)
    reqs = run_all(eng, [Request(p, params) for p in PROMPTS])
    assert all(len(r.output_ids) == NEW for r in reqs)
    assert eng.kv_usage()[0] == 0


def test_the_rows_count_the_proposals_before_them():
    draft = torch.tensor([2, 2, 1])
    extra = chain_extra(draft, 4)
    assert extra.tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 2, 0]]
    # root 0 -> node 1 (token 3) -> node 2 (token 3); node 3 (token 1) is the root's other child
    tokens = torch.tensor([9, 3, 3, 1])
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert tree_extra(tokens, ancestors, 10)[:, [1, 3]].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]


def test_penalise_by_hand():
    r = Request([3], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0))
    r.output_ids = [1, 1]
    scores = torch.tensor([[1.0, 2.0, -1.0, 4.0]])
    # token 1: seen twice -> 2 / 2 - 0.25 * 2 - 0.5; token 3: in the prompt only -> 4 / 2
    assert penalise(scores, r).tolist() == [[1.0, 0.0, -1.0, 2.0]]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0), ("repetition_penalty", True)])
def test_out_of_range_penalties_are_refused(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value}).validate()
