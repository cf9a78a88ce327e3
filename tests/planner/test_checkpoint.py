"""Weight bytes from safetensors headers: published totals, per-GPU tensor parallelism, shared
tensors counted once, and every malformed file refused with a message naming file and field."""

import json
import math
import pathlib
import struct

import pytest

from specdecode_worker.model_rules import checkpoint
from specdecode_worker.model_rules.checkpoint import (
    DTYPE_BITS,
    read_checkpoint,
    read_header,
    split_target_draft,
    total_bytes,
)
from specdecode_worker.errors import InputError
from devtools.checkpoints import write_model, write_safetensors


def llama_bytes(h, inter, layers, heads, kv, vocab, tied=False, qkv_bias=False, dtype_bytes=2):
    """Closed-form weight bytes of a Llama/Qwen2 decoder."""
    hd = h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter + 2 * h
    if qkv_bias:
        per_layer += heads * hd + 2 * kv * hd
    return (layers * per_layer + vocab * h * (1 if tied else 2) + h) * dtype_bytes


def fp8_linear(out_f, in_f):
    """E4M3 weight plus F32 inverse scales over 128x128 blocks."""
    return out_f * in_f + math.ceil(out_f / 128) * math.ceil(in_f / 128) * 4


# DeepSeek-V3, by hand from its config (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64,
# nope 128, v 128, dense inter 18432, 256 experts + 1 shared of 2048, vocab 129280, 61 layers, first 3 dense).
DS_ATTN = (fp8_linear(1536, 7168) + fp8_linear(128 * 192, 1536) + fp8_linear(576, 7168)
           + fp8_linear(128 * 256, 512) + fp8_linear(7168, 128 * 128) + (1536 + 512) * 2 + 2 * 7168 * 2)
DS_DENSE = 2 * fp8_linear(18432, 7168) + fp8_linear(7168, 18432)
DS_EXPERT = 2 * fp8_linear(2048, 7168) + fp8_linear(7168, 2048)
DS_MOE = 257 * DS_EXPERT + 256 * 7168 * 2 + 256 * 4
DS_TARGET = 2 * 129280 * 7168 * 2 + 7168 * 2 + 3 * (DS_ATTN + DS_DENSE) + 58 * (DS_ATTN + DS_MOE)
DS_MTP = DS_ATTN + DS_MOE + 3 * 7168 * 2 + 7168 * 14336 * 2  # enorm, hnorm, shared_head.norm, eh_proj


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    names = ["llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "eagle3-llama-3.1-8b",
             "qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct", "deepseek-v3"]
    return {n: write_model(root / n, n) for n in names}


def test_published_totals_from_headers(models):
    # metadata.total_size of the published model.safetensors.index.json files
    assert total_bytes(read_checkpoint(models["llama-3.1-8b-instruct"])) == 16_060_522_496
    assert total_bytes(read_checkpoint(models["llama-3.1-70b-instruct"])) == 141_107_412_992
    assert total_bytes(read_checkpoint(models["qwen2.5-7b-instruct"])) == 15_231_233_024
    # and the same numbers in closed form
    assert llama_bytes(4096, 14336, 32, 32, 8, 128256) == 16_060_522_496
    assert llama_bytes(8192, 28672, 80, 64, 8, 128256) == 141_107_412_992
    assert llama_bytes(3584, 18944, 28, 28, 4, 152064, qkv_bias=True) == 15_231_233_024
    # Qwen2.5-0.5B ties lm_head to the embedding: 494,032,768 parameters
    qwen05 = total_bytes(read_checkpoint(models["qwen2.5-0.5b-instruct"]))
    assert qwen05 == llama_bytes(896, 4864, 24, 14, 2, 151936, tied=True, qkv_bias=True) == 494_032_768 * 2


