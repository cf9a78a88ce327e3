"""Sparse checkpoints of published models for tests: real config.json, real safetensors headers
(Hugging Face tensor names, shapes and dtypes), and tensor data that is a hole made by truncate.

A 70B checkpoint costs a few kilobytes of disk; any reader that touched the data would read
zeros (and take seconds to minutes), while a header-only reader finishes at once.

Usage::

    from devtools.checkpoints import write_model
    target = write_model(tmp_path / "Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct")
    draft = write_model(tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B", "eagle3-llama-3.1-8b")
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
        "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
        "C64": 64, "I64": 64, "U64": 64, "F64": 64}

Tensor = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype, shape)

# config.json of each model as published on the Hugging Face hub (fields that matter kept verbatim).
CONFIGS: dict[str, dict] = {
    "llama-3.1-8b-instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "llama-3.1-70b-instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 8192,
        "intermediate_size": 28672, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (as converted to safetensors for SGLang).
    "eagle3-llama-3.1-8b": {
        "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
        "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
        "vocab_size": 128256, "draft_vocab_size": 32000,
    },
    "qwen2.5-7b-instruct": {
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
        "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 152064,
    },
    "qwen2.5-0.5b-instruct": {
        "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
        "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
        "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
    },
    # deepseek-ai/DeepSeek-V3: MLA, 256 routed experts, FP8 block-quantized, one MTP layer (index 61).
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "v_head_dim": 128, "vocab_size": 129280,
    },
}

# Shard counts of the published checkpoints.
SHARDS = {
    "llama-3.1-8b-instruct": 4,
    "llama-3.1-70b-instruct": 30,
    "eagle3-llama-3.1-8b": 1,
    "qwen2.5-7b-instruct": 4,
    "qwen2.5-0.5b-instruct": 1,
    "deepseek-v3": 163,
}

# Qwen2.5 tokenizer: 151643 BPE tokens plus 22 added special tokens, shared by the whole family.
QWEN_TOKENIZER = (151643, 22)


def _decoder_tensors(cfg: dict, prefix: str = "model.") -> list[Tensor]:
    """Llama/Qwen2-style decoder (GQA attention, gated MLP), BF16."""
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    bias = cfg.get("model_type") == "qwen2"
    out: list[Tensor] = [(f"{prefix}embed_tokens.weight", "BF16", (cfg["vocab_size"], h))]
    for i in range(L):
        p = f"{prefix}layers.{i}."
        out += [
            (p + "input_layernorm.weight", "BF16", (h,)),
            (p + "self_attn.q_proj.weight", "BF16", (heads * hd, h)),
            (p + "self_attn.k_proj.weight", "BF16", (kv * hd, h)),
            (p + "self_attn.v_proj.weight", "BF16", (kv * hd, h)),
            (p + "self_attn.o_proj.weight", "BF16", (h, heads * hd)),
            (p + "post_attention_layernorm.weight", "BF16", (h,)),
            (p + "mlp.gate_proj.weight", "BF16", (inter, h)),
            (p + "mlp.up_proj.weight", "BF16", (inter, h)),
            (p + "mlp.down_proj.weight", "BF16", (h, inter)),
        ]
        if bias:
            out += [
                (p + "self_attn.q_proj.bias", "BF16", (heads * hd,)),
                (p + "self_attn.k_proj.bias", "BF16", (kv * hd,)),
                (p + "self_attn.v_proj.bias", "BF16", (kv * hd,)),
            ]
    out.append((f"{prefix}norm.weight", "BF16", (h,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", "BF16", (cfg["vocab_size"], h)))
    return out


def _eagle3_tensors(cfg: dict) -> list[Tensor]:
    """EAGLE3 head: one decoder layer whose attention reads [embedding, hidden] (2h wide), an fc that
    fuses three target layers (3h -> h), a reduced-vocabulary lm_head and the d2t/t2d vocab maps.
    No embedding: it uses the target's."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    dv = cfg["draft_vocab_size"]
    p = "midlayer."
    return [
        ("d2t", "I64", (dv,)),
        ("t2d", "BOOL", (cfg["vocab_size"],)),
        ("fc.weight", "F16", (h, 3 * h)),
        (p + "hidden_norm.weight", "F16", (h,)),
        (p + "input_layernorm.weight", "F16", (h,)),
        (p + "self_attn.q_proj.weight", "F16", (heads * hd, 2 * h)),
        (p + "self_attn.k_proj.weight", "F16", (kv * hd, 2 * h)),
        (p + "self_attn.v_proj.weight", "F16", (kv * hd, 2 * h)),
        (p + "self_attn.o_proj.weight", "F16", (h, heads * hd)),
        (p + "post_attention_layernorm.weight", "F16", (h,)),
        (p + "mlp.gate_proj.weight", "F16", (inter, h)),
        (p + "mlp.up_proj.weight", "F16", (inter, h)),
        (p + "mlp.down_proj.weight", "F16", (h, inter)),
        ("norm.weight", "F16", (h,)),
        ("lm_head.weight", "F16", (dv, h)),
    ]


def _fp8(name: str, out_f: int, in_f: int) -> list[Tensor]:
    """An FP8 block-quantized linear: E4M3 weight plus one F32 inverse scale per 128x128 block."""
    return [(name + ".weight", "F8_E4M3", (out_f, in_f)),
            (name + ".weight_scale_inv", "F32", (math.ceil(out_f / 128), math.ceil(in_f / 128)))]


