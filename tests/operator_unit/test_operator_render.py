"""Planner pod and worker rendering: pure functions checked against the plan they came from."""

from __future__ import annotations

import json

import pytest

from specdecode_operator import labels, planner, workload
from specdecode_operator.spec import parse_spec, plan_key, planner_inputs
from specdecode_worker.contract import GIB
from tests.operator_helpers import DRAFT_COMMIT, OWNER, TARGET_COMMIT, example, hub_sources, make_plan, typed


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# --- planner pod ----------------------------------------------------------------------------------

def test_planner_args_of_the_example():
    view = parse_spec(example())
    assert planner.planner_args(view) == [
        "plan", "--target", "/models/meta-llama/Llama-3.1-8B-Instruct",
        "--draft", "/models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "--algorithm", "EAGLE3", "--tp", "auto",
        "--dtype", "bfloat16", "--gpu-product", "NVIDIA-H100-80GB-HBM3", "--mem-fraction-static", "auto",
        "--kv-cache-dtype", "auto",
        "--context-length", "8192", "--min-kv-tokens", "65536", "--max-running-requests", "64",
        "--output", "json", "--termination-log", "/dev/termination-log",
    ]


def test_planner_args_overrides_and_ngram():
    body = example("ngram.yaml")
    body["spec"]["gpu"]["memoryGiB"] = 20
    body["spec"]["serving"].update(memFractionStatic=0.85, cudaGraphMaxBatchSize=32, chunkedPrefillSize=4096)
    args = planner.planner_args(parse_spec(body))
    assert "--draft" not in args and "--gpu-product" not in args  # memory override wins; the CLI takes one
    assert _flag(args, "--gpu-memory-gib") == "20" and _flag(args, "--mem-fraction-static") == "0.85"
    assert _flag(args, "--cuda-graph-max-bs") == "32" and _flag(args, "--chunked-prefill-size") == "4096"
    assert _flag(args, "--algorithm") == "NGRAM"


def test_the_planner_prices_the_verify_width_the_worker_serves():
    """The worker's verify batches (and their CUDA graphs) take proposals + 1 rows per request;
    the planner is told that width when it is not its default, and the plan key records it, so a
    plan that fits is a worker that starts at any numDraftTokens."""
    from specdecode_worker.planner import plan_cli
    from specdecode_worker.planner.plan import ForwardGeometry, dynamic_reserve_bytes

    def widths(view):
        planner_width = plan_cli.plan_args(plan_cli.parser().parse_args(planner.planner_args(view)[1:])).verify_tokens
        return planner_width, int(_flag(workload.worker_args(view, typed(make_plan())), "--num-draft-tokens")) + 1

    ngram = parse_spec(example("ngram.yaml"))  # numDraftTokens 8
    assert widths(ngram) == (9, 9)
    eagle3 = parse_spec(example())  # a chain of 3 steps: the planner's default width, no flag
    assert widths(eagle3) == (4, 4) and "--num-draft-tokens" not in planner.planner_args(eagle3)
    body = example("ngram.yaml")
    body["spec"]["draft"]["numDraftTokens"] = 5
    assert widths(parse_spec(body)) == (6, 6) and plan_key(parse_spec(body)) != plan_key(ngram)
    body["spec"]["draft"]["numDraftTokens"] = 3
    assert "verifyWidth" not in planner_inputs(parse_spec(body))  # the default width: keys stay as they were
    assert planner_inputs(ngram)["verifyWidth"] == 9
    # By hand, NGRAM at width 9 (8 requests, graph batch 8, chunk 16; hidden 64, intermediate 128,
    # 4 heads, 2 KV heads, head 16, vocabulary 1000, 2 bytes): per token 2 x (3 x 64 + 4 x 32 + 2 x 32
    # + 3 x 128) = 1536 B, a logit row 1000 x (2 + 4) = 6000 B; the eager verify pass and the verify
    # graphs (larger than the decode graphs' 95,104 B) are 72 rows each: 72 x 7536 = 542,592 B; the
    # verify rows' sampling with every filter on, 72 x 1000 x 40 B (one block: 72 rows are far below
    # a 256 MiB block), outweighs the eager pass's activations (72 x 1536 B), which are gone by then;
    # the fp32 distributions the 72 rows drew from, 72 x 1000 x 4 B, are held beside them. The verify
    # graphs also hold split-KV partials: 72 rows x 16 splits x 4 heads x (16 + 1) fp32.
    small = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 2)
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 16, 8, 8, verify_tokens=9) == \
        1.25 * (2 * 542_592 - 72 * 1536 + 72 * 1000 * 40 + 72 * 1000 * 4 + 72 * 16 * 4 * 17 * 4)


