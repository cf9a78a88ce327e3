"""Block-quantized fp8 linears, served as the official DeepSeek-V3 release stores them.

The checkpoint holds an E4M3 ``weight`` and a float32 ``weight_scale_inv`` per block of
``weight_block_size`` (128 x 128 as published): w = weight * scale of its block. The weights stay
fp8 in memory (what the planner prices from the headers: one byte per element plus the scales);
each forward dequantizes one layer's weight to the compute dtype and runs a dense matmul (torch
native: correct on any device, not an fp8 tensor-core kernel). Under tensor parallelism a shard
must cover whole blocks, so its scale rows (or columns) are the blocks of its weight rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InputError
from ..parallel.group import SINGLE, TPGroup
from ..parallel.parallel_layers import _mark

FP8_DTYPE = torch.float8_e4m3fn


def fp8_block_size(config, where: str) -> tuple[int, int] | None:
    """The (rows, columns) block of an fp8 block-quantized checkpoint; None when it is not quantized."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    block_ok = isinstance(block, (list, tuple)) and len(block) == 2
    if method != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or not block_ok:
        raise InputError(f"{where}: quantization_config {quant} is not served; the worker serves fp8 e4m3 "
                         "block-quantized weights (weight_block_size [rows, columns]) or unquantized ones")
    return int(block[0]), int(block[1])


def _stored(param: nn.Parameter) -> nn.Parameter:
    param.keep_checkpoint_dtype = True  # the loader keeps fp8 weights and float32 scales as stored
    return param


class Fp8BlockLinear(nn.Module):
    """``split``: None (whole on every rank), "column" (output rows split) or "row" (input columns split;
    ``reduce`` sums the partial outputs across ranks, else the caller does)."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], tp: TPGroup = SINGLE,
                 split: str | None = None, reduce: bool = True):
        super().__init__()
        self.block, self.tp = block, tp
        self.reduce = split == "row" and reduce and tp.size > 1
        out_local, in_local, dim = out_features, in_features, None
        if tp.size > 1 and split == "column":
            out_local, dim = out_features // tp.size, 0
        elif tp.size > 1 and split == "row":
            in_local, dim = in_features // tp.size, 1
        local = (out_local, in_local)
        if dim is not None and local[dim] % block[dim]:
            what = "rows" if dim == 0 else "columns"
            raise InputError(f"--tp {tp.size}: a shard of {local[dim]} {what} does not cover whole fp8 blocks of "
                             f"{block[dim]}; use a tensor-parallel size that keeps them whole")
        full_scale = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        self.weight = _stored(nn.Parameter(torch.empty(local, dtype=FP8_DTYPE), requires_grad=False))
        self.weight_scale_inv = _stored(nn.Parameter(
            torch.empty(math.ceil(out_local / block[0]), math.ceil(in_local / block[1]), dtype=torch.float32),
            requires_grad=False))
        if dim is not None:
            start = tp.rank * local[dim]
            _mark(self.weight, tp, dim, start, local[dim], (out_features, in_features))
            _mark(self.weight_scale_inv, tp, dim, start // block[dim], local[dim] // block[dim], full_scale)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.weight.shape
        scale = self.weight_scale_inv.repeat_interleave(self.block[0], 0)[:rows]
        scale = scale.repeat_interleave(self.block[1], 1)[:, :cols]
        return (self.weight.float() * scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.dense_weight(x.dtype))
        return self.tp.all_reduce(y) if self.reduce else y


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight in the compute dtype, whether stored dense or fp8."""
    return linear.dense_weight(dtype) if isinstance(linear, Fp8BlockLinear) else linear.weight