def _deepseek_layer(cfg: dict, i: int) -> list[Tensor]:
    h = cfg["hidden_size"]
    heads, qr, kvr = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, vhd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    p = f"model.layers.{i}."
    out: list[Tensor] = [(p + "input_layernorm.weight", "BF16", (h,)),
                         (p + "post_attention_layernorm.weight", "BF16", (h,))]
    out += _fp8(p + "self_attn.q_a_proj", qr, h)
    out.append((p + "self_attn.q_a_layernorm.weight", "BF16", (qr,)))
    out += _fp8(p + "self_attn.q_b_proj", heads * (nope + rope), qr)
    out += _fp8(p + "self_attn.kv_a_proj_with_mqa", kvr + rope, h)
    out.append((p + "self_attn.kv_a_layernorm.weight", "BF16", (kvr,)))
    out += _fp8(p + "self_attn.kv_b_proj", heads * (nope + vhd), kvr)
    out += _fp8(p + "self_attn.o_proj", h, heads * vhd)
    if i < cfg["first_k_dense_replace"]:
        inter = cfg["intermediate_size"]
        out += (_fp8(p + "mlp.gate_proj", inter, h) + _fp8(p + "mlp.up_proj", inter, h)
                + _fp8(p + "mlp.down_proj", h, inter))
        return out
    m, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    out += [(p + "mlp.gate.weight", "BF16", (e, h)), (p + "mlp.gate.e_score_correction_bias", "F32", (e,))]
    for j in range(e):
        q = f"{p}mlp.experts.{j}."
        out += _fp8(q + "gate_proj", m, h) + _fp8(q + "up_proj", m, h) + _fp8(q + "down_proj", h, m)
    s = m * cfg["n_shared_experts"]
    q = p + "mlp.shared_experts."
    out += _fp8(q + "gate_proj", s, h) + _fp8(q + "up_proj", s, h) + _fp8(q + "down_proj", h, s)
    return out


def _deepseek_tensors(cfg: dict) -> list[Tensor]:
    h, v, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out: list[Tensor] = [("model.embed_tokens.weight", "BF16", (v, h))]
    for i in range(L):
        out += _deepseek_layer(cfg, i)
    out += [("model.norm.weight", "BF16", (h,)), ("lm_head.weight", "BF16", (v, h))]
    for i in range(L, L + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "embed_tokens.weight", "BF16", (v, h)),
            (p + "enorm.weight", "BF16", (h,)),
            (p + "hnorm.weight", "BF16", (h,)),
            (p + "eh_proj.weight", "BF16", (h, 2 * h)),
            (p + "shared_head.norm.weight", "BF16", (h,)),
            (p + "shared_head.head.weight", "BF16", (v, h)),
        ]
        out += _deepseek_layer(cfg, i)
    return out


def model_tensors(model: str) -> list[Tensor]:
    """The (name, dtype, shape) list of a published checkpoint."""
    cfg = CONFIGS[model]
    if model.startswith("eagle3"):
        return _eagle3_tensors(cfg)
    if model.startswith("deepseek"):
        return _deepseek_tensors(cfg)
    return _decoder_tensors(cfg)


def tensor_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return -(-math.prod(shape) * BITS[dtype] // 8)


def write_safetensors(path: Path, tensors: list[Tensor], metadata: dict | None = None) -> int:
    """Write a safetensors file with a real header and a sparse (never written) data section.

    Returns the data size in bytes."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        n = tensor_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
    os.truncate(path, 8 + len(raw) + offset)
    return offset


def write_checkpoint(model_dir: Path, config: dict, tensors: list[Tensor], shards: int = 1) -> Path:
    """config.json plus the tensors in ``shards`` files (with model.safetensors.index.json when > 1)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    if shards == 1:
        write_safetensors(model_dir / "model.safetensors", tensors)
        return model_dir
    bounds = [k * len(tensors) // shards for k in range(shards + 1)]
    weight_map, total = {}, 0
    for k in range(shards):
        part = tensors[bounds[k]:bounds[k + 1]]
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        total += write_safetensors(model_dir / name, part)
        weight_map.update({t[0]: name for t in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return model_dir


def write_tokenizer(model_dir: Path, vocab: int, added: int) -> None:
    """A BPE tokenizer.json with ``vocab`` tokens and ``added`` special tokens after them."""
    data = {
        "version": "1.0",
        "added_tokens": [{"id": vocab + i, "content": f"<|special_{i}|>", "special": True} for i in range(added)],
        "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(vocab)}, "merges": []},
    }
    (Path(model_dir) / "tokenizer.json").write_text(json.dumps(data, separators=(",", ":")))


def write_model(model_dir: Path, model: str, shards: int | None = None, tokenizer: bool = True) -> Path:
    """A sparse copy of a published model (see CONFIGS) in ``model_dir``."""
    write_checkpoint(model_dir, CONFIGS[model], model_tensors(model), SHARDS[model] if shards is None else shards)
    if tokenizer and model.startswith("qwen2.5"):
        write_tokenizer(model_dir, *QWEN_TOKENIZER)
    return Path(model_dir)
