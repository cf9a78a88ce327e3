"""Tensor parallelism on CPU with gloo: t ranks give the single-rank greedy output, hold the bytes
the planner predicts per GPU, and a rank that fails at load stops the whole worker."""

from __future__ import annotations

import json
import multiprocessing
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.planner import plan_cli  # noqa: E402
from specdecode_worker.engine.parallel.distributed import RankFailure, launch  # noqa: E402
from specdecode_worker.engine.request import Request  # noqa: E402

from tests.engine_helpers import engine, run_all, tiny_models  # noqa: E402
from tests.tp_helpers import (  # noqa: E402
    BUDGET_GIB,
    CONTEXT,
    FRACTION,
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    WALL_S,
    assert_serves_greedy_text,
    engine_kwargs,
    launches,
    serve_tp2_argv,
    tp_rank,
)
from devtools.tiny_models import write_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def single(models):
    """Single-rank greedy output per algorithm, in this process."""
    out = {}
    for algorithm in ("NONE", "STANDALONE"):
        draft = models["draft"] if algorithm == "STANDALONE" else None
        eng = engine(models["target"], algorithm, draft, context_len=CONTEXT, num_draft_tokens=3)
        out[algorithm] = [r.output_ids for r in run_all(eng, [Request(list(p), GREEDY) for p in PROMPTS])]
    return out


@pytest.fixture(scope="module")
def tp_runs(models):
    """Results per rank of launched tensor-parallel engines: one launch per t serves both algorithms."""
    runs = launches(tp_rank, lambda tp: {a: engine_kwargs(models, tp, a) for a in ("NONE", "STANDALONE")})
    return lambda tp, algorithm: [rank[algorithm] for rank in runs(tp)]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("algorithm", ["NONE", "STANDALONE"])
def test_greedy_output_equals_single_rank(tp_runs, single, tp, algorithm):
    ranks = tp_runs(tp, algorithm)
    assert len(ranks) == tp and all(r is not None for r in ranks)  # every follower was released
    assert ranks[0]["outputs"] == single[algorithm]
    assert all(len(o) == MAX_TOKENS for o in ranks[0]["outputs"])
    if algorithm == "STANDALONE":
        assert ranks[0]["proposed"] > 0


def _plan(models, tp: int, capsys) -> dict:
    argv = ["--target", str(models["target"]), "--algorithm", "STANDALONE", "--draft", str(models["draft"]),
            "--gpu-memory-gib", str(BUDGET_GIB[tp]), "--mem-fraction-static", str(FRACTION),
            "--context-length", str(CONTEXT), "--tp", str(tp)]
    assert plan_cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_holds_what_the_planner_predicts_per_gpu(models, tp_runs, capsys, tp):
    plan = _plan(models, tp, capsys)
    assert plan["tensorParallelSize"] == tp
    ranks = tp_runs(tp, "STANDALONE")
    planned = plan["kvCache"]["maxTotalNumTokens"]
    for info in ranks:
        assert info["target_weight_bytes"] == plan["weights"]["targetBytes"]
        assert info["draft_weight_bytes"] == plan["weights"]["draftBytes"]
        assert info["target_kv_cell"] == plan["kvCache"]["targetBytesPerToken"]
        assert info["draft_kv_cell"] == plan["kvCache"]["draftBytesPerToken"]
        assert info["profiled_tokens"] == planned
        assert info["allocated_tokens"] == planned and info["kv_rows"] == planned + 1
        assert info["draft_kv_rows"] == planned + 1  # the draft pool holds the same slots


def test_weights_shard_by_hand_count(models, tp_runs):
    """Tiny target (float32): vocab 160, hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads."""
    h, v, i, d = 64, 160, 128, 16
    per_layer_2 = (h * h + h * h + 3 * h * i) // 2 + 2 * h * d + 2 * h  # q, o, mlp halves; k, v 1 head; norms
    t2 = 2 * v * h // 2 + 2 * per_layer_2 + h  # embedding and head halves, final norm
    assert tp_runs(2, "STANDALONE")[1]["target_weight_bytes"] == 4 * t2
    # The draft (2 heads, 1 KV head) splits 2 ways, but not 4: at t=4 every rank holds it whole.
    assert [r["draft_tp"] for r in tp_runs(2, "STANDALONE")] == [2, 2]
    assert [r["draft_tp"] for r in tp_runs(4, "STANDALONE")] == [1, 1, 1, 1]


