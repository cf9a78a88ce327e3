"""GPUs per node for the planner: the spec's ``gpu.perNode``, else what the nodes offer, else 8.

Read once per planner run, not part of the plan key: the plan records the ``nodesPerReplica``
it chose, and a node pool that changes later (a node cordoned, one more added) does not re-plan
and roll a serving workload. A plan whose pods no longer fit any node is reported as
PlanExceedsNodeGPUs, which names the ``gpu.perNode`` that re-plans for the nodes at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdecode_worker.contract import DEFAULT_GPUS_PER_NODE

from .observe import max_node_gpus

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
