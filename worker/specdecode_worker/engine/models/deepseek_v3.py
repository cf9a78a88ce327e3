"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): MLA attention over the latent pool, MoE with grouped routing.

- Attention (MLA): q through the low-rank ``q_a_proj -> q_a_layernorm -> q_b_proj`` (or ``q_proj``),
  the latent ``kv_a_proj_with_mqa -> (c_kv, k_rope)``; the pool keeps ``c_kv`` (normalised) and the
  rotated ``k_rope``. ``kv_b_proj`` is absorbed: queries move into latent space (q_nope @ W_UK) and
  the attended latent is lifted by W_UV, so no per-head K/V is ever expanded from the cache.
- Rope on the ``qk_rope_head_dim`` part only, YaRN with mscale (softmax scale times mscale^2), and
  the interleaved pair layout of the published weights (``rope_interleave``, default true).
- MoE layers (from ``first_k_dense_replace`` on): sigmoid scores, ``e_score_correction_bias`` for the
  choice only, top-2 sum per group, ``topk_group`` groups kept, top-k experts, ``norm_topk_prob``,
  ``routed_scaling_factor``; plus shared experts. Earlier layers have a dense MLP. Eagerly each
  chosen expert runs over its tokens; in a graph runner's passes every expert runs, weighted by
  the routing (static shapes, no host read); with few (token, expert) pairs, a Triton kernel runs
  each pair over stacked expert weights instead (``MoE.stack_experts``, ``triton_moe.py``), so
  only the chosen experts' weights are read (fp8 ones scaled by their blocks as they load).
- Attention runs on the backend chosen for the pool (``attention.make_attn_backend``): the MLA
  Triton kernels on CUDA, the torch-native reference on CPU.
- Tensor parallelism: attention heads are split (``q_b_proj``/``kv_b_proj`` by head rows, ``o_proj``
  by columns); the latent projections and the router are replicated; every expert and the dense MLP
  are split by the intermediate dimension, and one all-reduce joins each MLP or MoE block.

Checkpoints load as published: per-expert tensor names ``mlp.experts.{j}.{gate,up,down}_proj``.
The layers at index ``num_hidden_layers`` and up are MTP (NextN) layers: the target skips them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InputError
from ..cuda_graph import in_graph_pass
from ..forward_batch import ForwardBatch
from ..kernels.fp8_linear import Fp8BlockLinear, dense_weight, fp8_block_size
from ..kernels.layer_kernels import apply_rotary, silu_mul, use_triton
from ..memory.mla_pool import MLATokenToKVPool
from ..parallel.group import SINGLE, TPGroup
from ..parallel.parallel_layers import (
    RowParallelLinear,
    column_linear,
    parallel_logits,
    row_linear,
    vocab_embedding,
)
from .base import CausalLM
from .llama import RMSNorm
from .rope import RotaryEmbedding, _rope_parameters

# The low-rank norms of MLA use DeepSeek's fixed epsilon, not rms_norm_eps (as transformers does).
LATENT_NORM_EPS = 1e-6


