"""Weights from safetensors files, matched to the model's parameters by their Hugging Face names."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ...errors import InputError
from ..kernels.cpu_linear import packed_bytes
from ..parallel.parallel_layers import read_shard

# Fills a model built on the meta device: (model, model_dir, device, dtype). ``load_safetensors`` is
# the served one; a benchmark may make weights on the device instead of reading files.
WeightSource = Callable[[torch.nn.Module, "str | Path", torch.device, torch.dtype], None]

# Checkpoint tensors that hold nothing the model needs (buffers recomputed at load).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_safetensors(model: torch.nn.Module, model_dir: str | Path, device, dtype: torch.dtype) -> None:
    """Fill every parameter of ``model`` (built on the meta device) from ``model_dir``."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputError(f"{model_dir}: no *.safetensors files; the worker loads safetensors checkpoints only")
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    skips = getattr(model, "skips_checkpoint_tensor", None)  # tensors of another model in the same files
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (skips is not None and skips(name)):
                    continue
                if name not in params:
                    if name == "lm_head.weight" and "model.embed_tokens.weight" in params:
                        continue  # tied head saved anyway
                    raise InputError(f"{file}: tensor '{name}' has no place in {type(model).__name__}")
                tensor, shape, expected = read_shard(f, name, params[name])  # this rank's slice under tp
                if shape != expected:
                    raise InputError(f"{file}: tensor '{name}' has shape {shape}, config.json implies {expected}")
                param = params[name]
                if getattr(param, "keep_checkpoint_dtype", False):  # fp8 weights and their scales, as stored
                    if tensor.dtype != param.dtype:
                        raise InputError(f"{file}: tensor '{name}' is {tensor.dtype}, config.json's "
                                         f"quantization_config implies {param.dtype}")
                    loaded[name] = tensor.to(device=device)
                else:
                    loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise InputError(f"{model_dir}: checkpoint lacks {len(missing)} tensors, first: {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer the module holds."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    total += packed_bytes(module)  # oneDNN-packed weights are neither parameters nor buffers
    for m in module.modules():  # dynamically quantized linears keep packed weights, not parameters
        if isinstance(m, torch.ao.nn.quantized.dynamic.Linear):
            w, b = m.weight(), m.bias()
            total += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
    return total
