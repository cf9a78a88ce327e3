"""Weight bytes of a checkpoint, read from safetensors headers only (tensor data is never read).

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON
mapping tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``; the data follows.
Reading the header and ``stat``-ing the file is enough to know every tensor's size and to check
that the file is complete, so a multi-GB shard costs one small read.

Per-GPU bytes under tensor parallelism t (the layout SGLang's parallel layers use):
- tensors with two or more dimensions (projections, experts, vocab-parallel embedding and
  lm_head, FP8 block scales) are split t ways: ceil(bytes / t);
- K/V projections hold ``max(1, kv_heads // t)`` of ``kv_heads`` heads per GPU, so they stop
  shrinking (are replicated) once t exceeds the KV head count;
- biases of column-parallel projections (q, gate, up) are split with their rows;
- other one-dimensional tensors (norms, row-parallel biases, score-correction biases) and the layers serving
  engines keep replicated (MLA down-projections ``q_a_proj``/``kv_a_proj_with_mqa``, the MoE
  router ``mlp.gate``, the EAGLE ``fc`` and MTP ``eh_proj`` linears) are whole on every GPU.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, NamedTuple

from ..errors import InputError

# Bits per element of every dtype safetensors defines.
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# The safetensors library refuses headers above this size; anything larger is corruption.
MAX_HEADER_BYTES = 100_000_000

_INDEX_NAMES = ("model.safetensors.index.json",)
# Modules serving engines keep whole on every rank (plain or replicated linears).
_REPLICATED_MODULES = frozenset({"q_a_proj", "kv_a_proj_with_mqa", "fc", "eh_proj"})
_KV_MODULES = frozenset({"k_proj", "v_proj"})
# Column-parallel projections: their output rows, bias included, are split across ranks.
_COLUMN_MODULES = frozenset({"q_proj", "gate_proj", "up_proj"})


def _classify(name: str, ndim: int) -> str:
    """How a tensor is laid out under tensor parallelism: "sharded", "kv" or "replicated"."""
    module = name.rpartition(".")[0]
    last = module.rpartition(".")[2]
    if last in _KV_MODULES:
        return "kv"
    if last in _COLUMN_MODULES and name.endswith(".bias"):
        return "sharded"
    if last in _REPLICATED_MODULES or module.endswith("mlp.gate") or ndim < 2:
        return "replicated"
    return "sharded"


def _layer_index(name: str) -> int | None:
    """Decoder layer index from a ``...layers.N...`` name, else None."""
    if name.startswith("layers."):
        rest = name[7:]
    else:
        at = name.find(".layers.")
        if at < 0:
            return None
        rest = name[at + 8:]
    digits = rest.partition(".")[0]
    return int(digits) if digits.isdigit() else None


class TensorInfo(NamedTuple):
    """One tensor of a checkpoint: its name, dtype, shape and stored size (a tuple: cheap in bulk)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    layer: int | None = None  # decoder layer index, None outside the layers
    parallel: str = "sharded"  # "sharded", "kv" (K/V projection) or "replicated"

    @property
    def is_embedding(self) -> bool:
        return self.name.endswith("embed_tokens.weight")

    @property
    def is_lm_head(self) -> bool:
        module = self.name.rpartition(".")[0]
        return module == "lm_head" or module.endswith(".lm_head") or module.endswith("shared_head.head")