class Linears:
    """Builds this model's linears: dense, or fp8 block-quantized as the checkpoint stores them."""

    def __init__(self, config, tp: TPGroup):
        self.block = fp8_block_size(config, "config.json")
        self.tp = tp
        if self.block and getattr(config, "attention_bias", False):
            raise InputError("config.json: fp8 block-quantized linears with attention_bias are not served")

    def replicated(self, in_f: int, out_f: int, bias: bool = False) -> nn.Module:
        return Fp8BlockLinear(in_f, out_f, self.block) if self.block else nn.Linear(in_f, out_f, bias=bias)

    def column(self, in_f: int, out_f: int) -> nn.Module:
        if self.block:
            return Fp8BlockLinear(in_f, out_f, self.block, self.tp, "column")
        return column_linear(in_f, out_f, False, self.tp)

    def row(self, in_f: int, out_f: int, bias: bool = False, reduce: bool = True) -> nn.Module:
        if self.block:
            return Fp8BlockLinear(in_f, out_f, self.block, self.tp, "row", reduce)
        if reduce:
            return row_linear(in_f, out_f, bias, self.tp)
        if self.tp.size == 1:
            return nn.Linear(in_f, out_f, bias=False)
        return PartialRowLinear(in_f, out_f, False, self.tp)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = _rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class PartialRowLinear(RowParallelLinear):
    """A row-parallel linear whose partial sums the caller reduces (one all-reduce per MoE block)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MLAttention(nn.Module):
    def __init__(self, config, layer_id: int, linears: Linears, tp: TPGroup = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        h, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads // tp.size
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        qk = self.nope + self.rope
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = linears.column(h, heads * qk)
        else:
            self.q_a_proj = linears.replicated(h, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linears.column(self.q_lora_rank, heads * qk)
        self.kv_a_proj_with_mqa = linears.replicated(h, self.kv_lora_rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linears.column(self.kv_lora_rank, heads * (self.nope + self.v_head_dim))
        self.o_proj = linears.row(heads * self.v_head_dim, h, bias)
        self.scaling = softmax_scale(config)
        self.interleaved = bool(getattr(config, "rope_interleave", True))

    def forward(self, x, cos, sin, fb: ForwardBatch, backend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(n, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_rope, k_rope = apply_rotary(q_rope, k_rope[:, None, :], cos, sin, self.interleaved)
        w = dense_weight(self.kv_b_proj, x.dtype).view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        latent = torch.cat([c_kv[:, None, :], k_rope], dim=-1)  # [n, 1, kv_lora_rank + rope]: the cell
        o_latent = backend.forward(torch.cat([q_latent, q_rope], dim=-1), latent, latent[..., : self.kv_lora_rank],
                                   self.layer_id, fb, self.scaling)  # [n, heads, kv_lora_rank]
        o = torch.einsum("nhc,hvc->nhv", o_latent, w_uv)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    """Gated MLP split by its intermediate dimension; ``reduce`` False leaves the sum to the caller."""

    def __init__(self, hidden: int, intermediate: int, linears: Linears, reduce: bool = True):
        super().__init__()
        self.gate_proj = linears.column(hidden, intermediate)
        self.up_proj = linears.column(hidden, intermediate)
        self.down_proj = linears.row(intermediate, hidden, reduce=reduce)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """Sigmoid scores; the bias steers the choice only; groups ranked by their two best experts."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen experts ``[n, top_k]`` and their weights (float32): on a GPU in one kernel after
        the router's product (``triton_moe.grouped_topk``), else by ``route``."""
        logits = F.linear(x.float(), self.weight.float())
        if not use_triton(logits):
            return self.route(logits)
        from ..kernels.triton_moe import grouped_topk  # imports triton: only where kernels run

        return grouped_topk(logits, self.e_score_correction_bias, self.n_group, self.topk_group, self.top_k,
                            self.norm_topk_prob, self.routed_scaling_factor)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing as torch ops (transformers' DeepSeek-V3): the kernel's reference."""
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n = logits.shape[0]
        group_scores = choice.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep[:, :, None].expand(n, self.n_group, self.num_experts // self.n_group).reshape(n, -1)
        experts = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, config, linears: Linears):
        super().__init__()
        self.tp = linears.tp
        h, m = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(h, m, linears, reduce=False) for _ in range(config.n_routed_experts))
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = MLP(h, m * shared, linears, reduce=False) if shared else None
        # The experts' weights stacked ([E, 2m, h] gate and up, [E, h, m] down), their parameters
        # views into them (``stack_experts``); None: graphs run every expert.
        self.gate_up_stack: torch.Tensor | None = None
        self.down_stack: torch.Tensor | None = None
        # fp8 experts: their stacked block scales and the block (rows, columns).
        self.gate_up_scales: torch.Tensor | None = None
        self.down_scales: torch.Tensor | None = None
        self.scale_block = (1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x)
        # Fewer (token, expert) pairs than experts, as in a decode round's passes, graphed or not:
        # the expert kernel, with no host read. More: every expert inside a graph, else the routed
        # path's one read of the routing (a prefill, or a round of many requests run eagerly).
        if self.gate_up_stack is not None and experts.numel() < len(self.experts):
            out = self.chosen_experts(x, experts, weights)
        elif graph_capturing():
            out = self.every_expert(x, experts, weights)
        else:
            out = self.routed(x, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def routed(self, x, experts, weights) -> torch.Tensor:
        """Each chosen expert over its own tokens (reads the chosen experts back to the host)."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():  # every rank routes alike: same experts, same order
            tokens, slot = torch.where(experts == e)
            y = self.experts[e](x[tokens]) * weights[tokens, slot, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out

    def every_expert(self, x, experts, weights) -> torch.Tensor:
        """Every expert over every token, weighted by the routing (zero where not chosen): static
        shapes and no host read, so a CUDA graph can hold it. The sum runs in the routed path's
        expert order; the price is every expert's weights read each step."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype, device=x.device)
        dense.scatter_(1, experts, weights.to(x.dtype))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += expert(x) * dense[:, e, None]
        return out

    def chosen_experts(self, x, experts, weights) -> torch.Tensor:
        """Each (token, chosen expert) pair on the Triton expert kernel over the stacked weights:
        static shapes, and only the chosen experts' weights are read (fewer pairs than experts)."""
        from ..kernels.triton_moe import expert_gemv  # imports triton: only where graphs run

        n, k = experts.shape
        ids = experts.reshape(-1)
        gate, up = expert_gemv(x, self.gate_up_stack, ids, k, self.gate_up_scales, self.scale_block).chunk(2, dim=-1)
        y = expert_gemv(silu_mul(gate, up), self.down_stack, ids, 1, self.down_scales, self.scale_block)
        return (y.view(n, k, -1) * weights.to(x.dtype)[..., None]).sum(1)

    @torch.no_grad()
    def stack_experts(self) -> bool:
        """Move the experts' weights (fp8 ones with their block scales) into stacked tensors, each
        expert's parameters becoming views (same bytes; while a layer is moved its experts are held
        twice, in phase 1, before any KV pool exists). Under tensor parallelism the stacks hold this
        rank's shards. False, and nothing moved, where the up rows would not start an fp8 block."""
        first = self.experts[0]
        fp8 = isinstance(first.gate_proj, Fp8BlockLinear)
        if fp8 and first.gate_proj.weight.shape[0] % first.gate_proj.block[0]:
            return False
        attrs = ("weight", "weight_scale_inv") if fp8 else ("weight",)
        gate_up = {a: _stack_rows(self.experts, ("gate_proj", "up_proj"), a) for a in attrs}
        down = {a: _stack_rows(self.experts, ("down_proj",), a) for a in attrs}
        self.gate_up_stack, self.down_stack = gate_up["weight"], down["weight"]
        if fp8:
            self.gate_up_scales, self.down_scales = gate_up["weight_scale_inv"], down["weight_scale_inv"]
            self.scale_block = first.gate_proj.block
        return True


def stack_layer_experts(moe: MoE) -> None:
    """Stack one layer's experts, then hand the originals' memory back to the device: phase 2 counts
    memory the caching allocator holds as in use, which would cost KV tokens."""
    moe.stack_experts()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _stack_rows(experts, names: tuple[str, ...], attr: str) -> torch.Tensor:
    """[E, rows, ...]: each expert's ``attr`` of the linears ``names``, their rows one after another;
    every expert's tensors become views into it."""
    first = [getattr(getattr(experts[0], n), attr) for n in names]
    rows = sum(t.shape[0] for t in first)
    stack = torch.empty(len(experts), rows, *first[0].shape[1:], dtype=first[0].dtype, device=first[0].device)
    for e, mlp in enumerate(experts):
        start = 0
        for name in names:
            linear = getattr(mlp, name)
            t = getattr(linear, attr)
            view = stack[e, start : start + t.shape[0]]
            view.copy_(t)
            setattr(linear, attr, nn.Parameter(view, requires_grad=False))
            start += t.shape[0]
    return stack


def graph_capturing() -> bool:
    """A graph runner's pass (its warm-up, so the kernels are compiled before capture, the capture,
    an eager replay) or any capture on this stream: MoE takes its static path."""
    return in_graph_pass() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, linears: Linears, kv_layer: int | None = None):
        super().__init__()
        self.self_attn = MLAttention(config, layer_id if kv_layer is None else kv_layer, linears, linears.tp)
        dense = layer_id < config.first_k_dense_replace
        self.mlp = MLP(config.hidden_size, config.intermediate_size, linears) if dense else MoE(config, linears)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, fb, backend):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, fb, backend)
        h, x = self.post_attention_layernorm.add_and_norm(x, attended)
        return x + self.mlp(h)


