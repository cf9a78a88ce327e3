"""Shared inputs for operator tests: the repository's example SDDs and MemoryPlans that keep the contract."""

from __future__ import annotations

from pathlib import Path

import yaml

from specdecode_worker.contract import GIB, kv_token_capacity, validate_plan

ROOT = Path(__file__).resolve().parents[1]


def example(name: str = "spec-deploy.yaml") -> dict:
    """An example SpecDecodeDeployment as the API server would hand it over (namespace, uid, generation)."""
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update(namespace="ns", uid="u-1", generation=1)
    return body


def make_plan(tp=1, fits=True, target=16_060_522_496, draft=849_763_584, f=0.83, g=85_520_809_984):
    """A MemoryPlan that satisfies the contract's identity (built with the planner's own formula)."""
    t_cell, d_cell = 131_072 // tp, 4_096 // tp
    tokens = kv_token_capacity(g, f, target // tp, draft // tp, GIB, t_cell, d_cell)
    return validate_plan({
        "apiVersion": "specdecode.io/v1alpha1", "kind": "MemoryPlan", "fits": fits, "algorithm": "EAGLE3",
        "target": "t", "draft": "d", "tensorParallelSize": tp, "gpuMemoryBytes": g, "memFractionStatic": f,
        "weights": {"targetBytes": target // tp, "draftBytes": draft // tp},
        "kvCache": {"targetBytesPerToken": t_cell, "draftBytesPerToken": d_cell, "draftNumLayers": 1,
                    "maxTotalNumTokens": tokens},
        "reserve": {"runtimeBytes": GIB, "dynamicBytes": 2 * GIB, "chunkedPrefillSize": 8192,
                    "cudaGraphMaxBs": 256, "maxRunningRequests": 64},
        "shortfallBytes": 0 if fits else 5 * GIB, "minMemFractionStatic": 0.3,
        "legacy": {"maxTotalNumTokens": tokens, "peakBytes": g}, "layerRatio": {"maxTotalNumTokens": tokens},
        "message": "fits" if fits else "does not fit",
    })
