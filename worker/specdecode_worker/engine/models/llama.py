"""Llama-family decoder (Llama, Qwen2, Mistral) whose attention reads and writes the paged pools.

Module names equal the Hugging Face parameter names, so safetensors load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from ..kernels.cpu_linear import pack
from ..kernels.layer_kernels import rms_norm, silu_mul
from ..parallel.group import SINGLE, TPGroup
from ..parallel.parallel_layers import (
    column_linear,
    fuse_linears,
    kv_head_block,
    parallel_logits,
    row_linear,
    vocab_embedding,
)
from .base import CausalLM
from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one launch on a GPU."""
        return rms_norm(x, self.weight, self.eps, residual=residual)


def _qkv_bias(config) -> bool:
    # Qwen2 always has q/k/v bias; Llama and Mistral only with attention_bias.
    return config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))


def sliding_window(config) -> int | None:
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


class Attention(nn.Module):
    """Under tensor parallelism t: heads / t query heads and max(1, kv_heads / t) KV heads per rank."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads = heads // tp.size
        kv_first, self.num_kv_heads = kv_head_block(kv_heads, tp)
        self.scaling = self.head_dim**-0.5
        bias = _qkv_bias(config)
        h, d = config.hidden_size, self.head_dim
        self.q_proj = column_linear(h, heads * d, bias, tp)
        kv_rows = dict(start=kv_first * d, length=self.num_kv_heads * d)
        self.k_proj = column_linear(h, kv_heads * d, bias, tp, **kv_rows)
        self.v_proj = column_linear(h, kv_heads * d, bias, tp, **kv_rows)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = row_linear(heads * d, h, o_bias, tp)
        self.qkv_proj = None  # q, k and v in one product, once loaded (``fuse_projections``)

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, fb: ForwardBatch, backend) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv_proj is not None:  # views of one output: the kernels read them in place
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        o = backend.forward(q, k, v, self.layer_id, fb, self.scaling)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = column_linear(h, i, bias, tp)
        self.up_proj = column_linear(h, i, bias, tp)
        self.down_proj = row_linear(i, h, bias, tp)
        self.gate_up_proj = None  # gate and up in one product, once loaded (``fuse_projections``)

    def fuse_projections(self) -> None:
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = Attention(config, layer_id, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, fb, backend):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, fb, backend)
        h, x = self.post_attention_layernorm.add_and_norm(x, attended)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__(config, LlamaModel(config, tp), RotaryEmbedding(config), tp)
        self.sliding_window = sliding_window(config)

    def fuse_projections(self) -> None:
        """After loading: each layer's q, k, v and its gate, up as one matrix product each."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def pack_weights(self) -> None:
        """Each layer's projections packed. The embedding and the head are not: a tied head shares
        the embedding's tensor, and an untied one is read as a weight by the draft heads."""
        for layer in self.model.layers:
            for block in (layer.self_attn, layer.mlp):
                for name, child in list(block.named_children()):
                    setattr(block, name, pack(child))

    def forward(self, fb: ForwardBatch, backend, logit_rows: torch.Tensor, capture=None) -> torch.Tensor:
        """Returns float32 logits for the flattened tokens selected by ``logit_rows``.

        ``capture`` (an EAGLE ``HiddenCapture``) also keeps the hidden states of every token that
        enter chosen layers (index ``len(layers)``: the last layer's output) for a draft head.
        """
        x = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary(fb.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            if capture is not None:
                capture.take(i, x)
            x = layer(x, cos, sin, fb, backend)
        if capture is not None:
            capture.take(len(self.model.layers), x, self.model.norm)
        x = self.model.norm(x[logit_rows])
        return parallel_logits(x, self.head_weight(), self.config.vocab_size, self.tp).float()