def test_planner_args_price_an_eagle_tree_as_the_worker_runs_it():
    body = example()
    body["spec"]["draft"].update(topK=4, numSteps=3, numDraftTokens=8)
    view = parse_spec(body)
    args = planner.planner_args(view)
    worker = workload.worker_args(view, typed(make_plan()))
    for flag in ("--num-draft-tokens", "--speculative-num-steps", "--speculative-eagle-topk"):
        assert _flag(args, flag) == _flag(worker, flag)
    assert _flag(args, "--num-draft-tokens") == "7" and _flag(args, "--speculative-eagle-topk") == "4"
    from specdecode_worker.planner import plan_cli

    planned = plan_cli.plan_args(plan_cli.parser().parse_args(args[1:]))
    assert (planned.verify_tokens, planned.tree_topk, planned.tree_steps) == (8, 4, 3)


def test_planner_pod_shape():
    view = parse_spec(example())
    key = plan_key(view)
    pod = planner.render_planner_pod(view, key, OWNER)
    assert pod["metadata"]["name"] == f"llama-8b-eagle3-plan-{key[:8]}"
    assert pod["metadata"]["labels"][labels.ROLE] == "planner"
    assert pod["metadata"]["labels"][labels.PLAN_KEY] == key
    assert pod["metadata"]["ownerReferences"] == [OWNER]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    c = spec["containers"][0]
    assert c["command"] == ["specdecode-worker"] and c["args"][0] == "plan"
    assert c["volumeMounts"][0] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert spec["volumes"][0] == {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    # everything else it may write is scratch space (the root filesystem is read-only)
    assert all("emptyDir" in v for v in spec["volumes"][1:])
    assert "nvidia.com/gpu" not in c["resources"]["limits"]  # catalogue memory: no GPU spent on planning
    assert "nodeSelector" not in spec


def test_planner_pod_that_measures_on_a_gpu():
    body = example()
    body["spec"]["planner"] = {"requestGPU": True}
    view = parse_spec(body)
    pod = planner.render_planner_pod(view, plan_key(view), OWNER)
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "--gpu-product" not in pod["spec"]["containers"][0]["args"]  # NVML measures instead


def _terminated(code, message, reason=None):
    return {"status": {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [{
        "name": "planner", "state": {"terminated": {"exitCode": code, "message": message,
                                                    "reason": reason or ("Completed" if code == 0 else "Error"),
                                                    "finishedAt": "2026-01-01T00:00:00Z"}}}]}}


def test_read_outcome_fits_misfit_and_failures():
    plan = make_plan()
    ok = planner.read_outcome(_terminated(0, json.dumps(plan)))
    assert ok.state == "fits" and ok.plan == plan
    misfit = make_plan(tp=8, fits=False)
    out = planner.read_outcome(_terminated(3, json.dumps(misfit)))
    assert out.state == "misfit" and out.plan["shortfallBytes"] == 5 * GIB
    bad = planner.read_outcome(_terminated(2, "config.json: field 'hidden_size' must be a positive integer"))
    assert bad.state == "failed" and "bad input" in bad.message and "hidden_size" in bad.message
    crash = planner.read_outcome(_terminated(1, "Traceback ... RuntimeError: boom"))
    assert crash.state == "failed" and "exit code 1" in crash.message and "boom" in crash.message
    garbage = planner.read_outcome(_terminated(0, "{not json"))
    assert garbage.state == "failed" and "not a valid MemoryPlan" in garbage.message
    broken = dict(plan, kvCache=dict(plan["kvCache"], maxTotalNumTokens=plan["kvCache"]["maxTotalNumTokens"] + 50))
    assert planner.read_outcome(_terminated(0, json.dumps(broken))).state == "failed"
    lying = dict(plan, fits=False)
    assert planner.read_outcome(_terminated(0, json.dumps(lying))).state == "failed"


def test_read_outcome_while_pending_names_the_scheduler_reason():
    pod = {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
    out = planner.read_outcome(pod)
    assert out.state == "pending" and "Insufficient nvidia.com/gpu" in out.message
    assert planner.read_outcome({"status": {"phase": "Running"}}).state == "running"
    deadline = planner.read_outcome({"status": {"phase": "Failed", "reason": "DeadlineExceeded"}})
    assert deadline.state == "failed" and "DeadlineExceeded" in deadline.message


def test_retry_backoff_doubles_to_a_cap():
    assert [planner.retry_delay(n) for n in (1, 2, 3, 4, 10)] == [10, 20, 40, 80, 300]


# --- workers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 8])
def test_deployment_pins_the_plan(tp):
    view = parse_spec(example())
    key = plan_key(view)
    plan = make_plan(tp=tp)
    dep = workload.render_deployment(view, typed(plan), key, OWNER)
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
    args = c["args"]
    assert args[0] == "serve"
    assert int(_flag(args, "--tp")) == tp
    assert float(_flag(args, "--mem-fraction-static")) == plan["memFractionStatic"]
    assert int(_flag(args, "--max-total-tokens")) == plan["kvCache"]["maxTotalNumTokens"]
    assert _flag(args, "--plan") == "/etc/specdecode/plan.json"
    assert _flag(args, "--draft") == "/models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert _flag(args, "--num-draft-tokens") == "3"  # numSteps proposals (numDraftTokens 4 counts the root)
    assert _flag(args, "--dtype") == "bfloat16"
    assert pod["metadata"]["annotations"][labels.PLAN_KEY] == key
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    shm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert bool(shm) == (tp > 1)
    # host memory: every rank's weights + 2 GiB, rounded up to GiB
    total = (plan["weights"]["targetBytes"] + plan["weights"]["draftBytes"]) * tp + 2 * GIB
    assert c["resources"]["requests"]["memory"] == f"{-(-total // GIB)}Gi"
    assert dep["spec"]["selector"] == {"matchLabels": {labels.NAME: "llama-8b-eagle3", labels.ROLE: "worker"}}
    assert dep["metadata"]["ownerReferences"] == [OWNER]


def test_startup_probe_covers_weight_loading():
    view = parse_spec(example())
    plan = make_plan()
    c = workload.render_deployment(view, typed(plan), "k", OWNER)["spec"]["template"]["spec"]["containers"][0]
    weights = plan["weights"]["targetBytes"] + plan["weights"]["draftBytes"]  # ~15.7 GiB
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= 300 + weights / (200 * (1 << 20))  # > 380 s at 200 MiB/s
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_replicas_change_leaves_the_pod_template_alone():
    body = example()
    view = parse_spec(body)
    plan = make_plan()
    before = workload.render_deployment(view, typed(plan), plan_key(view), OWNER)
    body["spec"]["replicas"] = 5
    view5 = parse_spec(body)
    after = workload.render_deployment(view5, typed(plan), plan_key(view5), OWNER)
    assert after["spec"]["replicas"] == 5
    assert after["spec"]["template"] == before["spec"]["template"]


def test_user_overrides_cannot_break_the_selector():
    body = example()
    body["spec"]["pod"] = {"labels": {labels.NAME: "evil", "team": "a"}, "annotations": {"x": "y"},
                           "nodeSelector": {"pool": "gpu"}, "serviceAccountName": "sa",
                           "tolerations": [{"key": "k", "operator": "Exists"}]}
    body["spec"]["resources"] = {"memory": "300Gi", "cpu": 16}
    dep = workload.render_deployment(parse_spec(body), typed(make_plan()), "k", OWNER)
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["labels"][labels.NAME] == "llama-8b-eagle3" and tmpl["metadata"]["labels"]["team"] == "a"
    assert tmpl["spec"]["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert tmpl["spec"]["serviceAccountName"] == "sa"
    assert {"key": "k", "operator": "Exists"} in tmpl["spec"]["tolerations"]
    assert tmpl["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "16", "memory": "300Gi"}


def test_configmap_and_service():
    view = parse_spec(example())
    plan = make_plan()
    cm = workload.render_configmap(view, typed(plan), "k", OWNER)
    assert cm["metadata"]["name"] == "llama-8b-eagle3-plan"
    assert json.loads(cm["data"]["plan.json"]) == plan
    svc = workload.render_service(view, OWNER)
    assert svc["spec"]["selector"] == labels.selector("llama-8b-eagle3")
    assert svc["spec"]["ports"][0]["port"] == 8000
    kinds = [o["kind"] for o in workload.render_children(view, typed(plan), "k", OWNER)]
    assert kinds == ["ConfigMap", "Deployment", "Service"]


def _hub(body, **hub):
    body["spec"]["modelStore"] = {"hub": {"endpoint": "http://hub.local", "tokenSecret": {"name": "hf", "key": "tok"},
                                          **hub}}
    return body


TOKEN_REF = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}}


def test_hub_planner_reads_headers_over_http_with_no_volume_and_the_token_by_reference():
    body = _hub(example())
    body["spec"]["target"]["revision"] = "v1.0"
    view = parse_spec(body)
    pod = planner.render_planner_pod(view, plan_key(view), OWNER)
    args = pod["spec"]["containers"][0]["args"]
    assert args[:9] == ["plan", "--model-source", "hub", "--target", "meta-llama/Llama-3.1-8B-Instruct",
                        "--target-revision", "v1.0", "--draft", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"]
    assert "--draft-revision" not in args  # none given: the hub's default branch
    assert "initContainers" not in pod["spec"]
    assert all("persistentVolumeClaim" not in v for v in pod["spec"]["volumes"])
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"tmp", "cache"}  # writable scratch only
    env = pod["spec"]["containers"][0]["env"]
    assert {"name": "HF_ENDPOINT", "value": "http://hub.local"} in env and TOKEN_REF in env
    assert all("value" not in e for e in env if e["name"] == "HF_TOKEN")
    # HF_HOME on an emptyDir: the root filesystem is read-only
    hf_home = next(e["value"] for e in env if e["name"] == "HF_HOME")
    mount = max((m for m in pod["spec"]["containers"][0]["volumeMounts"] if hf_home.startswith(m["mountPath"])),
                key=lambda m: len(m["mountPath"]))
    assert "emptyDir" in next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])


