"""Shape rules of model_config against published configs and hand-computed KV cells."""

import json

import pytest

from specdecode_worker.errors import InputError
from specdecode_worker.model_rules.model_config import load_shape, shape_from_config
from devtools.checkpoints import CONFIGS

LLAMA_8B = CONFIGS["llama-3.1-8b-instruct"]
QWEN_05B = CONFIGS["qwen2.5-0.5b-instruct"]
DEEPSEEK = CONFIGS["deepseek-v3"]


@pytest.mark.parametrize("head_dim", ["absent", None, 0])
def test_head_dim_defaults_to_hidden_over_heads_when_absent_or_null(head_dim):
    cfg = dict(LLAMA_8B)
    if head_dim != "absent":
        cfg["head_dim"] = head_dim
    shape = shape_from_config(cfg)
    assert shape.head_dim == 4096 // 32 == 128
    assert shape.v_head_dim == 128


def test_explicit_head_dim_is_kept_when_it_differs_from_hidden_over_heads():
    # Mistral-Nemo-Instruct-2407: hidden 5120, 32 heads, head_dim 128 (5120 // 32 would be 160).
    cfg = {"architectures": ["MistralForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 40,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072}
    shape = shape_from_config(cfg)
    assert shape.head_dim == 128
    # 40 layers x 8 KV heads x (128 + 128) x 2 bytes
    assert shape.kv_bytes_per_token(tp=1, kv_dtype_bytes=2) == 163_840


@pytest.mark.parametrize("v_head_dim", ["absent", None, 0])
def test_v_head_dim_absent_null_or_zero_means_head_dim(v_head_dim):
    cfg = {**LLAMA_8B, "head_dim": 96}
    if v_head_dim != "absent":
        cfg["v_head_dim"] = v_head_dim
    assert shape_from_config(cfg).v_head_dim == 96


def test_explicit_v_head_dim_is_priced():
    cfg = {**LLAMA_8B, "v_head_dim": 64}
    # 32 layers x 8 heads x (128 + 64) x 2 bytes
    assert shape_from_config(cfg).kv_bytes_per_token(1, 2) == 32 * 8 * 192 * 2


def test_kv_heads_default_to_attention_heads():
    cfg = {k: v for k, v in LLAMA_8B.items() if k != "num_key_value_heads"}
    assert shape_from_config(cfg).num_kv_heads == 32


@pytest.mark.parametrize("tp, per_gpu", [(1, 2), (2, 1), (4, 1), (8, 1)])
def test_kv_heads_per_gpu_are_replicated_when_tp_exceeds_them(tp, per_gpu):
    shape = shape_from_config(QWEN_05B)  # 2 KV heads
    assert shape.kv_heads_per_gpu(tp) == per_gpu
    assert shape.kv_bytes_per_token(tp, 2) == 24 * per_gpu * (64 + 64) * 2


def test_published_kv_cells():
    assert shape_from_config(LLAMA_8B).kv_bytes_per_token(1, 2) == 131_072  # 32 x 8 x 256 x 2
    assert shape_from_config(LLAMA_8B).kv_bytes_per_token(1, 1) == 65_536  # fp8
    assert shape_from_config(CONFIGS["qwen2.5-7b-instruct"]).kv_bytes_per_token(1, 2) == 57_344  # 28 x 4 x 256 x 2
    assert shape_from_config(QWEN_05B).kv_bytes_per_token(1, 2) == 12_288  # 24 x 2 x 128 x 2


def test_mla_cell_is_the_latent_and_not_divided_by_tp():
    shape = shape_from_config(DEEPSEEK)
    assert shape.is_mla
    for tp in (1, 8):
        assert shape.kv_bytes_per_token(tp, 2) == 61 * (512 + 64) * 2 == 70_272
    assert shape.kv_bytes_per_token(8, 2, num_layers=shape.draft_num_layers) == 1_152


def test_mla_architecture_without_latent_fields_is_an_error():
    cfg = {k: v for k, v in DEEPSEEK.items() if k != "kv_lora_rank"}
    with pytest.raises(InputError, match="kv_lora_rank"):
        shape_from_config(cfg)


def test_draft_layers_nextn_else_max_of_hidden_and_attention_layers():
    assert shape_from_config(DEEPSEEK).draft_num_layers == 1
    assert shape_from_config(QWEN_05B).draft_num_layers == 24
    assert shape_from_config({**QWEN_05B, "num_attention_layers": 30}).draft_num_layers == 30
    assert shape_from_config(CONFIGS["eagle3-llama-3.1-8b"]).draft_num_layers == 1


def test_nextn_read_from_nested_text_config_first_then_outer():
    text = {k: v for k, v in DEEPSEEK.items() if k != "num_nextn_predict_layers"}
    nested = {"architectures": ["DeepseekV3ForCausalLM"], "text_config": {**text, "num_nextn_predict_layers": 2},
              "num_nextn_predict_layers": 5}
    assert shape_from_config(nested).num_nextn_predict_layers == 2
    outer_only = {"architectures": ["DeepseekV3ForCausalLM"], "text_config": text, "num_nextn_predict_layers": 3}
    assert shape_from_config(outer_only).num_nextn_predict_layers == 3
    assert shape_from_config({"text_config": text, "architectures": ["X"]}).num_nextn_predict_layers is None


def test_nested_text_config_supplies_the_shape():
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "text_config": LLAMA_8B}
    shape = shape_from_config(cfg)
    assert (shape.hidden_size, shape.num_hidden_layers, shape.num_kv_heads, shape.vocab_size) == (4096, 32, 8, 128256)
    assert shape.max_position_embeddings == 131072


def test_config_errors_name_file_and_field(tmp_path):
    with pytest.raises(InputError, match=r"config.json: missing"):
        load_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match=r"config.json: not valid JSON"):
        load_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_8B, "hidden_size": "4096"}))
    with pytest.raises(InputError, match=r"config.json: field 'hidden_size' must be a positive integer"):
        load_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA_8B.items() if k != "vocab_size"}))
    with pytest.raises(InputError, match=r"field 'vocab_size'"):
        load_shape(tmp_path)


def test_hybrid_model_counts_only_layers_with_a_kv_cache():
    # Qwen3-Next style: every fourth layer is full attention, the rest linear attention (no KV cache)
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    cfg = {**LLAMA_8B, "num_hidden_layers": 48, "layer_types": types}
    shape = shape_from_config(cfg)
    assert shape.num_attention_layers == 12
    assert shape.kv_bytes_per_token(1, 2) == 12 * 8 * 256 * 2
    assert shape.draft_num_layers == 48
    # sliding-window layers still hold KV
    gemma_like = {**LLAMA_8B,
                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 26}
    assert shape_from_config(gemma_like).num_attention_layers == 32
