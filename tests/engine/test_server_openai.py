"""The OpenAI API as the ``openai`` client drives it against the real server, under each kind of
draft (a STANDALONE model, NGRAM lookups, an EAGLE3 head as a chain and as a tree): logprobs equal
to transformers' forward pass over the returned tokens, streamed or not, echoed prompts, and ``n``
samples of one prompt."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.engine_helpers import tiny_models  # noqa: E402
from tests.server_helpers import free_port, serve_argv, serving  # noqa: E402

PROMPT = "one two three four five"
# algorithm, the model folder it drafts with, and its own flags
DRAFTS = {
    "STANDALONE": ("STANDALONE", "draft", ()),
    "NGRAM": ("NGRAM", None, ()),
    "EAGLE3": ("EAGLE3", "eagle3", ("--num-draft-tokens", "3")),
    "EAGLE3-tree": ("EAGLE3", "eagle3", ("--num-draft-tokens", "5", "--speculative-num-steps", "2",
                                         "--speculative-eagle-topk", "2")),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs-server")
    found = tiny_models(root)
    # the target has 2 layers: the head reads the states entering layers 0, 1 and 2 (the last one's output)
    found["eagle3"] = write_eagle3_head(root / "eagle3", found["target"], draft_vocab=96, seed=3,
                                        aux_layer_ids=[-1, 0, 1])
    return found


@pytest.fixture(scope="module", params=list(DRAFTS))
def client(models, request):
    algorithm, draft, flags = DRAFTS[request.param]
    argv = serve_argv(models, free_port(), "--spec-policy", "fixed", *flags)
    argv[argv.index("--algorithm") + 1] = algorithm
    at = argv.index("--draft")
    if draft is None:
        del argv[at: at + 2]
    else:
        argv[at + 1] = str(models[draft])
    with serving(argv) as (base, _state):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none")


@pytest.fixture(scope="module")
def hf(models):
    tok = transformers.AutoTokenizer.from_pretrained(models["target"])
    model = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    return tok, model


def forward_logprobs(hf, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    _tok, model = hf
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1: -1], dim=-1)


def test_completion_logprobs_equal_the_forward_pass(client, hf):
    tok, model = hf
    out = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    prompt_ids = tok(PROMPT).input_ids
    greedy = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    output_ids = greedy[0, len(prompt_ids):].tolist()  # the target's own greedy tokens: the server's too
    assert lp.tokens == [tok.decode([t]) for t in output_ids]
    expected = forward_logprobs(hf, prompt_ids, output_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        assert value == pytest.approx(expected[i, output_ids[i]].item(), abs=1e-4)
        best = expected[i].topk(2)
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
        assert list(top) == [tok.decode([t]) for t in best.indices.tolist()]
        assert value == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the chosen token is the likeliest


def test_chat_logprobs_streamed_equal_those_not_streamed(client):
    messages = [{"role": "user", "content": "count with me"}]
    kw = dict(model="target", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 10
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert all(math.isclose(c.logprob, c.top_logprobs[0].logprob, abs_tol=1e-6) for c in content)
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kw) if chunk.choices
                and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    # The second request reuses the first's prompt KV (prefix cache): its prefill computes the last
    # position alone, in another order of float sums, so the values agree within rounding.
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(streamed, content))


def test_sampled_tokens_get_their_own_logprobs(client):
    out = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                    logprobs=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 12 and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs == [{}] * 12


@pytest.mark.parametrize("kw, needle", [
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_completion_logprobs_get_400(client, kw, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        client.completions.create(model="target", prompt=PROMPT, max_tokens=2, **kw)


def test_top_logprobs_without_logprobs_gets_400(client):
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       top_logprobs=2)


def test_without_logprobs_the_field_is_null(client):
    out = client.completions.create(model="target", prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].logprobs is None


def test_n_greedy_samples_are_the_same_text(client):
    out = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0, n=3,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 1
    one = client.completions.create(model="target", prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == one.choices[0].text
    assert out.usage.completion_tokens == 3 * 6 and out.usage.prompt_tokens == one.usage.prompt_tokens


def test_n_seeded_samples_differ_and_repeat(client):
    def texts(stream: bool):
        kw = dict(model="target", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3,
                  extra_body={"ignore_eos": True})
        if not stream:
            return [c.text for c in client.completions.create(**kw).choices]
        joined = ["", "", ""]
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                joined[c.index] += c.text
        return joined

    first = texts(False)
    assert len(set(first)) > 1, "sample i draws from seed + i, not one stream n times"
    assert texts(False) == first and texts(True) == first


def test_n_chat_streams_name_each_choice(client):
    stream = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, temperature=0, n=2, stream=True)
    finished, roles = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and set(finished) == {0, 1}


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_gets_400(client, n):
    with pytest.raises(openai.BadRequestError, match=r"'n' must be an integer in \[1, 16\]"):
        client.completions.create(model="target", prompt=PROMPT, max_tokens=2, n=n)


def test_echo_returns_the_prompt_and_its_logprobs(client, hf):
    tok, model = hf
    kw = dict(model="target", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    choice = client.completions.create(**kw).choices[0]
    prompt_ids = tok(PROMPT).input_ids
    prompt_text = tok.decode(prompt_ids)
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    ids = prompt_ids + tok(choice.text[len(prompt_text):], add_special_tokens=False).input_ids
    assert len(lp.tokens) == len(prompt_ids) + 4
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt_ids)):
        assert lp.token_logprobs[i] == pytest.approx(logp[i - 1, ids[i]].item(), abs=1e-4)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(logp[i - 1].topk(2).values.tolist(), abs=1e-4)
    assert lp.text_offset[len(prompt_ids)] == len(prompt_text)
    streamed = [c for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs] == lp.token_logprobs


def test_a_repeated_prompt_reports_its_cached_tokens(client, hf):
    """The second request of a prompt reuses the first's KV (the prefix cache): usage says how much,
    /metrics and /plan count it, and the answer is the same."""
    tok, _ = hf
    prompt = " ".join(["seven eight nine ten"] * 12)  # long enough for n samples to share it too
    n_prompt = len(tok(prompt).input_ids)
    kw = dict(model="target", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert first.usage.prompt_tokens == n_prompt
    assert first.usage.prompt_tokens_details.cached_tokens <= 1, "at most a start token other prompts share"
    assert second.usage.prompt_tokens_details.cached_tokens == n_prompt - 1, "all but the last prompt token"
    assert second.choices[0].text == first.choices[0].text
    private = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "cache_prompt": False}})
    assert private.usage.prompt_tokens_details.cached_tokens == 0
    assert private.choices[0].text == first.choices[0].text
    base = str(client.base_url).removesuffix("/v1/")
    import httpx

    metrics = httpx.get(f"{base}/metrics").text
    cached = next(float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("specdecode_prompt_cached_tokens_total"))
    assert cached >= n_prompt - 1
    plan = httpx.get(f"{base}/plan").json()["prefixCache"]
    assert plan["cachedTokens"] >= n_prompt - 1 and plan["poolTokens"] > plan["cachedTokens"]


def _metric(base: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{base}/metrics").text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _ngram_replay(prompt_ids: list[int], greedy_ids: list[int], max_tokens: int, k: int) -> tuple[int, int]:
    """Accepted and rejected prediction tokens of fixed NGRAM drafting, replayed over the target's
    greedy tokens (``greedy_ids`` runs k + 1 past ``max_tokens``: a round may verify past the end)."""
    from specdecode_worker.engine.speculation.reference import ngram_match

    accepted = rejected = 0
    i = 1  # the first token comes from the prefill
    while i < max_tokens:
        proposal = ngram_match(prompt_ids + greedy_ids[:i], k, 4)[0]
        kept_drafts = 0
        while kept_drafts < len(proposal) and proposal[kept_drafts] == greedy_ids[i + kept_drafts]:
            kept_drafts += 1
        kept = min(kept_drafts + 1, max_tokens - i)  # the round's tokens the completion takes
        accepted += min(kept_drafts, kept)
        rejected += len(proposal) - min(kept_drafts, kept)
        i += kept
    return accepted, rejected


def test_usage_counts_accepted_and_rejected_prediction_tokens(client, hf, request):
    """``usage.completion_tokens_details``: drafted tokens in the completion and the rest, the same
    streamed and not, summed over ``n`` choices, and adding up to what the server's counters
    verified. For NGRAM, both equal a replay of the lookups over transformers' greedy tokens."""
    tok, model = hf
    prompt = "one two three one two three one two"
    base = str(client.base_url).removesuffix("/v1/")
    kw = dict(model="target", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    before = _metric(base, "specdecode_draft_proposed_tokens_total")
    whole = client.completions.create(**kw).usage.completion_tokens_details
    proposed = _metric(base, "specdecode_draft_proposed_tokens_total") - before
    accepted, rejected = whole.accepted_prediction_tokens, whole.rejected_prediction_tokens
    assert accepted + rejected == proposed > 0 and 0 <= accepted <= 15
    streamed = [c.usage for c in client.completions.create(stream=True, **kw) if c.usage]
    assert len(streamed) == 1
    details = streamed[0].completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (accepted, rejected)
    twice = client.completions.create(n=2, **kw).usage.completion_tokens_details
    assert (twice.accepted_prediction_tokens, twice.rejected_prediction_tokens) == (2 * accepted, 2 * rejected)
    if request.node.callspec.params["client"] == "NGRAM":
        prompt_ids = tok(prompt).input_ids
        greedy = model.generate(torch.tensor([prompt_ids]), max_new_tokens=21, min_new_tokens=21, do_sample=False)
        assert (accepted, rejected) == _ngram_replay(prompt_ids, greedy[0, len(prompt_ids):].tolist(), 16, 4)
        assert accepted > 0
