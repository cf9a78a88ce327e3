"""Replicas larger than one node, operator side: the spec fields that let a plan span nodes reach
the planner and its key, and the CRD (crds/ and the chart's copy) accepts them."""

from __future__ import annotations

import pytest
import yaml

from specdecode_operator import planner
from specdecode_operator.spec import parse_spec, plan_key
from tests.operator_helpers import ROOT, example

CRD_PATHS = [ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml",
             ROOT / "charts" / "specdecode-operator" / "crds" / "specdecode.io_specdecodedeployments.yaml"]


def _with_gpu(**gpu) -> dict:
    body = example()
    body["spec"].setdefault("gpu", {}).update(gpu)
    return body


def _flags(body: dict) -> list[str]:
    args = planner.planner_args(parse_spec(body))
    return [a for a in args if a in ("--max-tp", "--gpus-per-node")] + \
        [args[i + 1] for i, a in enumerate(args) if a in ("--max-tp", "--gpus-per-node")]


def test_max_per_replica_beyond_a_node_lets_the_planner_choose_more():
    assert _flags(example()) == []
    assert _flags(_with_gpu(maxPerReplica=16)) == ["--max-tp", "16"]
    assert _flags(_with_gpu(maxPerReplica=32, perNode=4)) == ["--max-tp", "--gpus-per-node", "32", "4"]
    # Below 8 it does not shrink the plan (a larger plan is reported as PlanExceedsNodeGPUs instead).
    assert _flags(_with_gpu(maxPerReplica=4)) == []


@pytest.mark.parametrize("gpu, replans", [
    ({"maxPerReplica": 16}, True),
    ({"perNode": 4}, True),
    ({"maxPerReplica": 8}, False),
    ({"maxPerReplica": 4}, False),
])
def test_plan_key_follows_what_spreads_a_replica(gpu, replans):
    before = plan_key(parse_spec(example()))
    assert (plan_key(parse_spec(_with_gpu(**gpu))) != before) == replans


def test_crds_accept_replicas_over_nodes():
    for path in CRD_PATHS:
        crd = yaml.safe_load(path.read_text())
        gpu = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["gpu"]
        assert gpu["properties"]["maxPerReplica"]["enum"] == [1, 2, 4, 8, 16, 32]
        assert gpu["properties"]["perNode"]["minimum"] == 1
    assert CRD_PATHS[0].read_text() == CRD_PATHS[1].read_text()
