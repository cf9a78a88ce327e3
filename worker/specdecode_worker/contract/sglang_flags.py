"""The command line that pins SGLang to a plan: every number the planner priced
(``planner.runtimes.sglang``), set by flag, read from the plan's ``runtime`` section.

Standard library only: the operator renders it into the worker pod.
"""

from __future__ import annotations

from . import MemoryPlan

# The flags the rendered command sets; runtime.extraArgs may not set them.
OWNED_FLAGS = (
    "--model-path", "--model", "--served-model-name", "--host", "--port", "--tp-size", "--tp", "--dp-size",
    "--dp", "--pp-size", "--mem-fraction-static", "--max-total-tokens", "--page-size", "--context-length",
    "--max-running-requests", "--chunked-prefill-size", "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs",
    "--kv-cache-dtype", "--dtype", "--speculative-algorithm", "--speculative-draft-model-path",
    "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--disable-radix-cache",
)

ALGORITHMS = {"EAGLE": "EAGLE", "EAGLE3": "EAGLE3", "STANDALONE": "STANDALONE", "MTP": "NEXTN", "NGRAM": "NGRAM"}


def args(*, target_dir: str, served_name: str, draft_dir: str | None, algorithm: str, num_steps: int,
         proposals: int, plan: MemoryPlan, context_length: int, max_running: int, chunk: int, graph_bs: int,
         kv_cache_dtype: str, dtype: str, port: int, prefix_cache: bool = True) -> list[str]:
    """``python -m sglang.launch_server`` arguments that pin every planned number."""
    rt = plan.runtime
    if rt is None or rt.mem_fraction_static is None or rt.page_size is None:
        raise ValueError("the plan was not priced for SGLang: it has no runtime.memFractionStatic and pageSize")
    out = [
        "--model-path", target_dir, "--served-model-name", served_name,
        "--host", "0.0.0.0", "--port", str(port),
        "--tp-size", str(plan.tensor_parallel_size),
        "--mem-fraction-static", f"{rt.mem_fraction_static:.3f}",
        "--max-total-tokens", str(rt.reported_tokens),
        "--page-size", str(rt.page_size),
        "--context-length", str(context_length),
        "--max-running-requests", str(max_running),
        "--chunked-prefill-size", str(chunk),
        "--cuda-graph-max-bs-decode", str(graph_bs),
        "--kv-cache-dtype", kv_cache_dtype,
        "--dtype", rt.dtype or dtype,
        "--speculative-algorithm", ALGORITHMS[algorithm],
    ]
    if not prefix_cache:
        out.append("--disable-radix-cache")
    if algorithm == "NGRAM":
        out += ["--speculative-num-draft-tokens", str(proposals)]
    else:
        if draft_dir and algorithm != "MTP":
            out += ["--speculative-draft-model-path", draft_dir]
        out += ["--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(num_steps + 1)]
    return out
