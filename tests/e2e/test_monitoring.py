"""Monitoring: the workers' and the operator's /metrics, the chart's dashboard, scrape monitors and
alerts, and the autoscaling example.

Every metric the dashboard and the alerts query is looked up in real /metrics output: a tiny
worker served on loopback after one completion, and the operator's health endpoint over a status
the reconciler's own condition code produced. The chart is rendered by helm with and without the
Prometheus Operator's API; the HPA example is applied on the local control plane, whose HPA
controller must resolve the SDD's scale subresource.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
aiohttp = pytest.importorskip("aiohttp")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specdecode_operator import conditions as c  # noqa: E402
from specdecode_operator import health, labels  # noqa: E402
from specdecode_operator.metrics import StatusBook  # noqa: E402
from specdecode_worker.serving.metrics import RequestLatency  # noqa: E402

from devtools.cluster.controlplane import free_ports  # noqa: E402
from devtools.cluster.wait import wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specdecode-operator"
DASHBOARD = CHART / "dashboards" / "specdecode.json"
HPA = ROOT / "examples" / "hpa.yaml"
SPEC_DEPLOY = ROOT / "examples" / "spec-deploy.yaml"
CRD = ROOT / "crds" / "specdecode.io_specdecodedeployments.yaml"
# Exported only where the torch allocator keeps a peak (CUDA); test_cuda_worker_exports_the_dynamic_peak.
CUDA_ONLY = {"specdecode_dynamic_bytes_peak"}
MONITORING = ["--api-versions", "monitoring.coreos.com/v1"]
ALL_ON = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true"]


def sample_names(text: str) -> set[str]:
    """Every sample name of a Prometheus text exposition (parsing it validates the format)."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def queried_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bspecdecode_[a-z0-9_]+", expr))


# ---- the worker's latency histograms ---------------------------------------------------------


def _histogram(hist) -> dict[str, float]:
    [fam] = hist.collect()
    return {s.name.rsplit("_", 1)[1]: s.value for s in fam.samples if s.name.endswith(("_count", "_sum"))}


def test_latency_histograms_follow_the_token_updates():
    times = iter([10.0, 10.5, 10.7, 11.3, 11.4])  # submit, first token, 2 tokens, 1 token, end
    latency = RequestLatency(clock=lambda: next(times))
    seen = []
    update = latency.timed(lambda req, tokens: seen.append(tokens))
    req = SimpleNamespace(error=None)
    for tokens in ([7], [8, 9], [10], None):
        update(req, tokens)
    assert seen == [[7], [8, 9], [10], None]  # the stream still gets every update
    assert _histogram(latency.ttft) == pytest.approx({"count": 1, "sum": 0.5})
    # a round that commits two tokens after 0.2 s: 0.1 s each; then one token after 0.6 s
    assert _histogram(latency.inter_token) == pytest.approx({"count": 3, "sum": 0.8})
    assert _histogram(latency.e2e) == pytest.approx({"count": 1, "sum": 1.4})


def test_a_failed_request_counts_no_end_to_end_latency():
    times = iter([0.0, 0.2, 0.9])
    latency = RequestLatency(clock=lambda: next(times))
    update = latency.timed(lambda req, tokens: None)
    req = SimpleNamespace(error=None)
    update(req, [1])
    req.error = "device lost"
    update(req, None)
    assert _histogram(latency.ttft)["count"] == 1
    assert _histogram(latency.e2e)["count"] == 0


