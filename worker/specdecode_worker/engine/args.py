"""What the engine is asked to serve: the models, the algorithm and the sizes the plan pinned."""

from __future__ import annotations

from dataclasses import dataclass

# The speculation policy's modes (speculation/spec_policy.py): K drafts every round, or as measured.
ADAPTIVE, FIXED = "adaptive", "fixed"
MODES = (ADAPTIVE, FIXED)


@dataclass
class EngineArgs:
    target: str
    draft: str | None = None
    algorithm: str = "NONE"
    device: str = "cpu"
    dtype: str | None = None
    device_memory_bytes: int | None = None  # CPU budget; on CUDA measured
    mem_fraction_static: float = 0.9
    runtime_bytes: int = 0
    context_len: int = 2048
    min_kv_tokens: int = 0  # floor: below it the worker refuses to start
    max_total_tokens: int | None = None  # cap from the plan's pinned numbers
    max_running_requests: int = 8
    cuda_graph_max_bs: int = 0
    num_draft_tokens: int = 4
    speculative_num_steps: int | None = None  # EAGLE draft steps per round (default: num_draft_tokens)
    speculative_eagle_topk: int = 1  # EAGLE: 1 drafts a chain, more a tree of num_draft_tokens nodes
    ngram_max: int = 4
    ngram_min: int = 1  # the shortest suffix an n-gram lookup drafts from
    planned_tokens: int | None = None
    draft_quantization: str | None = None  # "int8": dynamic int8 draft linears (cpu)
    kv_cache_dtype: str = "auto"  # auto (the compute dtype), fp8_e4m3 or fp8_e5m2: every model's K/V pool
    spec_policy: str = FIXED  # fixed: K drafts every round; adaptive: see speculation/spec_policy.py
    chunked_prefill_size: int = 0  # most prompt tokens per prefill pass (the plan's chunkedPrefillSize); 0: no cap
    # Admission reserves this share of the tokens a request may still generate (1.0: the worst case,
    # prompt + max_tokens up front); an estimate that proves short is paid for by retraction.
    new_token_ratio: float = 0.5
    prefix_cache: bool = True  # finished and prefilled requests leave their KV for later prompts to reuse
    planned_dynamic_bytes: int | None = None  # the plan's reserve.dynamicBytes, checked by phase 3's warm-up
