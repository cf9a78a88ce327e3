"""What a runner may ask of every model it serves, each with what a model without the feature does."""

from __future__ import annotations

import torch
from torch import nn


class ServedModel(nn.Module):
    def stack_experts(self) -> None:
        """After loading, on Triton: MoE models stack their expert weights for the expert kernel.
        A dense model has none."""

    def fuse_projections(self) -> None:
        """After loading: q, k, v and gate, up as one matrix product each, where the model has them."""

    def make_kv_pool(self, size: int, dtype: torch.dtype, device):
        """The KV pool of a model with its own cell layout (MLA's latent); None: the standard
        per-head K/V pool."""
        return None
