"""Batch sampling on the logits' device: distributions against a per-row reference, draws against
exact counts, and one host transfer per engine pass whatever the algorithm."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine.sampler import batch_sampling  # noqa: E402
from specdecode_worker.engine.sampler.batch_sampling import (batch_probs, chain_rows, choose_tokens, draw,  # noqa: E402
                                                     verify_chains)
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import write_eagle_head  # noqa: E402
from tests.engine_helpers import engine, tiny_models  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402


def _reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row the obvious way: softmax at the temperature, keep the top k, keep the smallest
    prefix of the sorted tokens whose mass before each token is below top_p, renormalise."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if p.top_k:
        keep &= row >= torch.topk(row, p.top_k).values[-1]
    probs = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
    if p.top_p < 1:
        order = torch.argsort(probs, descending=True).tolist()
        mass, kept = 0.0, []
        for t in order:
            if mass >= p.top_p:
                break
            kept.append(t)
            mass += float(probs[t])
        mask = torch.zeros_like(keep)
        mask[kept] = True
        probs = torch.where(mask, probs, 0) / torch.where(mask, probs, 0).sum()
    return probs


def test_each_row_gets_its_own_temperature_top_k_and_top_p():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=7),
              SamplingParams(temperature=2.0, top_p=0.6), SamplingParams(temperature=0.8, top_k=10, top_p=0.9)]
    got = batch_probs(logits, params)
    for row, p, g in zip(logits, params, got):
        torch.testing.assert_close(g.double(), _reference_probs(row, p), atol=1e-6, rtol=1e-5)


def test_draw_inverts_the_cumulative_distribution_exactly():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 2.0, 2.0]])  # the second unnormalised
    u = (torch.arange(1000) + 0.5) / 1000
    first = draw(probs[:1].expand(1000, 4), u)
    second = draw(probs[1:].expand(1000, 4), u)
    assert torch.bincount(first, minlength=4).tolist() == [100, 0, 600, 300]
    assert torch.bincount(second, minlength=4).tolist() == [0, 0, 500, 500]


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()]
    tokens, _ = choose_tokens(logits, params, torch.tensor([0.3, 0.7, 0.9]))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_greedy_chains_accept_the_prefix_equal_to_the_argmax():
    best = [[3, 1, 4, 1], [5, 9, 2, 6], [2, 7, 1, 8]]
    logits = torch.full((3, 4, 10), -5.0)
    for i, row in enumerate(best):
        for j, t in enumerate(row):
            logits[i, j, t] = 5.0
    draft = torch.tensor([[3, 1, 0], [5, 9, 2], [0, 7, 1]])
    n, nxt = verify_chains(draft, None, logits, [3, 2, 3], [SamplingParams()] * 3, None)
    assert n.tolist() == [2, 2, 0] and nxt.tolist() == [4, 2, 2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_past_a_chains_length_are_never_read(temperature):
    """A padded verify batch's rows beyond each request's chain (here: scores that would accept
    every proposal, and proposals past the length equal to them) change nothing, with the lengths
    given on the device."""
    gen = torch.Generator().manual_seed(1)
    lengths, vocab = [0, 2, 3, 1], 6
    logits = torch.randn(4, 4, vocab, generator=gen)
    draft = torch.randint(0, vocab, (4, 3), generator=gen)
    draft_probs = torch.softmax(torch.randn(4, 3, vocab, generator=gen), -1)
    params = [SamplingParams(temperature=temperature)] * 4
    u = batch_sampling.uniforms(params, [torch.Generator().manual_seed(i) for i in range(4)], [k + 1 for k in lengths],
                                "cpu")
    want = verify_chains(draft, draft_probs, logits, lengths, params, u)
    padded_logits, padded_draft, padded_probs = logits.clone(), draft.clone(), draft_probs.clone()
    for i, k in enumerate(lengths):
        padded_logits[i, k + 1 :] = -50.0
        padded_logits[i, k + 1 :, 0] = 50.0  # a certain token 0...
        padded_draft[i, k:] = 0  # ...proposed there with certainty,
        if k < 3:  # and the proposal after the chain is the last real row's best
            padded_draft[i, k] = logits[i, k].argmax()
        padded_probs[i, k:] = torch.nn.functional.one_hot(padded_draft[i, k:], vocab).float()
    got = verify_chains(padded_draft, padded_probs, padded_logits, torch.tensor(lengths), params, u)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert all(n <= k for n, k in zip(got[0].tolist(), lengths))


# greedy, temperature only, top-k, top-p, both: interleaved, so a block's requests are not consecutive
MIXED = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
         SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=0.9, top_k=8, top_p=0.8)]


def _mixed(batch: int) -> list[SamplingParams]:
    return [MIXED[(3 * i) % len(MIXED)] for i in range(batch)]


def _blocks_of(monkeypatch, requests: int | None, rows_per_request: int, vocab: int) -> None:
    """Sample ``requests`` requests a block (None: the whole batch in one block)."""
    from specdecode_worker import contract
    from specdecode_worker.planner import plan

    budget = 1 << 60 if requests is None else plan.SAMPLING_BYTES_PER_LOGIT * requests * rows_per_request * vocab
    monkeypatch.setattr(contract, "SAMPLING_BLOCK_BYTES", budget)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_sampling_in_blocks_equals_one_block_and_each_request_alone(monkeypatch):
    """Tokens and distributions of a mixed batch (greedy, temperature, top-k, top-p rows) sampled
    in blocks of 2 requests are bit-identical to the whole batch at once and to each request on
    its own; cut rows never share a block with uncut ones, greedy rows are in none."""
    gen = torch.Generator().manual_seed(4)
    batch, vocab = 13, 40
    logits, params, u = torch.randn(batch, vocab, generator=gen) * 3, _mixed(batch), torch.rand(batch, generator=gen)
    _blocks_of(monkeypatch, 2, 1, vocab)
    blocks = batch_sampling.sampled_blocks(params, vocab)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    assert len(blocks) >= 4 and sorted(i for b in blocks for i in b) == sampled
    assert all(len({batch_sampling.cuts(params[i], vocab) for i in b}) == 1 for b in blocks)
    blocked = choose_tokens(logits, params, u)
    _blocks_of(monkeypatch, None, 1, vocab)
    assert _equal(blocked, choose_tokens(logits, params, u))
    for i, p in enumerate(params):
        tokens, probs = choose_tokens(logits[i : i + 1], [p], u[i : i + 1])
        assert tokens[0] == blocked[0][i]
        assert torch.equal(probs[0], blocked[1][i]) if not p.greedy else not blocked[1][i].any()
    for row, p, got in zip(logits, params, blocked[1]):  # and they are the distributions asked for
        if not p.greedy:
            torch.testing.assert_close(got.double(), _reference_probs(row, p), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("point_masses", [False, True])
def test_chain_acceptance_in_blocks_equals_one_block_and_each_request_alone(monkeypatch, point_masses):
    gen = torch.Generator().manual_seed(5)
    batch, k, vocab = 11, 3, 30
    params = _mixed(batch)
    lengths = [(i % 4) for i in range(batch)]
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    draft = torch.where(torch.rand(batch, k, generator=gen) < 0.7, logits[:, :k].argmax(-1),
                        torch.randint(0, vocab, (batch, k), generator=gen))  # mostly likely proposals
    draft_probs = None if point_masses else torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    u = torch.rand(batch, k + 1, generator=gen)
    _blocks_of(monkeypatch, 2, k + 1, vocab)
    assert len(batch_sampling.sampled_blocks(params, vocab, k + 1)) >= 4
    blocked = verify_chains(draft, draft_probs, logits, lengths, params, u)
    _blocks_of(monkeypatch, None, k + 1, vocab)
    assert _equal(blocked, verify_chains(draft, draft_probs, logits, lengths, params, u))
    for i, p in enumerate(params):
        alone = verify_chains(draft[i : i + 1], None if point_masses else draft_probs[i : i + 1], logits[i : i + 1],
                              lengths[i : i + 1], [p], u[i : i + 1])
        assert [t.item() for t in alone] == [blocked[0][i].item(), blocked[1][i].item()]
    assert blocked[0].sum() > 0 and (blocked[0] < torch.tensor(lengths)).any()  # accepts and rejects both ran


def test_tree_acceptance_in_blocks_equals_one_block_and_each_request_alone(monkeypatch):
    from specdecode_worker.engine.speculation.tree import DeviceTrees, TreeDrafter, TreeShape, accept_trees

    gen = torch.Generator().manual_seed(6)
    batch, vocab = 11, 24
    shape = TreeShape(2, 3, 5)
    drafter = TreeDrafter(shape, torch.randn(batch, vocab, generator=gen) * 2)
    for step in range(1, shape.steps):
        drafter.step_mask(step)
        drafter.expand(torch.randn(batch * shape.topk, vocab, generator=gen) * 2)
    trees = drafter.select(torch.zeros(batch, dtype=torch.int64))
    n = shape.nodes + 1
    logits = torch.randn(batch * n, vocab, generator=gen) * 2
    # the target leans towards the draft's children (row p scores node p's children), so paths go deep
    requests = torch.arange(batch)[:, None].expand(batch, n)
    logits.view(batch, n, vocab).index_put_((requests, trees.parents, trees.tokens), torch.tensor(3.0), accumulate=True)
    valid = torch.arange(n)[None] <= torch.tensor([n - 1 - (i % 3) for i in range(batch)])[:, None]
    params, u = _mixed(batch), torch.rand(batch, shape.steps * shape.topk + 1, generator=gen)
    _blocks_of(monkeypatch, 2, n, vocab)
    assert len(batch_sampling.sampled_blocks(params, vocab, n)) >= 4
    blocked = accept_trees(trees, shape, valid, logits, params, u)
    _blocks_of(monkeypatch, None, n, vocab)
    assert _equal(blocked, accept_trees(trees, shape, valid, logits, params, u))
    for i, p in enumerate(params):
        one = DeviceTrees(*(t[i : i + 1] for t in (trees.tokens, trees.parents, trees.depths, trees.mask)))
        alone = accept_trees(one, shape, valid[i : i + 1], logits.view(batch, n, vocab)[i], [p], u[i : i + 1])
        assert _equal(alone, tuple(t[i : i + 1] for t in blocked))
    assert blocked[0].sum() > 0


def test_chain_rows_lay_out_uneven_chains():
    assert chain_rows([2, 0, 1]) == [0, 1, 2, 3, 3, 3, 4, 5, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    found = tiny_models(root / "pair")
    small = write_tiny_model(root / "small", "llama", seed=0, weight_scale=3.0, vocab_size=16, num_hidden_layers=2)
    found.update(small=small, eagle=write_eagle_head(root / "eagle", small, seed=1))
    return found


@pytest.mark.parametrize("algorithm", ["NONE", "STANDALONE", "NGRAM", "EAGLE", "EAGLE-tree"])
def test_one_host_transfer_per_pass(models, algorithm):
    """Every decode round reads its results back once (the draft's proposals, or its tree's
    candidates, scores and parents, stay on the device until the verify pass's transfer), and a
    prefill pass that finishes prompts once."""
    tree = algorithm == "EAGLE-tree"
    algorithm = algorithm.removesuffix("-tree")
    target, draft = (models["small"], models["eagle"]) if algorithm == "EAGLE" else \
        (models["target"], models["draft"] if algorithm == "STANDALONE" else None)
    kw = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3) if tree \
        else dict(num_draft_tokens=3)
    eng = engine(target, algorithm, draft, **kw)
    params = [SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=9, temperature=1.0, seed=3,
                                                                            ignore_eos=True)]
    reqs = [eng.submit(Request([5, 6, 7, 5, 6, 7, 5][: 4 + i], p)) for i, p in enumerate(params * 2)]
    steps = 0
    while not all(r.done.is_set() for r in reqs):
        before = (batch_sampling.to_host.count, eng.stats.decode_steps, sum(bool(r.output_ids) for r in reqs))
        eng.step()
        transfers = batch_sampling.to_host.count - before[0]
        rounds = eng.stats.decode_steps - before[1]
        prefilled = sum(bool(r.output_ids) for r in reqs) - before[2]
        assert transfers == rounds + (1 if prefilled else 0), (transfers, rounds, prefilled)
        steps += rounds
    assert steps > 3 and all(len(r.output_ids) == 9 for r in reqs)