class MLARotary(RotaryEmbedding):
    """Rope over the ``qk_rope_head_dim`` part of each head (YaRN and mscale from the config)."""

    def __init__(self, config):
        nn.Module.__init__(self)
        self._config = config
        self.head_dim = config.qk_rope_head_dim
        self.reset("cpu")


class DeepseekV3Model(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        linears = Linears(config, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, linears) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def check_moe_splits(config, size: int, where: str) -> None:
    for name in ("moe_intermediate_size", "intermediate_size"):
        if getattr(config, name) % size:
            raise InputError(f"{where}: --tp {size} cannot shard this model: {name} {getattr(config, name)} does not "
                             f"divide by {size}")


class DeepseekV3ForCausalLM(CausalLM):
    """The target model. ``forward`` matches LlamaForCausalLM's (an MTP draft reads ``capture``)."""

    sliding_window = None

    def __init__(self, config, tp: TPGroup = SINGLE):
        if tp.size > 1:
            check_moe_splits(config, tp.size, "config.json")
        super().__init__(config, DeepseekV3Model(config, tp), MLARotary(config), tp)

    def stack_experts(self) -> None:
        """After loading: stacked expert weights for the Triton expert kernel (small passes)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                stack_layer_experts(layer.mlp)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """MTP layers (index >= num_hidden_layers) belong to the draft, not the target."""
        prefix = "model.layers."
        if not name.startswith(prefix):
            return False
        index = name[len(prefix):].partition(".")[0]
        return index.isdigit() and int(index) >= self.config.num_hidden_layers

    def make_kv_pool(self, size: int, dtype: torch.dtype, device) -> MLATokenToKVPool:
        c = self.config
        return MLATokenToKVPool(size, len(self.model.layers), c.kv_lora_rank, c.qk_rope_head_dim, dtype, device)

    def forward(self, fb: ForwardBatch, backend, logit_rows: torch.Tensor, capture=None) -> torch.Tensor:
        x = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary(fb.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, fb, backend)
        x = self.model.norm(x)
        if capture is not None:  # the MTP layer reads the target's final (normalised) hidden states
            capture.last = x
        return parallel_logits(x[logit_rows], self.head_weight(), self.config.vocab_size, self.tp).float()
