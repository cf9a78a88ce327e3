"""Spec view, plan key and the CRD: defaults agree, the key moves only with plan inputs, and the
examples satisfy the CRD's OpenAPI schema."""

from __future__ import annotations

import copy
import subprocess
import sys

import jsonschema
import pytest
import yaml

from specdecode_operator.spec import GROUP, KIND, PLURAL, VERSION, parse_spec, plan_key, planner_pod_name
from specdecode_worker.contract import KV_CACHE_DTYPES, PLANNED_ALGORITHMS
from tests.operator_helpers import ROOT, example
CRD = yaml.safe_load((ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
# Every example that is a SpecDecodeDeployment (examples/hpa.yaml is an autoscaler for one).
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml")
                  if any(doc and doc.get("kind") == KIND for doc in yaml.safe_load_all(p.read_text())))


def key_of(body: dict) -> str:
    return plan_key(parse_spec(body))


def _openapi_to_jsonschema(node):
    """Enough of the structural-schema dialect for jsonschema (int-or-string, preserve-unknown)."""
    if isinstance(node, dict):
        out = {k: _openapi_to_jsonschema(v) for k, v in node.items()
               if not k.startswith("x-kubernetes-") and k not in ("format",)}
        if node.get("x-kubernetes-int-or-string"):
            out.pop("anyOf", None)
            out.pop("pattern", None)
            out["type"] = ["integer", "string"]
        if out.get("type") == "object" and "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [_openapi_to_jsonschema(v) for v in node]
    return node


def test_every_deployment_example_is_checked():
    assert {p.name for p in EXAMPLES} >= {"spec-deploy.yaml", "standalone-draft.yaml", "ngram.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_the_crd_schema(path):
    body = yaml.safe_load(path.read_text())
    jsonschema.validate(body, _openapi_to_jsonschema(SCHEMA))
    assert body["apiVersion"] == "specdecode.io/v1alpha1" and body["kind"] == "SpecDecodeDeployment"


def test_schema_check_is_able_to_fail():
    body = example()
    body["spec"]["draft"]["algorithm"] = "MEDUSA"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, _openapi_to_jsonschema(SCHEMA))


def _crd_default(*path: str):
    node = SCHEMA["properties"]["spec"]
    for p in path:
        node = node["properties"][p]
    return node["default"]


def test_operator_defaults_equal_the_crd_defaults():
    view = parse_spec({"metadata": {"name": "x"}, "spec": {"target": {"model": "t"}, "draft": {"algorithm": "EAGLE"}}})
    assert view.replicas == _crd_default("replicas") == 1
    assert view.target_dtype == _crd_default("target", "dtype")
    assert view.num_steps == _crd_default("draft", "numSteps")
    assert view.top_k == _crd_default("draft", "topK")
    assert view.serving.context_length == _crd_default("serving", "contextLength")
    assert view.serving.max_running_requests == _crd_default("serving", "maxRunningRequests")
    assert view.serving.kv_cache_dtype == _crd_default("serving", "kvCacheDtype")
    assert view.planner_request_gpu is _crd_default("planner", "requestGPU")
    assert view.image_pull_policy == _crd_default("imagePullPolicy")
    created = parse_spec(_with_cache({"create": {}})).hub_cache
    assert created.access_mode == _crd_default("modelStore", "hub", "cache", "create", "accessMode")


def _with_cache(cache):
    body = example()
    body["spec"]["modelStore"] = {"hub": {"cache": cache}}
    return body


def test_hub_cache_views():
    shared = parse_spec(_with_cache({"claimName": "models"})).hub_cache
    assert (shared.claim_name, shared.create) == ("models", False)
    made = parse_spec(_with_cache({"create": {"storageClassName": "nfs", "accessMode": "ReadWriteOnce",
                                              "size": "300Gi"}})).hub_cache
    assert (made.create, made.storage_class, made.access_mode, made.size) == (True, "nfs", "ReadWriteOnce", "300Gi")
    assert parse_spec(example()).hub_cache is None


def test_spec_view_of_the_example():
    view = parse_spec(example())
    assert (view.name, view.namespace, view.replicas) == ("llama-8b-eagle3", "ns", 1)
    assert view.algorithm == "EAGLE3" and view.draft.model == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert view.model_path(view.target) == "/models/meta-llama/Llama-3.1-8B-Instruct"
    assert view.draft_dir == "/models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert view.num_draft_tokens == 4
    assert view.gpu_product == "NVIDIA-H100-80GB-HBM3" and view.pvc_claim == "models"


def test_derived_draft_tokens_and_draft_dirs():
    ngram = parse_spec(example("ngram.yaml"))
    assert ngram.draft_dir is None and ngram.num_draft_tokens == 8
    body = example()
    del body["spec"]["draft"]["numDraftTokens"]
    body["spec"]["draft"]["numSteps"] = 5
    assert parse_spec(body).num_draft_tokens == 6
    mtp = example()
    mtp["spec"]["draft"] = {"algorithm": "MTP"}
    assert parse_spec(mtp).draft_dir == "/models/meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("mutate", [
    lambda s: s.update(replicas=7),
    lambda s: s.update(pod={"nodeSelector": {"pool": "a"}, "annotations": {"a": "b"}}),
    lambda s: s.update(resources={"cpu": "16", "memory": "200Gi"}),
    lambda s: s["draft"].update(numSteps=3, topK=1),  # same values, explicit
], ids=["replicas", "pod-overrides", "host-resources", "same-values"])
def test_plan_key_ignores_what_does_not_change_the_plan(mutate):
    body = example()
    before = key_of(body)
    mutate(body["spec"])
    assert key_of(body) == before