def read_header(path: str | Path) -> list[TensorInfo]:
    """Tensors of one safetensors file; reads the header only and checks it against the file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise InputError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise InputError(
                    f"{path}: header length {n} bytes is absurd (limit {MAX_HEADER_BYTES}); "
                    "the file is corrupt or not safetensors"
                )
            if 8 + n > size:
                raise InputError(f"{path}: truncated safetensors header ({n} bytes announced, {size - 8} present)")
            raw = fh.read(n)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: corrupt safetensors header, not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header, expected a JSON object")

    data_bytes = size - 8 - n
    tensors = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_tensor(path, name, meta, data_bytes))
    return tensors


class _Where:
    """``file: tensor 'name'`` for error messages, formatted only when an error is raised."""

    __slots__ = ("path", "name")

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name

    def __format__(self, spec: str) -> str:
        return f"{self.path}: tensor '{self.name}'"


def _tensor(path: Path, name: str, meta: object, data_bytes: int) -> TensorInfo:
    where = _Where(path, name)
    if type(meta) is not dict:
        raise InputError(f"{where}: corrupt header entry, expected an object")
    dtype = meta.get("dtype")
    bits = DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        raise InputError(f"{where}: field 'dtype' has unknown value {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    shape = meta.get("shape")
    numel = 1
    if type(shape) is not list:
        numel = -1
    else:
        for d in shape:
            if type(d) is not int or d < 0:
                numel = -1
                break
            numel *= d
    if numel < 0:
        raise InputError(f"{where}: field 'shape' must be a list of non-negative integers, got {shape!r}")
    offsets = meta.get("data_offsets")
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or type(offsets[0]) is not int
        or type(offsets[1]) is not int
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InputError(f"{where}: field 'data_offsets' must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    nbytes = (numel * bits + 7) // 8
    if offsets[1] - offsets[0] != nbytes:
        raise InputError(
            f"{where}: field 'data_offsets' spans {offsets[1] - offsets[0]} bytes but "
            f"{dtype} {shape} needs {nbytes}; the header is corrupt"
        )
    if offsets[1] > data_bytes:
        raise InputError(
            f"{where}: data ends at byte {offsets[1]} but the file holds {data_bytes} data bytes; "
            "the file is truncated (re-download it)"
        )
    return TensorInfo(name, dtype, tuple(shape), nbytes, path.name, _layer_index(name), _classify(name, len(shape)))


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder: those an index names, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    for index_name in _INDEX_NAMES:
        index = model_dir / index_name
        if index.is_file():
            return _files_from_index(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    legacy = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if legacy:
        raise InputError(
            f"{model_dir}: holds only {', '.join(legacy[:3])}{' ...' if len(legacy) > 3 else ''}, no *.safetensors; "
            "the planner reads safetensors headers only: convert the checkpoint to safetensors "
            "(for example with transformers: save_pretrained(dir, safe_serialization=True))"
        )
    raise InputError(f"{model_dir}: no *.safetensors weights found (and no model.safetensors.index.json)")


def _files_from_index(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{index}: not valid JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{index}: field 'weight_map' must be a non-empty object of tensor name -> file")
    names = sorted(set(weight_map.values()))
    bad = [n for n in names if not isinstance(n, str) or "/" in n or n in {"", ".", ".."}]
    if bad:
        raise InputError(f"{index}: field 'weight_map' names invalid shard file {bad[0]!r}")
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise InputError(f"{index}: field 'weight_map' names shard '{missing[0]}', "
                         f"which is missing from {index.parent}")
    return [index.parent / n for n in names]


def read_checkpoint(model_dir: str | Path) -> list[TensorInfo]:
    """Every tensor of the checkpoint in ``model_dir`` (headers only)."""
    tensors: list[TensorInfo] = []
    for path in checkpoint_files(model_dir):
        tensors.extend(read_header(path))
    return tensors


def per_gpu_bytes(tensor: TensorInfo, tp: int, num_kv_heads: int | None = None) -> int:
    """Bytes of ``tensor`` each of ``tp`` ranks holds (see the module docstring for the rule)."""
    if tp == 1 or tensor.parallel == "replicated":
        return tensor.nbytes
    if tensor.parallel == "kv" and num_kv_heads:
        per_gpu = max(1, num_kv_heads // tp)
        return -(-tensor.nbytes * per_gpu // num_kv_heads)
    return -(-tensor.nbytes // tp)


def total_bytes(tensors: Iterable[TensorInfo], tp: int = 1, num_kv_heads: int | None = None) -> int:
    """Per-GPU bytes of a set of tensors under tensor parallelism ``tp``."""
    return sum(per_gpu_bytes(t, tp, num_kv_heads) for t in tensors)


# ``serve --dtype`` names and their safetensors dtype: the loader casts every floating tensor to it,
# except fp8 weights and their float32 block scales, which stay as stored (engine/kernels/fp8_linear.py).
SERVED_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_CAST_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_STORED_SUFFIXES = ("weight_scale_inv",)


def as_served(tensors: Iterable[TensorInfo], dtype: str | None) -> list[TensorInfo]:
    """The tensors as the worker holds them under ``--dtype`` (auto or None: as stored, which the
    checkpoint's dtype never exceeds)."""
    if dtype in (None, "auto"):
        return list(tensors)
    served = SERVED_DTYPES[dtype]
    bits = DTYPE_BITS[served]
    return [t._replace(dtype=served, nbytes=t.nbytes * bits // DTYPE_BITS[t.dtype])
            if t.dtype in _CAST_DTYPES and not t.name.endswith(_STORED_SUFFIXES) else t
            for t in tensors]


def split_target_draft(
    algorithm: str,
    target_tensors: list[TensorInfo],
    draft_tensors: list[TensorInfo] | None,
    target_num_layers: int,
) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """Which tensors each model holds in GPU memory, so that nothing is counted twice.

    - Layers with index >= the target's ``num_hidden_layers`` are MTP (NextN) layers: the target
      model never loads them. For MTP without a separate draft checkpoint they are the draft.
    - EAGLE and MTP drafts use the target's embedding and lm_head (``shared_head.head``); EAGLE3
      uses the target's embedding and keeps its own (usually reduced-vocabulary) lm_head, or the
      target's when it ships none. Shared tensors count once, in the target.
    - NGRAM has no draft model.
    """
    target = [t for t in target_tensors if t.layer is None or t.layer < target_num_layers]
    if algorithm == "NGRAM":
        return target, []
    if algorithm == "MTP" and draft_tensors is None:
        draft_tensors = [t for t in target_tensors if t.layer is not None and t.layer >= target_num_layers]
    draft = list(draft_tensors or [])
    if algorithm in ("EAGLE", "MTP"):
        draft = [t for t in draft if not (t.is_embedding or t.is_lm_head)]
    elif algorithm == "EAGLE3":
        draft = [t for t in draft if not t.is_embedding]
    return target, draft
