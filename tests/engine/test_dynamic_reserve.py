"""The dynamic reserve on CPU: a tiny model serves in a 2 GiB budget with every flag at its default."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.serving import serve_cli  # noqa: E402
from specdecode_worker.contract import MIB  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine  # noqa: E402
from specdecode_worker.planner.plan import ForwardGeometry, dynamic_reserve_bytes  # noqa: E402

from tests.engine_helpers import run_all, tiny_models  # noqa: E402


def test_tiny_model_starts_in_a_2_gib_budget_with_defaults(tmp_path):
    models = tiny_models(tmp_path)
    args = serve_cli.parser().parse_args([
        "--target", str(models["target"]), "--draft", str(models["draft"]), "--algorithm", "STANDALONE",
        "--device", "cpu", "--device-memory-gib", "2",
    ])
    engine_args, plan = serve_cli.resolve(args)
    assert plan.fits, plan.message
    # the activations follow the tiny geometry (hidden 64, vocabulary of the tiny tokenizer), not a
    # GPU's; cuBLAS's workspaces come on top, at a size that does not depend on the model
    assert plan.reserve.blas_workspace_bytes == 4 * 32 * MIB
    assert plan.reserve.dynamic_bytes - plan.reserve.blas_workspace_bytes < 64 * MIB
    assert plan.mem_fraction_static > 0.9
    eng = Engine(engine_args)
    eng.init_model_worker()
    (req,) = run_all(eng, [Request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert len(req.output_ids) == 4


def test_reserve_grows_with_the_geometry_and_the_sizes():
    small = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 2)
    large = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 128_256, 2)
    base = dynamic_reserve_bytes("NGRAM", small, None, 1, 2048, 8, 8)
    assert dynamic_reserve_bytes("NGRAM", large, None, 1, 2048, 8, 8) > 50 * base
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 4096, 8, 8) > base
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 2048, 64, 8) > base
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 2048, 8, 8, verify_tokens=1024) > base
    # STANDALONE and NGRAM capture verify graphs; an EAGLE head verifies eagerly
    verify_graphs = dynamic_reserve_bytes("NGRAM", large, None, 1, 8192, 256, 256, verify_tokens=8)
    assert verify_graphs > dynamic_reserve_bytes("NGRAM", large, None, 1, 8192, 256, 256, verify_tokens=4)


def test_serve_prices_its_own_verify_width(tmp_path):
    from specdecode_worker.planner.plan_cli import plan_args
    from specdecode_worker.serving.serve_shape import fill_from_plan

    def verify_tokens(argv):
        flags = serve_cli.parser().parse_args(argv)
        fill_from_plan(flags, None)  # as serve does without --plan
        return plan_args(flags).verify_tokens

    argv = ["--target", str(tmp_path), "--algorithm", "NGRAM", "--device", "cpu", "--device-memory-gib", "2"]
    assert verify_tokens(argv) == 5  # the default 4 proposals + 1
    assert verify_tokens(argv + ["--num-draft-tokens", "7"]) == 8


def test_eagle_tree_graphs_are_priced_by_hand():
    """A top-3 tree 3 steps deep verifying 7 nodes, graph batch 8, on a tiny geometry (hidden 64,
    intermediate 128, 4 heads of 16, 2 KV heads, vocabulary 1000, 2-byte dtype), counted by hand."""
    from specdecode_worker.planner.plan import draft_tree_step_bytes, tree_inputs_bytes

    geo = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 2)
    # a token at a layer's peak: 3 x 64 + (4 x 16 + 2 x 32) + 4 x 16 + 3 x 128 = 768 values, 1536 bytes
    assert geo.token_bytes(1) == 1536
    rows = 8 * 3
    hand = (rows * 1536  # the draft step's activations
            + rows * 1000 * (2 + 4)  # its logits, and their fp32 copy
            + 2 * rows * 1000 * 4  # fp32 logits over the target's vocabulary, and their log-softmax
            + rows * 64 * 2  # the head's features staged per row
            + 8 * (3 * 6 + 2 * 8 * 6 + 8)  # a [3, 6] int8 mask, 6 key slots and positions, the prefix
            + rows * 17 * 4 * 17 * 4)  # split-KV partials: 16 splits and the nodes', 4 heads, 16 values + lse
    assert draft_tree_step_bytes(geo, geo, 8, 3, 3) == hand == 487_888
    assert tree_inputs_bytes(8, 7, 7) == 8 * (7 * 7 + 2 * 8 * 7 + 8)
    chain = dynamic_reserve_bytes("EAGLE", geo, geo, 1, 2048, 8, 8, verify_tokens=7)
    tree = dynamic_reserve_bytes("EAGLE", geo, geo, 1, 2048, 8, 8, verify_tokens=7, tree_topk=3, tree_steps=3)
    # the tree's graphs replace the chain's draft-step pool (8 x 1536 + 8 x 1000 x 6 + split-KV partials
    # of 8 requests x 4 heads x 16 splits x 17 fp32) and add the verify pass's staged mask
    chain_draft = 8 * 1536 + 8 * 1000 * 6 + 8 * 4 * 16 * 17 * 4
    # its split-KV partials have one more split for the nodes: the verify graphs' 8 x 7 rows and the
    # eager pass's 8 requests of up to 32 tokens (4 heads, 16 values + lse each). The head's extend
    # graphs are the chain's, 7 rows wide: a chain of the same width may be served under this plan.
    partial = 4 * 17 * 4
    nodes = (8 * 7 + 8 * 32) * partial
    assert abs(tree - chain - 1.25 * (hand + tree_inputs_bytes(8, 7, 7) - chain_draft + nodes)) <= 1


def test_serve_and_the_planner_price_the_tree_they_run(tmp_path):
    from specdecode_worker.planner import plan_cli
    from specdecode_worker.planner.plan_cli import plan_args

    argv = ["--target", str(tmp_path), "--algorithm", "EAGLE3", "--device", "cpu", "--num-draft-tokens", "6",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "4"]
    args = plan_args(serve_cli.parser().parse_args(argv))
    assert (args.verify_tokens, args.tree_topk, args.tree_steps) == (7, 4, 3)
    chain = plan_args(serve_cli.parser().parse_args(argv[:6] + ["--num-draft-tokens", "3"]))
    assert (chain.verify_tokens, chain.tree_topk) == (4, 1)
    planned = plan_args(plan_cli.parser().parse_args(["--target", "t", "--algorithm", "EAGLE3"] + argv[6:]))
    assert (planned.verify_tokens, planned.tree_topk, planned.tree_steps) == (7, 4, 3)


def _sampling_peaks(batch: int, k: int, vocab: int, nodes: int) -> tuple[int, int, int]:
    """Live tensor bytes at the peak of a verify batch's chain acceptance, a tree's and a decode
    step's sampling, counted on CPU, over a batch mixing greedy rows, temperature-only rows and rows
    with a top-k and a top-p cut, interleaved (so blocks gather their rows)."""
    from specdecode_worker.engine.sampler.batch_sampling import choose_tokens, verify_chains
    from specdecode_worker.engine.speculation.tree import TreeDrafter, TreeShape, accept_trees

    from tests.live_bytes import LiveBytes

    kinds = [SamplingParams(temperature=1.0, top_k=2, top_p=0.9, seed=0), SamplingParams(),
             SamplingParams(temperature=0.7)]
    params = [kinds[i % 3] for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    draft = torch.randint(0, vocab, (batch, k), generator=g)
    u = torch.rand(batch, k + 1, generator=g)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)  # held since drafting
    with LiveBytes() as chains:
        verify_chains(draft, draft_probs, logits, [k] * batch, params, u)
    with LiveBytes() as decode:
        choose_tokens(logits[:, 0], params, u[:, 0])
    topk, steps = 3, 3
    shape = TreeShape(topk, steps, nodes)
    drafter = TreeDrafter(shape, torch.randn(batch, vocab, generator=g))
    for step in range(1, steps):
        drafter.step_mask(step)
        drafter.expand(torch.randn(batch * topk, vocab, generator=g))
    trees = drafter.select(torch.zeros(batch, dtype=torch.int64))
    tree_logits = torch.randn(batch * (nodes + 1), vocab, generator=g)
    with LiveBytes() as tree:
        accept_trees(trees, shape, torch.ones(batch, nodes + 1, dtype=torch.bool), tree_logits, params,
                     torch.rand(batch, steps * topk + 1, generator=g))
    return chains.peak, tree.peak, decode.peak


@pytest.mark.slow
def test_the_plan_prices_sampling_and_acceptance_in_blocks_as_measured(monkeypatch):
    """Sampling and acceptance with temperature, top-k and top-p (two sorts over the vocabulary)
    run in blocks: their live bytes, counted on CPU for batches of several blocks, stay within what
    the plan prices (``sampling_bytes``: one block's scratch, and the distributions the batch's
    rows drew from beside it), and stop growing with the batch past a block."""
    from specdecode_worker import contract
    from specdecode_worker.planner import plan

    k, vocab, nodes = 3, 4000, 6
    # 2 requests a verify block (8 chain rows), as 256 MiB holds 13 at Llama-3's vocabulary
    monkeypatch.setattr(contract, "SAMPLING_BLOCK_BYTES", plan.SAMPLING_BYTES_PER_LOGIT * 2 * (k + 1) * vocab)
    peaks = {batch: _sampling_peaks(batch, k, vocab, nodes) for batch in (6, 24)}
    for batch, (chains, tree, decode) in peaks.items():
        scratch, held = plan.sampling_bytes(vocab, batch * (k + 1), k + 1)
        assert scratch == plan.SAMPLING_BYTES_PER_LOGIT * 8 * vocab  # one block, not the batch's rows
        chain_held = batch * k * vocab * 4  # the draft distributions, through the verify pass
        assert chains + chain_held <= scratch + held
        assert decode <= scratch + held  # a decode step's blocks, and the distributions it returns
        tree_scratch, tree_held = plan.sampling_bytes(vocab, batch * (nodes + 1), nodes + 1)
        assert tree <= tree_scratch + tree_held
        # the count is of a block's sorts, not of small bookkeeping: most of the price is used
        tree_block = plan.SAMPLING_BYTES_PER_LOGIT * plan.sampling_block_rows(vocab, nodes + 1) * vocab
        assert chains > 0.75 * scratch and tree > 0.75 * tree_block
    # four times the batch: the chain and tree peaks grow by less than one vocabulary row per request
    (chains, tree, _), (chains4, tree4, _) = peaks[6], peaks[24]
    assert chains4 - chains < 18 * vocab and tree4 - tree < 18 * vocab


def test_split_kv_partials_follow_where_the_kernels_run():
    """The verify kernel's partials are priced where it runs: a head priced whole but sharded 8 ways
    has query groups of 4 per rank (28 heads over 4 KV heads: 7 whole), so its 10-row passes split
    there (40 rows) though the whole model's (70 rows) would take the extend kernel; and decode
    steps above the graphs' largest batch run eagerly with their decode partials."""
    head = ForwardGeometry(3584, 18_944, 28, 4, 128, 128, 152_064, 2)
    assert head.verify_workspace_bytes(8, 10, 1) == 0
    # rank: 4 heads, 1 KV head; 8 requests x 10 rows x 16 splits (8 x 1 KV head is far from 2 x 160 SMs)
    assert head.verify_workspace_bytes(8, 10, 1, shard_tp=8) == 8 * 10 * 16 * 4 * 129 * 4 == 2_641_920
    small = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 2)
    within = small.eager_split_bytes(16, 512, 1, False, decode_above=16)
    above = small.eager_split_bytes(16, 512, 1, False, decode_above=8)
    assert above == max(within, 16 * 4 * 16 * 17 * 4)  # 16 requests x 4 heads x 16 splits, eagerly decoded