def test_hub_planner_args_for_mtp_and_ngram_name_no_draft_repository():
    args = planner.planner_args(parse_spec(_hub(example("ngram.yaml"))))
    assert "--draft" not in args and "--model-source" in args
    body = _hub(example())
    body["spec"]["draft"] = {"algorithm": "MTP"}
    args = planner.planner_args(parse_spec(body))
    assert "--draft" not in args  # the planner's default: the target's own NextN layers


def test_a_hub_store_changes_the_plan_key_but_its_cache_does_not():
    pvc, hub = parse_spec(example()), parse_spec(_hub(example()))
    cached = parse_spec(_hub(example(), cache={"claimName": "models"}))
    assert plan_key(pvc) != plan_key(hub) == plan_key(cached)


def test_hub_workers_without_a_cache_download_the_plans_commits_in_init_containers():
    view = parse_spec(_hub(example()))
    plan = make_plan(sources=hub_sources())
    spec = workload.render_deployment(view, typed(plan), "k", OWNER)["spec"]["template"]["spec"]
    assert {"name": "models", "emptyDir": {}} in spec["volumes"]
    fetch_t, fetch_d = spec["initContainers"]
    assert fetch_t["args"] == ["fetch", "--repo", "meta-llama/Llama-3.1-8B-Instruct", "--commit", TARGET_COMMIT,
                               "--dest", f"/models/meta-llama/Llama-3.1-8B-Instruct/{TARGET_COMMIT}",
                               "--termination-log", "/dev/termination-log"]
    assert fetch_d["args"][fetch_d["args"].index("--commit") + 1] == DRAFT_COMMIT
    assert TOKEN_REF in fetch_t["env"] and {"name": "models", "mountPath": "/models"} in fetch_t["volumeMounts"]
    args = spec["containers"][0]["args"]
    assert _flag(args, "--target") == f"/models/meta-llama/Llama-3.1-8B-Instruct/{TARGET_COMMIT}"
    assert _flag(args, "--draft") == f"/models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B/{DRAFT_COMMIT}"