def test_sparse_70b_checkpoint_is_planned_from_headers_without_reading_data(models, monkeypatch):
    folder = models["llama-3.1-70b-instruct"]
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) == 30
    apparent = sum(p.stat().st_size for p in shards)
    on_disk = sum(p.stat().st_blocks * 512 for p in shards)
    assert apparent > 140e9 and on_disk < 50e6  # 141 GB of holes

    reads: dict[str, int] = {}
    real_open = pathlib.Path.open

    def counting_open(self, mode="r", *args, **kwargs):
        fh = real_open(self, mode, *args, **kwargs)
        if self.suffix == ".safetensors":
            real_read = fh.read

            def read(n=-1):
                data = real_read(n)
                reads[self.name] = reads.get(self.name, 0) + len(data)
                return data

            fh.read = read
        return fh

    monkeypatch.setattr(pathlib.Path, "open", counting_open)
    tensors = read_checkpoint(folder)
    assert total_bytes(tensors) == 141_107_412_992
    assert len(reads) == 30
    for shard in shards:
        with real_open(shard, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
        assert reads[shard.name] == 8 + header_len  # the header and not one byte of data


def test_every_safetensors_dtype_is_sized(tmp_path):
    tensors = [(f"t.{d}", d, (3, 8)) for d in DTYPE_BITS]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    got = {t.dtype: t.nbytes for t in read_header(tmp_path / "model.safetensors")}
    expected = {"BOOL": 24, "U8": 24, "I8": 24, "F8_E4M3": 24, "F8_E5M2": 24, "F8_E8M0": 24, "F4": 12,
                "F6_E2M3": 18, "F6_E3M2": 18, "I16": 48, "U16": 48, "F16": 48, "BF16": 48, "I32": 96,
                "U32": 96, "F32": 96, "C64": 192, "F64": 192, "I64": 192, "U64": 192}
    assert got == expected


def test_tp_splits_matrices_and_replicates_norms(models):
    tensors = read_checkpoint(models["llama-3.1-8b-instruct"])
    norms = (2 * 32 + 1) * 4096 * 2
    assert total_bytes(tensors, 2, 8) == (16_060_522_496 - norms) // 2 + norms == 8_030_527_488
    assert total_bytes(tensors, 8, 8) == (16_060_522_496 - norms) // 8 + norms


def test_kv_projections_stop_shrinking_once_tp_exceeds_kv_heads(models):
    # Qwen2.5-7B has 4 KV heads: at tp 8 each GPU holds one whole head of K and V (a quarter).
    tensors = read_checkpoint(models["qwen2.5-7b-instruct"])
    h, L = 3584, 28
    kv_weights = L * 2 * (512 * h) * 2
    kv_biases = L * 2 * 512 * 2
    replicated = (2 * L + 1) * h * 2  # norms; q biases split with q_proj's rows
    sharded = 15_231_233_024 - kv_weights - kv_biases - replicated
    assert total_bytes(tensors, 8, 4) == sharded // 8 + (kv_weights + kv_biases) // 4 + replicated
    assert total_bytes(tensors, 4, 4) == sharded // 4 + (kv_weights + kv_biases) // 4 + replicated


def test_eagle3_head_uses_the_targets_embedding_and_keeps_its_own_lm_head(models):
    target = read_checkpoint(models["llama-3.1-8b-instruct"])
    draft = read_checkpoint(models["eagle3-llama-3.1-8b"])
    t, d = split_target_draft("EAGLE3", target, draft, 32)
    assert total_bytes(t) == 16_060_522_496
    # layer with 2h-wide q/k/v (243,281,920 params) + fc 3h->h + lm_head 32000 x h + norm, fp16,
    # plus the d2t (I64) and t2d (BOOL) vocabulary maps
    layer = 4096 * 8192 + 2 * 1024 * 8192 + 4096 * 4096 + 3 * 4096 * 14336 + 3 * 4096
    assert layer == 243_281_920
    params = layer + 4096 * 3 * 4096 + 32000 * 4096 + 4096
    assert total_bytes(d) == params * 2 + 32000 * 8 + 128256 == 849_763_584

    # A head that ships its own copy of the embedding still uses the target's: not counted twice.
    with_embed = draft + [checkpoint.TensorInfo("embed_tokens.weight", "F16", (128256, 4096), 128256 * 4096 * 2, "x")]
    assert total_bytes(split_target_draft("EAGLE3", target, with_embed, 32)[1]) == 849_763_584
    # EAGLE (v1) shares the lm_head too.
    assert total_bytes(split_target_draft("EAGLE", target, with_embed, 32)[1]) == 849_763_584 - 32000 * 4096 * 2


def test_mtp_layer_inside_the_target_checkpoint_counts_as_draft_once(models):
    tensors = read_checkpoint(models["deepseek-v3"])
    t, d = split_target_draft("MTP", tensors, None, 61)
    assert total_bytes(t) == DS_TARGET
    assert total_bytes(d) == DS_MTP
    assert total_bytes(tensors) == DS_TARGET + DS_MTP + 2 * 129280 * 7168 * 2  # MTP's embed + head shared
    # a plain target never loads layer 61
    t_ngram, d_ngram = split_target_draft("NGRAM", tensors, None, 61)
    assert total_bytes(t_ngram) == DS_TARGET and d_ngram == []


def test_mla_replicated_projections_under_tp(models):
    tensors = read_checkpoint(models["deepseek-v3"])
    t, _ = split_target_draft("MTP", tensors, None, 61)
    by_name = {x.name: x for x in t}
    q_a = by_name["model.layers.0.self_attn.q_a_proj.weight"]
    kv_b = by_name["model.layers.0.self_attn.kv_b_proj.weight"]
    router = by_name["model.layers.5.mlp.gate.weight"]
    assert checkpoint.per_gpu_bytes(q_a, 8, 128) == 1536 * 7168
    assert checkpoint.per_gpu_bytes(router, 8, 128) == 256 * 7168 * 2
    assert checkpoint.per_gpu_bytes(kv_b, 8, 128) == 128 * 256 * 512 // 8


def _raw_file(path, header_bytes, data_len=0, length=None):
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header_bytes) if length is None else length))
        fh.write(header_bytes)
        fh.write(b"\0" * data_len)
    return path