# ---- a real tiny worker ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(base URL, completion usage, /metrics text) of a tiny STANDALONE worker after one completion."""
    from tests.engine_helpers import tiny_models
    from tests.server_helpers import free_port, serve_argv, serving

    models = tiny_models(tmp_path_factory.mktemp("monitoring"))
    with serving(serve_argv(models, free_port())) as (base, _state):
        body = {"model": "target", "prompt": "one two three", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        yield base, r.json()["usage"], httpx.get(f"{base}/metrics").text


def test_worker_exports_latency_histograms_of_the_request_it_served(worker):
    _base, usage, text = worker
    values = samples(text)
    n = usage["completion_tokens"]
    assert n == 10
    assert values[("specdecode_time_to_first_token_seconds_count", ())] == 1
    assert values[("specdecode_inter_token_latency_seconds_count", ())] == n - 1
    assert values[("specdecode_e2e_request_latency_seconds_count", ())] == 1
    ttft = values[("specdecode_time_to_first_token_seconds_sum", ())]
    inter = values[("specdecode_inter_token_latency_seconds_sum", ())]
    e2e = values[("specdecode_e2e_request_latency_seconds_sum", ())]
    assert 0 < ttft <= e2e and inter <= e2e  # parts of one request's life
    assert ttft + inter == pytest.approx(e2e, abs=0.25)  # the end comes with the last tokens
    buckets = sorted((float(dict(k)["le"]), v) for (name, k), v in values.items()
                     if name == "specdecode_inter_token_latency_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), n - 1)


def test_worker_exports_the_plans_dynamic_reserve(worker):
    base, _usage, text = worker
    plan = httpx.get(f"{base}/plan").json()["plan"]
    assert samples(text)[("specdecode_dynamic_bytes_planned", ())] == plan["reserve"]["dynamicBytes"]
    assert "specdecode_dynamic_bytes_peak" not in sample_names(text)  # the CPU keeps no allocator peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_worker_exports_the_dynamic_peak(tmp_path):
    from tests.engine_helpers import tiny_models
    from tests.server_helpers import free_port, serve_argv, serving

    models = tiny_models(tmp_path)
    argv = serve_argv(models, free_port())
    argv[argv.index("--device") + 1] = "cuda"
    del argv[argv.index("--device-memory-gib"):argv.index("--device-memory-gib") + 2]  # the GPU's own memory
    with serving(argv) as (base, _state):
        httpx.post(f"{base}/v1/completions", json={"prompt": "one two", "max_tokens": 8}, timeout=120)
        values = samples(httpx.get(f"{base}/metrics").text)
    peak = values[("specdecode_dynamic_bytes_peak", ())]
    assert 0 < peak < torch.cuda.get_device_properties(0).total_memory


# ---- the operator's metrics on its health port ------------------------------------------------


def _status(ready: bool) -> dict:
    """A status as the reconciler writes it, from its own condition code."""
    verdicts = {c.PLANNED: c.Verdict("True", c.PLAN_READY, "fits")}
    if ready:
        verdicts |= {c.AVAILABLE: c.Verdict("True", "MinimumReplicasAvailable"),
                     c.DEGRADED: c.Verdict("False", "AsExpected"), c.READY: c.Verdict("True", "ReplicasReady")}
    else:
        verdicts |= {c.AVAILABLE: c.Verdict("False", c.PODS_NOT_READY),
                     c.DEGRADED: c.Verdict("True", c.WORKER_OOM_KILLED, 'OOMKilled "quoted"\nnext line'),
                     c.READY: c.Verdict("False", c.PODS_NOT_READY)}
    conds = c.apply_verdicts([], verdicts, 3, "2026-01-01T00:00:00Z")
    ready_n = 2 if ready else 1
    return {"conditions": conds, "replicas": 2, "readyReplicas": ready_n, "phase": c.phase(conds, ready_n, 2)}


async def _scrape(book: StatusBook, probe) -> tuple[dict, str, str]:
    port = free_ports(1)[0]
    runner = await health.serve(f"http://127.0.0.1:{port}/healthz", probe, book)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
                live = await r.json()
            async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
                assert r.status == 200
                return live, r.headers["Content-Type"], await r.text()
    finally:
        await runner.cleanup()


def test_the_liveness_endpoint_reports_the_reconcilers_request_counter(monkeypatch):
    """What benchmarks/operator_scale.py reads: the operator's own probe, served by its own
    endpoint, carries the reconciler's API request counter (it once read a key that the endpoint no
    longer nests, and reported 0.0 requests per SDD)."""
    import importlib.util

    from specdecode_operator import handlers

    counted = SimpleNamespace(due={"a": 0, "b": 0}, reconciler=SimpleNamespace(kube=SimpleNamespace(requests=265)))
    monkeypatch.setattr(handlers, "CONTROLLER", counted)
    live, _, _ = asyncio.run(_scrape(StatusBook(), handlers.probe))
    spec = importlib.util.spec_from_file_location(
        "operator_scale", Path(__file__).resolve().parents[2] / "benchmarks" / "operator_scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.reconciler_requests(live) == 265 and live["tracked"] == 2
    with pytest.raises(KeyError, match="no apiRequests"):
        bench.reconciler_requests({"tracked": 2})


@pytest.fixture(scope="module")
def operator_metrics() -> str:
    book = StatusBook()
    book.record("team-a", "llama", _status(ready=True))
    book.record("team-b", "qwen", _status(ready=False))
    book.record("team-b", "gone", _status(ready=True))
    book.forget("team-b", "gone")
    live, content_type, text = asyncio.run(_scrape(book, lambda: {"tracked": 2}))
    assert live == {"tracked": 2}
    assert content_type.startswith("text/plain; version=0.0.4")
    return text


def test_operator_exports_sdd_conditions_phase_and_replicas(operator_metrics):
    values = samples(operator_metrics)

    def cond(ns, sdd, ctype):
        [(key, value)] = [(dict(k), v) for (name, k), v in values.items()
                          if name == "specdecode_sdd_condition" and dict(k)["sdd"] == sdd and dict(k)["type"] == ctype]
        assert key["namespace"] == ns
        return key["status"], key["reason"], value

    assert cond("team-a", "llama", "Ready") == ("True", "ReplicasReady", 1)
    assert cond("team-a", "llama", "Degraded") == ("False", "AsExpected", 0)
    assert cond("team-b", "qwen", "Degraded") == ("True", c.WORKER_OOM_KILLED, 1)
    assert cond("team-b", "qwen", "Planned") == ("True", c.PLAN_READY, 1)
    assert values[("specdecode_sdd_phase", (("namespace", "team-b"), ("phase", "Degraded"), ("sdd", "qwen")))] == 1
    assert values[("specdecode_sdd_phase", (("namespace", "team-b"), ("phase", "Ready"), ("sdd", "qwen")))] == 0
    assert values[("specdecode_sdd_ready_replicas", (("namespace", "team-b"), ("sdd", "qwen")))] == 1
    assert values[("specdecode_sdd_replicas", (("namespace", "team-b"), ("sdd", "qwen")))] == 2
    assert values[("specdecode_sdd_tracked", ())] == 2
    assert "gone" not in operator_metrics


@pytest.mark.parametrize("url", ["ftp://0.0.0.0:8080/healthz", "http://0.0.0.0/healthz", "http://0.0.0.0:8080/metrics"])
def test_a_liveness_url_that_cannot_serve_both_is_refused(url):
    from specdecode_operator.main import main

    with pytest.raises(ValueError, match="--liveness"):
        health.endpoint(url)
    assert main(["--liveness", url]) == 2


def test_running_operator_serves_its_sdds_conditions_next_to_liveness(cluster, namespace):
    from tests.e2e_helpers import Operator

    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/specdecodedeployments.specdecode.io", "--timeout=60s")
    sdd = yaml.safe_load(SPEC_DEPLOY.read_text())
    name = sdd["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", str(SPEC_DEPLOY))
    op = Operator(cluster, namespace).start()
    try:
        metrics_url = op.health.rsplit("/", 1)[0] + health.METRICS_PATH

        def planned() -> dict | None:
            text = httpx.get(metrics_url, timeout=5).text
            found = [dict(k) for (metric, k), _v in samples(text).items()
                     if metric == "specdecode_sdd_condition" and dict(k).get("type") == "Planned"]
            return found[0] if found else None

        def agrees_with_status() -> bool:
            status = json.loads(cluster.kubectl("get", "sdd", name, "-n", namespace, "-o", "json").stdout).get("status")
            cond = c.get((status or {}).get("conditions") or [], c.PLANNED)
            return cond is not None and planned() == {"namespace": namespace, "sdd": name, "type": "Planned",
                                                      "status": cond["status"], "reason": cond["reason"]}

        wait_for(agrees_with_status, timeout=60, what="the SDD's Planned condition on the operator's /metrics")
        assert httpx.get(op.health, timeout=5).status_code == 200
    finally:
        op.stop()


# ---- the dashboard ---------------------------------------------------------------------------


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def test_dashboard_queries_only_metrics_the_worker_and_operator_serve(worker, operator_metrics):
    served = sample_names(worker[2]) | sample_names(operator_metrics)
    queried = set().union(*map(queried_metrics, _dashboard_exprs()))
    assert queried - CUDA_ONLY, "the dashboard queries no specdecode metric"
    assert queried - CUDA_ONLY - served == set()


def test_dashboard_has_the_panels_an_operator_of_the_service_needs():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for needed in ("tokens/s", "time to first token", "inter-token latency", "acceptance rate", "accepted length",
                   "draft length", "kv pool usage", "planned vs actual kv tokens", "dynamic bytes", "phase durations"):
        assert needed in titles, f"no panel for {needed}: {titles}"
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]


# ---- chart values ----------------------------------------------------------------------------


def _schema_and_values():
    return json.loads((CHART / "values.schema.json").read_text()), yaml.safe_load((CHART / "values.yaml").read_text())


def test_monitoring_values_fully_enabled_satisfy_the_schema():
    schema, values = _schema_and_values()
    values["metrics"]["serviceMonitor"].update(enabled=True, labels={"release": "kps"}, interval="15s")
    values["metrics"]["prometheusRule"].update(enabled=True, acceptanceRateBelow=0.3, **{"for": "5m"})
    values["metrics"]["dashboard"].update(namespace="monitoring", annotations={"grafana_folder": "LLM"})
    jsonschema.validate(values, schema)


@pytest.mark.parametrize("path,bad", [
    (("serviceMonitor", "interval"), "30 seconds"),
    (("serviceMonitor", "enable"), True),  # typo: unknown keys are refused
    (("prometheusRule", "acceptanceRateBelow"), 1.5),
    (("prometheusRule", "for"), 600),
    (("dashboard", "labels"), {"grafana_dashboard": 1}),
    (("dashboard", "namespace"), "Monitoring"),
])
def test_schema_refuses_wrong_monitoring_values(path, bad):
    schema, values = _schema_and_values()
    changed = copy.deepcopy(values)
    changed["metrics"][path[0]][path[1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(changed, schema)


# ---- the chart, rendered by helm -------------------------------------------------------------


def _render(cluster, *args: str) -> list[dict]:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    out = cluster.helm("template", "sdo", str(CHART), "-n", "sys", "--kube-version", version, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _kinds(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_without_the_monitoring_api_no_monitor_or_rule_renders(cluster):
    kinds = _kinds(_render(cluster, *ALL_ON))
    assert not {"PodMonitor", "ServiceMonitor", "PrometheusRule"} & set(kinds)
    assert "Service" not in kinds  # the operator Service comes only with its ServiceMonitor (or when asked)
    [dashboard] = kinds["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["specdecode.json"]) == json.loads(DASHBOARD.read_text())


def test_install_without_the_monitoring_api_says_what_was_left_out(cluster, namespace):
    out = cluster.helm("install", "sdo", str(CHART), "-n", namespace, "--dry-run=client", *ALL_ON).stdout
    assert "metrics.serviceMonitor.enabled is true, but this cluster serves no monitoring.coreos.com/v1" in out
    assert "metrics.prometheusRule.enabled is true, but this cluster serves no monitoring.coreos.com/v1" in out
    quiet = cluster.helm("install", "sdo", str(CHART), "-n", namespace, "--dry-run=client").stdout
    assert "monitoring.coreos.com" not in quiet.split("NOTES:")[1]


def test_with_the_monitoring_api_monitors_select_workers_and_operator(cluster):
    assert not {"PodMonitor", "ServiceMonitor", "PrometheusRule"} & set(_kinds(_render(cluster, *MONITORING)))
    kinds = _kinds(_render(cluster, *MONITORING, *ALL_ON, "--set", "metrics.serviceMonitor.labels.release=kps"))
    [pod_monitor], [service_monitor], [service], [dep] = (kinds[k] for k in
                                                          ("PodMonitor", "ServiceMonitor", "Service", "Deployment"))
    for monitor in (pod_monitor, service_monitor):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kps"
    # the workers: the labels and the port of the pods the operator renders
    from specdecode_operator import workload
    from specdecode_operator.spec import parse_spec

    from tests.operator_helpers import OWNER, example, make_plan, typed

    pod = workload.render_deployment(parse_spec(example()), typed(make_plan()), "k", OWNER)["spec"]["template"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    [endpoint] = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["relabelings"][0]["sourceLabels"] == ["__meta_kubernetes_pod_label_specdecode_io_name"]
    # the operator: its Service, on the health port that serves /metrics
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [svc_endpoint] = service_monitor["spec"]["endpoints"]
    assert svc_endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    container_ports = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert svc_endpoint["port"] in container_ports and svc_endpoint["path"] == health.METRICS_PATH

    scoped = _kinds(_render(cluster, *MONITORING, *ALL_ON, "--set", "watch.scope=namespace",
                            "--set", "watch.namespaces={team-a,team-b}"))
    assert scoped["PodMonitor"][0]["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_alerts_cover_the_failures_and_query_served_metrics(cluster, worker, operator_metrics):
    threshold = ["--set-json", "metrics.prometheusRule.acceptanceRateBelow=0.35"]  # --set would make it a string
    kinds = _kinds(_render(cluster, *MONITORING, *ALL_ON, *threshold))
    [rule] = kinds["PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"SpecDecodeKVTokensBelowPlan", "SpecDecodeDynamicPeakAbovePlan", "SpecDecodeAcceptanceCollapsed",
            "SpecDecodePodsNotReady", "SpecDecodeDegraded"} <= set(alerts)
    assert "< 0.35" in alerts["SpecDecodeAcceptanceCollapsed"]["expr"]
    served = sample_names(worker[2]) | sample_names(operator_metrics)
    for name, alert in alerts.items():
        used = queried_metrics(alert["expr"])
        assert used and used - CUDA_ONLY <= served, (name, used - served)
        assert "{{ $labels." in alert["annotations"]["summary"]  # Prometheus templating survived helm's


# ---- the autoscaling example on the local control plane ---------------------------------------


def test_hpa_example_scales_the_sdd_through_its_scale_subresource(cluster, namespace):
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/specdecodedeployments.specdecode.io", "--timeout=60s")
    sdd = yaml.safe_load(SPEC_DEPLOY.read_text())
    [hpa] = [d for d in yaml.safe_load_all(HPA.read_text()) if d]
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (sdd["apiVersion"], sdd["kind"], sdd["metadata"]["name"])
    name = sdd["metadata"]["name"]
    cluster.kubectl("apply", "-n", namespace, "-f", str(SPEC_DEPLOY))
    # what the operator writes: the replica count and the worker selector the scale subresource reads
    status = {"status": {"replicas": sdd["spec"]["replicas"], "selector": labels.selector_string(name)}}
    cluster.kubectl("patch", "sdd", name, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))
    scale_path = f"/apis/specdecode.io/v1alpha1/namespaces/{namespace}/specdecodedeployments/{name}/scale"
    scale = json.loads(cluster.kubectl("get", "--raw", scale_path).stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == sdd["spec"]["replicas"]
    assert scale["status"]["selector"] == labels.selector_string(name)

    cluster.kubectl("apply", "-n", namespace, "-f", str(HPA))  # no metrics API is needed to create it

    def conditions():
        got = json.loads(cluster.kubectl("get", "hpa", name, "-n", namespace, "-o", "json").stdout)
        return {cond["type"]: cond for cond in (got.get("status") or {}).get("conditions") or []}

    wait_for(lambda: "ScalingActive" in conditions(), timeout=60, what="the HPA controller to look at the HPA")
    conds = conditions()
    # the controller read the SDD's scale subresource, then asked for the worker metric, which no
    # adapter serves on this plane
    assert conds["AbleToScale"]["status"] == "True" and conds["AbleToScale"]["reason"] == "SucceededGetScale"
    assert conds["ScalingActive"]["status"] == "False", conds
    assert "specdecode_" in conds["ScalingActive"]["message"], conds["ScalingActive"]
