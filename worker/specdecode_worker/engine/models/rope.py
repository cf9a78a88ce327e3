"""Rotary position embedding, with the scaled variants taken from transformers' rope functions."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.layer_kernels import apply_rotary


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inv_freq_and_scale(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config)
    if params["rope_type"] == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv.float(), float(scale)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self._config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.reset("cpu")

    def reset(self, device) -> None:
        """(Re)compute the frequencies on ``device``; a model built on the meta device needs this."""
        with torch.device("cpu"):
            inv, self.scale = inv_freq_and_scale(self._config, self.head_dim)
        self.inv_freq = inv.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    @staticmethod
    def apply(q, k, cos, sin):
        """``q`` and ``k`` rotated (one launch on a GPU: ``layer_kernels.apply_rotary``)."""
        return apply_rotary(q, k, cos, sin)
