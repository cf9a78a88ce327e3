"""An MTP SpecDecodeDeployment end to end on the real control plane: the planner pod plans the
target's NextN layer as the draft (at the tensor parallelism the worker drafts with) and the
operator rolls out workers that serve `--algorithm MTP` from the target's own folder."""

from __future__ import annotations

import json
import subprocess

import pytest

from devtools.checkpoints import CONFIGS, _deepseek_tensors, write_checkpoint
from devtools.cluster.wait import wait_for
from tests.e2e_helpers import BIN, apply, condition, example, get_object, list_objects, phase_is, wait_sdd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "deepseek-ai/DeepSeek-V3-small"
NAME = "deepseek-mtp"
# DeepSeek-V3's architecture (MLA, grouped MoE, fp8 blocks, one NextN layer) cut to fit one GPU.
SMALL = {**CONFIGS["deepseek-v3"], "num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 16,
         "n_group": 4, "topk_group": 2, "num_attention_heads": 16, "num_key_value_heads": 16,
         "hidden_size": 2048, "intermediate_size": 4096, "moe_intermediate_size": 512, "q_lora_rank": 512,
         "vocab_size": 32768, "max_position_embeddings": 8192}


def test_mtp_deployment_plans_the_nextn_layer_and_rolls_out(cluster, namespace, store, operator):  # noqa: F811
    write_checkpoint(store / MODEL, SMALL, _deepseek_tensors(SMALL), shards=2)
    body = example(target__model=MODEL, draft={"algorithm": "MTP", "numSteps": 2, "numDraftTokens": 3})
    body["metadata"]["name"] = NAME
    apply(cluster, namespace, body)
    sdd = wait_sdd(cluster, namespace, NAME, phase_is("Ready"), "Ready")
    plan = sdd["status"]["plan"]
    assert condition(sdd, "Planned")["reason"] == "PlanReady"
    assert plan["algorithm"] == "MTP" and plan["tensorParallelSize"] == 1
    assert plan["kvCache"]["draftNumLayers"] == 1
    # one latent layer: (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes
    assert plan["kvCache"]["draftBytesPerToken"] == 576 * 2
    # status.plan is the CLI's own plan for the same inputs (as the example's serving section sets
    # them, the verify width of 2 proposals + 1 the worker serves, and the example's bfloat16, in
    # which the worker holds the float32 router biases)
    out = subprocess.run([str(BIN / "specdecode-worker"), "plan", "--target", str(store / MODEL), "--algorithm", "MTP",
                          "--tp", "auto", "--dtype", "bfloat16", "--gpu-product", "NVIDIA-H100-80GB-HBM3",
                          "--context-length", "8192",
                          "--min-kv-tokens", "65536", "--max-running-requests", "64", "--num-draft-tokens", "2",
                          "--output", "json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    expected = json.loads(out.stdout)
    assert expected["kvCache"] == plan["kvCache"] and expected["weights"] == plan["weights"]
    dep = get_object(cluster, namespace, "deployment", NAME)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--algorithm") + 1] == "MTP"
    assert args[args.index("--num-draft-tokens") + 1] == "2"  # numSteps proposals per round
    target = args[args.index("--target") + 1]
    assert target.endswith(MODEL) and args[args.index("--draft") + 1] == target  # the NextN layer's folder
    workers = list_objects(cluster, namespace, "pods", f"specdecode.io/name={NAME},specdecode.io/role=worker")
    assert len(workers) == 1
    pinned = json.loads(get_object(cluster, namespace, "configmap", f"{NAME}-plan")["data"]["plan.json"])
    assert pinned["kvCache"] == plan["kvCache"]
    assert pinned["reserve"]["verifyTokens"] == 3 and pinned["reserve"]["treeTopk"] == 1  # what serve checks
    wait_for(lambda: condition(get_object(cluster, namespace, "sdd", NAME), "Available")["status"] == "True",
             timeout=30, what="Available")
