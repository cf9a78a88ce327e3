"""`specdecode-worker plan --engine vllm|sglang`: the plan restated in each engine's arithmetic.

References are hand computations from the published Llama-3.1-8B and EAGLE3 configs and the
engines' formulas as their sources state them (vLLM 0.32.0 ``kv_cache_utils``; SGLang 0.5.23
``_profile_available_bytes`` and ``DefaultPoolConfigurator``), not the modules under test.
"""

import json
import math

import pytest

from specdecode_worker.planner import plan_cli
from specdecode_worker.contract import GIB, validate_plan
from specdecode_worker.planner.runtimes import check_engine, vllm
from devtools.checkpoints import write_model

G = 79 * GIB
F = 0.835
TARGET_W, DRAFT_W = 16_060_522_496, 849_763_584
CELL = 32 * 2 * 8 * 128 * 2 + 1 * 2 * 8 * 128 * 2  # 32 target layers + 1 EAGLE3 layer: K and V, 8 heads of 128, bf16
EMBED = 128_256 * 4_096 * 2  # the target's embedding, which the EAGLE3 head shares


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {n: str(write_model(root / n, n)) for n in
            ("llama-3.1-8b-instruct", "eagle3-llama-3.1-8b", "qwen2.5-0.5b-instruct", "qwen2.5-7b-instruct",
              "deepseek-v3")}


def plan(models, capsys, *extra, engine="specdecode", context=8192):
    code = plan_cli.main(["--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                          "--algorithm", "EAGLE3", "--gpu-memory-gib", "79", "--mem-fraction-static", str(F),
                          "--context-length", str(context), "--engine", engine, *map(str, extra)])
    out, err = capsys.readouterr()
    assert code in (0, 3), err
    return code, validate_plan(json.loads(out))


def test_specdecode_is_the_default_and_unchanged(models, capsys):
    _, default = plan(models, capsys)
    assert "runtime" not in default
    assert default["kvCache"]["maxTotalNumTokens"] == 390_960  # as test_plan_cli's golden case


def test_vllm_one_budget_in_whole_blocks(models, capsys):
    code, p = plan(models, capsys, engine="vllm")
    rt, kv = p["runtime"], p["kvCache"]
    assert code == 0 and p["fits"]
    # the plan's KV bytes less vLLM's 1 GiB graph allowance, in tokens, then whole blocks of 32
    tokens = math.floor((G * F - TARGET_W - DRAFT_W - GIB - GIB) / CELL)
    assert tokens == 383_016
    blocks = tokens // 32
    assert (rt["engine"], rt["version"], rt["blockSize"], rt["numBlocks"]) == ("vllm", "0.32.0", 32, blocks)
    assert rt["kvCacheMemoryBytes"] == blocks * 32 * CELL == kv["poolBytes"]
    # vLLM's report: num_blocks / cdiv(max_model_len, block_size) * max_model_len
    assert rt["reportedTokens"] == blocks * 32 == kv["maxTotalNumTokens"]
    assert rt["dtype"] == "bfloat16" and "--kv-cache-memory-bytes" in p["message"]


def test_vllm_report_when_the_context_is_not_whole_blocks():
    assert vllm.reported_tokens(1_000, 32, 1_000) == int(1_000 / 32 * 1_000)  # cdiv(1000, 32) = 32 blocks a request
    assert vllm.reported_tokens(1_195, 32, 2_048) == 38_240  # vLLM 0.32 on CPU reported 38,240 for this pool


