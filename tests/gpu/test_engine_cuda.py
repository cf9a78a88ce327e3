"""The engine on a real GPU: CUDA graphs, every drafting algorithm, fp8 KV pools, memory vs the plan.

Skipped where no CUDA device is visible (CI has none); run on a GPU machine with
`python -m pytest tests/gpu/test_engine_cuda.py`.
"""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from specdecode_worker.planner import plan_cli  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.engine_helpers import assert_every_slot_back, engine, record_rounds, run_all, tiny_models_with_eagle_heads  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402

CUDA = dict(device="cuda", device_memory_bytes=None, max_total_tokens=4096, cuda_graph_max_bs=8,
            max_running_requests=4)
VOCAB = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models_with_eagle_heads(tmp_path_factory.mktemp("cuda"), VOCAB, num_hidden_layers=6, draft_vocab=6)


def _prompts(vocab: int, n: int = 5):
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 14))] for _ in range(n)]


def _outputs(target, algorithm="NONE", draft=None, vocab=VOCAB, **kw):
    eng = engine(target, algorithm, draft, **{**CUDA, **kw})
    reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in _prompts(vocab)])
    allocator = eng.target_runner.token_to_kv_pool_allocator
    free = allocator.available_size() if hasattr(allocator, "available_size") else None
    return [r.output_ids for r in reqs], free, allocator.size


def test_plain_decoding_with_cuda_graphs_equals_transformers(models):
    target = models["target"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    ours, _, _ = _outputs(target, vocab=vocab)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).cuda().eval()
    for prompt, got in zip(_prompts(vocab), ours):
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, len(prompt):].tolist()
        assert got == want


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("case", ["STANDALONE", "STANDALONE-copy", "NGRAM", "EAGLE-chain", "EAGLE-tree",
                                  "EAGLE3-chain", "EAGLE3-tree"])
def test_speculative_output_equals_plain_output_on_cuda(models, case, kv):
    algorithm, _, variant = case.partition("-")
    if algorithm.startswith("EAGLE"):
        target, draft, vocab = models["small"], models[algorithm.lower()], VOCAB
        extra = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3) if variant == "tree" \
            else dict(num_draft_tokens=3)
    else:
        target = models["target"]
        draft = {"STANDALONE": models["draft"], "NGRAM": None}[algorithm] if variant != "copy" else models["copy"]
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        extra = {}
    plain, _, _ = _outputs(target, vocab=vocab, kv_cache_dtype=kv)
    spec, free, size = _outputs(target, algorithm, draft, vocab=vocab, kv_cache_dtype=kv, **extra)
    assert spec == plain
    if free is not None:
        assert free == size  # every slot came back


