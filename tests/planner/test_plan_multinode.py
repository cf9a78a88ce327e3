"""Plans larger than one node: t beyond 8 only when allowed, pods per replica from GPUs per node,
and the inter-node NCCL buffers priced in the runtime reserve."""

from __future__ import annotations

import json

import pytest

from specdecode_worker.planner import plan_cli
from specdecode_worker.contract import GIB, MIB, validate_plan
from specdecode_worker.planner.plan import nodes_per_replica, runtime_reserve_bytes

from devtools.checkpoints import write_model

H100 = ["--gpu-product", "NVIDIA-H100-80GB-HBM3", "--context-length", "8192", "--max-running-requests", "64"]
# Llama-3.1-70B on 8 x H100 holds ~1.55M KV tokens; 1.6M needs the weights spread over 16 GPUs.
BEYOND_ONE_NODE = ["--min-kv-tokens", "1600000"]


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m") / "Llama-3.1-70B-Instruct", "llama-3.1-70b-instruct")


def _plan(capsys, target, *args) -> tuple[int, dict]:
    code = plan_cli.main(["--target", str(target), "--algorithm", "NGRAM", *H100, *args])
    return code, json.loads(capsys.readouterr().out)


def test_nodes_per_replica_is_the_fewest_equal_shares_a_node_holds():
    assert [nodes_per_replica(t, 8) for t in (1, 2, 4, 8, 16, 32)] == [1, 1, 1, 1, 2, 4]
    assert nodes_per_replica(8, 4) == 2 and nodes_per_replica(16, 6) == 4  # 4 pods of 4, not 3 uneven ones
    assert nodes_per_replica(2, 1) == 2


def test_runtime_reserve_prices_inter_node_buffers():
    assert runtime_reserve_bytes(8) == GIB + 8 * 128 * MIB
    assert runtime_reserve_bytes(16, 2) == GIB + 16 * 128 * MIB + 512 * MIB
    assert runtime_reserve_bytes(16, 1) == GIB + 16 * 128 * MIB  # one 16-GPU node: NVLink only


def test_auto_stops_at_one_node_unless_max_tp_allows_more(capsys, llama70b):
    code, plan = _plan(capsys, llama70b, *BEYOND_ONE_NODE)
    assert code == 3 and not plan["fits"] and plan["tensorParallelSize"] == 8 and plan["nodesPerReplica"] == 1
    assert "no tensor-parallel size up to 8 fits" in plan["message"]
    assert "allow more GPUs per replica (--max-tp, gpu.maxPerReplica)" in plan["message"]

    code, plan = _plan(capsys, llama70b, *BEYOND_ONE_NODE, "--max-tp", "16")
    assert code == 0 and plan["fits"], plan["message"]
    assert plan["tensorParallelSize"] == 16 and plan["nodesPerReplica"] == 2
    assert plan["reserve"]["runtimeBytes"] == runtime_reserve_bytes(16, 2)
    assert "fits on 16 GPUs (2 nodes of 8)" in plan["message"]
    assert validate_plan(plan) is plan


def test_gpus_per_node_decides_how_many_pods(capsys, llama70b):
    code, plan = _plan(capsys, llama70b, "--tp", "8", "--gpus-per-node", "4")
    assert code == 0 and plan["nodesPerReplica"] == 2
    code, single = _plan(capsys, llama70b, "--tp", "8")
    assert single["nodesPerReplica"] == 1
    # The same 8 GPUs over two nodes pay the network buffers: fewer KV tokens.
    assert plan["reserve"]["runtimeBytes"] - single["reserve"]["runtimeBytes"] == 512 * MIB
    assert plan["kvCache"]["maxTotalNumTokens"] < single["kvCache"]["maxTotalNumTokens"]


@pytest.mark.parametrize("flags, problem", [
    (["--max-tp", "12"], "--max-tp: must be one of 1, 2, 4, 8, 16, 32, got 12"),
    (["--gpus-per-node", "0"], "--gpus-per-node: must be positive, got 0"),
])
def test_bad_multinode_flags_are_refused(capsys, llama70b, flags, problem):
    assert plan_cli.main(["--target", str(llama70b), "--algorithm", "NGRAM", *H100, *flags]) == 2
    assert problem in capsys.readouterr().err


def test_contract_refuses_nodes_that_do_not_divide_t(capsys, llama70b):
    _, plan = _plan(capsys, llama70b, "--tp", "8")
    with pytest.raises(ValueError, match="nodesPerReplica 3 must divide tensorParallelSize 8"):
        validate_plan({**plan, "nodesPerReplica": 3})
    legacy = {k: v for k, v in plan.items() if k != "nodesPerReplica"}  # plans written before it: one node
    assert validate_plan(legacy) is legacy
