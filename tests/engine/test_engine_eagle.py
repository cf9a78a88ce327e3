"""EAGLE / EAGLE3 heads: greedy output equals the target's own, pools equal the plan, bad heads fail at load."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.planner import plan_cli  # noqa: E402
from specdecode_worker.engine.speculation.head_runner import EagleRunner  # noqa: E402
from specdecode_worker.engine.model_runner import ModelRunner  # noqa: E402
from specdecode_worker.engine.phases import Phase, PhaseError  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from devtools.eagle_heads import make_repeating, write_copying_eagle_head, write_eagle3_head, write_eagle_head  # noqa: E402
from tests.engine_helpers import assert_every_slot_back, engine, run_all  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402

from specdecode_worker.contract import GIB  # noqa: E402
# A small vocabulary makes random heads agree with the target often enough that accepted chains
# and accepted tree paths (slot remapping, feature hand-over) are exercised, not only rejections.
VOCAB = 8
CHAIN = dict(num_draft_tokens=3)
TREE = dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    # 6 layers: the EAGLE3 default reads the states entering layers 2, 3 and 3.
    target = write_tiny_model(root / "target", "llama", seed=0, weight_scale=3.0, vocab_size=VOCAB, num_hidden_layers=6)
    return {
        "target": target,
        "eagle": write_eagle_head(root / "eagle", target, seed=1),
        "eagle_bin": write_eagle_head(root / "eagle-bin", target, seed=1, fmt="bin"),
        "eagle2": write_eagle_head(root / "eagle-2layer", target, seed=2, layers=2),
        "eagle3": write_eagle3_head(root / "eagle3", target, draft_vocab=6, seed=3),
        "eagle3_ids": write_eagle3_head(root / "eagle3-ids", target, draft_vocab=6, seed=4, aux_layer_ids=[0, 2, 4]),
        "root": root,
    }


def _prompts(n=5, seed=0, vocab=VOCAB):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(2, 14))] for _ in range(n)]


def _generate(target, algorithm="NONE", draft=None, params=None, vocab=VOCAB, **kw):
    eng = engine(target, algorithm, draft, max_running_requests=3, **kw)
    params = params or SamplingParams(max_tokens=24, ignore_eos=True)
    reqs = run_all(eng, [Request(p, params) for p in _prompts(vocab=vocab)])
    return [r.output_ids for r in reqs], eng


@pytest.fixture(scope="module")
def reference(models):
    return _generate(models["target"])[0]


@pytest.mark.parametrize("head", ["eagle", "eagle2", "eagle3", "eagle3_ids"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_output_is_the_target_greedy_output(models, reference, head, mode):
    algorithm = "EAGLE3" if head.startswith("eagle3") else "EAGLE"
    out, eng = _generate(models["target"], algorithm, models[head], **(CHAIN if mode == "chain" else TREE))
    assert out == reference
    stats = eng.stats
    # 5 requests, at most 3 running at once: requests joined and left a running batch.
    assert stats.finished_requests == 5 and stats.verify_rounds > 0
    # Some rounds accepted drafts, so the commit of accepted slots and features ran.
    assert stats.accepted_tokens > 0, stats.accept_lengths
    assert sum(n * c for n, c in stats.accept_lengths.items()) == stats.accepted_tokens
    assert_every_slot_back(eng)  # every slot (verify, rejected, tree scratch) came back


@pytest.mark.parametrize("kw", [CHAIN, TREE], ids=["chain", "tree"])
def test_deep_acceptance_keeps_the_target_greedy_output(tmp_path, kw):
    """A head that proposes "repeat the last token" on a target that mostly repeats: whole chains
    and 3-deep tree paths are accepted, and a partly accepted round (then a change of token)
    still gives the target's own output."""
    target = make_repeating(write_tiny_model(tmp_path / "t", "llama", seed=0, weight_scale=3.0, vocab_size=16,
                                             num_hidden_layers=4), layer_scale=1.0)
    head = write_copying_eagle_head(tmp_path / "h", target)
    ref, _ = _generate(target, vocab=16)
    out, eng = _generate(target, "EAGLE", head, vocab=16, **kw)
    assert out == ref
    lengths = eng.stats.accept_lengths
    assert max(lengths) == 3 and min(lengths) < 3, lengths


def test_sampling_runs_with_chain_and_tree(models):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    for kw in (CHAIN, TREE):
        out, eng = _generate(models["target"], "EAGLE3", models["eagle3"], params=params, **kw)
        assert all(len(o) == 12 and all(0 <= t < VOCAB for t in o) for o in out)