def one_gb_bf16_model(folder):
    """A 1 GB Llama-shaped model stored in bf16, as published checkpoints are: the planner prices
    the header's dtype."""
    from safetensors.torch import load_file, save_file

    target = write_tiny_model(folder, "llama", seed=0, hidden_size=2048, intermediate_size=5632,
                              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    weights = target / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    cfg = json.loads((target / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(cfg))
    return target


def test_worker_tokens_match_the_plan_made_with_nvml(tmp_path, capsys):
    """A 1 GB bf16 model: the planner reads NVML, the worker measures after loading; they agree."""
    target = one_gb_bf16_model(tmp_path / "big")
    argv = ["--target", str(target), "--algorithm", "NGRAM", "--context-length", "4096", "--mem-fraction-static", "0.5"]
    assert plan_cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpu"]["source"] == "nvml"
    planned = plan["kvCache"]["maxTotalNumTokens"]
    eng = engine(target, "NGRAM", device="cuda", device_memory_bytes=None, mem_fraction_static=0.5,
                   runtime_bytes=plan["reserve"]["runtimeBytes"], context_len=4096, cuda_graph_max_bs=8,
                   planned_tokens=planned, dtype="bfloat16")
    actual = eng.memory_profile.max_total_num_tokens
    print(f"planned {planned} tokens, worker allocated {actual}")
    # The worker charges the larger of the plan's runtime reserve and what it measures in use, so it
    # may hold slightly fewer tokens, never more.
    assert 0.98 * planned <= actual <= planned


# ---- graphs for every algorithm, sampling on the device, start-up against the plan ------------------
def _graph_case(models, case: str):
    """(algorithm, target, draft, vocabulary, engine flags) of a case named ALGORITHM[-chain|-tree]:
    EAGLE heads on the small target, STANDALONE and NGRAM on the target with 3 proposals."""
    algorithm, _, variant = case.partition("-")
    if algorithm.startswith("EAGLE"):
        extra = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3) if variant == "tree" \
            else dict(num_draft_tokens=3)
        return algorithm, models["small"], models[algorithm.lower()], VOCAB, extra
    target = models["target"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    extra = {} if algorithm == "NONE" else dict(num_draft_tokens=3)
    return algorithm, target, {"STANDALONE": models["draft"]}.get(algorithm), vocab, extra


def _count_graph_replays(monkeypatch) -> list[int]:
    from specdecode_worker.engine.cuda_graph import GraphRunner

    seen, real = [], GraphRunner.replay

    def replay(self, fb, *extras):
        seen.append(fb.batch_size)
        return real(self, fb, *extras)

    monkeypatch.setattr(GraphRunner, "replay", replay)
    return seen


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("case", ["NONE", "STANDALONE", "NGRAM", "EAGLE-chain", "EAGLE3-chain", "EAGLE-tree",
                                  "EAGLE3-tree"])
def test_greedy_output_through_cuda_graphs_equals_eager_output(models, monkeypatch, case, batch):
    """Captured graphs (decode, verify, EAGLE draft steps and verify passes, chains' and trees')
    against the same engine without graphs, at batch 1 and at a batch of 32 (every captured size up
    to 32)."""
    algorithm, target, draft, vocab, extra = _graph_case(models, case)
    sizes = dict(device="cuda", device_memory_bytes=None, max_total_tokens=8192, max_running_requests=32)
    prompts = [[random.Random(i).randrange(3, vocab) for _ in range(3 + i % 11)] for i in range(batch)]

    def outputs(graph_bs):
        eng = engine(target, algorithm, draft, cuda_graph_max_bs=graph_bs, **sizes, **extra)
        seen.clear()  # the warm-up's passes do not count
        reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts])
        return [r.output_ids for r in reqs]

    seen = _count_graph_replays(monkeypatch)
    eager = outputs(0)
    assert not seen
    assert outputs(32) == eager
    assert seen, "no pass replayed a graph"


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("algorithm", ["STANDALONE", "NGRAM", "EAGLE", "EAGLE3"])
def test_ragged_verify_rounds_replay_the_captured_verify_graph(models, monkeypatch, algorithm, batch):
    """Draft lengths drawn per request and round (0 to K, seeded; at batch 32 one request never
    drafts and one is capped at 1): greedy output through captured graphs equals the engine without
    graphs, every round where anybody verifies a proposal replays the verify graph of width K + 1,
    and every KV slot goes back to the allocator."""
    from specdecode_worker.engine.cuda_graph import GraphRunner

    k = 3
    if algorithm.startswith("EAGLE"):
        target, draft, vocab = models["small"], models[algorithm.lower()], VOCAB
    else:
        target, draft = models["target"], {"STANDALONE": models["draft"]}.get(algorithm)
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    rng = random.Random(batch)
    phrases = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 7))] for _ in range(batch)]
    prompts = [p * 3 if i % 2 == 0 else p + [rng.randrange(3, vocab) for _ in range(4)] for i, p in enumerate(phrases)]
    fields = [dict(speculative=False), dict(max_draft_tokens=1)] if batch > 1 else []
    sizes = dict(device="cuda", device_memory_bytes=None, max_total_tokens=8192, max_running_requests=32)
    seen, real = [], GraphRunner.replay

    def replay(self, fb, *extras):
        if not self.last_only:  # an extend graph (a head's extend is k + 1 wide too) is not a verify pass
            seen.append(self.tokens_per_req)
        return real(self, fb, *extras)

    monkeypatch.setattr(GraphRunner, "replay", replay)

    def outputs(graph_bs):
        eng = engine(target, algorithm, draft, cuda_graph_max_bs=graph_bs, num_draft_tokens=k,
                     spec_policy="adaptive", **sizes)
        lengths = random.Random(5)
        eng.policy.draft_lengths = lambda rids, caps, **_: [lengths.randrange(0, c + 1) for c in caps]
        rounds = record_rounds(eng)
        seen.clear()  # the warm-up's passes do not count
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        reqs = run_all(eng, [Request(p, params, **(fields[i] if i < len(fields) else {}))
                             for i, p in enumerate(prompts)])
        assert_every_slot_back(eng)
        return [r.output_ids for r in reqs], [ks for ks in rounds if any(ks)]

    eager, _ = outputs(0)
    assert not seen
    graphed, drafting = outputs(32)
    assert graphed == eager
    assert seen.count(k + 1) == len(drafting) > 0
    if batch == 1:  # a round shorter than K replays the K + 1 graph
        assert any(0 < max(ks) < k for ks in drafting)
    else:  # mixed lengths in one round (of 32 draws, one is nearly always K)
        assert any(len(set(ks)) > 1 for ks in drafting)