def _header(**tensors):
    return json.dumps(tensors).encode()


@pytest.mark.parametrize(
    "header, data_len, length, message",
    [
        (b"{not json", 0, None, r"model.safetensors: corrupt safetensors header, not valid JSON"),
        (b"[1, 2]", 0, None, r"model.safetensors: corrupt safetensors header, expected a JSON object"),
        (b"{}", 0, 10_000, r"model.safetensors: truncated safetensors header \(10000 bytes announced, 2 present\)"),
        (b"{}", 0, 2**62, r"model.safetensors: header length 4611686018427387904 bytes is absurd"),
        (_header(w={"dtype": "F12", "shape": [2], "data_offsets": [0, 3]}), 3, None,
         r"tensor 'w': field 'dtype' has unknown value 'F12'"),
        (_header(w={"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}), 8, None,
         r"tensor 'w': field 'shape' must be a list of non-negative integers"),
        (_header(w={"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}), 8, None,
         r"tensor 'w': field 'data_offsets' must be \[begin, end\]"),
        (_header(w={"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}), 8, None,
         r"tensor 'w': field 'data_offsets' spans 8 bytes but F32 \[4\] needs 16"),
        (_header(w={"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}), 10, None,
         r"tensor 'w': data ends at byte 16 but the file holds 10 data bytes; the file is truncated"),
    ],
)
def test_malformed_files_are_refused_naming_file_and_field(tmp_path, header, data_len, length, message):
    path = _raw_file(tmp_path / "model.safetensors", header, data_len, length)
    with pytest.raises(InputError, match=message):
        read_header(path)


def test_file_shorter_than_the_length_prefix(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(InputError, match="truncated safetensors file"):
        read_header(tmp_path / "model.safetensors")


def test_truncated_shard_of_a_sparse_checkpoint(tmp_path):
    folder = write_model(tmp_path / "m", "llama-3.1-8b-instruct")
    shard = folder / "model-00002-of-00004.safetensors"
    shard.open("r+b").truncate(shard.stat().st_size - 1)
    with pytest.raises(InputError, match=r"model-00002-of-00004.safetensors: tensor '.*': data ends at byte"):
        read_checkpoint(folder)


def test_index_that_names_a_missing_shard(tmp_path):
    folder = write_model(tmp_path / "m", "llama-3.1-8b-instruct")
    (folder / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(InputError, match=r"index.json: field 'weight_map' names shard 'model-00003-of-00004"):
        read_checkpoint(folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(InputError, match=r"index.json: field 'weight_map' must be a non-empty object"):
        read_checkpoint(folder)


def test_pytorch_bin_only_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK")
    with pytest.raises(InputError, match=r"holds only pytorch_model.bin, no \*.safetensors; .*convert the checkpoint"):
        read_checkpoint(tmp_path)


def test_folder_without_weights(tmp_path):
    with pytest.raises(InputError, match=r"no \*.safetensors weights found"):
        read_checkpoint(tmp_path)