def test_pytorch_model_bin_head_loads_like_safetensors(models, reference):
    out, eng = _generate(models["target"], "EAGLE", models["eagle_bin"], **CHAIN)
    assert out == reference
    same = eng.draft_runner.model
    other = engine(models["target"], "EAGLE", models["eagle"]).draft_runner.model
    for (n, a), (_, b) in zip(same.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n


def test_pickled_code_in_a_bin_head_is_refused(models, tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    head = write_eagle_head(tmp_path / "evil", models["target"], seed=1, fmt="bin")
    state = torch.load(head / "pytorch_model.bin", weights_only=True)
    state["fc.bias"] = Payload()
    torch.save(state, head / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"weights_only=True"):
        engine(models["target"], "EAGLE", head)
    assert not marker.exists()


def test_phase_split_and_shared_tensors_loaded_once(models):
    eng = engine(models["target"], "EAGLE", models["eagle"])
    target, draft = eng.target_runner, eng.draft_runner
    assert draft.req_to_token_pool is target.req_to_token_pool
    assert draft.token_to_kv_pool_allocator is target.token_to_kv_pool_allocator
    assert draft.token_to_kv_pool is not target.token_to_kv_pool
    # The checkpoint carries a copy of embed_tokens; the head holds none and borrows the target's.
    names = dict(draft.model.named_parameters())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert eng.speculator.passes.embed is target.model.model.embed_tokens
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in draft.model.parameters()}


def test_head_cannot_load_before_its_target(models):
    target = ModelRunner(models["target"])  # constructed, weights not loaded
    runner = EagleRunner(str(models["eagle"]), target, "EAGLE")
    with pytest.raises(PhaseError, match=r"phase 1 \(load weights\)"):
        runner.load_weights()
    assert runner.phase == Phase.CREATED


@pytest.mark.parametrize("algorithm,head", [("EAGLE", "eagle"), ("EAGLE3", "eagle3")])
def test_draft_pool_and_weights_equal_the_plan(models, capsys, algorithm, head):
    argv = ["--target", str(models["target"]), "--algorithm", algorithm, "--draft", str(models[head]),
            "--gpu-memory-gib", "1.1", "--mem-fraction-static", "0.95", "--context-length", "64"]
    assert plan_cli.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    eng = engine(models["target"], algorithm, models[head], device_memory_bytes=int(1.1 * GIB),
                   mem_fraction_static=0.95, runtime_bytes=plan["reserve"]["runtimeBytes"], context_len=64)
    t, d = eng.target_runner, eng.draft_runner
    # Hand count of the head's cell: 1 layer x 2 KV heads x (16 + 16) x 4 bytes.
    assert plan["kvCache"]["draftBytesPerToken"] == d.kv_cell_bytes == d.token_to_kv_pool.bytes_per_token() == 256
    assert plan["weights"]["targetBytes"] == t.weight_bytes
    assert plan["weights"]["draftBytes"] == d.weight_bytes
    planned = plan["kvCache"]["maxTotalNumTokens"]
    assert eng.memory_profile.max_total_num_tokens == planned == t.token_to_kv_pool_allocator.size
    assert d.token_to_kv_pool.k_buffer[0].shape[0] == planned + 1


def _head_bytes(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys()}


def test_head_bytes_by_hand(models):
    """The planner's draft bytes are the checkpoint minus the shared tensors, counted by hand here."""
    for algorithm, head, shared in (("EAGLE", "eagle", {"embed_tokens.weight"}), ("EAGLE3", "eagle3", set())):
        sizes = _head_bytes(models[head])
        own = sum(b for n, b in sizes.items() if n not in shared)
        eng = engine(models["target"], algorithm, models[head])
        assert eng.draft_runner.weight_bytes == own


def _fails_at_load(target, algorithm, head, match):
    eng = Engine(EngineArgs(str(target), str(head), algorithm, device_memory_bytes=64 << 20))
    with pytest.raises(InputError, match=match):
        eng.init_model_worker()
    assert eng.phase == Phase.CREATED and eng.memory_pool_config is None  # phase 1 never finished


def test_missing_fc_fails_at_phase_1(models, tmp_path):
    head = write_eagle_head(tmp_path / "nofc", models["target"], drop=("fc.weight", "fc.bias"))
    _fails_at_load(models["target"], "EAGLE", head, r"tensor 'fc.weight' is missing")


def test_hidden_size_mismatch_fails_at_phase_1(models, tmp_path):
    wrong_fc = write_eagle3_head(tmp_path / "fc", models["target"], draft_vocab=6, fc_in=3 * 48)
    _fails_at_load(models["target"], "EAGLE3", wrong_fc, r"tensor 'fc.weight' has shape \(64, 144\).*hidden size 64")
    narrow = write_eagle_head(tmp_path / "narrow", models["target"], hidden_size=32, num_attention_heads=2,
                              num_key_value_heads=1, intermediate_size=64)
    _fails_at_load(models["target"], "EAGLE", narrow, r"hidden_size 32 differs.*'model.embed_tokens.weight'")


def test_d2t_of_the_wrong_length_fails_at_phase_1(models, tmp_path):
    head = write_eagle3_head(tmp_path / "d2t", models["target"], draft_vocab=6, d2t_len=5)
    _fails_at_load(models["target"], "EAGLE3", head, r"tensor 'd2t' has shape \(5,\).*\(6,\)")


def test_tree_arguments_are_checked_before_loading(models):
    with pytest.raises(InputError, match="must equal --speculative-num-steps"):
        Engine(EngineArgs(str(models["target"]), str(models["eagle"]), "EAGLE", num_draft_tokens=4,
                             speculative_num_steps=2))
    with pytest.raises(InputError, match="has 6 candidates"):
        Engine(EngineArgs(str(models["target"]), str(models["eagle"]), "EAGLE", num_draft_tokens=8,
                             speculative_num_steps=2, speculative_eagle_topk=2))
