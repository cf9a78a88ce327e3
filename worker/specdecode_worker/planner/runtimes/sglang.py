"""SGLang's sizing rules, read from SGLang 0.5.23 (``contract.sglang_flags`` pins SGLang to them).

SGLang sizes its KV pool after loading every weight (``KVCacheConfigurator._profile_available_bytes``):

    rest = free_after_load - free_before_load * (1 - mem_fraction_static)
    max_total_num_tokens = rest // cell    (then capped by --max-total-tokens, page-aligned)

``free_before_load`` is the GPU's memory less what the CUDA context and communicators took, so
``rest = free_before_load * f - weights - transient``. Its cell for an EAGLE, EAGLE3,
STANDALONE or NextN (MTP) draft is the target's scaled by the layer ratio, ``int(cell * (1 + draft_layers /
target_layers))`` (``DefaultPoolConfigurator``), which assumes the draft's layers are as wide as
the target's. The draft's pool is then allocated with the same token count at its real width.
The plan therefore sizes tokens by the larger of the two cells, so both the engine's arithmetic
and the memory really allocated fit, and pins the count with --max-total-tokens. The fraction is
set so that SGLang's own arithmetic reaches that count: ``transient`` is what SGLang holds while
it sizes the pool and frees afterwards (the draft's copies of the target's embedding and
lm_head, SGLang issue #36452), priced by the planner from the checkpoint.

SGLang reports ``max_total_num_tokens`` in ``/server_info`` and as the
``sglang:max_total_num_tokens`` gauge.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from ...contract import GIB

VERSION = "0.5.23"
PAGE_SIZE = 1  # token-granular pages, as this project's engine; pinned with --page-size
# SGLang's CUDA graphs and activations live in the (1 - f) share it leaves; nothing beyond the
# plan's dynamic reserve is set aside here, which a GPU run has yet to check (docs/engines.md).
EXTRA_RESERVE_BYTES = 0



def _ceil3(x: float) -> float:
    return math.ceil(x * 1000 - 1e-9) / 1000


def price(plan: dict[str, Any], transient_bytes: int = 0) -> dict[str, Any]:
    """The plan restated in SGLang's terms: the token count both cells fit, the fraction that
    makes SGLang's arithmetic reach it, and the count SGLang will report."""
    out = copy.deepcopy(plan)
    kv, w = out["kvCache"], out["weights"]
    g, f = out["gpuMemoryBytes"], out["memFractionStatic"]
    cell = kv["targetBytesPerToken"] + kv["draftBytesPerToken"]
    ratio = (out.get("layerRatio") or {}).get("bytesPerToken") or cell  # plans made before it lack it
    sglang_cell = cell if out["algorithm"] == "NGRAM" else ratio
    runtime = out["reserve"]["runtimeBytes"]
    weights = w["targetBytes"] + w["draftBytes"]
    budget = g * f - weights - runtime - transient_bytes - EXTRA_RESERVE_BYTES
    tokens = max(0, min(kv["maxTotalNumTokens"], int(budget // max(cell, sglang_cell))))
    tokens -= tokens % PAGE_SIZE
    # SGLang splits the memory free before loading (the device's, less the runtime reserve).
    pre_load = g - runtime
    fraction = _ceil3((weights + transient_bytes + tokens * sglang_cell) / pre_load) if pre_load > 0 else 1.0
    kv["maxTotalNumTokens"] = tokens
    kv["poolBytes"] = tokens * cell
    out["memFractionStatic"] = (tokens * cell + weights + runtime) / g
    out["runtime"] = {"engine": "sglang", "version": VERSION, "reportedTokens": tokens,
                      "extraReserveBytes": EXTRA_RESERVE_BYTES + transient_bytes,
                      "memFractionStatic": fraction, "pageSize": PAGE_SIZE}
    need = max(kv["minTokens"], 1)
    if out["fits"] and (tokens < need or fraction >= 1):
        out["fits"] = False
        out["shortfallBytes"] = max(1, (need - tokens) * max(cell, sglang_cell))
    where = (f"SGLang {VERSION}: --mem-fraction-static {fraction:.3f} --max-total-tokens {tokens} (need {need})"
             + (f"; SGLang holds {transient_bytes / GIB:.2f} GiB of draft copies while it sizes the pool"
                if transient_bytes else ""))
    out["message"] = where if out["fits"] else f"{where}; {out['message']}"
    return out
