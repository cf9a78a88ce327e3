"""The graph runners' static-buffer logic on CPU: ``eager=True`` keeps the buffers, the staging
and the padding of CUDA graphs and replays by calling the function again, so every algorithm's
greedy output through them must equal the output without graphs, at batch 1 and at a batch
padded up to a captured size. (Captured CUDA graphs: tests/gpu/test_engine_cuda.py.)"""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.sampler import batch_sampling  # noqa: E402
from specdecode_worker.engine.cuda_graph import CudaGraphRunner, GraphRunner  # noqa: E402
from specdecode_worker.engine.forward_batch import ForwardBatch  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import make_repeating, write_copying_eagle_head  # noqa: E402
from tests.engine_helpers import assert_every_slot_back, engine, record_rounds, run_all, tiny_models_with_eagle_heads  # noqa: E402
from devtools.tiny_models import VOCAB_SIZE, write_tiny_model  # noqa: E402

VOCAB, MAX_BS = 16, 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models_with_eagle_heads(tmp_path_factory.mktemp("graphs"), VOCAB, num_hidden_layers=4, draft_vocab=12)


def test_replay_pads_stages_extras_and_returns_the_real_rows():
    calls = []

    def fn(fb, rows, extra):
        calls.append(fb.batch_size)
        return fb.input_ids[rows] * 10 + fb.positions[rows], extra[rows].sum(-1)

    runner = GraphRunner(fn, 8, "cpu", tokens_per_req=2, extra_widths=(3,), extra_dtype=torch.float32, eager=True)
    assert runner.sizes == [1, 2, 4, 8] and sorted(calls) == [1, 2, 4, 8]  # captured once per size
    fb = ForwardBatch(input_ids=torch.tensor([1, 2, 3, 4, 5, 6]), positions=torch.tensor([7, 8, 0, 1, 4, 5]),
                      out_cache_loc=torch.tensor([11, 12, 13, 14, 15, 16]), req_pool_indices=torch.tensor([2, 3, 5]),
                      seq_lens=torch.tensor([9, 2, 6]), extend_lens=[2, 2, 2], seq_lens_cpu=[9, 2, 6])
    extra = torch.arange(18, dtype=torch.float32).view(6, 3)
    ids, sums = runner.replay(fb, extra)
    assert calls[-1] == 4  # three requests replay the graph of four
    assert ids.tolist() == [17, 28, 30, 41, 54, 65] and sums.tolist() == extra.sum(-1).tolist()
    static = runner.inputs.batch(4)
    assert static.seq_lens.tolist() == [9, 2, 6, 2] and static.seq_lens_cpu == [9, 2, 6, 2]
    assert static.out_cache_loc[6:].eq(0).all() and runner.extras[0][6:8].eq(0).all()  # padding: slot 0, zeros


def test_an_extend_graph_returns_each_requests_last_row():
    def fn(fb, rows):
        return fb.input_ids[rows] * 10 + fb.positions[rows]

    runner = GraphRunner(fn, 4, "cpu", tokens_per_req=3, eager=True, last_only=True)
    fb = ForwardBatch(input_ids=torch.tensor([0, 1, 2, 0, 0, 3]), positions=torch.tensor([4, 4, 5, 7, 7, 7]),
                      out_cache_loc=torch.tensor([0, 11, 12, 0, 0, 13]), req_pool_indices=torch.tensor([2, 3]),
                      seq_lens=torch.tensor([6, 8]), extend_lens=[3, 3], seq_lens_cpu=[6, 8])
    (out,) = runner.replay(fb)
    assert out.tolist() == [25, 37]  # rows 2 and 5 of the two requests, not the padding's


def _prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def _outputs(eng, prompts, max_tokens=10):
    reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts])
    return [r.output_ids for r in reqs]


