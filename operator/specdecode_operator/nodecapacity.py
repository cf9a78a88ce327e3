"""GPUs per node for the planner: the spec's ``gpu.perNode``, else what the nodes offer, else 8.

Read once per planner run, not part of the plan key: the plan records the ``nodesPerReplica``
it chose, and a node pool that changes later (a node cordoned, one more added) does not re-plan
and roll a serving workload. A plan whose pods no longer fit any node is reported as
PlanExceedsNodeGPUs, which names the ``gpu.perNode`` that re-plans for the nodes at hand.

``NodeCapacity`` reads the nodes for both: the planner's GPUs per node and that check.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from specdecode_worker.contract import DEFAULT_GPUS_PER_NODE

from . import kube as k8s
from .kube import ApiError, Kube
from .observe import max_node_gpus
from .spec import SpecView

log = logging.getLogger(__name__)
# Nodes change rarely; one list serves every SDD for this long.
NODE_CACHE_SECONDS = 20.0

FROM_SPEC, FROM_NODES, FROM_DEFAULT = "spec", "nodes", "default"


@dataclass(frozen=True)
class GpusPerNode:
    """``count`` for the planner's --gpus-per-node; ``source`` and ``note`` say where it came from."""

    count: int
    source: str
    note: str = ""  # for the Planned condition; empty when the spec set it

    @property
    def planner_flag(self) -> int | None:
        """The value to pass to the planner; None leaves the planner's own default (8)."""
        return None if self.source == FROM_DEFAULT else self.count


def gpus_per_node(spec_per_node: int | None, product: str | None, nodes: list[dict[str, Any]] | None,
                  unreadable: str = "") -> GpusPerNode:
    """The spec's value if set; else the largest allocatable nvidia.com/gpu among schedulable nodes
    of ``product`` (any node without a product); else the default.

    ``nodes`` is None when they could not be read; ``unreadable`` then says why.
    """
    if spec_per_node is not None:
        return GpusPerNode(int(spec_per_node), FROM_SPEC)
    where = f"nodes labelled nvidia.com/gpu.product={product}" if product else "nodes"
    if nodes is None:
        return GpusPerNode(DEFAULT_GPUS_PER_NODE, FROM_DEFAULT,
                           f"GPUs per node: {DEFAULT_GPUS_PER_NODE}, the default ({unreadable or 'nodes not read'}); "
                           "set gpu.perNode if your nodes hold fewer")
    best = max_node_gpus(nodes, product)
    if not best:  # none yet (a cluster autoscaler may add them): the default
        return GpusPerNode(DEFAULT_GPUS_PER_NODE, FROM_DEFAULT,
                           f"GPUs per node: {DEFAULT_GPUS_PER_NODE}, the default (no schedulable {where} offer "
                           "nvidia.com/gpu); set gpu.perNode if your nodes hold fewer")
    return GpusPerNode(best, FROM_NODES,
                       f"GPUs per node: {best}, the most nvidia.com/gpu allocatable on schedulable {where}")


class NodeCapacity:
    """What the cluster's nodes offer, read through ``kube`` (one list shared for a while), or
    nothing when the operator may not read them."""

    def __init__(self, kube: Kube, check_nodes: bool = True, clock: Callable[[], float] = time.time):
        self.kube = kube
        self.check_nodes = check_nodes
        self.clock = clock
        self._forbidden = False
        self._cache: tuple[float, list[dict[str, Any]]] | None = None

    def max_gpus(self, view: SpecView) -> int | None:
        """The most GPUs of ``gpu.product`` one schedulable node offers; None when nodes are not read."""
        nodes, _ = self._readable()
        return None if nodes is None else max_node_gpus(nodes, view.gpu_product)

    def per_node(self, view: SpecView) -> GpusPerNode:
        """GPUs per node for the planner (``gpus_per_node``)."""
        if view.gpu_per_node is not None:  # no need to read nodes
            return gpus_per_node(view.gpu_per_node, view.gpu_product, None)
        nodes, why_not = self._readable()
        return gpus_per_node(None, view.gpu_product, nodes, why_not)

    def _readable(self) -> tuple[list[dict[str, Any]] | None, str]:
        """The nodes, or None and why they are not read."""
        if not self.check_nodes:
            return None, "the operator runs with --no-node-check"
        if not self._forbidden:
            try:
                return self._list(), ""
            except ApiError as exc:
                if exc.status != 403:
                    raise
                # A namespaced install without node access: the scheduler reports misfits instead.
                log.info("nodes are not readable; GPUs per node come from gpu.perNode or the default, and "
                         "PlanExceedsNodeGPUs is left to the scheduler's messages")
                self._forbidden = True
        return None, "the operator may not list nodes: the chart's rbac.readNodes grants it"

    def _list(self) -> list[dict[str, Any]]:
        now = self.clock()
        if self._cache is None or now - self._cache[0] > NODE_CACHE_SECONDS:
            self._cache = (now, self.kube.list(k8s.NODES))
        return self._cache[1]