def test_kv_heads_fewer_than_ranks_are_replicated(tp_runs):
    # 2 KV heads over 4 ranks: each rank holds one (max(1, 2 // 4)); 2 layers x 1 x (16 + 16) x 4 bytes.
    for info in tp_runs(4, "NONE"):
        assert info["target_kv_heads"] == 1 and info["target_kv_cell"] == 256
    for info in tp_runs(2, "NONE"):
        assert info["target_kv_heads"] == 1 and info["target_kv_cell"] == 256


def test_a_rank_failing_at_load_stops_the_whole_worker(models, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(models["target"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(RankFailure, match=r"rank 1 of 2 failed: .*stopped the other 1 rank") as err:
        launch(2, tp_rank, ({"NONE": engine_kwargs(models, 2, "NONE")}, {1: str(bad)}), wall_timeout_s=WALL_S)
    assert "deserializing header" in str(err.value)  # the failing rank's own error, not a peer's
    assert multiprocessing.active_children() == []  # no rank left behind


def test_planner_replicates_a_standalone_draft_that_cannot_split(models, capsys):
    one, two, four = (_plan(models, t, capsys) for t in (1, 2, 4))  # 2 draft heads split 2 ways, not 4
    assert two["weights"]["draftBytes"] < one["weights"]["draftBytes"] == four["weights"]["draftBytes"]
    assert two["weights"]["targetBytes"] > four["weights"]["targetBytes"]
    # 1 layer x 1 KV head x (16 + 16) x 4 bytes, whole at t=4 as at t=1.
    assert four["kvCache"]["draftBytesPerToken"] == 128


def test_a_target_that_cannot_split_is_refused(tmp_path):
    from specdecode_worker.engine.parallel.parallel_layers import check_splits
    from specdecode_worker.errors import InputError

    target = write_tiny_model(tmp_path / "odd", num_attention_heads=4, num_key_value_heads=2, intermediate_size=130)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target)
    with pytest.raises(InputError, match="intermediate_size 130 does not divide by 4"):
        check_splits(cfg, 4, "odd/config.json")
    cfg.num_attention_heads = 6
    with pytest.raises(InputError, match="6 attention heads do not divide by 4"):
        check_splits(cfg, 4, "odd/config.json")


def test_serve_tp2_answers_like_transformers(models, tmp_path):
    """``specdecode-worker serve --tp 2``: a supervisor, two ranks, rank 0 on HTTP; greedy text equals transformers'."""
    import os
    import signal
    import subprocess

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")

    from specdecode_worker.engine.parallel.distributed import free_port
    from tests.server_helpers import wait_until_healthy

    port = free_port()
    argv = serve_tp2_argv(models, port, BUDGET_GIB[2])
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, WALL_S, [tmp_path / "serve.log"])
        assert httpx.get(f"{base}/plan").json()["plan"]["tensorParallelSize"] == 2
        assert_serves_greedy_text(base, models["target"], ["hello world what is the", "the cat and the dog"], 12)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_each_rank_loads_only_its_slice_and_the_planner_counts_it(tmp_path):
    """Qwen2 (q/k/v biases) at t=2, built per rank in this process: shards rejoin into the
    checkpoint's tensors, and each rank's bytes equal the planner's per-GPU count."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from specdecode_worker.model_rules.checkpoint import read_checkpoint, total_bytes
    from specdecode_worker.engine.parallel.distributed import TPGroup
    from specdecode_worker.engine.models.loader import load_safetensors, tensor_bytes
    from specdecode_worker.engine.models.llama import LlamaForCausalLM

    folder = write_tiny_model(tmp_path / "qwen", "qwen2", num_attention_heads=4, num_key_value_heads=2)
    cfg = AutoConfig.from_pretrained(folder)
    full = load_file(str(folder / "model.safetensors"))
    ranks = []
    for rank in range(2):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, tp=TPGroup(rank, 2))
        load_safetensors(model, folder, "cpu", torch.float32)
        ranks.append(dict(model.named_parameters()))
        assert tensor_bytes(model) == total_bytes(read_checkpoint(folder), 2, 2)
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=0), full[name])
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([r[name] for r in ranks], dim=1), full[name])
    assert torch.equal(ranks[0]["model.norm.weight"], ranks[1]["model.norm.weight"])
