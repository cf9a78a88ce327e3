"""EAGLE draft heads: small decoders that read the target's hidden states.

EAGLE-1/2 (``EagleHead``): ``fc`` maps concat(embed(token), target feature) (2H) to H, then one or
more Llama decoder layers (the first without an input norm); the output is the next feature and
the target's lm_head turns it into logits. The feature is the target's last hidden state after
its final norm (the lm_head's input).

EAGLE3 (``Eagle3Head``): the target hands over the hidden states entering three of its layers;
``fc`` maps their concat (3 x target H) to H. One decoder layer whose q/k/v read
concat(input_layernorm(embed), hidden_norm(h)) (2H) with the residual on h; the pre-norm output
is fed back as the next step's h (``fc`` skipped), its final-normed form goes through the head's
own lm_head over a draft vocabulary; ``d2t`` maps draft id d to target id d + d2t[d].

Draft position p reads token p + 1 with the feature of position p, so it predicts token p + 2.
Both heads share the target's embedding; EAGLE-1 also its lm_head. Module names match the
published checkpoints after ``checkpoint_tensors`` normalises them.

Under tensor parallelism t the heads shard as the planner prices them (``checkpoint.per_gpu_bytes``):
the decoder layers as the target's (column-parallel q/k/v, gate/up; row-parallel o, down; KV heads
``max(1, kv / t)``), EAGLE3's own lm_head by vocabulary rows; ``fc``, the norms and ``d2t``/``t2d``
stay whole on every rank. The features they read (the target's residual stream after its
row-parallel all-reduces, and the embedding after its all-reduce) are already whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.layer_kernels import silu_mul
from ..parallel.group import SINGLE, TPGroup
from ..parallel.parallel_layers import column_linear, kv_head_block, lm_head, row_linear
from .base import ServedModel
from .llama import RMSNorm
from .rope import RotaryEmbedding


class HeadAttention(nn.Module):
    """Sharded as the target's attention: heads / t query heads, max(1, kv_heads / t) KV heads."""

    def __init__(self, config, layer_id: int, in_dim: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = d = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads = heads // tp.size
        kv_first, self.num_kv_heads = kv_head_block(kv_heads, tp)
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        kv_rows = dict(start=kv_first * d, length=self.num_kv_heads * d)
        self.q_proj = column_linear(in_dim, heads * d, bias, tp)
        self.k_proj = column_linear(in_dim, kv_heads * d, bias, tp, **kv_rows)
        self.v_proj = column_linear(in_dim, kv_heads * d, bias, tp, **kv_rows)
        self.o_proj = row_linear(heads * d, config.hidden_size, bias, tp)

    def forward(self, x, cos, sin, fb, backend):
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, k, cos, sin)
        return self.o_proj(backend.forward(q, k, v, self.layer_id, fb, self.scaling).reshape(n, -1))


class HeadMLP(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = column_linear(h, i, bias, tp)
        self.up_proj = column_linear(h, i, bias, tp)
        self.down_proj = row_linear(i, h, bias, tp)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class HeadLayer(nn.Module):
    """A Llama decoder layer; EAGLE3's reads concat(normed embedding, normed hidden)."""

    def __init__(self, config, layer_id: int, eagle3: bool, input_norm: bool, tp: TPGroup = SINGLE):
        super().__init__()
        h = config.hidden_size
        self.eagle3 = eagle3
        self.self_attn = HeadAttention(config, layer_id, 2 * h if eagle3 else h, tp)
        self.mlp = HeadMLP(config, tp)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps) if (input_norm or eagle3) else None
        if eagle3:
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, x, cos, sin, fb, backend, embeds=None):
        if self.eagle3:
            a = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        else:
            a = x if self.input_layernorm is None else self.input_layernorm(x)
        h, x = self.post_attention_layernorm.add_and_norm(x, self.self_attn(a, cos, sin, fb, backend))
        return x + self.mlp(h)


class EagleHead(ServedModel):
    """EAGLE-1/2. ``fc_bias`` and ``first_input_norm`` follow what the checkpoint holds."""

    eagle3 = False

    def __init__(self, config, fc_bias: bool = True, first_input_norm: bool = False, tp: TPGroup = SINGLE):
        super().__init__()
        h = config.hidden_size
        self.hidden_size = h
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)  # replicated: its input is the whole feature
        self.layers = nn.ModuleList(
            HeadLayer(config, i, eagle3=False, input_norm=(i > 0 or first_input_norm), tp=tp)
            for i in range(config.num_hidden_layers)
        )
        self.rotary = RotaryEmbedding(config)
        self.sliding_window = None

    def forward(self, embeds, hidden, from_target: bool, fb, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the lm_head's input, the next feature); both are the layers' output here.

        ``from_target`` is unused: EAGLE-1 features always have the target's hidden size.
        """
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        cos, sin = self.rotary(fb.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, fb, backend)
        return x, x


class Eagle3Head(ServedModel):
    eagle3 = True

    def __init__(self, config, target_hidden_size: int, draft_vocab_size: int | None, has_d2t: bool,
                 tp: TPGroup = SINGLE):
        super().__init__()
        h = config.hidden_size
        self.hidden_size = h
        self.fc = nn.Linear(3 * target_hidden_size, h, bias=False)  # replicated: its input is the whole feature
        self.layers = nn.ModuleList([HeadLayer(config, 0, eagle3=True, input_norm=True, tp=tp)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # No own lm_head: the target's serves. No d2t: draft ids are target ids. An own lm_head is
        # vocabulary-parallel under t (ceil(draft vocab / t) rows per rank), d2t whole on every rank.
        self.draft_vocab_size = draft_vocab_size
        self.lm_head = lm_head(draft_vocab_size, h, tp) if draft_vocab_size is not None else None
        if has_d2t:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None
        self.rotary = RotaryEmbedding(config)
        self.sliding_window = None

    def forward(self, embeds, hidden, from_target: bool, fb, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """``from_target``: ``hidden`` holds the target's 3 aux states (fc applies) rather than the
        H-sized feature the head produced itself. Returns (normed output, pre-norm output)."""
        x = self.fc(hidden) if from_target else hidden
        cos, sin = self.rotary(fb.positions, x.dtype)
        x = self.layers[0](x, cos, sin, fb, backend, embeds=embeds)
        return self.norm(x), x
