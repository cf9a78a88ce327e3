"""Plan against actual for vllm and sglang: the KV tokens the engine itself reports.

Each such worker pod has a readiness gate (labels.KV_VERIFIED). Once its containers are ready, the
operator reads the engine's own report from the pod and sets the gate: True when the engine sized
at least the planned tokens (less one block or page of rounding), False otherwise, so a pod whose
engine sized less never takes traffic. ``verify`` reads the reports and sets the gates; the rest is pure.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.request
from dataclasses import dataclass
from typing import Any

from specdecode_worker.contract import MemoryPlan

from . import conditions as c
from . import labels
from .kube import now_iso
from .workload import HTTP_PORT

# Where each engine reports the tokens its KV pool holds.
REPORT_PATHS = {"vllm": "/metrics", "sglang": "/server_info"}
KV_BELOW_PLAN = "KVCacheBelowPlan"
KV_MATCHES_PLAN = "KVCacheMatchesPlan"
_VLLM_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


log = logging.getLogger(__name__)
REPORT_TIMEOUT_SECONDS = 3


def http_get(url: str) -> str | None:
    """The body at ``url``, or None when the engine does not answer (yet)."""
    try:
        with urllib.request.urlopen(url, timeout=REPORT_TIMEOUT_SECONDS) as resp:
            return resp.read().decode(errors="replace")
    except (OSError, ValueError) as exc:
        log.debug("no KV report at %s: %s", url, exc)
        return None


def reported_tokens(engine: str, body: str) -> int | None:
    """The engine's own KV token count from its report, or None if the report does not hold it yet."""
    if engine == "vllm":
        match = _VLLM_INFO.search(body)
        if not match:
            return None
        value = dict(_LABEL.findall(match.group(1))).get("kv_cache_size_tokens")
        return int(float(value)) if value not in (None, "", "None") else None
    if engine == "sglang":
        try:
            info = json.loads(body)
        except ValueError:
            return None
        for scope in [info] + list(info.get("internal_states") or []):
            if isinstance(scope, dict) and scope.get("max_total_num_tokens") is not None:
                return int(scope["max_total_num_tokens"])
        return None
    raise ValueError(f"no KV report for engine {engine!r}")


def rounding(plan: MemoryPlan) -> int:
    """Tokens an engine may round away: one vLLM block or one SGLang page."""
    rt = plan.runtime
    return (rt.block_size or rt.page_size or 1) if rt is not None else 1


@dataclass(frozen=True)
class Check:
    pod: str
    planned: int
    reported: int
    engine: str
    rounding: int = 1  # a shortfall of less than one block or page is rounding

    @property
    def ok(self) -> bool:
        return self.reported > self.planned - self.rounding

    def message(self) -> str:
        if self.ok:
            return f"{self.engine} reports {self.reported} KV tokens; the plan has {self.planned}"
        return (f"pod {self.pod}: {self.engine} reports {self.reported} KV tokens but the plan has {self.planned} "
                f"(short by {self.planned - self.reported}): the engine sized its cache by other numbers than "
                "planned; check runtime.image is the engine version the plan names (status.plan.runtime.version) "
                "and that runtime.extraArgs changes no memory setting")


def check(pod: dict[str, Any], plan: MemoryPlan, reported: int) -> Check:
    rt = plan.runtime
    if rt is None:
        raise ValueError("the plan has no runtime section: specdecode's own engine has no KV report to check")
    return Check(pod["metadata"]["name"], rt.reported_tokens, reported, rt.engine, rounding(plan))


def needs_check(pod: dict[str, Any]) -> bool:
    """A worker pod whose containers are ready and whose gate is not yet decided."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conds = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return conds.get("ContainersReady") == "True" and conds.get(labels.KV_VERIFIED) not in ("True", "False")


def gate_condition(result: Check, now: str) -> dict[str, Any]:
    return {"type": labels.KV_VERIFIED, "status": "True" if result.ok else "False",
            "reason": KV_MATCHES_PLAN if result.ok else KV_BELOW_PLAN,
            "message": result.message(), "lastTransitionTime": now}


def report_url(pod: dict[str, Any], engine: str, port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}{REPORT_PATHS[engine]}" if ip else None


def recorded(pod: dict[str, Any]) -> dict[str, Any] | None:
    """What the pod's gate says, for status.engineKV: its name, verdict and the engine's number."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == labels.KV_VERIFIED and cond.get("status") in ("True", "False"):
            found = re.search(r"reports (\d+) KV tokens", cond.get("message") or "")
            return {"name": pod["metadata"]["name"], "verified": cond["status"] == "True",
                    "reportedTokens": int(found.group(1)) if found else None}
    return None


def verify(kube, fetch, pods: list[dict[str, Any]], plan: MemoryPlan, status: dict[str, Any]) -> dict[str, c.Verdict]:
    """Set each of ``pods``' readiness gate (the current plan's vllm/sglang workers) from the
    engine's own KV report (``fetch``: url -> body or None), record planned and reported tokens per
    pod in status.engineKV, and say when one fell short."""
    rt = plan.runtime
    for pod in pods:
        if not needs_check(pod):
            continue
        url = report_url(pod, rt.engine, HTTP_PORT)
        body = fetch(url) if url else None
        reported = None if body is None else reported_tokens(rt.engine, body)
        if reported is None:  # not serving its report yet: the next poll asks again
            continue
        condition = gate_condition(check(pod, plan, reported), now_iso())
        pod = kube.set_pod_condition(pod, condition) or pod
        pods = [pod if p["metadata"]["name"] == pod["metadata"]["name"] else p for p in pods]
    records = [r for r in map(recorded, pods) if r]
    status["engineKV"] = {"engine": rt.engine, "version": rt.version,
                          "plannedTokens": rt.reported_tokens, "pods": records}
    short = [r for r in records if not r["verified"]]
    if not short:
        return {}
    worst = min(short, key=lambda r: r["reportedTokens"] or 0)
    pod = next(p for p in pods if p["metadata"]["name"] == worst["name"])
    message = check(pod, plan, worst["reportedTokens"] or 0).message()
    problem = c.Verdict("True", c.KV_CACHE_BELOW_PLAN, message)
    return {c.DEGRADED: problem, c.READY: c.Verdict("False", c.KV_CACHE_BELOW_PLAN, message)}
