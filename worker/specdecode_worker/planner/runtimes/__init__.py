"""Other serving engines as the worker runtime: how each one is priced and pinned to the plan.

Each engine sizes its KV pool by its own arithmetic, so the plan is made once by this project's
rules (weights, both KV pools, reserves) and then restated in each engine's terms: the flags that
pin it and the tokens the engine will report. One module per engine holds its rules, read from a
named version of its source. Standard library only: the operator, which has no torch, imports it.
"""

from __future__ import annotations

from typing import Any

from ...contract import DEFAULT_ENGINE, ENGINES, sglang_flags, vllm_flags
from . import sglang, vllm

FLAGS = {"vllm": vllm_flags, "sglang": sglang_flags}

# What each engine can serve of what the planner plans. Both engines support every algorithm as a
# chain of proposals; only this project's engine verifies an EAGLE tree (topK > 1) and adapts the
# draft length to load.
SUPPORTED_ALGORITHMS = {
    "specdecode": ("EAGLE", "EAGLE3", "STANDALONE", "MTP", "NGRAM"),
    "vllm": ("EAGLE", "EAGLE3", "STANDALONE", "MTP", "NGRAM"),
    "sglang": ("EAGLE", "EAGLE3", "STANDALONE", "MTP", "NGRAM"),
}


def check_engine(engine: str, algorithm: str, top_k: int = 1, nodes: int = 1) -> str | None:
    """Why ``engine`` cannot serve this shape, in the SDD's terms; None when it can."""
    if engine not in ENGINES:
        return f"runtime.engine must be one of {', '.join(ENGINES)}, got {engine!r}"
    if algorithm not in SUPPORTED_ALGORITHMS[engine]:
        return f"runtime.engine {engine} does not serve draft.algorithm {algorithm}"
    if engine != DEFAULT_ENGINE and top_k > 1:
        return (f"runtime.engine {engine}: draft.topK {top_k} asks for an EAGLE tree, which only the specdecode "
                "engine verifies; set draft.topK to 1 or runtime.engine to specdecode")
    if engine != DEFAULT_ENGINE and nodes > 1:
        return (f"runtime.engine {engine}: the plan spreads a replica over {nodes} nodes, which only the specdecode "
                "engine runs (as a LeaderWorkerSet group); use GPUs with more memory, a larger gpu.perNode, or "
                "runtime.engine specdecode")
    return None


def price(engine: str, plan: dict[str, Any], dtype: str, transient_bytes: int = 0) -> dict[str, Any]:
    """The plan restated for ``engine`` (unchanged for specdecode's own engine).

    ``dtype``: the compute dtype the plan priced, which the engine is told rather than left to
    resolve ``auto`` its own way (vLLM casts a float32 checkpoint to 16 bits).
    ``transient_bytes``: per GPU, the draft's copies of target tensors that SGLang holds while it
    sizes its pool (the planner reads them from the checkpoint).
    """
    if engine == DEFAULT_ENGINE:
        return plan
    priced = sglang.price(plan, transient_bytes) if engine == "sglang" else vllm.price(plan)
    priced["runtime"]["dtype"] = dtype
    return priced


def owned_flags(engine: str) -> tuple[str, ...]:
    """Flags the operator sets from the plan and the spec, which runtime.extraArgs may not set."""
    return FLAGS[engine].OWNED_FLAGS if engine in FLAGS else ()
