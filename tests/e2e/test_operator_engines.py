"""vLLM and SGLang as the worker runtime, on the operator's side: what it renders for each engine,
and plan against actual (the readiness gate from the engine's own KV report) against an in-memory
API. The real engines run in tests/e2e/test_e2e_engines.py and tests/planner/test_sglang_args.py."""

from __future__ import annotations

import copy
import json

import pytest

from specdecode_operator import conditions as c
from specdecode_operator import kvcheck, labels, planner, workload
from specdecode_operator.reconcile import Options, Reconciler
from specdecode_operator.kube import Ref
from specdecode_operator.spec import parse_spec, plan_key, planner_inputs
from specdecode_worker.planner.runtimes import price
from tests.operator_helpers import NS, OWNER, Clock, FakeKube, example, make_plan, typed

NAME = "llama-8b-eagle3"


def sdd(engine="vllm", **runtime):
    body = example()
    body["spec"]["runtime"] = {"engine": engine, **runtime}
    return body


def priced(engine):
    plan = make_plan()
    plan["kvCache"].update(contextLength=8192, minTokens=65536)  # the example's serving limits
    plan["layerRatio"]["bytesPerToken"] = 135_168
    return price(engine, plan, "bfloat16", transient_bytes=1_050_673_152)


def render(engine, **runtime):
    view = parse_spec(sdd(engine, **runtime), "img:1")
    dep = workload.render_deployment(view, typed(priced(engine)), "k", OWNER)
    return dep["spec"]["template"]["spec"]


def flag(args, name):
    return args[args.index(name) + 1]


def test_vllm_pod_runs_the_engine_image_with_every_planned_number():
    plan = priced("vllm")
    pod = render("vllm", extraArgs=["--enforce-eager"])
    (ctr,) = pod["containers"]
    args = ctr["args"]
    assert ctr["image"] == "vllm/vllm-openai:v0.32.0"
    assert ctr["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(args, "--kv-cache-memory-bytes") == str(plan["runtime"]["kvCacheMemoryBytes"])
    assert flag(args, "--block-size") == "32" and flag(args, "--tensor-parallel-size") == "1"
    assert flag(args, "--max-model-len") == "8192" and flag(args, "--max-num-seqs") == "64"
    assert flag(args, "--max-num-batched-tokens") == "8192" and flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--model") == "/models/meta-llama/Llama-3.1-8B-Instruct"
    assert flag(args, "--served-model-name") == "meta-llama/Llama-3.1-8B-Instruct"
    assert json.loads(flag(args, "--speculative-config")) == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": "/models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}
    assert args[-1] == "--enforce-eager"  # extraArgs come last
    assert pod["readinessGates"] == [{"conditionType": labels.KV_VERIFIED}]
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/health"
    assert any(v["name"] == "dshm" for v in pod["volumes"])


def test_sglang_pod_pins_fraction_and_tokens():
    plan = priced("sglang")
    pod = render("sglang", image="registry.local/sglang:mine")
    (ctr,) = pod["containers"]
    args = ctr["args"]
    assert ctr["image"] == "registry.local/sglang:mine"
    assert ctr["command"] == ["python3", "-m", "sglang.launch_server"]
    assert flag(args, "--mem-fraction-static") == f"{plan['runtime']['memFractionStatic']:.3f}"
    assert flag(args, "--max-total-tokens") == str(plan["runtime"]["reportedTokens"])
    assert flag(args, "--speculative-algorithm") == "EAGLE3" and flag(args, "--speculative-num-draft-tokens") == "4"
    assert flag(args, "--tp-size") == "1" and flag(args, "--page-size") == "1"
    assert pod["readinessGates"] == [{"conditionType": labels.KV_VERIFIED}]


def test_specdecode_engine_is_unchanged():
    view = parse_spec(example(), "img:1")
    pod = workload.render_deployment(view, typed(make_plan()), "k", OWNER)["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["specdecode-worker"] and "readinessGates" not in pod
    assert "engine" not in planner_inputs(view)  # specdecode plans keep their keys
    assert "--engine" not in planner.planner_args(view)


def test_engine_is_a_planner_input():
    ours, theirs = parse_spec(example(), "img:1"), parse_spec(sdd("vllm"), "img:1")
    assert plan_key(ours) != plan_key(theirs)
    args = planner.planner_args(theirs)
    assert flag(args, "--engine") == "vllm"


# --- plan against actual ----------------------------------------------------------------------------

VLLM_METRICS = ('# TYPE vllm:cache_config_info gauge\n'
                'vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="%d",num_gpu_blocks="9"} 1.0\n')


def test_reported_tokens_from_each_engine():
    assert kvcheck.reported_tokens("vllm", VLLM_METRICS % 38240) == 38240
    assert kvcheck.reported_tokens("vllm", "# no cache info yet\n") is None
    assert kvcheck.reported_tokens("sglang", json.dumps({"max_total_num_tokens": 1032040})) == 1032040
    assert kvcheck.reported_tokens("sglang", json.dumps({"internal_states": [{"max_total_num_tokens": 7}]})) == 7
    assert kvcheck.reported_tokens("sglang", "not json") is None


def test_one_block_of_rounding_is_not_a_shortfall():
    plan = priced("vllm")
    planned = plan["runtime"]["reportedTokens"]
    pod = {"metadata": {"name": "p"}}
    assert kvcheck.check(pod, typed(plan), planned).ok and kvcheck.check(pod, typed(plan), planned - 31).ok
    short = kvcheck.check(pod, typed(plan), planned - 32)
    assert not short.ok and str(planned) in short.message() and str(planned - 32) in short.message()


@pytest.fixture
def cluster():
    kube = FakeKube()
    kube.put_sdd(sdd("vllm"))
    answers: dict[str, str | None] = {}
    r = Reconciler(kube, Options(default_image="img:1"), clock=Clock(), fetch=lambda url: answers.get(url))
    r.reconcile(NS, NAME)
    kube.finish_planner(0, json.dumps(priced("vllm")))
    r.reconcile(NS, NAME)
    return kube, r, answers


def add_worker(kube, name, ip):
    view = parse_spec(kube.sdd(NAME), "img:1")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "labels": labels.selector(NAME),
                        "annotations": {labels.PLAN_KEY: plan_key(view)}},
           "spec": {}, "status": {"podIP": ip, "phase": "Running",
                                  "conditions": [{"type": "ContainersReady", "status": "True"},
                                                 {"type": "Ready", "status": "False"}]}}
    kube.objects[Ref.of(pod)] = copy.deepcopy(pod)


