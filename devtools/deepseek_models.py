"""Tiny random DeepSeek-V3 checkpoints (MLA, grouped MoE routing, YaRN), optionally with an MTP layer.

Written by transformers' ``save_pretrained`` (per-expert tensor names, as published). The MTP layer
is appended the way the published checkpoints carry it: ``model.layers.{num_hidden_layers}`` with
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, a decoder block, and copies of
``embed_tokens`` and ``shared_head.head`` (equal to the target's embedding and lm_head).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from devtools.tiny_models import write_tokenizer

TINY = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0},
    num_nextn_predict_layers=1, bos_token_id=1, eos_token_id=3, tie_word_embeddings=False,
)


def write_tiny_deepseek(out_dir: str | Path, seed: int = 0, weight_scale: float = 4.0, mtp: bool = False,
                        **overrides) -> Path:
    """A random DeepseekV3ForCausalLM plus tokenizer in ``out_dir``; ``mtp`` appends one NextN layer."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**TINY, **overrides})
    model = DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(weight_scale)
        for module in model.modules():  # a non-zero bias, so the choice and the weights differ
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.rand_like(module.e_score_correction_bias) * 0.5)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    if mtp:
        tensors = load_file(out / "model.safetensors")
        tensors.update(mtp_layer_tensors(config, tensors, seed + 1, weight_scale))
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def mtp_layer_tensors(config, target: dict, seed: int, weight_scale: float) -> dict:
    """The NextN layer at index num_hidden_layers: a MoE decoder block plus the MTP glue."""
    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    # A one-layer MoE model donates a decoder block with this geometry (first_k_dense_replace 0: MoE).
    donor_cfg = DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})
    donor = DeepseekV3ForCausalLM(donor_cfg).float()
    with tempfile.TemporaryDirectory() as tmp:  # saved, so the experts carry their published names
        donor.save_pretrained(tmp, safe_serialization=True)
        donor_tensors = load_file(Path(tmp) / "model.safetensors")
    L, h = config.num_hidden_layers, config.hidden_size
    p = f"model.layers.{L}."
    out = {}
    for name, t in donor_tensors.items():
        if name.startswith("model.layers.0."):
            scaled = t if "norm" in name else t * weight_scale
            if name.endswith("e_score_correction_bias"):
                scaled = torch.rand_like(t) * 0.5
            out[p + name[len("model.layers.0."):]] = scaled.contiguous()
    out[p + "enorm.weight"] = 1 + 0.1 * torch.randn(h)
    out[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(h)
    out[p + "eh_proj.weight"] = torch.randn(h, 2 * h) * (weight_scale / (2 * h) ** 0.5)
    out[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h)
    out[p + "embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    out[p + "shared_head.head.weight"] = target["lm_head.weight"].clone()
    return out


def config_of(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


FP8_KEEP_DENSE = ("mlp.gate.weight", "eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight", "norm.weight")


def quantize_fp8(src: Path, fp8_dir: Path, dense_dir: Path, block: tuple[int, int] = (8, 8)) -> tuple[Path, Path]:
    """The release's format from a dense checkpoint: every decoder linear as E4M3 plus a float32
    ``weight_scale_inv`` per block (amax / 448). ``dense_dir`` gets the same weights dequantized, an
    independent reference any dense implementation can load."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(Path(src) / "model.safetensors")
    fp8, dense = {}, {}
    for name, w in tensors.items():
        quantize = name.startswith("model.layers.") and w.dim() == 2 and not name.endswith(FP8_KEEP_DENSE)
        if not quantize:
            fp8[name] = dense[name] = w
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        amax = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                amax[i, j] = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max()
        scale = (amax / 448.0).clamp(min=1e-12)
        full = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        q = (w / full).to(torch.float8_e4m3fn)
        fp8[name], fp8[name[: -len("weight")] + "weight_scale_inv"] = q, scale
        dense[name] = q.float() * full
    for out, data, quantized in ((Path(fp8_dir), fp8, True), (Path(dense_dir), dense, False)):
        shutil.copytree(src, out)
        save_file(data, out / "model.safetensors", metadata={"format": "pt"})
        if quantized:
            cfg = config_of(out)
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": list(block)}
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(fp8_dir), Path(dense_dir)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation with transformers: argmax of its logits, EOS included
    (``generate(min_new_tokens=...)`` would suppress EOS and pick another token)."""
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def record_static_moe(monkeypatch) -> list[str]:
    """Records the MoE paths that read no routing back to the host: few (token, expert) pairs
    (graphed or not), or every expert (graph passes). Routed passes are not recorded."""
    from specdecode_worker.engine.models import deepseek_v3

    paths = []

    def recorded(path):
        real = getattr(deepseek_v3.MoE, path)

        def run(self, *args):
            paths.append(path)
            return real(self, *args)
        return run

    for path in ("chosen_experts", "every_expert"):
        monkeypatch.setattr(deepseek_v3.MoE, path, recorded(path))
    return paths
