"""Tensor-parallel layers and how each rank's shard is cut from the full checkpoint tensor.

- ``ColumnParallelLinear`` (q/k/v, gate/up): each rank holds a block of output rows (and of the
  bias); the output stays split, which is what the next row-parallel layer wants.
- ``RowParallelLinear`` (o, down): each rank holds a block of input columns; partial outputs are
  summed with an all-reduce, then the whole bias is added once.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: each rank holds ceil(vocab / t) rows (the last
  shard padded with zeros); lookups outside a rank's rows give zeros and an all-reduce joins
  them; logits are gathered along the vocabulary.
- K/V projections hold ``max(1, kv_heads // t)`` heads: when t exceeds the KV heads each rank
  holds the one head its query heads read (heads are replicated), the planner's rule.

A sharded parameter carries ``tp_shard = (dim, start, length, full_shape)`` so the loader reads
only its slice of the safetensors tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InputError
from .group import SINGLE, TPGroup, get_tp


def _mark(param: nn.Parameter, tp: TPGroup, dim: int, start: int, length: int,
          full_shape: tuple[int, ...]) -> nn.Parameter:
    if tp.size > 1:
        param.tp_shard = (dim, start, length, tuple(full_shape))
    return param


class ColumnParallelLinear(nn.Module):
    """``out_features`` split by rows; ``start``/``length`` pick a block other than the even one."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE,
                 start: int | None = None, length: int | None = None):
        super().__init__()
        length = out_features // tp.size if length is None else length
        start = tp.rank * length if start is None else start
        self.weight = _mark(nn.Parameter(torch.empty(length, in_features)), tp, 0, start, length,
                            (out_features, in_features))
        self.bias = _mark(nn.Parameter(torch.empty(length)), tp, 0, start, length, (out_features,)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        length = in_features // tp.size
        self.weight = _mark(nn.Parameter(torch.empty(out_features, length)), tp, 1, tp.rank * length, length,
                            (out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # whole: added once, after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class FusedLinear(nn.Module):
    """Linear layers that read the same input as one matrix product: their weights (each rank's
    shards) stacked by rows, one launch where there were several; the caller splits the output by
    ``sizes``. Loading stays by the checkpoint's names: the parts are fused after they are loaded."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.sizes = [p.weight.shape[0] for p in parts]
        self.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        biases = [p.bias for p in parts]
        self.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def fuse_linears(parts: list[nn.Module]) -> FusedLinear | None:
    """One product for ``parts``, or None where they cannot be one: another kind of layer (fp8,
    quantized, row-parallel), weights of different dtypes or devices, a bias on some only."""
    if not all(type(p) in (nn.Linear, ColumnParallelLinear) for p in parts):
        return None
    if len({(p.weight.dtype, p.weight.device, p.weight.shape[1]) for p in parts}) != 1:
        return None
    if len({p.bias is None for p in parts}) != 1:
        return None
    return FusedLinear(parts)


def vocab_rows(vocab_size: int, tp: TPGroup) -> int:
    return -(-vocab_size // tp.size)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.rows = vocab_rows(vocab_size, tp)
        self.start = tp.rank * self.rows
        self.weight = _mark(nn.Parameter(torch.empty(self.rows, hidden_size)), tp, 0, self.start, self.rows,
                            (vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE):
        super().__init__()
        rows = vocab_rows(vocab_size, tp)
        self.weight = _mark(nn.Parameter(torch.empty(rows, hidden_size)), tp, 0, tp.rank * rows, rows,
                            (vocab_size, hidden_size))


def parallel_logits(x: torch.Tensor, head_weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Full-vocabulary logits on every rank from each rank's rows of the head."""
    return tp.all_gather_last_dim(F.linear(x, head_weight))[..., :vocab_size]


def kv_head_block(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, KV heads) this rank holds: ``max(1, kv // t)`` heads, replicated past kv."""
    return tp.rank * num_kv_heads // tp.size, max(1, num_kv_heads // tp.size)


def heads_problem(config, size: int) -> str | None:
    """Why ``size`` ranks cannot split the heads (the planner's rule), or None when they can."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        return f"{heads} attention heads do not divide by {size}"
    if kv % size and size % kv:
        return f"{kv} KV heads neither divide by {size} nor divide {size}"
    return None


def check_splits(config, size: int, where: str) -> None:
    problem = heads_problem(config, size)
    if problem is None and config.intermediate_size % size:
        problem = f"intermediate_size {config.intermediate_size} does not divide by {size}"
    if problem:
        raise InputError(f"{where}: --tp {size} cannot shard this model: {problem}; use a tensor-parallel size "
                         "that divides the attention heads, the KV heads (or a multiple of them) and intermediate_size")


def read_shard(f, name: str, param: nn.Parameter) -> tuple[torch.Tensor | None, tuple, tuple]:
    """This rank's part of checkpoint tensor ``name`` from open safetensors file ``f``.

    Returns (tensor, checkpoint shape, the full shape the model expects); tensor is None when the
    shapes differ, so the caller can name the mismatch.
    """
    spec = getattr(param, "tp_shard", None)
    if spec is None:
        tensor = f.get_tensor(name)
        return tensor, tuple(tensor.shape), tuple(param.shape)
    piece = f.get_slice(name)
    shape = tuple(piece.get_shape())
    if shape != spec[3]:
        return None, shape, spec[3]
    return _cut(piece, spec), shape, spec[3]


def take_shard(tensor: torch.Tensor, param: nn.Parameter) -> tuple[torch.Tensor | None, tuple]:
    """This rank's part of a whole checkpoint tensor already in memory (as ``read_shard``).

    Returns (tensor, the full shape the model expects); tensor is None when the shapes differ.
    """
    spec = getattr(param, "tp_shard", None)
    full = tuple(param.shape) if spec is None else spec[3]
    if tuple(tensor.shape) != full:
        return None, full
    return (tensor if spec is None else _cut(tensor, spec).clone()), full  # clone: not a view of the whole


def _cut(piece, spec) -> torch.Tensor:
    dim, start, length, full = spec
    end = min(start + length, full[dim])
    tensor = piece[start:end] if dim == 0 else piece[:, start:end]
    if tensor.shape[dim] < length:  # last vocabulary shard: zero rows past the vocabulary
        pad = list(tensor.shape)
        pad[dim] = length - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
    return tensor


def model_tp(config, role: str, where: str) -> TPGroup:
    """How a model is laid out over this process's group: sharded, or (a draft only) replicated.

    The target must shard. A draft whose heads cannot be split t ways is too small to shard: every
    rank holds it whole and rank 0 alone runs it (the planner prices it whole per GPU too).
    """
    tp = get_tp()
    if tp.size == 1:
        return tp
    if role == "draft" and heads_problem(config, tp.size):
        return SINGLE
    check_splits(config, tp.size, where)
    return tp


# Builders: plain torch modules on a single rank (so tools that look for ``nn.Linear``, such as
# dynamic quantization, keep working there), parallel ones across ranks.

def column_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE,
                  start: int | None = None, length: int | None = None) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias, tp, start, length)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> nn.Module:
    if tp.size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden_size, tp)
