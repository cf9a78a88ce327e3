"""The SDDs' status as Prometheus metrics: conditions, phase, replica counts and hub downloads.

The reconciler records each SDD's latest status here; the health endpoint renders it at scrape
time in the Prometheus text format (written by hand: the operator image carries no metrics
library). Every condition is one series per SDD and type, valued 1 when True and 0 otherwise,
with its status and reason as labels, so an alert can say why.
"""

from __future__ import annotations

import threading
from typing import Any

PHASES = ("Pending", "Planning", "Deploying", "Ready", "Degraded", "Failed")


class StatusBook:
    """The latest status the operator wrote for each SDD it tracks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[tuple[str, str], dict[str, Any]] = {}

    def record(self, namespace: str, name: str, status: dict[str, Any] | None) -> None:
        with self._lock:
            self._status[(namespace, name)] = dict(status or {})

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._status.pop((namespace, name), None)

    def items(self) -> list[tuple[tuple[str, str], dict[str, Any]]]:
        with self._lock:
            return sorted(self._status.items())


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    # Integers exactly (bytes reach 1e11; %g keeps 6 digits), anything else as %g.
    number = str(value) if isinstance(value, int) else f"{value:g}"
    return f"{name}{{{inner}}} {number}"


def render(book: StatusBook) -> str:
    """The text exposition format (version 0.0.4)."""
    entries = book.items()
    conditions, phases, replicas, ready, done, total = [], [], [], [], [], []
    tracked = [f"specdecode_sdd_tracked {len(entries)}"]
    for (namespace, name), status in entries:
        sdd = {"namespace": namespace, "sdd": name}
        for cond in status.get("conditions") or []:
            labels = sdd | {"type": cond.get("type", ""), "status": cond.get("status", ""),
                            "reason": cond.get("reason", "")}
            conditions.append(_sample("specdecode_sdd_condition", labels, 1 if cond.get("status") == "True" else 0))
        phase = status.get("phase", "")
        for p in PHASES:
            phases.append(_sample("specdecode_sdd_phase", sdd | {"phase": p}, 1 if p == phase else 0))
        replicas.append(_sample("specdecode_sdd_replicas", sdd, status.get("replicas", 0)))
        ready.append(_sample("specdecode_sdd_ready_replicas", sdd, status.get("readyReplicas", 0)))
        for model in status.get("models") or []:  # a hub cache: download progress per model
            labels = sdd | {"repo": model.get("repo", ""), "commit": model.get("commit", "")}
            done.append(_sample("specdecode_sdd_model_downloaded_bytes", labels, model.get("bytesDone", 0)))
            total.append(_sample("specdecode_sdd_model_bytes", labels, model.get("bytesTotal", 0)))
    families = [
        ("specdecode_sdd_condition", "gauge", "1 when the SDD's condition of this type is True, else 0", conditions),
        ("specdecode_sdd_phase", "gauge", "1 for the SDD's current phase", phases),
        ("specdecode_sdd_replicas", "gauge", "worker pods of the SDD's current rollout", replicas),
        ("specdecode_sdd_ready_replicas", "gauge", "worker pods that are Ready", ready),
        ("specdecode_sdd_model_downloaded_bytes", "gauge",
         "bytes of a hub model downloaded into the SDD's cache (its completed parts)", done),
        ("specdecode_sdd_model_bytes", "gauge", "bytes of a hub model's files at the planned commit", total),
        ("specdecode_sdd_tracked", "gauge", "SDDs the operator tracks", tracked),
    ]
    lines = []
    for name, kind, doc, samples in families:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"