def test_hub_workers_with_a_cache_mount_it_read_only_and_download_nothing():
    view = parse_spec(_hub(example(), cache={"claimName": "shared-models"}))
    plan = typed(make_plan(sources=hub_sources()))
    spec = workload.render_deployment(view, plan, "k", OWNER)["spec"]["template"]["spec"]
    assert "initContainers" not in spec
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "shared-models", "readOnly": True}} \
        in spec["volumes"]
    worker = spec["containers"][0]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in worker["volumeMounts"]
    assert _flag(worker["args"], "--target") == f"/models/meta-llama/Llama-3.1-8B-Instruct/{TARGET_COMMIT}"
    assert not any(e["name"] == "HF_TOKEN" for e in worker.get("env", []))  # workers never talk to the hub


def test_hub_mtp_workers_draft_from_the_targets_folder():
    body = _hub(example(), cache={"create": {}})
    body["spec"]["draft"] = {"algorithm": "MTP"}
    view = parse_spec(body)
    sources = hub_sources()
    del sources["draft"]
    args = workload.worker_args(view, typed(make_plan(sources=sources)))
    assert _flag(args, "--draft") == _flag(args, "--target") == \
        f"/models/meta-llama/Llama-3.1-8B-Instruct/{TARGET_COMMIT}"


