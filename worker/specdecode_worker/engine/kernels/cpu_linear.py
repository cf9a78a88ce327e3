"""Linear layers whose weights are packed once into oneDNN's blocked layout, for CPU serving.

``F.linear`` on CPU hands oneDNN a row-major weight, which it reorders into its blocked layout on
every call. Reordering once at load time halves a decode step's matrix products on this project's
2-core test machine (SmolLM2-135M's projections at 8 rows: 470 to 250 us per layer in bf16, and
about as much in fp32; docs/benchmarks.md). The layout does not depend on the batch: one packing
serves every row count.

A weight is packed only where both its dimensions are multiples of ``ALIGN``. oneDNN pads a blocked
dimension to its block size (16 to 64), so an aligned weight takes exactly its dense bytes and the
plan's weight term stays exact; an unaligned one stays dense. Packing replaces the dense tensor,
so a weight shared with another module (a tied embedding) is never packed: it would be held twice.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..parallel.parallel_layers import ColumnParallelLinear, FusedLinear

PACKING_ENV = "SPECDECODE_CPU_PACKING"  # "0": dense weights through F.linear (the reference)
ALIGN = 64
BATCH_HINT = 16  # oneDNN's row-count hint; 4 to 64 measured alike here, 1 was slower from 4 rows up


def cpu_packing() -> bool:
    return os.environ.get(PACKING_ENV, "1") != "0"


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0 and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` with ``weight`` held packed. ``sizes`` (a fused layer's parts)
    is kept for callers that split the output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None):
        super().__init__()
        if not can_pack(weight):
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} cannot be packed")
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()  # the packed copy's size: aligned, so unpadded
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if sizes is not None:
            self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_bytes(module: nn.Module) -> int:
    """Bytes of every packed weight in ``module`` (they are neither parameters nor buffers)."""
    return sum(m.nbytes for m in module.modules() if isinstance(m, PackedLinear))


PLAIN_PRODUCTS = (nn.Linear, ColumnParallelLinear, FusedLinear)  # forward is F.linear(x, weight, bias), no more


def pack(linear: nn.Module) -> nn.Module:
    """``linear`` as a ``PackedLinear`` where it is a plain product whose weight can be packed;
    otherwise ``linear`` itself. The caller passes only layers whose weight nothing else holds."""
    if type(linear) not in PLAIN_PRODUCTS or not can_pack(linear.weight):
        return linear
    return PackedLinear(linear.weight, linear.bias, getattr(linear, "sizes", None))
