"""Phase 2's measurement: how many KV token slots fit once every weight is resident.

The formula is the planner's ``kv_token_capacity``; only its inputs are measured here. On CUDA the
device memory is the free memory before the worker touched the GPU (NVML, as the planner reads
it), and the runtime term is the larger of the planned reserve and what is really in use besides
the weights (CUDA context, allocator slack). On CPU a budget (``--device-memory-gib``) stands in
for the device, so the same arithmetic runs and tests can check it exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...contract import kv_token_capacity


@dataclass(frozen=True)
class MemoryProfile:
    device: str
    device_memory_bytes: int
    mem_fraction_static: float
    target_weight_bytes: int
    draft_weight_bytes: int
    runtime_bytes: int
    target_bytes_per_token: int
    draft_bytes_per_token: int
    max_total_num_tokens: int
    kv_dtype: str = ""  # the K/V pools' storage dtype, as torch names it

    def as_dict(self) -> dict:
        return asdict(self)


def free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def profile_memory(
    device: torch.device,
    device_memory_bytes: int,
    mem_fraction_static: float,
    target_weight_bytes: int,
    draft_weight_bytes: int,
    runtime_bytes: int,
    target_bytes_per_token: int,
    draft_bytes_per_token: int,
    free_after_weights: int | None = None,
    kv_dtype: str = "",
) -> MemoryProfile:
    """``device_memory_bytes``: the budget (CPU) or the free memory measured before start-up (CUDA)."""
    runtime = runtime_bytes
    if free_after_weights is not None:
        in_use = device_memory_bytes - free_after_weights - target_weight_bytes - draft_weight_bytes
        runtime = max(runtime_bytes, in_use)
    tokens = kv_token_capacity(
        device_memory_bytes, mem_fraction_static, target_weight_bytes, draft_weight_bytes, runtime,
        target_bytes_per_token, draft_bytes_per_token,
    )
    return MemoryProfile(
        device.type, device_memory_bytes, mem_fraction_static, target_weight_bytes, draft_weight_bytes,
        runtime, target_bytes_per_token, draft_bytes_per_token, tokens, kv_dtype,
    )
