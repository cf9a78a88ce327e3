"""Structured outputs under speculation: with a grammar, greedy output equals the target alone
under the same grammar (transformers' forward pass, each step masked by a fresh llguidance
matcher), for every algorithm, and sampled output always matches the grammar."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
llguidance = pytest.importorskip("llguidance")

from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.serving.structured import grammar_source, token_grammar  # noqa: E402

from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from tests.engine_helpers import engine, run_all, tiny_models_with_eagle_heads  # noqa: E402

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3], [4, 0, 7, 7, 2, 1, 3, 6, 5, 0, 1]]
NEW = 14
# Pairs of words. The tiny tokenizers are word-level, so a word another token begins ("one" and
# "on") would let a mask allow a token no other token can complete; these words have no such prefix.
# "small" has 8 tokens (the a an of are 4..7); the 160-token models have every word.
GRAMMARS = {8: r"((the|a)of)+", 160: r"((two|six|cat)(red|blue|green|four))+"}
EOS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    found = tiny_models_with_eagle_heads(root, vocab=8, num_hidden_layers=6, draft_vocab=6)
    found["mtp"] = write_tiny_deepseek(root / "mtp", mtp=True)
    return found


@pytest.fixture(scope="module")
def tokenizer(models):
    return transformers.AutoTokenizer.from_pretrained(models["target"])


CASES = {
    "NONE": ("small", None, {}),
    "STANDALONE": ("target", "copy", {}),
    "STANDALONE-draft": ("target", "draft", {}),
    "NGRAM": ("small", None, {}),
    "EAGLE": ("small", "eagle", dict(num_draft_tokens=3)),
    "EAGLE3-tree": ("small", "eagle3", dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)),
    "MTP": ("mtp", None, dict(num_draft_tokens=3)),  # the target's own NextN layer drafts
}


def vocab_of(model_dir) -> int:
    return transformers.AutoConfig.from_pretrained(model_dir).vocab_size


def grammar_for(tokenizer, model_dir):
    vocab = vocab_of(model_dir)
    return token_grammar(tokenizer, vocab, llguidance.LLMatcher.grammar_from_regex(GRAMMARS[vocab]))


def reference(model_dir, tokenizer, prompt: list[int]) -> list[int]:
    """The target alone: its last logits, masked by the grammar, argmax; to EOS, the grammar's end or NEW tokens."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    grammar = grammar_for(tokenizer, model_dir)
    out: list[int] = []
    while len(out) < NEW:
        with torch.no_grad():
            scores = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        token = int(scores.masked_fill(~grammar.mask(), float("-inf")).argmax())
        out.append(token)
        grammar.commit([token])
        if token == EOS or grammar.complete:
            break
    return out


def _base(case: str) -> str:
    return case.removesuffix("-graphs").removesuffix("-plain")


def _run(models, tokenizer, case, **params):
    target, draft, kw = CASES[_base(case)]
    algorithm = case.split("-")[0]
    eng = engine(models[target], algorithm, models[draft] if draft else None, max_running_requests=3, **kw)
    if case.endswith("-graphs"):  # verify rows padded per request, as CUDA graphs lay them out (eager stand-ins)
        eng.speculator.capture_graphs(3, eager=True)
    # "-plain": requests that never draft, so EAGLE runs its plain rounds
    reqs = [Request(p, SamplingParams(max_tokens=NEW, **params), grammar=grammar_for(tokenizer, models[target]),
                    speculative=not case.endswith("-plain")) for p in PROMPTS]
    return run_all(eng, reqs), eng


def matches(tokenizer, vocab: int, tokens: list[int]) -> bool:
    """The tokens are a prefix the grammar allows (a fresh matcher takes every one)."""
    matcher = token_grammar(tokenizer, vocab, llguidance.LLMatcher.grammar_from_regex(GRAMMARS[vocab])).matcher
    return matcher.validate_tokens(tokens) == len(tokens)


@pytest.mark.parametrize("case", list(CASES) + ["EAGLE-graphs", "EAGLE3-tree-graphs", "EAGLE-plain"])
def test_greedy_output_under_a_grammar_equals_the_target_alone(models, tokenizer, case):
    reqs, eng = _run(models, tokenizer, case, temperature=0.0)
    target = models[CASES[_base(case)][0]]
    assert [r.output_ids for r in reqs] == [reference(target, tokenizer, p) for p in PROMPTS]
    assert all(matches(tokenizer, vocab_of(target), r.output_ids) for r in reqs)
    assert eng.kv_usage()[0] == 0
    if case != "NONE" and not case.endswith("-plain"):
        assert eng.stats.proposed_tokens > 0, "the rounds drafted: the masks were applied to verify rows"


