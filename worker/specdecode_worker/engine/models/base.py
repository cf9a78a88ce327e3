"""What a runner may ask of every model it serves, each with what a model without the feature does."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.group import SINGLE, TPGroup
from ..parallel.parallel_layers import lm_head


class ServedModel(nn.Module):
    def stack_experts(self) -> None:
        """After loading, on Triton: MoE models stack their expert weights for the expert kernel.
        A dense model has none."""

    def fuse_projections(self) -> None:
        """After loading: q, k, v and gate, up as one matrix product each, where the model has them."""

    def pack_weights(self) -> None:
        """After fusing, on CPU: projections held in oneDNN's layout (``kernels.cpu_linear``), where
        the model packs them. A model without it keeps ``F.linear`` on dense weights."""

    def make_kv_pool(self, size: int, dtype: torch.dtype, device):
        """The KV pool of a model with its own cell layout (MLA's latent); None: the standard
        per-head K/V pool."""
        return None


class CausalLM(ServedModel):
    """A decoder stack (``model``: ``embed_tokens``, ``layers``, ``norm``), its rotary embedding and
    its head: the embedding where the checkpoint ties them, else an ``lm_head`` of its own."""

    def __init__(self, config, model: nn.Module, rotary: nn.Module, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = model
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = lm_head(config.vocab_size, config.hidden_size, tp)
        self.rotary = rotary

    @property
    def num_kv_layers(self) -> int:
        return len(self.model.layers)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