@pytest.mark.parametrize("name", [
    "spec-deploy.yaml", "ngram.yaml", "standalone-draft.yaml",
])
def test_worker_args_parse_with_the_serve_cli(name):
    """Every flag the operator renders is one `specdecode-worker serve` accepts, agreeing with the plan."""
    from specdecode_worker.serving.serve_cli import check_flags_against_plan, parser

    view = parse_spec(example(name))
    plan = make_plan(tp=2)
    ns = parser().parse_args(workload.worker_args(view, typed(plan))[1:])
    assert ns.tp == "2" and ns.plan == "/etc/specdecode/plan.json" and ns.algorithm == view.algorithm
    check_flags_against_plan(ns, typed(plan), ns.plan)  # raises when a pinned number is not the plan's


def test_ngram_worker_args():
    ngram = workload.worker_args(parse_spec(example("ngram.yaml")), typed(make_plan()))
    assert _flag(ngram, "--num-draft-tokens") == "8" and "--draft" not in ngram


def test_eagle_tree_worker_args_count_proposals_without_the_root():
    spec = example()
    spec["spec"]["draft"].update(topK=4, numSteps=3, numDraftTokens=16)
    args = workload.worker_args(parse_spec(spec), typed(make_plan()))
    assert _flag(args, "--speculative-eagle-topk") == "4" and _flag(args, "--speculative-num-steps") == "3"
    assert _flag(args, "--num-draft-tokens") == "15"  # 16 verified tokens: the root and 15 proposals
    chain = workload.worker_args(parse_spec(example()), typed(make_plan()))
    assert _flag(chain, "--speculative-eagle-topk") == "1" and _flag(chain, "--num-draft-tokens") == "3"


def test_speculation_policy_renders_to_the_worker_flag():
    """draft.policy.mode reaches `serve --spec-policy`; adaptive when the spec leaves it out."""
    from specdecode_worker.serving.serve_cli import parser

    assert _flag(workload.worker_args(parse_spec(example()), typed(make_plan())), "--spec-policy") == "adaptive"
    spec = example()
    spec["spec"]["draft"]["policy"] = {"mode": "fixed"}
    args = workload.worker_args(parse_spec(spec), typed(make_plan()))
    assert _flag(args, "--spec-policy") == "fixed"
    assert parser().parse_args(args[1:]).spec_policy == "fixed"