def test_sglang_fraction_reaches_the_planned_tokens(models, capsys):
    code, p = plan(models, capsys, engine="sglang")
    rt, kv = p["runtime"], p["kvCache"]
    assert code == 0 and p["fits"]
    sglang_cell = int(32 * 2 * 8 * 128 * 2 * (1 + 1 / 32))  # the target's cell scaled by the layer ratio
    assert sglang_cell == CELL  # an EAGLE3 layer is as wide as the target's
    tokens = math.floor((G * F - TARGET_W - DRAFT_W - GIB - EMBED) / CELL)
    assert rt["reportedTokens"] == tokens == kv["maxTotalNumTokens"]
    assert rt["extraReserveBytes"] == EMBED and rt["pageSize"] == 1
    # SGLang's own arithmetic with the pinned fraction, over the memory free before loading
    pre_load = G - GIB
    rest = pre_load * rt["memFractionStatic"] - TARGET_W - DRAFT_W - EMBED
    assert rest // sglang_cell >= tokens  # so --max-total-tokens is what binds
    assert (pre_load * (rt["memFractionStatic"] - 0.001) - TARGET_W - DRAFT_W - EMBED) // sglang_cell < tokens
    # and the pools really allocated (target and draft at their own widths) fit the plan's budget
    assert tokens * CELL <= G * F - TARGET_W - DRAFT_W - GIB


def test_sglang_prices_a_draft_wider_than_its_layer_ratio(models, capsys):
    """A STANDALONE draft with wider layers than the target's: SGLang's layer-ratio cell under-counts
    it, so the plan sizes tokens by the real cell, which SGLang's arithmetic then also reaches."""
    code = plan_cli.main(["--target", models["qwen2.5-0.5b-instruct"], "--draft", models["qwen2.5-7b-instruct"],
                          "--algorithm", "STANDALONE", "--gpu-memory-gib", "40", "--mem-fraction-static", "0.8",
                          "--context-length", "4096", "--engine", "sglang"])
    out, err = capsys.readouterr()
    p = validate_plan(json.loads(out))
    assert code == 0, err
    target_cell = 24 * 2 * 2 * 64 * 2  # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64
    draft_cell = 28 * 2 * 4 * 128 * 2  # Qwen2.5-7B: 28 layers, 4 KV heads of 128
    ratio_cell = int(target_cell * (1 + 28 / 24))  # what SGLang's configurator prices
    assert (p["kvCache"]["targetBytesPerToken"], p["kvCache"]["draftBytesPerToken"]) == (target_cell, draft_cell)
    assert p["layerRatio"]["bytesPerToken"] == ratio_cell < target_cell + draft_cell
    weights = p["weights"]["targetBytes"] + p["weights"]["draftBytes"]
    tokens = math.floor((40 * GIB * 0.8 - weights - GIB) / (target_cell + draft_cell))
    assert p["runtime"]["reportedTokens"] == tokens == p["kvCache"]["maxTotalNumTokens"]
    rest = (40 * GIB - GIB) * p["runtime"]["memFractionStatic"] - weights
    assert rest // ratio_cell >= tokens


def test_engine_plans_keep_the_termination_log_limit(models, capsys, tmp_path):
    for engine in ("vllm", "sglang"):
        code = plan_cli.main(["--target", models["deepseek-v3"], "--algorithm", "MTP", "--gpu-product", "NVIDIA-H200",
                              "--engine", engine, "--termination-log", str(tmp_path / engine)])
        capsys.readouterr()
        text = (tmp_path / engine).read_text()
        assert code in (0, 3) and len(text.encode()) < 4096
        assert json.loads(text)["runtime"]["engine"] == engine


def test_vllm_does_not_fit_without_room_for_its_allowance(models, capsys):
    code, p = plan(models, capsys, "--min-kv-tokens", 390_000, engine="vllm")
    assert code == 3 and not p["fits"]
    assert "390000" in p["message"] and "graph allowance" in p["message"]


def test_engines_refuse_what_they_cannot_serve(models, capsys):
    assert check_engine("vllm", "EAGLE3", top_k=4) and "EAGLE tree" in check_engine("vllm", "EAGLE3", top_k=4)
    assert "LeaderWorkerSet" in check_engine("sglang", "MTP", nodes=2)
    assert check_engine("specdecode", "EAGLE3", top_k=4, nodes=2) is None
    code = plan_cli.main(["--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                          "--algorithm", "EAGLE3", "--gpu-memory-gib", "79", "--engine", "vllm",
                          "--speculative-num-steps", "3", "--speculative-eagle-topk", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and "--speculative-eagle-topk 4" in err and "--engine vllm" in err
