"""A plan that fits is a worker that starts: every algorithm x model family of the tiny test matrix
goes through the planner and then the worker (t = 1). A pair the planner accepts must start and
decode; a pair the planner refuses must be refused by the worker too, with the same kind of error."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.request import SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.planner.plan import PlanArgs  # noqa: E402
from specdecode_worker.planner.plan_cli import make_plan  # noqa: E402

from devtools.deepseek_models import write_tiny_deepseek  # noqa: E402
from devtools.eagle_heads import write_eagle3_head, write_eagle_head  # noqa: E402
from tests.engine_helpers import engine  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402

GIB = 1 << 30
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    m = {
        "llama": write_tiny_model(root / "llama", "llama", seed=0),
        "qwen2": write_tiny_model(root / "qwen2", "qwen2", seed=0, vocab_size=192),
        "mistral": write_tiny_model(root / "mistral", "mistral", seed=0),
        "deepseek": write_tiny_deepseek(root / "deepseek", mtp=True, num_hidden_layers=2),
        "deepseek-no-mtp": write_tiny_deepseek(root / "deepseek-no-mtp", num_hidden_layers=2,
                                               num_nextn_predict_layers=0),
        "llama-small": write_tiny_model(root / "llama-small", "llama", seed=1, **SMALL),
        "qwen2-small": write_tiny_model(root / "qwen2-small", "qwen2", seed=1, vocab_size=136, **SMALL),
    }
    m["eagle-llama"] = write_eagle_head(root / "eagle-llama", m["llama"])
    m["eagle3-llama"] = write_eagle3_head(root / "eagle3-llama", m["llama"], draft_vocab=64, aux_layer_ids=[0, 1, 1])
    # the default layers [2, L//2, L-3] do not exist in a two-layer target
    m["eagle3-default-layers"] = write_eagle3_head(root / "eagle3-default-layers", m["llama"], draft_vocab=64)
    return m


CASES = [  # (target, algorithm, draft or None, the planner accepts it)
    ("llama", "NGRAM", None, True),
    ("llama", "STANDALONE", "llama-small", True),
    ("llama", "EAGLE", "eagle-llama", True),
    ("llama", "EAGLE3", "eagle3-llama", True),
    ("llama", "EAGLE3", "eagle3-default-layers", False),
    ("llama", "MTP", None, False),  # no NextN layer
    ("qwen2", "STANDALONE", "qwen2-small", True),  # one tokenizer, vocabularies padded 192 vs 136
    ("mistral", "STANDALONE", "llama-small", True),
    ("deepseek", "NGRAM", None, True),
    ("deepseek", "MTP", None, True),
    ("deepseek", "STANDALONE", "llama-small", True),
    ("deepseek-no-mtp", "MTP", None, False),
    ("llama", "STANDALONE", "deepseek", False),  # a model with MTP layers drafts for itself only
]


@pytest.mark.slow
@pytest.mark.parametrize("target, algorithm, draft, accepted", CASES,
                         ids=[f"{t}-{a}-{d or 'none'}" for t, a, d, _ in CASES])
def test_a_plan_that_fits_is_a_worker_that_starts(models, target, algorithm, draft, accepted):
    draft_dir = str(models[draft]) if draft else None
    args = PlanArgs(target=str(models[target]), algorithm=algorithm, draft=draft_dir, tp=1, gpu_memory_gib=1.5,
                    mem_fraction_static=0.95, context_length=64)
    if not accepted:
        with pytest.raises(InputError):
            make_plan(args)
        with pytest.raises(InputError):
            engine(models[target], algorithm, models[draft] if draft else None, context_len=64)
        return
    plan = make_plan(args)
    assert plan["fits"], plan["message"]
    eng = engine(models[target], algorithm, models[draft] if draft else None,
                 device_memory_bytes=int(1.5 * GIB), mem_fraction_static=plan["memFractionStatic"],
                 runtime_bytes=plan["reserve"]["runtimeBytes"], context_len=64, num_draft_tokens=3)
    assert eng.target_runner.token_to_kv_pool_allocator.size == plan["kvCache"]["maxTotalNumTokens"]
    assert eng.target_runner.weight_bytes == plan["weights"]["targetBytes"]
    if eng.draft_runner is not None:
        assert eng.draft_runner.weight_bytes == plan["weights"]["draftBytes"]
        assert eng.draft_runner.kv_cell_bytes == plan["kvCache"]["draftBytesPerToken"]
    out = eng.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)).output_ids
    assert len(out) == 6