def _count_replays(monkeypatch, extends: list | None = None) -> list[tuple[int, int]]:
    """(width, batch) of every graph replay; an extend graph's (the last rows' logits) go to
    ``extends`` instead, where given."""
    seen, real = [], GraphRunner.replay

    def replay(self, fb, *extras):
        if not self.last_only:
            seen.append((self.tokens_per_req, fb.batch_size))
        elif extends is not None:
            extends.append((self.tokens_per_req, fb.batch_size, list(fb.seq_lens_cpu)))
        return real(self, fb, *extras)

    monkeypatch.setattr(GraphRunner, "replay", replay)
    return seen


def _graph_runner(eng, k: int) -> None:
    """The target's decode and verify graphs, and a STANDALONE draft's decode and first-step
    (2 tokens, left-padded) graphs, eager stand-ins."""
    for runner in eng.model_runners():
        ctx = runner.memory_pool_config.context_len
        runner.cuda_graphs = CudaGraphRunner(runner.model, runner.backend, MAX_BS, ctx, "cpu", eager=True)
        if runner is eng.target_runner and k:
            runner.verify_graphs = CudaGraphRunner(runner.model, runner.backend, MAX_BS, ctx, "cpu", k + 1,
                                                   eager=True)
        elif runner is not eng.target_runner:
            runner.extend_graphs = CudaGraphRunner(runner.model, runner.backend, MAX_BS, ctx, "cpu", 2,
                                                   eager=True, last_only=True)