def _planned_by(args: list[str]) -> dict:
    """The MemoryPlan `specdecode-worker plan ARGS` would write, sized over a synthetic 8B-like
    geometry (no model folder is read): the planner's own flag parsing and ``build_plan``."""
    from specdecode_worker.planner import plan_cli
    from specdecode_worker.planner.plan import Candidate, ForwardGeometry, PlanRequest, build_plan

    planned = plan_cli.plan_args(plan_cli.parser().parse_args(args[1:]))
    geometry = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 128_256, 2)
    req = PlanRequest(
        algorithm=planned.algorithm, target_name="t", draft_name=planned.draft, gpu_memory_bytes=80 * GIB,
        gpu_total_bytes=80 * GIB, gpu_source="override", gpu_name="g", kv_cache_dtype="bfloat16",
        draft_num_layers=1, target_num_layers=32, target_vocab_size=128_256, min_tokens=planned.context_length,
        context_length=planned.context_length, max_running_requests=planned.max_running_requests,
        cuda_graph_max_bs=planned.cuda_graph_max_bs, chunked_prefill_size=planned.chunked_prefill_size,
        target_geometry=geometry, draft_geometry=None if planned.algorithm == "NGRAM" else geometry,
        verify_tokens=planned.verify_tokens, tree_topk=planned.tree_topk, tree_steps=planned.tree_steps)
    plan = build_plan(req, {1: Candidate(1, 16 * GIB, GIB, 131_072, 4_096)}, [1])
    assert plan["fits"], plan["message"]
    return plan


def _spec_of(algorithm: str, **draft) -> dict:
    body = example({"NGRAM": "ngram.yaml", "STANDALONE": "standalone-draft.yaml"}.get(algorithm, "spec-deploy.yaml"))
    body["spec"]["draft"]["algorithm"] = algorithm
    body["spec"]["draft"].update(draft)
    if algorithm == "MTP":
        body["spec"]["draft"].pop("model", None)
    return body


@pytest.mark.parametrize("algorithm,draft", [
    ("EAGLE3", {}), ("EAGLE", {}), ("EAGLE3", {"topK": 4, "numSteps": 3, "numDraftTokens": 8}),
    ("EAGLE", {"topK": 2, "numSteps": 5, "numDraftTokens": 6}), ("EAGLE3", {"numSteps": 6, "numDraftTokens": 7}),
    ("MTP", {}), ("MTP", {"numSteps": 2, "numDraftTokens": 3}), ("STANDALONE", {}), ("NGRAM", {}),
    ("NGRAM", {"numDraftTokens": 3}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{n}" for k, n in v.items()) or "defaults")
def test_rendered_worker_args_serve_exactly_the_shape_the_planner_args_priced(algorithm, draft):
    """For every algorithm, the worker the operator renders passes the worker's own check against
    the plan its planner pod would write, at the very shape that plan priced (nothing narrower,
    nothing wider): the planner and worker arguments come from one spec."""
    from specdecode_worker.serving import serve_cli, serve_shape

    view = parse_spec(_spec_of(algorithm, **draft))
    plan = _planned_by(planner.planner_args(view))
    flags = serve_cli.parser().parse_args(workload.worker_args(view, typed(plan))[1:])
    serve_shape.fill_from_plan(flags, typed(plan))
    serve_cli.check_flags_against_plan(flags, typed(plan), flags.plan)
    assert serve_shape.check_against_plan(flags, typed(plan), flags.plan) == []  # raises when wider; lists narrower
    reserve = plan["reserve"]
    assert flags.num_draft_tokens + 1 == reserve["verifyTokens"] == view.num_draft_tokens + (algorithm == "NGRAM")
    shape = serve_shape.serve_shape(flags, typed(plan))
    assert (shape.cuda_graph_max_bs, shape.chunked_prefill_size, shape.max_running_requests) == \
        (reserve["cudaGraphMaxBs"], reserve["chunkedPrefillSize"], reserve["maxRunningRequests"])
    if view.top_k > 1:
        tree = (flags.speculative_eagle_topk, flags.speculative_num_steps)
        assert tree == (reserve["treeTopk"], reserve["treeSteps"])