def test_the_grammar_changes_the_output(models, tokenizer):
    free = run_all(engine(models["small"], "NONE"), [Request(p, SamplingParams(max_tokens=NEW)) for p in PROMPTS])
    ruled, _ = _run(models, tokenizer, "NONE", temperature=0.0)
    assert [r.output_ids for r in free] != [r.output_ids for r in ruled]


@pytest.mark.parametrize("case", ["STANDALONE-draft", "EAGLE3-tree", "NGRAM"])
def test_sampled_output_always_matches_the_grammar(models, tokenizer, case):
    reqs, eng = _run(models, tokenizer, case, temperature=1.0, seed=7)
    vocab = vocab_of(models[CASES[case][0]])
    assert all(r.output_ids and matches(tokenizer, vocab, r.output_ids) for r in reqs)
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert eng.kv_usage()[0] == 0


def test_a_finished_grammar_ends_the_request(models, tokenizer):
    """A grammar with one way to end stops the request there, EOS or not."""
    grammar = token_grammar(tokenizer, 8, llguidance.LLMatcher.grammar_from_regex("(the|a)of"))
    eng = engine(models["small"], "NGRAM")
    [r] = run_all(eng, [Request([4, 5], SamplingParams(max_tokens=NEW, ignore_eos=True), grammar=grammar)])
    assert len(r.output_ids) <= 3 and r.output_ids[1] == 7 and r.finish_reason == "stop"


def test_masks_follow_a_chain_and_a_tree(tokenizer):
    grammar = token_grammar(tokenizer, 8, llguidance.LLMatcher.grammar_from_regex(r"(the(a|an)of)+"))
    allowed = [row.nonzero().flatten().tolist() for row in grammar.masks_along([4, 5, 7, 4])]
    assert allowed == [[4], [5, 6], [7], [EOS, 4], [5, 6]]
    # a refused proposal (6 after "the a") is never consumed: rows from there on allow everything
    rows = grammar.masks_along([4, 5, 6, 7])
    assert rows[2].nonzero().flatten().tolist() == [7] and bool(rows[3].all()) and bool(rows[4].all())
    # root -> the -> {an, a}; a -> of
    tree = grammar.tree_masks([EOS, 4, 6, 5, 7], [0, 0, 1, 1, 3])
    assert [row.nonzero().flatten().tolist() for row in tree] == [[4], [5, 6], [7], [7], [EOS, 4]]
    assert grammar.mask().nonzero().flatten().tolist() == [4], "the matcher rolled back to the committed output"


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "'response_format' must be"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}, "Invalid type: bogus"),
    ({"type": "json_schema", "json_schema": {"schema": 3}}, "must be an object with a 'schema'"),
    ({"type": "json_object"}, "no token of this model's vocabulary can begin such an output"),
])
def test_formats_that_cannot_be_served_are_refused(tokenizer, response_format, message):
    with pytest.raises(InputError, match=message):
        token_grammar(tokenizer, 160, grammar_source(response_format))


def test_masks_past_the_grammars_end_leave_the_committed_state_alone(tokenizer):
    """Reading masks along proposals that finish the grammar (and its EOS) does not move the
    request's matcher: the same tokens then commit cleanly."""
    grammar = token_grammar(tokenizer, 8, llguidance.LLMatcher.grammar_from_regex("(the|a)of"))
    rows = grammar.masks_along([4, 7, EOS])
    assert [row.nonzero().flatten().tolist() for row in rows[:3]] == [[4, 5], [7], [EOS]]
    grammar.commit([4, 7])
    assert grammar.complete and not grammar.matcher.is_error()


def test_drafts_propose_within_the_grammar(models, tokenizer):
    """A draft that is a copy of the target, masked to the grammar as it drafts, proposes the
    target's own constrained choices: every proposal is accepted (unmasked, it proposes the
    target's unconstrained choices, which the grammar refuses wherever it binds)."""
    reqs, eng = _run(models, tokenizer, "STANDALONE", temperature=0.0)
    assert eng.stats.proposed_tokens > 0
    assert eng.stats.accepted_tokens == eng.stats.proposed_tokens


def test_lookups_are_cut_where_the_grammar_refuses(models, tokenizer):
    """NGRAM proposals stop before a token the grammar refuses: the prompts repeat tokens the
    grammar never allows, and no verified proposal is one of them."""
    reqs, eng = _run(models, tokenizer, "NGRAM", temperature=0.0)
    allowed = {4, 5, 7, EOS}  # the, a, of, and EOS after "of"
    seen = []
    real = eng.speculator.decode_round

    def spy(reqs, draft_lengths=None, lookup=None):
        if lookup is not None:
            seen.extend(t for proposal in lookup.proposals for t in proposal)
        return real(reqs, draft_lengths, lookup)

    eng.speculator.decode_round = spy
    more = [Request(p, SamplingParams(max_tokens=NEW), grammar=grammar_for(tokenizer, models["small"]))
            for p in PROMPTS]
    run_all(eng, more)
    assert seen and set(seen) <= allowed
