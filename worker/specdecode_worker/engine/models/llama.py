"""Llama-family decoder (Llama, Qwen2, Mistral) whose attention reads and writes the paged pools.

Module names equal the Hugging Face parameter names, so safetensors load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _qkv_bias(config) -> bool:
    # Qwen2 always has q/k/v bias; Llama and Mistral only with attention_bias.
    return config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))


def sliding_window(config) -> int | None:
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


class Attention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        bias = _qkv_bias(config)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=o_bias)

    def forward(self, x, cos, sin, fb: ForwardBatch, backend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        o = backend.forward(q, k, v, self.layer_id, fb, self.scaling)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, fb, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, fb, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        self.sliding_window = sliding_window(config)

    @property
    def num_kv_layers(self) -> int:
        return len(self.model.layers)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, fb: ForwardBatch, backend, logit_rows: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits for the flattened tokens selected by ``logit_rows``."""
        x = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary(fb.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, fb, backend)
        x = self.model.norm(x[logit_rows])
        return nn.functional.linear(x, self.head_weight()).float()