# top-3 trees 3 deep, 6 nodes verified: draft-tree steps of 3 tokens, verify passes of 7
TREE = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)
CASES = {
    "NONE": ("target", None, {}),
    "STANDALONE": ("target", "draft", dict(num_draft_tokens=3)),
    "NGRAM": ("target", None, dict(num_draft_tokens=3)),
    "EAGLE": ("small", "eagle", dict(num_draft_tokens=3)),
    "EAGLE3": ("small", "eagle3", dict(num_draft_tokens=3)),
    "EAGLE-tree": ("small", "eagle", TREE),
    "EAGLE3-tree": ("small", "eagle3", TREE),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("algorithm", list(CASES))
def test_greedy_output_through_graph_buffers_equals_eager(models, monkeypatch, algorithm, batch):
    target, draft, kw = CASES[algorithm]
    algorithm = algorithm.removesuffix("-tree")
    target, draft = models[target], models[draft] if draft else None
    vocab = VOCAB if target == models["small"] else VOCAB_SIZE
    prompts = _prompts(batch, vocab, seed=batch)
    plain = _outputs(engine(target, "NONE", max_running_requests=MAX_BS), prompts)
    eng = engine(target, algorithm, draft, max_running_requests=MAX_BS, **kw)
    if algorithm.startswith("EAGLE"):
        eng.speculator.capture_graphs(MAX_BS, eager=True)
        tree = "speculative_eagle_topk" in kw
        assert {key[0] for key in eng.speculator.passes.graphs} == (
            {"target", "target_tree", "draft_tree", "draft_extend"} if tree else {"target", "draft", "draft_extend"})
    else:
        _graph_runner(eng, kw.get("num_draft_tokens", 0) if algorithm != "NONE" else 0)
    extends = []
    seen = _count_replays(monkeypatch, extends)
    assert _outputs(eng, prompts) == plain
    assert seen, "no pass went through the graph buffers"
    if algorithm.startswith("EAGLE"):  # the head's extend over each round's accepted tokens
        assert extends and {w for w, _, _ in extends} == {4}
    if algorithm.startswith("EAGLE"):
        # chain: draft steps (and plain steps) and the k + 1 verify pass; tree: top-k draft steps
        # and the root + nodes verify pass (and plain steps, if a round drafts nothing)
        assert {w for w, _ in seen} - {1} == ({3, 7} if tree else {4})
        if batch > 1:  # (at batch 1 these random heads happen to have every proposal rejected)
            assert eng.stats.accepted_tokens > 0  # accepted drafts were committed from the graphs' outputs
    assert_every_slot_back(eng)  # every slot (verify, rejected, tree scratch) came back


@pytest.mark.parametrize("batch", [1, 3])
def test_a_fully_accepted_round_leaves_the_draft_two_tokens_for_its_extend_graph(models, monkeypatch, batch):
    """With the target as its own draft every proposal is accepted, so each round leaves the draft
    two uncached tokens (the last proposal and the next token): its first step replays the
    2-token extend graph, and the output stays the target's."""
    prompts = _prompts(batch, VOCAB_SIZE, seed=7)
    plain = _outputs(engine(models["target"], "NONE", max_running_requests=MAX_BS), prompts)
    eng = engine(models["target"], "STANDALONE", models["target"], max_running_requests=MAX_BS, num_draft_tokens=3)
    _graph_runner(eng, 3)
    extends = []
    _count_replays(monkeypatch, extends)
    assert _outputs(eng, prompts) == plain
    assert eng.stats.accepted_tokens == eng.stats.proposed_tokens > 0
    assert extends and {(w, b) for w, b, _ in extends} == {(2, batch)}
    assert_every_slot_back(eng)


def test_deep_tree_paths_through_graph_buffers_keep_the_target_greedy_output(tmp_path, monkeypatch):
    """A head that proposes "repeat the last token" on a target that mostly repeats: 3-deep tree
    paths are accepted through the graphs (the accepted nodes' slots and features are taken
    from the graph outputs), and partly accepted rounds too; each round reads back once."""
    target = make_repeating(write_tiny_model(tmp_path / "t", "llama", seed=0, weight_scale=3.0, vocab_size=16,
                                             num_hidden_layers=4), layer_scale=1.0)
    head = write_copying_eagle_head(tmp_path / "h", target)
    prompts = _prompts(3, 16, seed=2)
    plain = _outputs(engine(target, "NONE", max_running_requests=MAX_BS), prompts)
    eng = engine(target, "EAGLE", head, max_running_requests=MAX_BS, **TREE)
    eng.speculator.capture_graphs(MAX_BS, eager=True)
    extends = []
    seen = _count_replays(monkeypatch, extends)
    reqs = [eng.submit(Request(p, SamplingParams(max_tokens=10, ignore_eos=True))) for p in prompts]
    while not all(r.done.is_set() for r in reqs):  # one read-back per round, one per prefill that samples
        before = (batch_sampling.to_host.count, eng.stats.decode_steps, sum(bool(r.output_ids) for r in reqs))
        eng.step()
        rounds = eng.stats.decode_steps - before[1]
        prefilled = sum(bool(r.output_ids) for r in reqs) > before[2]
        assert batch_sampling.to_host.count - before[0] == rounds + prefilled
    assert [r.output_ids for r in reqs] == plain
    assert {w for w, _ in seen} - {1} == {3, 7}
    assert extends and {w for w, _, _ in extends} == {4}  # depth 3 + 1: every accepted path's extend
    lengths = eng.stats.accept_lengths
    assert max(lengths) == 3 and min(lengths) < 3, lengths
    assert_every_slot_back(eng)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("algorithm", ["EAGLE-tree", "EAGLE3-tree"])
def test_tree_greedy_output_through_graph_buffers_on_triton(models, monkeypatch, algorithm, batch):
    """The same through the Triton backend (its interpreter on CPU): its tree-masked extend kernel
    reads the masks, slots and prefix lengths from the graphs' staged buffers."""
    from specdecode_worker.engine.kernels.attention import ATTENTION_BACKEND_ENV
    from specdecode_worker.engine.kernels.triton_backend import TritonAttnBackend

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")
    target, draft, kw = CASES[algorithm]
    prompts = _prompts(batch, VOCAB, seed=batch)
    plain = _outputs(engine(models[target], "NONE", max_running_requests=MAX_BS), prompts)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    eng = engine(models[target], algorithm.removesuffix("-tree"), models[draft], max_running_requests=MAX_BS, **kw)
    assert isinstance(eng.speculator.passes.target_tree_backend, TritonAttnBackend)
    eng.speculator.capture_graphs(MAX_BS, eager=True)
    seen = _count_replays(monkeypatch)
    assert _outputs(eng, prompts, max_tokens=6) == [o[:6] for o in plain]
    assert {w for w, _ in seen} - {1} == {3, 7}
    assert_every_slot_back(eng)


def test_mtp_greedy_output_through_graph_buffers_equals_eager(tmp_path, monkeypatch):
    """DeepSeek's target steps (1 and k + 1 tokens) and the NextN layer's chain steps through the
    speculator's graph buffers give the plain engine's greedy output. Graph passes run MoE on its
    static path (every expert, weighted by the routing), the plain engine on the routed one."""
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")

    from devtools.deepseek_models import record_static_moe, write_tiny_deepseek

    model = write_tiny_deepseek(tmp_path / "ds", mtp=True)
    prompts = _prompts(3, 100, seed=4)
    plain = _outputs(engine(model, "NONE", max_running_requests=MAX_BS, context_len=128), prompts)
    eng = engine(model, "MTP", max_running_requests=MAX_BS, context_len=128, num_draft_tokens=2)
    eng.speculator.capture_graphs(MAX_BS, eager=True)
    assert set(eng.speculator.passes.graphs) == {("target", 1), ("target", 3), ("draft", 1), ("draft_extend", 3)}
    static_moe = record_static_moe(monkeypatch)
    seen = _count_replays(monkeypatch)
    assert _outputs(eng, prompts) == plain
    assert {w for w, _ in seen} == {1, 3}
    assert len(static_moe) >= len(seen)  # every replay (NextN steps included) took the static path


@pytest.mark.slow
def test_deepseek_decode_through_graph_buffers_equals_eager(tmp_path, monkeypatch):
    """Without speculation a DeepSeek target's decode steps replay the runner's decode graphs."""
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from devtools.deepseek_models import record_static_moe, write_tiny_deepseek

    model = write_tiny_deepseek(tmp_path / "ds")
    prompts = _prompts(3, 100, seed=5)
    plain = _outputs(engine(model, "NONE", max_running_requests=MAX_BS, context_len=128), prompts)
    eng = engine(model, "NONE", max_running_requests=MAX_BS, context_len=128)
    _graph_runner(eng, 0)
    static_moe = record_static_moe(monkeypatch)
    seen = _count_replays(monkeypatch)
    assert _outputs(eng, prompts) == plain
    assert {w for w, _ in seen} == {1} and len(static_moe) >= len(seen)


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_graph_paths_equal_the_routed_path(fp8):
    """The static MoE paths a graph pass takes give the routed path's output: every expert
    weighted by the routing, and (after stacking the experts' weights, fp8 ones with their block
    scales, which changes neither the parameters nor their bytes) the Triton kernel over the
    chosen (token, expert) pairs."""
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepseekV3Config")
    from specdecode_worker.engine.parallel.distributed import SINGLE
    from specdecode_worker.engine.models.loader import tensor_bytes
    from specdecode_worker.engine.models.deepseek_v3 import Linears, MoE

    from devtools.deepseek_models import TINY

    torch.manual_seed(0)
    quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32]}}
    config = transformers.DeepseekV3Config(**TINY, **(quant if fp8 else {}))
    moe = MoE(config, Linears(config, SINGLE))
    for name, p in moe.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            p.copy_(torch.randn(p.shape).to(p.dtype))
        elif name.endswith("weight_scale_inv"):
            p.copy_(torch.rand(p.shape) * 0.2 + 0.1)  # a different scale per block
        else:
            torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, TINY["hidden_size"])
    experts, weights = moe.gate(x)
    assert experts.unique().numel() > 1  # several experts chosen, several left out
    routed = moe.routed(x, experts, weights)
    torch.testing.assert_close(moe.every_expert(x, experts, weights), routed, atol=1e-5, rtol=1e-4)
    params, nbytes = {n: p.clone() for n, p in moe.named_parameters()}, tensor_bytes(moe)
    assert moe.stack_experts() and (moe.gate_up_scales is not None) == fp8
    assert tensor_bytes(moe) == nbytes and all(p.equal(params[n]) for n, p in moe.named_parameters())
    assert moe.experts[5].up_proj.weight.data_ptr() == moe.gate_up_stack[5, TINY["moe_intermediate_size"]:].data_ptr()
    torch.testing.assert_close(moe.routed(x, experts, weights), routed)
    torch.testing.assert_close(moe.chosen_experts(x, experts, weights), routed, atol=1e-5, rtol=1e-4)