def test_gate_opens_when_the_engine_reports_the_plan(cluster):
    kube, r, answers = cluster
    planned = priced("vllm")["runtime"]["reportedTokens"]
    add_worker(kube, "w-1", "10.0.0.5")
    r.reconcile(NS, NAME)  # the engine is not answering yet: nothing is decided
    assert kube.pod_conditions == [] and kube.sdd(NAME)["status"]["engineKV"]["pods"] == []
    answers["http://10.0.0.5:8000/metrics"] = VLLM_METRICS % planned
    r.reconcile(NS, NAME)
    ((pod, gate),) = kube.pod_conditions
    assert pod == "w-1" and gate["type"] == labels.KV_VERIFIED and gate["status"] == "True"
    status = kube.sdd(NAME)["status"]
    assert status["engineKV"] == {"engine": "vllm", "version": "0.32.0", "plannedTokens": planned,
                                  "pods": [{"name": "w-1", "verified": True, "reportedTokens": planned}]}
    r.reconcile(NS, NAME)  # decided once
    assert len(kube.pod_conditions) == 1


def test_a_shortfall_keeps_the_pod_unready_and_says_both_numbers(cluster):
    kube, r, answers = cluster
    planned = priced("vllm")["runtime"]["reportedTokens"]
    add_worker(kube, "w-2", "10.0.0.6")
    answers["http://10.0.0.6:8000/metrics"] = VLLM_METRICS % (planned // 2)
    r.reconcile(NS, NAME)
    ((_, gate),) = kube.pod_conditions
    assert gate["status"] == "False" and gate["reason"] == kvcheck.KV_BELOW_PLAN
    status = kube.sdd(NAME)["status"]
    degraded = c.get(status["conditions"], c.DEGRADED)
    assert degraded["status"] == "True" and degraded["reason"] == c.KV_CACHE_BELOW_PLAN
    assert str(planned) in degraded["message"] and str(planned // 2) in degraded["message"]
    assert c.get(status["conditions"], c.READY)["status"] == "False"
    assert any(reason == c.KV_CACHE_BELOW_PLAN and warning for reason, _, warning in kube.events)


def test_the_crd_refuses_exactly_the_flags_the_operator_owns():
    """The CEL rule on runtime.extraArgs is a copy of the runtimes' owned flags, kept in step here."""
    import re

    import yaml

    from specdecode_worker.planner.runtimes import owned_flags
    from tests.operator_helpers import ROOT

    crd = yaml.safe_load((ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml").read_text())
    runtime = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["runtime"]
    [rule] = [r["rule"] for r in runtime["x-kubernetes-validations"] if "extraArgs.all" in r["rule"]]
    refused = set(re.search(r"\^\(([^)]*)\)", rule).group(1).split("|"))
    assert refused == set(owned_flags("vllm")) | set(owned_flags("sglang"))


@pytest.mark.parametrize("engine, on, off", [
    ("specdecode", [], ["--disable-prefix-cache"]),
    ("vllm", ["--enable-prefix-caching"], ["--no-enable-prefix-caching"]),
    ("sglang", [], ["--disable-radix-cache"]),
])
def test_serving_prefix_cache_reaches_every_engine(engine, on, off):
    """serving.prefixCache (default true) is pinned with each engine's own flag."""
    prefix_flags = {"--disable-prefix-cache", "--enable-prefix-caching", "--no-enable-prefix-caching",
                    "--disable-radix-cache"}
    for enabled, expected in ((True, on), (False, off)):
        body = sdd(engine)
        if not enabled:
            body["spec"]["serving"]["prefixCache"] = False
        view = parse_spec(body, "img:1")
        plan = typed(priced(engine) if engine != "specdecode" else make_plan())
        args = workload.render_deployment(view, plan, "k", OWNER)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert [a for a in args if a in prefix_flags] == expected