@pytest.mark.parametrize("case", ["STANDALONE", "NGRAM", "EAGLE-chain", "EAGLE3-tree"])
def test_a_rounds_host_syncs_do_not_grow_with_the_batch(models, case):
    """CUDA's sync debug mode reports every host synchronisation: a speculative round through the
    graphs synchronises a fixed number of times (the read-back of its results, the read of the
    slots it frees), at batch 1 as at batch 8. A pageable host-to-device copy or a per-request
    read would make the count grow with the batch."""
    import warnings

    algorithm, target, draft, vocab, extra = _graph_case(models, case)
    sizes = dict(device="cuda", device_memory_bytes=None, max_total_tokens=8192, max_running_requests=8,
                 cuda_graph_max_bs=8)

    def syncs_per_round(batch: int) -> list[int]:
        eng = engine(target, algorithm, draft, **sizes, **extra)
        counts, real_round = [], eng.speculator.decode_round

        def counted(reqs, *args, **kwargs):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = real_round(reqs, *args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
            return out

        eng.speculator.decode_round = counted
        prompts = [[random.Random(i).randrange(3, vocab) for _ in range(3 + i % 5)] * 2 for i in range(batch)]
        run_all(eng, [Request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts])
        return counts

    one, eight = syncs_per_round(1), syncs_per_round(8)
    print(f"{case}: host syncs per round at batch 1 {one}, at batch 8 {eight}")
    assert one and eight
    # A tree round also frees its scratch slots, a read of its own.
    assert max(eight) <= max(one) <= (4 if case.endswith("tree") else 3), (one, eight)


def test_sampling_and_acceptance_never_synchronise(models):
    """Device sampling and chain acceptance queue work only: CUDA's sync debug mode raises on any
    host synchronisation inside them; the one read-back is to_host."""
    from specdecode_worker.engine.sampler.batch_sampling import choose_tokens, to_host, uniforms, verify_chains

    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20), SamplingParams(), SamplingParams(temperature=1.0)]
    logits = torch.randn(3, 4, 1000, device="cuda")
    draft = torch.randint(0, 1000, (3, 3), device="cuda")
    draft_probs = torch.softmax(torch.randn(3, 3, 1000, device="cuda"), -1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        u = uniforms(params, [gen] * 3, [4, 3, 2], "cuda")
        tokens, _ = choose_tokens(logits[:, 0], params, u[:, 0])
        n, nxt = verify_chains(draft, draft_probs, logits, [3, 2, 1], params, u)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    n, nxt, tokens = to_host(n, nxt, tokens)
    assert all(0 <= a <= k for a, k in zip(n, [3, 2, 1])) and all(0 <= t < 1000 for t in nxt + tokens)


def test_tree_drafting_and_acceptance_never_synchronise():
    """Tree expansion, selection, masks and acceptance (greedy and sampled rows) queue work only;
    the one read-back is to_host."""
    from specdecode_worker.engine.sampler.batch_sampling import to_host, uniforms
    from specdecode_worker.engine.speculation.tree import TreeDrafter, TreeShape, accept_trees

    shape, batch, vocab = TreeShape(3, 3, 6), 4, 1000
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=1.0)]
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(batch, vocab, device="cuda")
    steps = [torch.randn(batch * 3, vocab, device="cuda") for _ in range(shape.steps - 1)]
    target = torch.randn(batch * shape.width, vocab, device="cuda")
    roots = torch.arange(batch, device="cuda")
    valid = torch.ones(batch, shape.width, dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafter = TreeDrafter(shape, first)
        for step, logits in enumerate(steps, start=1):
            drafter.step_mask(step)
            drafter.expand(logits)
        trees = drafter.select(roots)
        u = uniforms(params, [gen] * batch, shape.steps * shape.topk + 1, "cuda")
        count, nxt, path = accept_trees(trees, shape, valid, target, params, u)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    count, nxt, path = to_host(count, nxt, path)
    assert all(0 <= c <= shape.steps for c in count) and all(0 <= t < vocab for t in nxt)


@pytest.mark.parametrize("case", ["EAGLE3-chain", "EAGLE3-tree", "MTP"])
def test_example_sizes_start_at_context_8192_with_the_default_graph_batch_and_the_peak_within_plan(
        tmp_path, capsys, case):
    """Planned at contextLength 8192 with the planner's defaults for this GPU (cudaGraphMaxBs,
    chunkedPrefillSize): a 1 GB bf16 target with an EAGLE3 head drafting chains or trees, and the
    tiny DeepSeek-V3 drafting with its NextN layer, start, capture their graphs, and phase 3's
    warm-up (the longest prompt in chunks with the draft catching up, then a full speculative
    round) measures a dynamic peak at or below the plan's."""
    tree = ("--speculative-eagle-topk", "3", "--speculative-num-steps", "3", "--num-draft-tokens", "6")
    if case == "MTP":
        if not hasattr(transformers, "DeepseekV3ForCausalLM"):
            pytest.skip("this transformers has no DeepseekV3ForCausalLM")
        from devtools.deepseek_models import write_tiny_deepseek

        target, draft, algorithm, extra = write_tiny_deepseek(tmp_path / "ds", mtp=True,
                                                              max_position_embeddings=8192), None, "MTP", ()
        kw, dtype = dict(num_draft_tokens=3), None
    else:
        target = one_gb_bf16_model(tmp_path / "big")
        draft, algorithm = write_eagle3_head(tmp_path / "head", target, draft_vocab=8000, seed=3), "EAGLE3"
        extra = tree if case == "EAGLE3-tree" else ("--num-draft-tokens", "3")
        kw = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3) if case == "EAGLE3-tree" \
            else dict(num_draft_tokens=3)
        dtype = "bfloat16"
    argv = ["--target", str(target), "--algorithm", algorithm, "--context-length", "8192", *extra]
    if draft is not None:
        argv += ["--draft", str(draft)]
    assert plan_cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    reserve = plan["reserve"]
    assert reserve["cudaGraphMaxBs"] > 0
    eng = engine(target, algorithm, draft, device="cuda", device_memory_bytes=None,
                 mem_fraction_static=plan["memFractionStatic"], runtime_bytes=reserve["runtimeBytes"], context_len=8192,
                 cuda_graph_max_bs=reserve["cudaGraphMaxBs"], max_running_requests=reserve["maxRunningRequests"],
                 chunked_prefill_size=reserve["chunkedPrefillSize"], planned_dynamic_bytes=reserve["dynamicBytes"],
                 planned_tokens=plan["kvCache"]["maxTotalNumTokens"], dtype=dtype, **kw)
    peak = eng.dynamic_peak
    print(f"{case}: dynamic bytes planned {peak.planned}, measured {peak.measured} ({peak.note}); KV tokens "
          f"planned {plan['kvCache']['maxTotalNumTokens']}, allocated {eng.memory_profile.max_total_num_tokens}")
    assert peak.measured is not None and peak.measured <= peak.planned
    assert peak.chunk_tokens == min(reserve["chunkedPrefillSize"], 8191) and peak.prompt_tokens == 8191
    assert peak.batch == reserve["maxRunningRequests"] and peak.width == kw["num_draft_tokens"] + 1
    assert any("catch-up" in p for p in peak.passes) and any("sampling" in p for p in peak.passes)
    assert eng.speculator.passes.graphs, "the draft and verify graphs were captured"
    out = eng.generate(list(range(3, 40)), SamplingParams(max_tokens=8, ignore_eos=True)).output_ids
    assert len(out) == 8


