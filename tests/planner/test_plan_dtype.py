"""The spec's ``target.dtype`` is priced by the planner as the worker computes in it: the planner
pod and the worker get the same --dtype, and the worker's ``serve --plan`` check passes against
the plan the planner's arguments produce (a float32 spec on a bfloat16 checkpoint used to be
planned at 2 bytes and refused by the worker on a GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode_operator import planner, workload
from specdecode_operator.spec import parse_spec, plan_key, planner_inputs
from specdecode_worker.planner import plan_cli
from specdecode_worker.serving import serve_cli
from specdecode_worker.errors import InputError
from specdecode_worker.planner.plan import ForwardGeometry, dynamic_reserve_bytes
from specdecode_worker.serving.serve_shape import check_against_plan, planned_dtype
from devtools.checkpoints import write_checkpoint
from tests.operator_helpers import example, make_plan, typed

# One Llama layer: hidden 64, MLP 128, 4 heads of 16, 2 KV heads, vocabulary 1000, stored bfloat16.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
TENSORS = [
    ("model.embed_tokens.weight", "BF16", (1000, 64)),
    ("model.layers.0.input_layernorm.weight", "BF16", (64,)),
    ("model.layers.0.self_attn.q_proj.weight", "BF16", (64, 64)),
    ("model.layers.0.self_attn.k_proj.weight", "BF16", (32, 64)),
    ("model.layers.0.self_attn.v_proj.weight", "BF16", (32, 64)),
    ("model.layers.0.self_attn.o_proj.weight", "BF16", (64, 64)),
    ("model.layers.0.post_attention_layernorm.weight", "BF16", (64,)),
    ("model.layers.0.mlp.gate_proj.weight", "BF16", (128, 64)),
    ("model.layers.0.mlp.up_proj.weight", "BF16", (128, 64)),
    ("model.layers.0.mlp.down_proj.weight", "BF16", (64, 128)),
    ("model.norm.weight", "BF16", (64,)),
    ("lm_head.weight", "BF16", (1000, 64)),
]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-bf16"), CONFIG, TENSORS)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _view(dtype: str):
    body = example("ngram.yaml")
    body["spec"]["target"]["dtype"] = dtype
    body["spec"]["gpu"] = {"memoryGiB": 20}
    body["spec"]["serving"].update(contextLength=2048, minKvTokens=4096)
    return parse_spec(body)


def _plan_from_planner_args(view, model_dir) -> dict:
    args = planner.planner_args(view)[1:]
    args[args.index("--target") + 1] = str(model_dir)  # the store's folder, here a local copy
    return plan_cli.plan_from_flags(plan_cli.parser().parse_args(args))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_planner_and_worker_agree_on_the_dtype_and_the_worker_accepts_the_plan(tiny_bf16, tmp_path, dtype):
    view = _view(dtype)
    plan = _plan_from_planner_args(view, tiny_bf16)
    assert plan["fits"], plan["message"]
    planner_dtype = _flag(planner.planner_args(view), "--dtype") if dtype != "auto" else "auto"
    worker = workload.worker_args(view, typed(plan))
    assert _flag(worker, "--dtype") == planner_dtype == dtype
    if dtype == "auto":
        assert "--dtype" not in planner.planner_args(view)
    flags = serve_cli.parser().parse_args(worker[1:])
    flags.target = str(tiny_bf16)
    assert planned_dtype(flags, typed(plan), "cuda") == dtype
    check_against_plan(flags, typed(plan), "plan.json", "cuda")  # raises when wider than planned
    assert plan["reserve"]["dtypeBytes"] == {"float32": 4, "bfloat16": 2, "auto": 2}[dtype]


def test_a_float32_plan_of_a_bfloat16_checkpoint_by_hand(tiny_bf16):
    """165,056 elements (embedding and head 2 x 64,000, q and o 2 x 4,096, k and v 2 x 2,048, MLP
    3 x 8,192, three norms of 64): 330,112 B stored, 660,224 B served in float32. The KV cell of
    the one layer: 2 KV heads x (16 + 16) x 4 B = 256 B per token (128 B in bfloat16)."""
    auto = _plan_from_planner_args(_view("auto"), tiny_bf16)
    wide = _plan_from_planner_args(_view("float32"), tiny_bf16)
    assert auto["weights"]["targetBytes"] == 330_112 and wide["weights"]["targetBytes"] == 660_224
    assert auto["kvCache"]["targetBytesPerToken"] == 128 and wide["kvCache"]["targetBytesPerToken"] == 256
    assert (auto["kvCache"]["dtype"], wide["kvCache"]["dtype"]) == ("bfloat16", "float32")
    assert (auto["reserve"]["dtypeBytes"], wide["reserve"]["dtypeBytes"]) == (2, 4)
    assert "dtype" not in auto["reserve"] and wide["reserve"]["dtype"] == "float32"
    r = wide["reserve"]
    geometry = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 4)
    assert r["dynamicBytes"] == dynamic_reserve_bytes(
        "NGRAM", geometry, None, 1, r["chunkedPrefillSize"], r["cudaGraphMaxBs"], r["maxRunningRequests"],
        verify_tokens=r["verifyTokens"]) + r["blasWorkspaceBytes"]
    assert r["dynamicBytes"] > auto["reserve"]["dynamicBytes"]


def test_fp8_weights_and_their_scales_stay_as_stored():
    from specdecode_worker.model_rules.checkpoint import TensorInfo, as_served

    tensors = [TensorInfo("a.weight", "F8_E4M3", (256, 256), 65_536, "f", 0, "matrix"),
               TensorInfo("a.weight_scale_inv", "F32", (2, 2), 16, "f", 0, "matrix"),
               TensorInfo("n.weight", "BF16", (256,), 512, "f", 0, "vector")]
    assert [t.nbytes for t in as_served(tensors, "float32")] == [65_536, 16, 1024]
    assert [t.nbytes for t in as_served(tensors, "bfloat16")] == [65_536, 16, 512]
    assert as_served(tensors, "auto") == tensors


def test_a_plan_made_without_the_dtype_is_refused_by_a_float32_worker(tiny_bf16):
    """What the planner pod did before: the checkpoint's 2 bytes; the worker's float32 takes 4."""
    view = _view("float32")
    args = planner.planner_args(view)[1:]
    at = args.index("--dtype")
    del args[at:at + 2]
    args[args.index("--target") + 1] = str(tiny_bf16)
    stale = plan_cli.plan_from_flags(plan_cli.parser().parse_args(args))
    flags = serve_cli.parser().parse_args(workload.worker_args(view, typed(stale))[1:])
    with pytest.raises(InputError, match="re-plan with --dtype float32"):
        check_against_plan(flags, typed(stale), "plan.json", "cuda")


def test_auto_on_a_gpu_serves_the_planned_dtype_and_cpu_keeps_auto():
    flags = serve_cli.parser().parse_args(["--target", "/models/t", "--algorithm", "NGRAM"])
    base = typed(make_plan())
    plan = dataclasses.replace(base, reserve=dataclasses.replace(base.reserve, dtype="bfloat16", dtype_bytes=2))
    assert planned_dtype(flags, plan, "cuda") == "bfloat16" and planned_dtype(flags, plan, "cpu") == "auto"
    unnamed = dataclasses.replace(base, reserve=dataclasses.replace(base.reserve, dtype=None, dtype_bytes=2))
    assert planned_dtype(flags, unnamed, "cuda") == "auto"


def test_only_a_dtype_other_than_auto_enters_the_plan_key():
    """A plan made before the planner priced the dtype is re-made; auto plans keep their keys."""
    assert "pricedDtype" not in planner_inputs(_view("auto"))
    assert planner_inputs(_view("float32"))["pricedDtype"] == "float32"
    assert plan_key(_view("float32")) != plan_key(_view("bfloat16"))
