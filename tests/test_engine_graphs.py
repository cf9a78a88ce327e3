"""The graph runners' static-buffer logic on CPU: ``eager=True`` keeps the buffers, the staging
and the padding of CUDA graphs and replays by calling the function again, so every algorithm's
greedy output through them must equal the output without graphs, at batch 1 and at a batch
padded up to a captured size. (Captured CUDA graphs: tests/test_engine_cuda.py.)"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.cuda_graph import CudaGraphRunner, GraphRunner  # noqa: E402
from specdecode_worker.engine.forward_batch import ForwardBatch  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from tests.eagle_heads import write_eagle3_head, write_eagle_head  # noqa: E402
from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, write_tiny_model  # noqa: E402

VOCAB, MAX_BS = 16, 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    found = tiny_models(root / "pair")
    small = write_tiny_model(root / "small", "llama", seed=0, weight_scale=3.0, vocab_size=VOCAB, num_hidden_layers=4)
    found.update(small=small, eagle=write_eagle_head(root / "eagle", small, seed=1),
                 eagle3=write_eagle3_head(root / "eagle3", small, draft_vocab=12, seed=3))
    return found


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


def _prompts(n, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def _outputs(eng, prompts):
    reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts])
    return [r.output_ids for r in reqs]


def _count_replays(monkeypatch) -> list[tuple[str, int]]:
    seen, real = [], GraphRunner.replay

    def replay(self, fb, *extras):
        seen.append((self.tokens_per_req, fb.batch_size))
        return real(self, fb, *extras)

    monkeypatch.setattr(GraphRunner, "replay", replay)
    return seen


def _graph_runner(eng, k: int) -> None:
    """The target's (and a STANDALONE draft's) decode and verify graphs, eager stand-ins."""
    for runner in eng.model_runners():
        ctx = runner.memory_pool_config.context_len
        runner.cuda_graphs = CudaGraphRunner(runner.model, runner.backend, MAX_BS, ctx, "cpu", eager=True)
        if runner is eng.target_runner and k:
            runner.verify_graphs = CudaGraphRunner(runner.model, runner.backend, MAX_BS, ctx, "cpu", k + 1,
                                                   eager=True)


CASES = {
    "NONE": ("target", None, {}),
    "STANDALONE": ("target", "draft", dict(num_draft_tokens=3)),
    "NGRAM": ("target", None, dict(num_draft_tokens=3)),
    "EAGLE": ("small", "eagle", dict(num_draft_tokens=3)),
    "EAGLE3": ("small", "eagle3", dict(num_draft_tokens=3)),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("algorithm", list(CASES))
def test_greedy_output_through_graph_buffers_equals_eager(models, monkeypatch, algorithm, batch):
    target, draft, kw = CASES[algorithm]
    target, draft = models[target], models[draft] if draft else None
    vocab = VOCAB if target == models["small"] else VOCAB_SIZE
    prompts = _prompts(batch, vocab, seed=batch)
    plain = _outputs(engine(target, "NONE", max_running_requests=MAX_BS), prompts)
    eng = engine(target, algorithm, draft, max_running_requests=MAX_BS, **kw)
    if algorithm.startswith("EAGLE"):
        eng.speculator.capture_graphs(MAX_BS, eager=True)
        assert {key[0] for key in eng.speculator._graphs} == {"target", "draft"}
    else:
        _graph_runner(eng, kw.get("num_draft_tokens", 0) if algorithm != "NONE" else 0)
    seen = _count_replays(monkeypatch)
    assert _outputs(eng, prompts) == plain
    assert seen, "no pass went through the graph buffers"
    if algorithm.startswith("EAGLE"):
        assert {w for w, _ in seen} == {1, 4}  # draft steps (and plain steps) and the k + 1 verify pass


def test_mtp_greedy_output_through_graph_buffers_equals_eager(tmp_path, monkeypatch):
    """DeepSeek's target steps (1 and k + 1 tokens) and the NextN layer's chain steps through the
    speculator's graph buffers, with MoE on the path a CUDA graph captures (every expert, weighted
    by the routing), give the plain engine's greedy output (its MoE on the routed path)."""
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from specdecode_worker.engine.models import deepseek_v3

    from tests.deepseek_models import write_tiny_deepseek

    model = write_tiny_deepseek(tmp_path / "ds", mtp=True)
    prompts = _prompts(3, 100, seed=4)
    plain = _outputs(engine(model, "NONE", max_running_requests=MAX_BS, context_len=128), prompts)
    eng = engine(model, "MTP", max_running_requests=MAX_BS, context_len=128, num_draft_tokens=2)
    eng.speculator.capture_graphs(MAX_BS, eager=True)
    assert set(eng.speculator._graphs) == {("target", 1), ("target", 3), ("draft", 1)}
    static_moe = []
    real = deepseek_v3.MoE.every_expert

    def every_expert(self, *args):
        static_moe.append(1)
        return real(self, *args)

    monkeypatch.setattr(deepseek_v3, "graph_capturing", lambda: True)
    monkeypatch.setattr(deepseek_v3.MoE, "every_expert", every_expert)
    seen = _count_replays(monkeypatch)
    assert _outputs(eng, prompts) == plain
    assert {w for w, _ in seen} == {1, 3} and static_moe


def test_moe_every_expert_path_equals_the_routed_path():
    """The static MoE path a CUDA graph captures gives the routed path's output."""
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepseekV3Config")
    from specdecode_worker.engine.distributed import SINGLE
    from specdecode_worker.engine.models.deepseek_v3 import Linears, MoE

    from tests.deepseek_models import TINY

    torch.manual_seed(0)
    moe = MoE(transformers.DeepseekV3Config(**TINY), Linears(transformers.DeepseekV3Config(**TINY), SINGLE))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(7, TINY["hidden_size"])
    experts, weights = moe.gate(x)
    assert experts.unique().numel() > 1  # several experts chosen, several left out
    routed = moe.routed(x, experts, weights)
    torch.testing.assert_close(moe.every_expert(x, experts, weights), routed, atol=1e-5, rtol=1e-4)