@pytest.mark.parametrize("batch", [1, 32])
def test_mtp_greedy_output_through_cuda_graphs_equals_eager_and_plain(tmp_path, monkeypatch, batch):
    """The tiny DeepSeek-V3 with its NextN layer drafting on the MLA Triton kernels: target steps,
    verify passes (k + 1 tokens) and NextN chain steps replay captured graphs (MoE on its static
    path), and the output equals the same engine without graphs and the target's plain decoding."""
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from devtools.deepseek_models import write_tiny_deepseek

    model = write_tiny_deepseek(tmp_path / "ds", mtp=True)
    sizes = dict(device="cuda", device_memory_bytes=None, max_total_tokens=8192, max_running_requests=32,
                 context_len=256)
    prompts = [[random.Random(i).randrange(4, 150) for _ in range(3 + i % 11)] for i in range(batch)]

    def outputs(algorithm, graph_bs):
        eng = engine(model, algorithm, cuda_graph_max_bs=graph_bs, **sizes,
                     **({"num_draft_tokens": 3} if algorithm == "MTP" else {}))
        if algorithm == "MTP" and graph_bs:
            assert set(eng.speculator.passes.graphs) == {("target", 1), ("target", 4), ("draft", 1),
                                                         ("draft_extend", 4)}
            assert type(eng.draft_runner.backend).__name__ == "TritonMLABackend"
        seen.clear()  # the warm-up's passes do not count
        reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts])
        return [r.output_ids for r in reqs]

    seen = _count_graph_replays(monkeypatch)
    plain = outputs("NONE", 0)
    eager = outputs("MTP", 0)
    assert not seen
    assert eager == plain
    assert outputs("MTP", 32) == eager
    assert seen, "no pass replayed a graph"
