"""Every pod the operator renders passes Pod Security "restricted", and the checker that says so
catches each rule it claims to check."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from specdecode_operator import planner, podsecurity, workload
from specdecode_operator.spec import parse_spec, plan_key
from tests.restricted_profile import hub_store, pod_spec_of, rendered_pods, violations
from tests.operator_helpers import OWNER, example, hub_sources, make_plan, typed

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("what,spec", list(rendered_pods()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_rendered_pod_is_restricted_clean(what, spec):
    assert violations(spec) == [], what
    assert spec["automountServiceAccountToken"] is False  # no container here talks to the API
    for c in spec.get("initContainers", []) + spec["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        # what a read-only root leaves writable is scratch space, and the caches point into it
        assert "emptyDir" in volumes[mounts["/tmp"]] and "emptyDir" in volumes[mounts[podsecurity.CACHE_DIR]]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env["HF_HOME"].startswith(podsecurity.CACHE_DIR + "/")


def test_the_pod_user_is_the_images_user():
    """runAsNonRoot needs a numeric user; it must be the one the worker image creates and runs as."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (user,) = set(re.findall(r"^USER\s+(\d+):(\d+)\s*$", dockerfile, re.M))  # both images' targets
    view = parse_spec(example())
    spec = pod_spec_of(planner.render_planner_pod(view, plan_key(view), OWNER))
    sc = spec["securityContext"]
    assert (str(sc["runAsUser"]), str(sc["runAsGroup"])) == user
    assert sc["fsGroup"] == sc["runAsGroup"]  # the model cache is writable by the image's group


def test_spec_pod_adds_to_the_defaults():
    body = hub_store(example())
    body["spec"]["pod"] = {"serviceAccountName": "puller", "securityContext": {"runAsUser": 2000, "fsGroup": 3000}}
    view = parse_spec(body)
    spec = pod_spec_of(workload.render_deployment(view, typed(make_plan(sources=hub_sources())), plan_key(view), OWNER))
    assert spec["serviceAccountName"] == "puller" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsUser"] == 2000 and spec["securityContext"]["fsGroup"] == 3000
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert violations(spec) == []


def _clean():
    view = parse_spec(hub_store(example()))
    plan = typed(make_plan(tp=2, sources=hub_sources()))
    return pod_spec_of(workload.render_deployment(view, plan, plan_key(view), OWNER))


def _worker(spec):
    return spec["containers"][0]


@pytest.mark.parametrize("breaks,expected", [
    (lambda s: s["securityContext"].pop("runAsNonRoot"), "worker must run with runAsNonRoot=true"),
    (lambda s: _worker(s)["securityContext"].update(runAsNonRoot=False), "worker must run with runAsNonRoot=true"),
    (lambda s: s["securityContext"].update(runAsUser=0), "runAsUser is 0"),
    (lambda s: s["securityContext"].pop("seccompProfile"), "seccompProfile is None"),
    (lambda s: s["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccompProfile is Unconfined"),
    (lambda s: _worker(s)["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation=false"),
    (lambda s: _worker(s)["securityContext"].update(capabilities={"drop": ["NET_RAW"]}), "drop ALL"),
    (lambda s: _worker(s)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "SYS_ADMIN"),
    (lambda s: _worker(s)["securityContext"].update(privileged=True), "is privileged"),
    (lambda s: s["initContainers"][0].pop("securityContext"), "fetch-target must"),
    (lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
    (lambda s: s.update(hostNetwork=True), "hostNetwork"),
    (lambda s: _worker(s)["ports"][0].update(hostPort=8000), "hostPort"),
])
def test_the_checker_catches_each_rule(breaks, expected):
    spec = copy.deepcopy(_clean())
    assert violations(spec) == []
    breaks(spec)
    found = violations(spec)
    assert any(expected in v for v in found), found
