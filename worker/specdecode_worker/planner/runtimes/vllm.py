"""vLLM's sizing rules, read from vLLM 0.32.0 (``contract.vllm_flags`` pins vLLM to them).

vLLM sizes one KV byte budget for every attention layer it runs, the draft's included
(``get_kv_cache_config_from_groups``: ``num_blocks = budget // bytes_per_block``, where a block
holds ``block_size`` tokens of every layer). ``--kv-cache-memory-bytes`` sets that budget directly
and skips vLLM's memory profiling (``Worker.determine_available_memory``), so the plan fixes it:
the planned tokens rounded down to whole blocks, times the plan's KV bytes per token.

vLLM reports ``kv_cache_size_tokens`` (log line "KV cache size", metric
``vllm:cache_config_info``) as ``num_blocks / cdiv(max_model_len, block_size) * max_model_len``
(``get_kv_cache_capacity``); one block is its null block and never holds a token.
"""

from __future__ import annotations

import copy
from typing import Any

from ...contract import GIB

VERSION = "0.32.0"
# Pinned with --block-size so the count does not depend on which attention backend vLLM picks:
# 32 suits FlashAttention and FlashInfer (multiples of 16) and vLLM's CPU kernels (multiples of
# 32); MLA kernels (FlashMLA) need 64.
BLOCK_SIZE = 32
MLA_BLOCK_SIZE = 64
# vLLM's own memory beyond this project's dynamic reserve: torch.compile's piecewise CUDA graphs
# (one pool shared by every capture size) and its sampler's warm-up. An allowance, not a
# measurement: vLLM profiles these at start-up only when the KV budget is not given, and no GPU has
# checked this number yet (docs/engines.md).
EXTRA_RESERVE_BYTES = GIB



def block_size(algorithm: str) -> int:
    return MLA_BLOCK_SIZE if algorithm == "MTP" else BLOCK_SIZE


def reported_tokens(num_blocks: int, block: int, max_model_len: int) -> int:
    """vLLM's ``kv_cache_size_tokens`` for one full-attention group, with its float arithmetic."""
    per_request = -(-max_model_len // block)
    return int(num_blocks / per_request * max_model_len)


def price(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan restated in vLLM's terms: whole blocks, the byte budget that gives them, and the
    tokens vLLM will report. A plan that fits only without vLLM's allowance does not fit."""
    out = copy.deepcopy(plan)
    kv, w = out["kvCache"], out["weights"]
    g, f = out["gpuMemoryBytes"], out["memFractionStatic"]
    cell = kv["targetBytesPerToken"] + kv["draftBytesPerToken"]
    static = w["targetBytes"] + w["draftBytes"] + out["reserve"]["runtimeBytes"]
    available = max(0, min(kv["maxTotalNumTokens"], int((g * f - static - EXTRA_RESERVE_BYTES) // cell)))
    block = block_size(out["algorithm"])
    blocks = available // block
    pool = blocks * block * cell
    context = kv.get("contextLength") or kv["minTokens"]
    usable = max(0, blocks - 1) * block  # the null block holds no token
    kv["maxTotalNumTokens"] = blocks * block
    kv["poolBytes"] = pool
    out["memFractionStatic"] = (pool + static) / g
    out["runtime"] = {"engine": "vllm", "version": VERSION,
                      "reportedTokens": reported_tokens(blocks, block, context),
                      "extraReserveBytes": EXTRA_RESERVE_BYTES, "kvCacheMemoryBytes": pool,
                      "blockSize": block, "numBlocks": blocks}
    need = max(kv["minTokens"], 1)
    if out["fits"] and usable < need:
        out["fits"] = False
        out["shortfallBytes"] = (need - usable + block) * cell
    where = (f"vLLM {VERSION}: --kv-cache-memory-bytes {pool} gives {blocks} blocks of {block} tokens, "
             f"{usable} usable KV tokens (need {need}) beside a {EXTRA_RESERVE_BYTES / GIB:.2f} GiB graph allowance")
    out["message"] = where if out["fits"] else f"{where}; {out['message']}"
    return out
