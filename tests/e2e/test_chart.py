"""The Helm chart: static checks here, then the chart's life on the real control plane.

Static: the chart's CRD copy is byte-identical to crds/, and values.schema.json accepts the
shipped values and refuses wrong ones. End to end (the `cluster` fixture): helm lint, the rendered
manifests accepted by the API server in a server-side dry run, install, the operator running as a
local process with only the chart ServiceAccount's token reconciling an example to Ready (so the
RBAC is enough) and refused what it does not need (so it is not more), upgrade with changed
values, and uninstall leaving nothing behind but the CRD.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.chart_helpers import (
    CHART, RELEASE, LocalOperator, assert_example_reconciles, can_i, container_args, forbidden_lines, local_example,
    sa_kubeconfig, wait_ready,
)
from devtools.cluster.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
TOP_CRDS = ROOT / "crds"


def _yaml_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.y*ml"))}


def test_chart_crds_equal_the_top_level_crds():
    top, chart = _yaml_files(TOP_CRDS), _yaml_files(CHART / "crds")
    assert top, "crds/ holds no CRD manifest"
    assert set(chart) == set(top), (
        f"charts/specdecode-operator/crds/ has {sorted(chart)}, crds/ has {sorted(top)}: "
        "copy crds/*.yaml into the chart"
    )
    for name in top:
        assert chart[name] == top[name], f"chart copy of {name} differs from crds/{name}: copy it again"


def _schema_and_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return schema, values


def test_shipped_values_satisfy_the_schema():
    schema, values = _schema_and_values()
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(values, schema)


@pytest.mark.parametrize(
    "path,bad",
    [
        (("watch", "scope"), "everywhere"),  # not an enum value
        (("replicaCount",), 2),  # kopf peering is not leader election
        (("image", "pullPolicy"), "Sometimes"),
        (("liveness", "port"), 70000),
        (("operator", "logFormat"), "xml"),
        (("watch", "namespaces"), ["Not_A_Namespace"]),
        (("rbac", "readNode"), True),  # typo of readNodes: unknown keys are refused
        (("workerNetworkPolicy", "namespaces"), ["Not_A_Namespace"]),
        (("workerNetworkPolicy", "enable"), True),
    ],
)
def test_schema_refuses_wrong_values(path, bad):
    schema, values = _schema_and_values()
    changed = copy.deepcopy(values)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(changed, schema)


# ---- on the real control plane ---------------------------------------------------------------

def kube_version(cluster) -> str:
    return json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]


def render(cluster, namespace: str, *values: str, release: str = "sdo") -> list[dict]:
    out = cluster.helm("template", release, str(CHART), "-n", namespace,
                       "--kube-version", kube_version(cluster), *values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_passes_in_both_scopes(cluster):
    for values in ([], ["--set", "watch.scope=namespace", "--set", "watch.namespaces={a,b}",
                        "--set", "rbac.readNodes=false", "--set", "metrics.service.enabled=true"]):
        result = cluster.helm("lint", "--strict", str(CHART), *values)
        assert "0 chart(s) failed" in result.stdout, result.stdout


def test_helm_refuses_values_outside_the_schema(cluster, namespace):
    result = cluster.helm("template", "sdo", str(CHART), "-n", namespace, "--kube-version",
                          kube_version(cluster), "--set", "watch.scope=everywhere", check=False)
    assert result.returncode != 0
    assert "watch.scope" in result.stderr or "scope" in result.stderr, result.stderr


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_rendered_chart_passes_a_server_side_dry_run(cluster, namespace, scope):
    values = ["--set", f"watch.scope={scope}", "--set", "metrics.service.enabled=true"]
    manifest = cluster.helm("template", "sdo", str(CHART), "-n", namespace, "--include-crds",
                            "--kube-version", kube_version(cluster), *values).stdout
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=manifest)
    applied = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    assert len(applied) == len(docs), result.stdout


def test_rbac_is_scoped_as_asked_and_never_broad(cluster, namespace):
    cluster_docs = render(cluster, namespace)
    ns_docs = render(cluster, namespace, "--set", "watch.scope=namespace", "--set", "watch.namespaces={a,b}")
    no_nodes = render(cluster, namespace, "--set", "watch.scope=namespace", "--set", "rbac.readNodes=false")

    assert [r["metadata"]["name"] for r in by_kind(cluster_docs, "ClusterRole")] == ["sdo-specdecode-operator"]
    assert not by_kind(cluster_docs, "Role")
    # Namespace scope: a Role per watched namespace; the only cluster-wide grant is reading nodes.
    assert sorted(r["metadata"]["namespace"] for r in by_kind(ns_docs, "Role")) == ["a", "b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(ns_docs, "RoleBinding")) == ["a", "b"]
    [node_role] = by_kind(ns_docs, "ClusterRole")
    assert node_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    assert not by_kind(no_nodes, "ClusterRole") and not by_kind(no_nodes, "ClusterRoleBinding")
    [dep] = by_kind(no_nodes, "Deployment")
    assert "--no-node-check" in dep["spec"]["template"]["spec"]["containers"][0]["args"]

    for docs in (cluster_docs, ns_docs):
        for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
            for rule in role["rules"]:
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[field], f"wildcard in {role['metadata']['name']}: {rule}"
                assert not {"secrets", "pods/exec", "roles", "clusterroles"} & set(rule["resources"]), rule
                assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"], rule


def test_operator_pod_is_hardened(cluster, namespace):
    [dep] = by_kind(render(cluster, namespace), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_operator_pod_is_restricted_clean(cluster, namespace):
    """By the restricted profile's rules, and by the API server's PodSecurity admission itself."""
    from tests.restricted_profile import violations

    [dep] = by_kind(render(cluster, namespace), "Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert violations(spec) == []
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    cluster.kubectl("create", "serviceaccount", spec["serviceAccountName"], "-n", namespace)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator", "namespace": namespace}, "spec": spec}
    result = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)
    assert result.returncode == 0 and "PodSecurity" not in result.stderr, result.stderr


def test_worker_network_policy_selects_the_operators_workers(cluster, namespace):
    from specdecode_operator import labels, workload

    assert not by_kind(render(cluster, namespace), "NetworkPolicy")  # off by default
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    docs = render(cluster, namespace, "--set", "workerNetworkPolicy.enabled=true", "--set", "watch.scope=namespace",
                  "--set", f"watch.namespaces={{{namespace},b}}", "--set-json",
                  f"workerNetworkPolicy.from=[{json.dumps(peer)}]")
    policies = by_kind(docs, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == sorted([namespace, "b"])
    worker_labels = labels.common("any-sdd", labels.ROLE_WORKER)
    for policy in policies:
        spec = policy["spec"]
        selector = spec["podSelector"]["matchLabels"]
        assert selector.items() <= worker_labels.items()  # it selects the pods the operator renders
        # Only the serving port: rank traffic is the operator's per-SDD policy (one SDD's pods
        # must not reach another's NCCL ports, which a namespace-wide rule here would allow).
        # The second rule lets the operator read a vllm/sglang worker's own KV report.
        [serving, operator_reads] = spec["ingress"]
        assert serving["ports"] == [{"port": workload.HTTP_PORT, "protocol": "TCP"}] and serving["from"] == [peer]
        assert operator_reads["ports"] == serving["ports"]
        [operator_pods] = operator_reads["from"]
        assert operator_pods["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace}
        assert operator_pods["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "specdecode-operator"
        assert spec["policyTypes"] == ["Ingress"]
    [dep] = by_kind(docs, "Deployment")
    assert "--worker-network-policy" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    policy_rule = {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                   "verbs": ["create", "patch", "delete"]}
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted([namespace, "b"])
    assert all(policy_rule in r["rules"] for r in roles)
    cluster_docs = render(cluster, namespace, "--set", "workerNetworkPolicy.enabled=true")
    [cluster_role] = [r for r in by_kind(cluster_docs, "ClusterRole")
                      if r["metadata"]["name"] == "sdo-specdecode-operator"]
    assert policy_rule in cluster_role["rules"]
    off = render(cluster, namespace)  # off: neither the flag nor the grant
    [dep] = by_kind(off, "Deployment")
    assert "--worker-network-policy" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert all(r["apiGroups"] != ["networking.k8s.io"] for role in by_kind(off, "ClusterRole") for r in role["rules"])
    mine = next(p for p in policies if p["metadata"]["namespace"] == namespace)
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(mine))
    assert "(server dry run)" in result.stdout


# ---- the chart's life: install, the operator with the chart's credentials, upgrade, uninstall --

def test_install_reconcile_with_chart_credentials_upgrade_uninstall(cluster, namespace, tmp_path):
    ns = namespace
    sa = f"{RELEASE}-specdecode-operator"
    sa_user = f"system:serviceaccount:{ns}:{sa}"
    helm_ns = ["-n", ns]

    # install (cluster scope, the default)
    cluster.helm("install", RELEASE, str(CHART), *helm_ns, "--wait", "--timeout", "120s")
    assert cluster.kubectl("get", "crd", "specdecodedeployments.specdecode.io").returncode == 0
    args = container_args(cluster, ns)
    assert "--all-namespaces" in args

    # the operator with nothing but the chart ServiceAccount's token reconciles an example to Ready
    kubeconfig = sa_kubeconfig(cluster, ns, sa, tmp_path / "sa.kubeconfig")
    whoami = cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
                             f"--kubeconfig={kubeconfig}").stdout
    assert whoami == sa_user
    op = LocalOperator(args, kubeconfig, tmp_path / "operator-cluster.log")
    try:
        assert_example_reconciles(cluster, op, ns, "tiny")
    finally:
        op.stop()
    # ... and it could not have done more than the operator needs
    assert can_i(cluster, sa_user, "create", "pods", "-n", ns)
    assert can_i(cluster, sa_user, "update", "specdecodedeployments", "--subresource=status", "-n", ns)
    for denied in (["get", "secrets", "-n", ns], ["delete", "services", "-n", ns],
                   ["create", "pods", "--subresource=exec", "-n", ns], ["delete", "specdecodedeployments", "-n", ns],
                   ["update", "specdecodedeployments", "-n", ns], ["create", "clusterroles"],
                   ["patch", "nodes"], ["delete", "configmaps", "-n", ns]):
        assert not can_i(cluster, sa_user, *denied), f"the operator's account may {' '.join(denied)}"

    # upgrade: namespace scope over a second namespace, other resources, plain logs, a Service
    watched = f"{ns}-w"
    cluster.kubectl("create", "namespace", watched)
    try:
        cluster.helm("upgrade", RELEASE, str(CHART), *helm_ns, "--wait", "--timeout", "120s",
                     "--set", "watch.scope=namespace", "--set", f"watch.namespaces={{{watched}}}",
                     "--set", "operator.logFormat=plain", "--set", "resources.limits.memory=768Mi",
                     "--set", "metrics.service.enabled=true")
        history = json.loads(cluster.helm("history", RELEASE, *helm_ns, "-o", "json").stdout)
        assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"
        args = container_args(cluster, ns)
        assert f"--namespace={watched}" in args and "--all-namespaces" not in args
        assert "--log-format=plain" in args
        dep = json.loads(cluster.kubectl("get", "deployment", sa, "-n", ns, "-o", "json").stdout)
        assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "768Mi"
        assert cluster.kubectl("get", "service", sa, "-n", ns).returncode == 0
        assert cluster.kubectl("get", "clusterrole", sa, check=False).returncode != 0
        assert cluster.kubectl("get", "role", sa, "-n", watched).returncode == 0
        assert not can_i(cluster, sa_user, "list", "pods", "-n", ns)  # no longer cluster-wide
        assert can_i(cluster, sa_user, "create", "pods", "-n", watched)

        # the narrower credentials still reconcile in the watched namespace
        op = LocalOperator(args, kubeconfig, tmp_path / "operator-namespace.log")
        try:
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(local_example(cluster, watched, "tiny-ns")))
            status = wait_ready(cluster, op, watched, "tiny-ns")
            assert status["readyReplicas"] == 1
            # Only kopf's own cluster-scope discovery may be refused (it falls back by design).
            unexpected = [line for line in forbidden_lines(op) if "namespaces" not in line.lower()
                          and "customresourcedefinitions" not in line.lower()]
            assert not unexpected, "\n".join(unexpected)
        finally:
            op.stop()
        cluster.kubectl("delete", "sdd", "--all", "-n", watched, "--wait=true")
    finally:
        cluster.kubectl("delete", "sdd", "--all", "-n", ns, "--wait=true", check=False)

    # uninstall: nothing of the release is left but the CRD
    cluster.helm("uninstall", RELEASE, *helm_ns, "--wait", "--timeout", "120s")
    kinds = "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,configmaps"
    for where in (ns, watched):
        # The operator pod goes through graceful deletion after its Deployment is gone.
        wait_for(lambda where=where: not cluster.kubectl(
            "get", kinds, "-n", where, "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name").stdout.split(),
            timeout=60, interval=1, what=f"release objects gone from {where}")
    cluster_left = cluster.kubectl("get", "clusterroles,clusterrolebindings", "-l",
                                   f"app.kubernetes.io/instance={RELEASE}", "-o", "name").stdout.split()
    assert not cluster_left, cluster_left
    sa_left = cluster.kubectl("get", "serviceaccount", sa, "-n", ns, check=False)
    assert sa_left.returncode != 0
    release_secrets = cluster.kubectl("get", "secrets", "-n", ns, "-l", f"owner=helm,name={RELEASE}",
                                      "-o", "name").stdout.split()
    assert not release_secrets, release_secrets
    assert cluster.kubectl("get", "crd", "specdecodedeployments.specdecode.io").returncode == 0
    cluster.kubectl("delete", "namespace", watched, "--wait=false", check=False)