# ---- ragged verify batches: every mix of draft lengths through the one verify graph ----------------
def test_padded_chain_batch_lays_out_every_request_at_the_graph_width():
    from specdecode_worker.engine.batch import PAD_SLOT, padded_chain_batch
    from specdecode_worker.engine.memory.pools import ReqToTokenPool

    pool = ReqToTokenPool(4, 32, "cpu")
    pool.req_to_token[:] = torch.arange(4 * 32).view(4, 32) + 1000
    chains = torch.tensor([[7, 8, 9], [4, 0, 0]])
    fb, padded = padded_chain_batch(pool, [2, 1], [5, 9], chains, [3, 1], width=4)
    assert fb.extend_lens == [4, 4] and padded.width == 4 and padded.lengths.tolist() == [3, 1]
    assert fb.input_ids.tolist() == [7, 8, 9, 0, 4, 0, 0, 0]
    # Padding rows repeat the last real position (causal masking hides them) and write the pad slot.
    assert fb.positions.tolist() == [5, 6, 7, 7, 9, 9, 9, 9]
    assert fb.out_cache_loc.tolist() == [1069, 1070, 1071, PAD_SLOT, 1041, PAD_SLOT, PAD_SLOT, PAD_SLOT]
    assert fb.seq_lens.tolist() == fb.seq_lens_cpu == [8, 10] and fb.req_pool_indices.tolist() == [2, 1]


