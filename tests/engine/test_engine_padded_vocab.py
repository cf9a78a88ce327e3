"""Draft pairs that share one tokenizer but pad their vocabularies differently (as Qwen2.5 7B and
0.5B do): the planner and the worker accept them by one rule, and decoding stays exact."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.engine import model_runner as runner_mod  # noqa: E402
from specdecode_worker.engine.speculation import verify  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.planner.plan import PlanArgs  # noqa: E402
from specdecode_worker.planner.plan_cli import make_plan  # noqa: E402

from devtools.checkpoints import write_tokenizer as write_other_tokenizer  # noqa: E402
from tests.engine_helpers import engine, hf_greedy, run_all  # noqa: E402
from devtools.tiny_models import VOCAB, write_tiny_model  # noqa: E402

TOKENS = len(VOCAB)  # ids the shared tokenizer defines; every head has padding rows above it
NARROW = 136  # the narrower draft's padded vocabulary
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22], list(range(30, 60))]
GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
DRAFT_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    return {
        "target": write_tiny_model(root / "target", seed=0, weight_scale=3.0, vocab_size=192),
        "narrower": write_tiny_model(root / "narrower", seed=1, weight_scale=3.0, vocab_size=NARROW, **DRAFT_SHAPE),
        "wider": write_tiny_model(root / "wider", seed=2, weight_scale=3.0, vocab_size=256, **DRAFT_SHAPE),
    }


@pytest.fixture(scope="module")
def reference(models):
    return hf_greedy(models["target"], PROMPTS, 30)


def _plan(target, draft):
    return make_plan(PlanArgs(target=str(target), draft=str(draft), algorithm="STANDALONE", tp=1, gpu_memory_gib=1.1,
                              mem_fraction_static=0.95, context_length=64))


@pytest.mark.parametrize("draft", ["narrower", "wider"])
def test_padded_pair_is_planned_and_served_with_the_target_greedy_output(models, reference, draft):
    assert _plan(models["target"], models[draft])["fits"]
    eng = engine(models["target"], "STANDALONE", models[draft])
    assert eng.draft_runner.vocabulary.proposable_ids == min(192, NARROW if draft == "narrower" else 256)
    outputs = [r.output_ids for r in run_all(eng, [Request(p, GREEDY) for p in PROMPTS])]
    assert outputs == reference
    assert eng.stats.proposed_tokens > 0
    assert eng.kv_usage()[0] == 0


@pytest.mark.parametrize("draft, shared", [("narrower", NARROW), ("wider", 192)])
def test_draft_proposes_only_rows_both_heads_have_and_verification_reads_the_whole_target_row(
        models, monkeypatch, draft, shared):
    seen = []

    def recording_verify(draft, draft_probs, target_logits, lengths, params, u):
        for i, k in enumerate(lengths):
            seen.append((draft[i, :k].tolist(), draft_probs[i, :k], target_logits.shape[-1]))
        return verify_chains(draft, draft_probs, target_logits, lengths, params, u)

    verify_chains = verify.verify_chains
    monkeypatch.setattr(verify, "verify_chains", recording_verify)
    eng = engine(models["target"], "STANDALONE", models[draft])
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True)
    run_all(eng, [Request(p, params) for p in PROMPTS])
    proposals = [t for s in seen for t in s[0]]
    assert proposals and max(proposals) < shared
    for _, probs, width in seen:
        assert width == 192  # the target's full padded row
        for p in probs:
            assert p.shape == (192,) and float(p[shared:].sum()) == 0.0


def test_target_padding_ids_reach_the_draft_as_ids_it_can_read(models):
    # A random target emits ids above the tokenizer's; the narrower draft embeds only 136 rows.
    eng = engine(models["target"], "STANDALONE", models["narrower"])
    prompt = [150, 170, 191, 5]
    ref = engine(models["target"]).generate(prompt, GREEDY).output_ids
    assert eng.generate(prompt, GREEDY).output_ids == ref


def test_other_tokenizer_is_refused_by_planner_and_worker_alike(models, tmp_path, monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(models["narrower"], other)
    (other / "tokenizer.json").unlink()
    write_other_tokenizer(other, TOKENS + 4, 0)
    with pytest.raises(InputError) as planned:
        _plan(models["target"], other)
    loads = []
    monkeypatch.setattr(runner_mod.ModelRunner, "load_weights", lambda self: loads.append(self.name))
    eng = Engine(EngineArgs(str(models["target"]), str(other), "STANDALONE", device_memory_bytes=64 << 20))
    with pytest.raises(InputError) as served:
        eng.init_model_worker()
    message = str(served.value)
    assert str(planned.value) == message
    assert f"defines {TOKENS + 4} token ids" in message and "must use the target's tokenizer" in message
    assert loads == []  # refused before any weight is read
