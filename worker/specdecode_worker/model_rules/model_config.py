"""Model shapes read from a Hugging Face ``config.json``, without importing torch.

The rules follow what serving engines derive (SGLang's ``_derive_model_shapes``): explicit head
dims are kept, absent or null ones default to ``hidden_size // num_attention_heads``, KV heads
default to the attention heads, and ``num_nextn_predict_layers`` is read from a nested text config
before the outer one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError

# Architectures whose attention stores a compressed latent (MLA) instead of per-head K and V.
MLA_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLMNextN",
        "KimiK2ForCausalLM",
        "Glm4MoeLiteForCausalLM",
    }
)

# Config keys that hold the total KV head count, in the order engines look them up.
_KV_HEAD_KEYS = (
    "n_head_kv",
    "num_kv_heads",
    "num_key_value_heads",
    "multi_query_group_num",
    "num_attention_groups",
)

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """The shape facts of one model that memory accounting needs."""

    path: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab_size: int
    torch_dtype: str
    tie_word_embeddings: bool
    intermediate_size: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    num_nextn_predict_layers: int | None = None
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    max_position_embeddings: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.torch_dtype, 2)

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each rank holds; replicated when tp exceeds the KV head count."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: int, num_layers: int | None = None) -> int:
        """KV cache bytes per token per GPU over ``num_layers`` layers (default: all attention layers).

        MLA keeps the full latent on every rank, so it is not divided by tp.
        """
        layers = self.num_attention_layers if num_layers is None else num_layers
        if self.is_mla:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes
        return layers * self.kv_heads_per_gpu(tp) * (self.head_dim + self.v_head_dim) * kv_dtype_bytes

    @property
    def draft_num_layers(self) -> int:
        """Layers of KV a model needs when it serves as a draft."""
        if self.num_nextn_predict_layers is not None:
            return self.num_nextn_predict_layers
        return max(self.num_hidden_layers, self.num_attention_layers)


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _optional_int(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _kv_layers(cfg: dict[str, Any]) -> int | None:
    """Layers that keep a KV cache in a hybrid model, from the standard ``layer_types`` list.

    Full and sliding-window attention layers count (engines without a separate SWA pool size
    them alike); linear-attention, Mamba and convolution layers keep no KV cache.
    """
    types = cfg.get("layer_types")
    if not isinstance(types, list) or not types:
        return None
    count = sum(1 for t in types if isinstance(t, str) and "attention" in t and "linear" not in t)
    return count or None


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """Read ``config.json`` of a model folder, with errors that name the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"{path}: missing; a model folder needs a Hugging Face config.json")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{path}: must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def shape_from_config(cfg: dict[str, Any], where: str = "config.json") -> ModelShape:
    """Derive a ModelShape from a parsed config (the text config of a multimodal one)."""
    outer = cfg
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    inner = {**outer, **text} if text else outer

    hidden = _positive_int(inner, "hidden_size", where)
    layers = _positive_int(inner, "num_hidden_layers", where)
    heads = _positive_int(inner, "num_attention_heads", where)
    kv_heads = next((inner[k] for k in _KV_HEAD_KEYS if isinstance(inner.get(k), int) and inner[k] > 0), heads)

    head_dim = inner.get("head_dim")
    if not isinstance(head_dim, int) or head_dim <= 0:
        head_dim = hidden // heads
    v_head_dim = inner.get("v_head_dim")
    if not isinstance(v_head_dim, int) or v_head_dim <= 0:
        v_head_dim = head_dim

    architectures = outer.get("architectures") or []
    architecture = architectures[0] if architectures else str(outer.get("model_type", "unknown"))
    kv_lora_rank = _optional_int(inner, "kv_lora_rank")
    is_mla = architecture in MLA_ARCHITECTURES or kv_lora_rank is not None
    qk_rope = _optional_int(inner, "qk_rope_head_dim")
    if is_mla and (kv_lora_rank is None or qk_rope is None):
        raise InputError(f"{where}: MLA model '{architecture}' needs 'kv_lora_rank' and 'qk_rope_head_dim'")

    nextn = _optional_int(text, "num_nextn_predict_layers") if text else None
    if nextn is None:
        nextn = _optional_int(outer, "num_nextn_predict_layers")

    vocab = inner.get("vocab_size") or outer.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise InputError(f"{where}: field 'vocab_size' must be a positive integer, got {vocab!r}")

    dtype = inner.get("torch_dtype") or inner.get("dtype") or outer.get("torch_dtype") or "bfloat16"
    return ModelShape(
        path=where,
        architecture=architecture,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_layers=_optional_int(inner, "num_attention_layers") or _kv_layers(inner) or layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        vocab_size=vocab,
        torch_dtype=str(dtype),
        tie_word_embeddings=bool(outer.get("tie_word_embeddings", inner.get("tie_word_embeddings", False))),
        intermediate_size=_optional_int(inner, "intermediate_size"),
        kv_lora_rank=kv_lora_rank if is_mla else None,
        qk_rope_head_dim=qk_rope if is_mla else None,
        num_nextn_predict_layers=nextn,
        draft_vocab_size=_optional_int(inner, "draft_vocab_size"),
        target_hidden_size=_optional_int(inner, "target_hidden_size"),
        max_position_embeddings=_optional_int(inner, "max_position_embeddings"),
    )


def load_shape(model_dir: str | Path) -> ModelShape:
    """Shape of the model in ``model_dir`` (reads only its config.json)."""
    cfg = read_config(model_dir)
    return shape_from_config(cfg, where=str(Path(model_dir) / "config.json"))