RAGGED = {name: CASES[name] for name in ("STANDALONE", "NGRAM", "EAGLE", "EAGLE3")}
K = 3


def _copying_prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram hits) and ones that do not (misses)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(batch):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 7))]
        prompts.append(phrase * 3 if i % 2 == 0 else phrase + [rng.randrange(3, vocab) for _ in range(4)])
    return prompts


def _ragged_engine(models, algorithm: str, graph_bs: int):
    """An adaptive engine whose policy picks each request's length at random within its cap
    (seeded), with the eager stand-ins of every graph it would capture on a GPU."""
    target, draft, _ = RAGGED[algorithm]
    eng = engine(models[target], algorithm, models[draft] if draft else None, max_running_requests=MAX_BS,
                 num_draft_tokens=K, spec_policy="adaptive")
    rng = random.Random(7)
    eng.policy.draft_lengths = lambda rids, caps, **_: [rng.randrange(0, c + 1) for c in caps]
    if algorithm.startswith("EAGLE"):
        eng.speculator.capture_graphs(graph_bs, eager=True)
    else:
        _graph_runner(eng, K)
    return eng


def _requests(prompts, mixed: bool) -> list[Request]:
    """With ``mixed``: one request that never drafts, one capped at one draft token, the rest free."""
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    fields = [dict(speculative=False), dict(max_draft_tokens=1)] if mixed else []
    return [Request(p, greedy, **(fields[i] if i < len(fields) else {})) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("algorithm", list(RAGGED))
def test_ragged_rounds_replay_the_verify_graph_and_keep_greedy_output(models, monkeypatch, algorithm, batch):
    """Per-request draft lengths (0 included: a one-row chain), requests that do not draft, a cap of
    one and n-gram misses in one batch: every round where anybody verifies a proposal replays the
    verify graph of width K + 1 (none runs eagerly), a round where nobody does replays the decode
    graph, the greedy output is the target's own, and every KV slot goes back to the allocator."""
    from specdecode_worker.engine.sampler import batch_sampling

    target, _, _ = RAGGED[algorithm]
    vocab = VOCAB if target == "small" else VOCAB_SIZE
    prompts = _copying_prompts(batch, vocab, seed=batch)
    plain = [r.output_ids for r in run_all(engine(models[target], "NONE", max_running_requests=MAX_BS),
                                           _requests(prompts, mixed=False))]
    eng = _ragged_engine(models, algorithm, MAX_BS)
    rounds = record_rounds(eng)
    seen = _count_replays(monkeypatch)
    reqs = [eng.submit(r) for r in _requests(prompts, mixed=batch > 1)]
    while not all(r.done.is_set() for r in reqs):
        before = (batch_sampling.to_host.count, len(rounds), sum(bool(r.output_ids) for r in reqs))
        eng.step()
        prefilled = sum(bool(r.output_ids) for r in reqs) - before[2]
        assert batch_sampling.to_host.count - before[0] == len(rounds) - before[1] + (prefilled > 0)
    assert [r.output_ids for r in reqs] == plain

    drafting = [ks for ks in rounds if any(ks)]
    verify_replays = [bs for width, bs in seen if width == K + 1]
    assert len(verify_replays) == len(drafting) > 0  # every verify pass went through the graph
    assert any(0 < max(ks) < K for ks in drafting), rounds  # rounds narrower than the graph
    if batch > 1:
        assert any(len(set(ks)) > 1 for ks in drafting), rounds  # mixed lengths in one round
        assert reqs[0].proposed_draft_tokens == 0  # the per-request fields held
        assert reqs[1].proposed_draft_tokens <= reqs[1].verify_rounds
    if algorithm != "EAGLE" and algorithm != "EAGLE3":
        # A round where nobody verifies anything is a plain decode step through the decode graph.
        assert len([w for w, _ in seen if w == 1]) >= len(rounds) - len(drafting)
    assert_every_slot_back(eng)


@pytest.mark.slow
def test_sampling_stays_exact_through_the_verify_graph_when_the_draft_length_changes(tmp_path, monkeypatch):
    """The chi-square check of the adaptive tests (second sampled token against transformers' exact
    marginal, draft lengths drawn at random per request and round), with every verify pass padded
    into the verify graph's width."""
    from tests.engine_helpers import CHI2_CRIT, chi_square, second_token_case, second_token_counts

    target, draft, prompt, exact, draft_marginal = second_token_case(tmp_path)
    eng = engine(target, "STANDALONE", draft, num_draft_tokens=3, max_running_requests=64, spec_policy="adaptive")
    rng = random.Random(1)
    eng.policy.draft_lengths = lambda rids, caps, **_: [rng.randrange(0, c + 1) for c in caps]
    for runner in eng.model_runners():
        ctx = runner.memory_pool_config.context_len
        runner.cuda_graphs = CudaGraphRunner(runner.model, runner.backend, 64, ctx, "cpu", eager=True)
    eng.target_runner.verify_graphs = CudaGraphRunner(eng.target_runner.model, eng.target_runner.backend, 64,
                                                      eng.target_runner.memory_pool_config.context_len, "cpu", 4,
                                                      eager=True)
    seen = _count_replays(monkeypatch)
    counts = second_token_counts(eng, prompt)
    assert set(eng.stats.draft_lengths) == {0, 1, 2, 3}
    assert 0 < eng.stats.accepted_tokens < eng.stats.proposed_tokens
    assert any(width == 4 for width, _ in seen)
    assert chi_square(counts, exact) < CHI2_CRIT[7]
    assert chi_square(counts, draft_marginal) > CHI2_CRIT[7]


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "EAGLE"])
def test_the_policy_warm_up_times_whole_rounds_as_serving_runs_them(models, monkeypatch, algorithm):
    """The cost model's seed: real rounds through the speculator, at batch 1, 2, 4, ... each one
    plain, drafting 1..K and (above 1) one request drafting K; a drafting round's verify pass
    replays the verify graph, as serving's does; every slot and request row comes back."""
    from specdecode_worker.engine.speculation.step_timing import round_shapes, time_rounds

    target, draft, _ = RAGGED[algorithm]
    eng = engine(models[target], algorithm, models[draft] if draft else None, max_running_requests=MAX_BS,
                 num_draft_tokens=K)
    if algorithm == "EAGLE":
        eng.speculator.capture_graphs(MAX_BS, eager=True)
    else:
        _graph_runner(eng, K)
    slots = eng.target_runner.slots
    free, rows = slots.free_slots(), slots.free_rows()
    spec, ran = eng.speculator, []
    decode_round = spec.decode_round

    def recording(reqs, draft_lengths=None, lookup=None):
        results = decode_round(reqs, draft_lengths, lookup)
        ran.append((len(reqs), sum(1 for k in draft_lengths if k), max(draft_lengths),
                    sum(x.proposed for x in results)))
        return results

    spec.decode_round = recording
    seen = _count_replays(monkeypatch)
    cost = time_rounds(spec, MAX_BS, 64, repeats=2)
    shapes = round_shapes(MAX_BS, K)
    assert [int(b) for b in cost.sizes] == [1, 2, 4] and cost.depth == K
    assert {(b, j, k) for b, j, k, _ in ran} >= set(shapes)
    assert all(proposed == j * k for b, j, k, proposed in ran), "every timed round drafted what it was asked"
    assert all(cost.plain(b) > 0 and cost.round(b, b * K, K) > 0 for b in (1, 2, 4))
    assert (K + 1, MAX_BS) in seen, "a drafting round's verify pass replays the verify graph"
    assert (slots.free_slots(), slots.free_rows()) == (free, rows)