@pytest.mark.parametrize("mutate", [
    lambda s: s["draft"].update(model="other/draft"),
    lambda s: s["target"].update(revision="abc123"),
    lambda s: s["target"].update(dtype="float16"),
    lambda s: s["draft"].update(algorithm="STANDALONE"),
    lambda s: s["serving"].update(contextLength=4096),
    lambda s: s["serving"].update(minKVTokens=1),
    lambda s: s["serving"].update(kvCacheDtype="fp8_e4m3"),
    lambda s: s["serving"].update(memFractionStatic=0.8),
    lambda s: s["serving"].update(maxRunningRequests=8),
    lambda s: s["gpu"].update(product="NVIDIA-H200"),
    lambda s: s["gpu"].update(memoryGiB=40),
    lambda s: s.update(image="registry/worker:2"),
], ids=["draft-model", "target-revision", "dtype", "algorithm", "context", "min-kv", "kv-dtype",
        "mem-fraction", "max-running", "gpu-product", "gpu-memory", "image"])
def test_plan_key_follows_every_plan_input(mutate):
    body = example()
    before = key_of(body)
    mutate(body["spec"])
    assert key_of(body) != before


def test_plan_key_is_stable_across_processes_and_dict_order():
    body = example()
    shuffled = copy.deepcopy(body)
    shuffled["spec"] = dict(reversed(list(shuffled["spec"].items())))
    assert key_of(body) == key_of(shuffled)
    key = key_of(body)
    assert len(key) == 16 and int(key, 16) >= 0
    assert planner_pod_name(parse_spec(body), key) == f"llama-8b-eagle3-plan-{key[:8]}"


def test_crd_shape():
    version = CRD["spec"]["versions"][0]
    assert CRD["spec"]["names"]["shortNames"] == ["sdd"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["TP"] == ".status.plan.tensorParallelSize"
    assert columns["KV-Tokens"] == ".status.plan.kvCache.maxTotalNumTokens"
    assert {"Phase", "Ready", "GPUs", "Age"} <= set(columns)
    status = SCHEMA["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed"]
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    draft = SCHEMA["properties"]["spec"]["properties"]["draft"]
    draft_rules = " ".join(r["rule"] for r in draft["x-kubernetes-validations"])
    assert "NGRAM" in draft_rules and "numDraftTokens" in draft_rules


def test_crd_names_the_contract_values():
    spec = SCHEMA["properties"]["spec"]["properties"]
    assert tuple(spec["draft"]["properties"]["algorithm"]["enum"]) == PLANNED_ALGORITHMS
    assert tuple(spec["serving"]["properties"]["kvCacheDtype"]["enum"]) == KV_CACHE_DTYPES
    assert CRD["spec"]["group"] == GROUP and CRD["spec"]["names"]["kind"] == KIND
    assert CRD["spec"]["names"]["plural"] == PLURAL and CRD["spec"]["versions"][0]["name"] == VERSION


def test_operator_imports_no_torch():
    """The operator image has no torch: the worker contract it reads must not pull it in."""
    code = ("import sys, specdecode_operator.handlers, specdecode_operator.main, specdecode_operator.reconcile; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
