"""The command line that pins vLLM to a plan: every number the planner priced
(``planner.runtimes.vllm``), set by flag, read from the plan's ``runtime`` section.

Standard library only: the operator renders it into the worker pod.
"""

from __future__ import annotations

import json
from typing import Any

from . import MemoryPlan

# The flags the rendered command sets; runtime.extraArgs may not set them.
OWNED_FLAGS = (
    "--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size", "-tp",
    "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp", "--kv-cache-memory-bytes",
    "--gpu-memory-utilization", "--num-gpu-blocks-override", "--block-size", "--max-model-len",
    "--max-num-seqs", "--max-num-batched-tokens", "--speculative-config", "--kv-cache-dtype", "--dtype",
    "--max-cudagraph-capture-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
)

METHODS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "STANDALONE": "draft_model", "MTP": "mtp", "NGRAM": "ngram"}


def speculative_config(algorithm: str, draft_dir: str | None, proposals: int) -> dict[str, Any]:
    """vLLM's --speculative-config for the planned algorithm."""
    config: dict[str, Any] = {"method": METHODS[algorithm], "num_speculative_tokens": proposals}
    if algorithm == "NGRAM":
        # vLLM drafts only where a suffix of at least prompt_lookup_min tokens recurs (default 5).
        config.update(prompt_lookup_min=2, prompt_lookup_max=5)
    elif algorithm != "MTP" and draft_dir:
        config["model"] = draft_dir
    return config


def args(*, target_dir: str, served_name: str, draft_dir: str | None, algorithm: str, proposals: int,
         plan: MemoryPlan, context_length: int, max_running: int, chunk: int, graph_bs: int,
         kv_cache_dtype: str, dtype: str, port: int, prefix_cache: bool = True) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` arguments that pin every planned number."""
    rt = plan.runtime
    if rt is None or rt.kv_cache_memory_bytes is None or rt.block_size is None:
        raise ValueError("the plan was not priced for vLLM: it has no runtime.kvCacheMemoryBytes and blockSize")
    return [
        "--model", target_dir, "--served-model-name", served_name,
        "--host", "0.0.0.0", "--port", str(port),
        "--tensor-parallel-size", str(plan.tensor_parallel_size),
        "--kv-cache-memory-bytes", str(rt.kv_cache_memory_bytes),
        "--block-size", str(rt.block_size),
        "--max-model-len", str(context_length),
        "--max-num-seqs", str(max_running),
        "--max-num-batched-tokens", str(chunk),
        "--max-cudagraph-capture-size", str(graph_bs * (proposals + 1)),
        "--kv-cache-dtype", {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}.get(kv_cache_dtype, "auto"),
        "--dtype", rt.dtype or dtype,
        "--speculative-config", json.dumps(speculative_config(algorithm, draft_dir, proposals),
                                           separators=(",", ":")),
        "--enable-prefix-caching" if prefix_cache else "--no-enable-prefix-caching",
    ]
