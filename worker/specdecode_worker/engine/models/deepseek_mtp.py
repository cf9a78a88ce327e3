"""DeepSeek-V3's multi-token-prediction (NextN) layer as a draft model.

One draft step at position i reads the token at i + 1 and the target's hidden state at i:
``h = eh_proj(concat(enorm(embed(token)), hnorm(hidden)))``, then the decoder block (MLA over the
draft's own one-layer latent pool, MoE or dense as its index says), then ``shared_head.norm``; the
logits come from the target's lm_head. Later steps of a chain feed back the layer's own output as
the hidden state (as SGLang and vLLM do); the target's hidden state is its final, normalised one.

Weights load as published: ``model.layers.{num_hidden_layers}.*`` of the target's checkpoint. The
checkpoint's copies of ``embed_tokens`` and ``shared_head.head`` are not loaded: the target's
embedding and lm_head serve, so they are resident once, as the planner counts them.

Under tensor parallelism t the layer shards as the planner prices it (``checkpoint.per_gpu_bytes``):
the decoder block as a target layer; ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm``
whole on every rank. Its inputs (the target's normalised hidden state, the embedding after its
all-reduce) and its output (after the block's all-reduces) are whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import InputError
from ..forward_batch import ForwardBatch
from ..memory.mla_pool import MLATokenToKVPool
from ..parallel.group import SINGLE, TPGroup
from .base import ServedModel
from .deepseek_v3 import DecoderLayer, Linears, MLARotary, MoE, check_moe_splits, stack_layer_experts
from .llama import RMSNorm

# Tensors of the NextN layer that duplicate the target's (served by the target, loaded once).
SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class NextNLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)  # replicated, bf16 in the release
        # The block's own K/V live at layer 0 of the draft's one-layer pool.
        linears = Linears(config, tp)
        block = DecoderLayer(config, layer_id, linears, kv_layer=0)
        self.self_attn, self.mlp = block.self_attn, block.mlp
        self.input_layernorm, self.post_attention_layernorm = block.input_layernorm, block.post_attention_layernorm
        self.shared_head = SharedHead(h, eps)

    def block(self, x, cos, sin, fb, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, fb, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Layers(nn.Module):
    """``model.layers.{index}`` holds the NextN layer, so parameter names equal the checkpoint's."""

    def __init__(self, index: int, layer: NextNLayer):
        super().__init__()
        self.layers = nn.ModuleDict({str(index): layer})


class DeepseekMTP(ServedModel):
    sliding_window = None

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        nextn = getattr(config, "num_nextn_predict_layers", None) or 0
        if nextn != 1:
            raise InputError(f"config.json: num_nextn_predict_layers is {nextn}; MTP drafting serves exactly one "
                             "NextN layer (as DeepSeek-V3/R1 publish)")
        if tp.size > 1:
            check_moe_splits(config, tp.size, "config.json")
        self.config = config
        self.tp = tp
        self.index = config.num_hidden_layers
        self.model = _Layers(self.index, NextNLayer(config, self.index, tp))
        self.rotary = MLARotary(config)

    @property
    def layer(self) -> NextNLayer:
        return self.model.layers[str(self.index)]

    @property
    def num_kv_layers(self) -> int:
        return 1

    def stack_experts(self) -> None:
        """After loading: stacked expert weights for the Triton expert kernel in CUDA graphs."""
        if isinstance(self.layer.mlp, MoE):
            stack_layer_experts(self.layer.mlp)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Everything but the NextN layer is the target's; so are the layer's embedding and head copies."""
        prefix = f"model.layers.{self.index}."
        return not name.startswith(prefix) or name[len(prefix):] in SHARED_WITH_TARGET

    def make_kv_pool(self, size: int, dtype: torch.dtype, device) -> MLATokenToKVPool:
        c = self.config
        return MLATokenToKVPool(size, 1, c.kv_lora_rank, c.qk_rope_head_dim, dtype, device)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, from_target: bool, fb: ForwardBatch,
                backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed hidden for the logits, the hidden the next chained step reads): both the
        ``shared_head.norm`` output. ``from_target`` is part of the draft-head protocol (unused)."""
        layer = self.layer
        x = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary(fb.positions, x.dtype)
        out = layer.shared_head.norm(layer.block(x, cos, sin, fb, backend))
        return out, out