def test_the_policy_warm_up_prefills_its_prefixes_in_chunks(models):
    """The timed rounds' cached prefixes are prefilled at most one planned prefill chunk per pass:
    one pass over every request's prefix may be larger than anything the plan priced."""
    from specdecode_worker.engine.speculation.step_timing import time_rounds

    eng = engine(models["target"], "NGRAM", max_running_requests=MAX_BS, num_draft_tokens=K)
    runner = eng.target_runner
    widths, real = [], runner.forward

    def forward(fb, last_only=False):
        widths.append(len(fb.extend_lens) and sum(fb.extend_lens))
        return real(fb, last_only)

    runner.forward = forward
    time_rounds(eng.speculator, MAX_BS, 256, chunk_tokens=24, repeats=1)
    runner.forward = real
    prefills = [w for w in widths if w > MAX_BS * (K + 1)]
    assert prefills and max(prefills) <= 24


def test_mtp_ragged_rounds_replay_the_verify_graph_and_keep_greedy_output(tmp_path, monkeypatch):
    """MTP's chain (DeepSeek-V3 and its NextN layer) under per-request draft lengths, a request
    that never drafts and one capped at 1: the same checks as for the other chains."""
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from devtools.deepseek_models import write_tiny_deepseek

    model, k = write_tiny_deepseek(tmp_path / "ds", mtp=True), 2
    prompts = _copying_prompts(3, 100, seed=5)
    plain = [r.output_ids for r in run_all(engine(model, "NONE", max_running_requests=MAX_BS, context_len=128),
                                           _requests(prompts, mixed=False))]
    eng = engine(model, "MTP", max_running_requests=MAX_BS, context_len=128, num_draft_tokens=k,
                 spec_policy="adaptive")
    rng = random.Random(3)
    eng.policy.draft_lengths = lambda rids, caps, **_: [rng.randrange(0, c + 1) for c in caps]
    eng.speculator.capture_graphs(MAX_BS, eager=True)
    rounds = record_rounds(eng)
    seen = _count_replays(monkeypatch)
    reqs = run_all(eng, _requests(prompts, mixed=True))
    assert [r.output_ids for r in reqs] == plain
    drafting = [ks for ks in rounds if any(ks)]
    assert len([w for w, _ in seen if w == k + 1]) == len(drafting) > 0
    assert any(len(set(ks)) > 1 for ks in drafting) and reqs[0].proposed_draft_tokens == 0
    assert_every_slot_back(eng)
